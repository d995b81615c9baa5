"""The emulated cluster is the declared one, at the `--cores` the bench uses: `hexiscale profile` inside it
measures every rank's FLOP/s within 10 % of its declared share (after the emulator's trimming), and a
TP-2 all-reduce of a small tensor costs the declared latency plus at most 1 ms, not a CFS period.

Skipped without root / cgroups / `ip netns` (the reason says what is missing). The ratio test is also
skipped while other work uses more than 10 % of the host's CPUs (measured first; the bench refuses
then too: under load the ratios drift with it, emulate/hostload.py); HEXISCALE_TEST_IGNORE_LOAD=1
runs it anyway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.emulate import EmulatedCluster, missing_support
from lightning_hexiscale.emulate.fidelity import RATE_TOLERANCE, RateCheck, check_exchange

REPO = Path(__file__).resolve().parents[2]
MISSING = missing_support() if sys.platform.startswith("linux") else ["Linux"]
pytestmark = [pytest.mark.skipif(bool(MISSING), reason=f"emulated cluster unsupported here: {'; '.join(MISSING)}"),
              pytest.mark.timing]
BENCH_CORES = [("emu_4to1", 1.5), ("emu_headroom", 1.6)]
"""(cluster, --cores) as benchmarks/bench_hetero.py runs them on a 2-core host (docs/results/emulated-cluster.md)."""


def skip_if_busy() -> None:
    from lightning_hexiscale.emulate.hostload import load_refusal, sample_load

    why = load_refusal(sample_load(2.0))
    if why and os.environ.get("HEXISCALE_TEST_IGNORE_LOAD") != "1":
        pytest.skip(f"host too busy for emulated timings: {why}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cluster, cores", BENCH_CORES[:1])
def test_tp2_allreduce_costs_the_declared_latency_not_a_period(cluster, cores):
    with EmulatedCluster(cluster, cores=cores) as emu:
        pairs = check_exchange(emu, reps=100)
    assert len(pairs) == len(Cluster.load(cluster).machines)  # one TP-2 pair per 2-device machine
    for p in pairs:
        assert p.passes, p.text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster, cores", BENCH_CORES)
def test_profiled_compute_ratio_within_10_percent(cluster, cores, tmp_path):
    skip_if_busy()
    out = tmp_path / "profiled.yaml"
    cmd = [sys.executable, "-m", "lightning_hexiscale.cli", "emulate", cluster, "--cores", str(cores), "--timeout",
           "240", "--", sys.executable, "-m", "lightning_hexiscale.cli", "profile", "--out", str(out), "--reps", "2",
           "--sizes", "1MiB,4MiB", "--timeout", "230"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "compute trimmed" in p.stdout  # `hexiscale emulate` trims before the command runs
    m = yaml.safe_load(out.with_suffix(".matrix.yaml").read_text())
    declared = Cluster.load(cluster)
    check = RateCheck(tuple(d.flops for d in declared.devices), tuple(m["flops_per_rank"]), (),
                      tuple(d.gpu_type for d in declared.devices))
    assert check.passes(RATE_TOLERANCE), f"{check.text()}\n{p.stdout[-2000:]}"
