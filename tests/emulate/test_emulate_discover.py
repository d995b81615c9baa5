"""`hexiscale discover` inside `hexiscale emulate emu_headroom --cores 1.6`: discovery recovers the
declared compute ratio (EMU-FAST : EMU-SLOW = 2 : 1) within 10 % and the machine-pair links (40 MB/s)
within 15 %, in at most 60 s; a second call reuses the cached file in under 2 s; the plan made
from the discovered file is as good as the plan made from the preset, both priced on the discovered
file; and ``Trainer(strategy="hexiscale")`` with no cluster, in the same emulated cluster, finds the
file (same hardware, model and precision), plans on its three machines and trains.

What the preset is compared as: this host's emulation, i.e. with the link latency the veths really
have when the kernel lacks ``sch_netem`` (the emulator says "latency: NOT emulated"; discovery
measures what is there, tens of microseconds, not the declared 1 ms). Two comparisons:

- FLOP/s + links (the discovered file without its layer tables, the preset having none, so like for
  like): the two plans estimate within 3 % of each other;
- the whole discovered file (layer tables included): the discovered plan is no more than 3 % slower
  than the preset's. Not within 3 % both ways: the measured layer times of a 0.8 M-parameter model on
  throttled CPU ranks are mostly overheads that FLOP/s pricing (the preset's) does not see, which is
  what layer tables are for; the preset's plan is priced about 2x slower on them.

Skipped without root / cgroups / `ip netns`; marked ``timing`` (deselected by ``make test``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_hexiscale.emulate import missing_support

REPO = Path(__file__).resolve().parents[2]
MISSING = missing_support() if sys.platform.startswith("linux") else ["Linux"]
GLOBAL_BATCH = 24
FIT = """
import os
import lightning.pytorch as pl
from torch.utils.data import DataLoader
import lightning_hexiscale  # noqa: F401
from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.lightning.example import LlamaLitModule

