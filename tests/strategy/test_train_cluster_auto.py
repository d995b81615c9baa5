"""``hexiscale train cluster=auto`` (issue 40, item 1): before planning, the job discovers this machine's
cluster for its model and precision (4 forked CPU ranks; refused on a CUDA machine), writes the cluster file into
``$HEXISCALE_CACHE_DIR``, plans on it and trains; a second run with the same fingerprint reuses the
cached file and says so. A sweep and a torchrun/SLURM launch are refused with the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_hexiscale.cli.train_discover import CPU_RANKS, local_ranks
from lightning_hexiscale.cli.train_job import AUTO_ENV, take_auto_cluster
from lightning_hexiscale.errors import ConfigError

HEXISCALE = Path(sys.executable).parent / "hexiscale"
ARGS = ["cluster=auto", "model=llama_tiny", "trainer.progress_bar=false", "data.num_samples=64"]


def _run(args: list[str], cwd: Path, cache: Path, timeout: float) -> subprocess.CompletedProcess:
    if not HEXISCALE.is_file():
        pytest.skip(f"no console script at {HEXISCALE} (package not installed in this environment)")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                             "TORCHELASTIC_RUN_ID", "SLURM_PROCID", AUTO_ENV)}
    env["HEXISCALE_CACHE_DIR"] = str(cache)
    return subprocess.run([str(HEXISCALE), "train", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA cluster=auto is refused (test below)")
def test_train_cluster_auto_discovers_then_reuses_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _run([*ARGS, "dry_run=true", f"hydra.run.dir={tmp_path / 'plan'}"], tmp_path, cache, timeout=80)
    assert first.returncode == 0, first.stderr[-3000:]
    files = sorted(p for p in cache.glob("*.yaml") if not p.name.endswith(".matrix.yaml"))  # and its matrices
    assert len(files) == 1, (list(cache.iterdir()) if cache.exists() else "no cache", first.stdout[-2000:])
    assert "cluster=auto: discovering this machine's cluster for llama_tiny (32-true) on 4 local ranks" in first.stdout
    assert re.search(rf"discovered in [\d.]+ s: {re.escape(str(files[0]))}", first.stdout), first.stdout[-2000:]
    assert "discover [6/6]" in first.stdout + first.stderr  # discovery's progress lines
    name = f"discovered_{files[0].stem[:8]}"
    assert f"planning for llama_tiny on cluster {name} (4 devices)" in first.stdout, first.stdout[-2000:]
    assert (tmp_path / "plan" / "plan.yaml").is_file()

    second = _run([*ARGS, "train.global_batch=8", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
                  tmp_path, cache, timeout=80)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"reusing the cluster discovered earlier: {files[0]} (same fingerprint" in second.stdout, second.stdout[-2000:]
    assert "discover [" not in second.stdout + second.stderr  # nothing measured again
    assert sorted(p for p in cache.glob("*.yaml") if not p.name.endswith(".matrix.yaml")) == files
    assert f"on cluster {name}" in second.stdout
    assert re.search(r"training loss: first [\d.]+ -> last [\d.]+ after 2 steps", second.stdout), second.stdout[-2000:]


def test_cluster_auto_is_refused_in_a_sweep_and_under_torchrun(monkeypatch):
    monkeypatch.delenv(AUTO_ENV, raising=False)
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match=r"cluster = 'auto': a sweep \(-m\).*hexiscale discover"):
        take_auto_cluster(["-m", "cluster=auto", "train.global_batch=8,16"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ConfigError, match=r"not under torchrun or SLURM.*cluster=my_cluster.yaml"):
        take_auto_cluster(["cluster=auto"])
    assert os.environ.get(AUTO_ENV) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert take_auto_cluster(["cluster=auto", "model=llama_tiny"]) == ["model=llama_tiny"]
    assert os.environ[AUTO_ENV] == "1"
    assert take_auto_cluster(["cluster=cpu2"]) == ["cluster=cpu2"]
    assert AUTO_ENV not in os.environ  # a later run without cluster=auto does not discover


def test_cluster_auto_is_refused_on_a_cuda_machine(monkeypatch):
    """--local forks gloo ranks, which would measure the CPU, not the GPUs: refused with the torchrun fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"cluster = 'auto'.*2 CUDA GPU.*torchrun --nproc-per-node=2 .*discover"):
        local_ranks()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_ranks() == CPU_RANKS == 4


def test_cluster_auto_elsewhere_says_to_discover_first():
    """``hexiscale plan cluster=auto`` (any command composing conf/config.yaml): not a preset; the fix
    names ``hexiscale discover`` and the presets."""
    from lightning_hexiscale.config.schema import compose

    with pytest.raises(ConfigError, match=r"cluster = 'auto'.*hexiscale discover --local 4 .*cpu_demo"):
        compose(["cluster=auto"])