local = int(os.environ["LOCAL_WORLD_SIZE"])
trainer = pl.Trainer(strategy="hexiscale", accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                     max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(LlamaLitModule("llama_tiny", lr=1e-3), DataLoader(generated_corpus(24 * 2, 128), batch_size=24))
if trainer.is_global_zero:
    s = trainer.strategy
    print("CLUSTER", s.cluster.name, [m.name for m in s.cluster.machines], "STEPS", trainer.global_step)
"""


def _discover(tmp_path: Path, script: Path | None = None) -> str:
    """`hexiscale emulate emu_headroom --cores 1.6 -- hexiscale discover ...` (or ``python script``)."""
    run = ([sys.executable, str(script)] if script else
           [sys.executable, "-m", "lightning_hexiscale.cli", "discover", "--model", "llama_tiny", "--out",
            str(tmp_path / "d.yaml"), "--timeout", "140"])
    cmd = [sys.executable, "-m", "lightning_hexiscale.cli", "emulate", "emu_headroom", "--cores", "1.6",
           "--timeout", "150", "--", *run]
    env = dict(os.environ, PYTHONPATH=str(REPO), HEXISCALE_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=REPO, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _plans_compared(discovered, preset, model) -> tuple[float, float]:
    """(estimate of the discovered file's plan, estimate of the preset's plan), both on ``discovered``."""
    from lightning_hexiscale.lightning.plan_resolution import search_plan
    from lightning_hexiscale.planner import Workload, estimate

    w_disc = Workload.for_cluster(model, discovered, "32-true")
    plan_disc, est_disc = search_plan(discovered, w_disc, GLOBAL_BATCH, {}, iterations=20)
    plan_pre, _ = search_plan(preset, Workload.for_cluster(model, preset, "32-true"), GLOBAL_BATCH, {}, iterations=20)
    return est_disc.iteration_time_s, estimate(plan_pre, discovered, w_disc).iteration_time_s


@pytest.mark.skipif(bool(MISSING), reason=f"emulated cluster unsupported here: {'; '.join(MISSING)}")
@pytest.mark.timing
@pytest.mark.timeout(400)
def test_discover_in_emulator_recovers_cluster_and_reuses_cache(tmp_path):
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig

    out = _discover(tmp_path)
    took = float(re.search(r"discovered in ([0-9.]+) s", out).group(1))
    assert took <= 60.0, out[-2000:]
    m = yaml.safe_load((tmp_path / "d.matrix.yaml").read_text())
    doc = yaml.safe_load((tmp_path / "d.yaml").read_text())
    assert [(x["name"], x["count"]) for x in doc["machines"]] == [("fast", 2), ("slow.0", 2), ("slow.1", 2)]
    disc = Cluster.load(str(tmp_path / "d.yaml"))
    ratio = disc.devices[0].flops / disc.devices[2].flops
    assert abs(ratio - 2.0) <= 0.1 * 2.0, f"EMU-FAST/EMU-SLOW FLOP/s {ratio:.3f}, declared 2.0"
    cross = [(a, b) for a in range(6) for b in range(6) if disc.devices[a].machine != disc.devices[b].machine]
    worst = max(abs(m["bandwidth_Bps"][a][b] - 40e6) / 40e6 for a, b in cross)
    assert worst <= 0.15, f"machine-pair links {sorted({m['bandwidth_Bps'][a][b] for a, b in cross})}, declared 40e6 B/s"
    # each machine's NIC (its two ranks sending out at once) is the preset's one NIC of 40 MB/s; summed
    # per-flow figures read the slow machines' 28.7 + 20.8 = 49.5 MB/s
    nics = {h: f["aggregate_Bps"] for h, f in m["nics"].items()}
    assert set(nics) == {"fast", "slow.0", "slow.1"} and all(abs(b - 40e6) <= 0.15 * 40e6 for b in nics.values()), nics
    assert {t.gpu for t in disc.layer_tables} == {"EMU-FAST", "EMU-SLOW"}

    again = _discover(tmp_path)
    reuse = float(re.search(r"reusing the cluster discovered earlier: .* \(same fingerprint; ([0-9.]+) s", again).group(1))
    assert reuse < 2.0, again[-2000:]

    model = LlamaConfig.load("llama_tiny")
    preset_doc = yaml.safe_load((REPO / "conf" / "cluster" / "emu_headroom.yaml").read_text())
    if "latency: NOT emulated" in out:  # the links have the veth's own latency: compare with what is emulated
        preset_doc["inter_machine"]["latency"] = f"{disc.latency[0, 2] * 1e6:.3f}us"
    preset_doc.pop("defaults")
    # nor are the links inside a machine (its ranks share an unshaped loopback, bounded by their CPU
    # quotas: 1.4-23 GB/s measured from run to run where the preset says 2 GB/s; with the preset's
    # figure the two plans differed by up to 19 %): compare with what was emulated there too
    fast, slow = preset_doc["machines"]
    preset_doc["machines"] = [fast] + [{**slow, "name": f"slow.{k}"} for k in range(slow.pop("repeat"))]
    for entry in preset_doc["machines"]:
        found = next(x for x in doc["machines"] if x["name"] == entry["name"])
        entry["intra_bandwidth"], entry["intra_latency"] = found["intra_bandwidth"], found["intra_latency"]
    preset = Cluster.from_config(preset_doc)
    no_tables = {k: v for k, v in doc.items() if k not in ("layer_times", "defaults")}
    est_disc, est_pre = _plans_compared(Cluster.from_config(no_tables), preset, model)
    assert abs(est_disc - est_pre) <= 0.03 * est_pre, (est_disc, est_pre)
    est_disc, est_pre = _plans_compared(disc, preset, model)
    assert est_disc <= 1.03 * est_pre, (est_disc, est_pre)

    (tmp_path / "fit.py").write_text(FIT)
    fit = _discover(tmp_path, tmp_path / "fit.py")
    assert "reusing the cluster discovered earlier" in fit, fit[-3000:]
    assert f"CLUSTER {doc['name']} ['fast', 'slow.0', 'slow.1'] STEPS 2" in fit, fit[-3000:]
