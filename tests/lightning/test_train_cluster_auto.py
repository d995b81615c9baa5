"""``hexiscale train`` with ``cluster=auto``, its default (issue 40, item 1): with no ``cluster=`` (or with
``cluster=auto``) the job discovers this machine's cluster for its model and precision before planning (one
spawned NCCL rank per CUDA GPU, else 4 forked CPU ranks), writes the cluster file into
``$HEXISCALE_CACHE_DIR``, plans on it and trains; a second run with the same fingerprint reuses the cached
file and says so. A sweep and a torchrun/SLURM launch are refused with the fix; ``cluster=<preset or file>``
skips discovery. The local ranks themselves: tests/profiling/test_discover_local.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_hexiscale.cli import train_discover
from lightning_hexiscale.cli.discover_local import local_launch
from lightning_hexiscale.cli.train_job import AUTO_ENV, FILES_ENV, auto_cluster, take_auto_cluster
from lightning_hexiscale.errors import ConfigError

HEXISCALE = Path(sys.executable).parent / "hexiscale"
ROOT = Path(__file__).resolve().parents[2]
ARGS = ["model=llama_tiny", "trainer.progress_bar=false", "data.num_samples=64"]


def _run(args: list[str], cwd: Path, cache: Path, timeout: float) -> subprocess.CompletedProcess:
    if not HEXISCALE.is_file():
        pytest.skip(f"no console script at {HEXISCALE} (package not installed in this environment)")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                             "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                                             AUTO_ENV)}
    env["HEXISCALE_CACHE_DIR"] = str(cache)
    return subprocess.run([str(HEXISCALE), "train", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_train_without_cluster_discovers_then_cluster_auto_reuses_the_cache(tmp_path):
    """No cluster= at all: the default discovers (and says how to skip it); then cluster=auto reuses the file."""
    cache = tmp_path / "cache"
    launch = local_launch()  # 4 CPU ranks here; one per GPU on a CUDA machine
    precision = "bf16-mixed" if launch.backend == "nccl" else "32-true"
    first = _run([*ARGS, "dry_run=true", f"hydra.run.dir={tmp_path / 'plan'}"], tmp_path, cache, timeout=80)
    assert first.returncode == 0, first.stderr[-3000:]
    files = sorted(p for p in cache.glob("*.yaml") if not p.name.endswith(".matrix.yaml"))  # and its matrices
    assert len(files) == 1, (list(cache.iterdir()) if cache.exists() else "no cache", first.stdout[-2000:])
    assert (f"cluster defaults to auto (discovered and cached): discovering this machine's cluster for llama_tiny "
            f"({precision}) on {launch.describe()}, or reusing the cached one; pass cluster=<preset or file> to skip "
            "discovery") in first.stdout, first.stdout[-2000:]
    assert re.search(rf"discovered in [\d.]+ s: {re.escape(str(files[0]))}", first.stdout), first.stdout[-2000:]
    assert "discover [6/6]" in first.stdout + first.stderr  # discovery's progress lines
    name = f"discovered_{files[0].stem[:8]}"
    assert f"planning for llama_tiny on cluster {name} ({launch.ranks} devices)" in first.stdout, first.stdout[-2000:]
    assert (tmp_path / "plan" / "plan.yaml").is_file()

    second = _run(["cluster=auto", *ARGS, "train.global_batch=8", "trainer.max_steps=2",
                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, cache, timeout=80)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "cluster=auto: discovering this machine's cluster for llama_tiny" in second.stdout, second.stdout[-2000:]
    assert f"reusing the cluster discovered earlier: {files[0]} (same fingerprint" in second.stdout, second.stdout[-2000:]
    assert "discover [" not in second.stdout + second.stderr  # nothing measured again
    assert sorted(p for p in cache.glob("*.yaml") if not p.name.endswith(".matrix.yaml")) == files
    assert f"on cluster {name}" in second.stdout
    assert re.search(r"training loss: first [\d.]+ -> last [\d.]+ after 2 steps", second.stdout), second.stdout[-2000:]


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher's variables, and the job's own (AUTO_ENV, FILES_ENV) put back as they were afterwards: a
    flag left set would make a later in-process run of the suite discover. (setenv first: delenv of an absent
    variable records nothing to undo.)"""
    for key in (AUTO_ENV, FILES_ENV, "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return monkeypatch


def test_no_cluster_means_auto_and_a_named_cluster_skips_discovery(no_launcher):
    assert take_auto_cluster(["model=llama_tiny", "dry_run=true"]) == ["model=llama_tiny", "dry_run=true"]
    assert auto_cluster() == "default"
    assert take_auto_cluster(["cluster=auto", "model=llama_tiny"]) == ["model=llama_tiny"]
    assert auto_cluster() == "given"
    for named in (["cluster=cpu2"], ["cluster=my_cluster.yaml"], ["+cluster=cpu2"]):
        assert take_auto_cluster(named) == named
        assert auto_cluster() is None and AUTO_ENV not in os.environ  # a later run names its own cluster


def test_cluster_auto_is_refused_in_a_sweep_and_under_torchrun(no_launcher):
    """Given or by default: a sweep and a torchrun/SLURM launch do not discover (the fix: discover, then a file)."""
    with pytest.raises(ConfigError, match=r"cluster = 'auto': a sweep \(-m\).*hexiscale discover"):
        take_auto_cluster(["-m", "cluster=auto", "train.global_batch=8,16"])
    with pytest.raises(ConfigError, match=r"cluster = 'auto \(the default: no cluster= given\)': a sweep \(-m\) "
                                          r"does not discover.*cluster=my_cluster.yaml, or name a preset \(cluster=cpu_demo\)"):
        take_auto_cluster(["-m", "train.global_batch=8,16"])
    assert take_auto_cluster(["-m", "cluster=cpu2,cpu_hetero4"]) == ["-m", "cluster=cpu2,cpu_hetero4"]
    for launcher in ({"TORCHELASTIC_RUN_ID": "0"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}):
        for key, value in launcher.items():
            no_launcher.setenv(key, value)
        for argv in (["cluster=auto"], ["model=llama_tiny"]):
            with pytest.raises(ConfigError, match=r"not under torchrun or SLURM.*cluster=my_cluster.yaml"):
                take_auto_cluster(argv)
        assert take_auto_cluster(["cluster=cpu2"]) == ["cluster=cpu2"]
        for key in launcher:
            no_launcher.delenv(key)
    assert os.environ.get(AUTO_ENV) is None


def test_cluster_auto_discovers_in_an_interactive_allocation(no_launcher):
    """A shell of ``srun --pty bash`` (or a job named interactive) has SLURM_PROCID=0 and SLURM_NTASKS too,
    but nothing launched the command's ranks: Lightning launches them itself there, and the machine it
    runs on is discovered as without SLURM (it was refused as a SLURM launch)."""
    for name in ("bash", "interactive"):
        for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": name}.items():
            no_launcher.setenv(key, value)
        assert take_auto_cluster(["model=llama_tiny"]) == ["model=llama_tiny"] and auto_cluster() == "default"
        no_launcher.delenv(AUTO_ENV)


def test_a_cluster_override_needs_a_named_cluster(no_launcher):
    """cluster.KEY=... changes a preset or file; with nothing named it would be dropped by discovery: refused."""
    with pytest.raises(ConfigError, match=r"cluster = 'auto \(the default.*cluster.inter_machine.bandwidth=1GB/s "
                                          r"changes a preset or file.*Fix: name the cluster it changes \(cluster=cpu_demo"):
        take_auto_cluster(["cluster.inter_machine.bandwidth=1GB/s"])
    argv = ["cluster=cpu2", "cluster.inter_machine.bandwidth=1GB/s"]
    assert take_auto_cluster(argv) == argv


def test_a_plan_file_without_cluster_runs_on_the_cluster_it_was_made_for(no_launcher, tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    data = yaml.safe_load((ROOT / "tests" / "bad_configs" / "good_tiny_plan.yaml").read_text())
    plan.write_text(yaml.safe_dump({**data, "meta": {"cluster": "cpu_hetero4"}}))
    assert take_auto_cluster([f"plan={plan}"]) == [f"plan={plan}", "cluster=cpu_hetero4"]
    assert auto_cluster() is None
    assert "cluster=cpu_hetero4: the cluster the plan was made for (its meta.cluster" in capsys.readouterr().out
    plan.write_text(yaml.safe_dump({**data, "meta": {"cluster": "discovered_0123abcd"}}))  # no preset: discover
    assert take_auto_cluster([f"plan={plan}"]) == [f"plan={plan}"] and auto_cluster() == "default"


def test_a_primary_config_that_chooses_a_cluster_skips_discovery(no_launcher, tmp_path):
    """``-cn my_exp`` whose defaults say ``override cluster: cpu2`` (directly, or in a config it
    includes) ran on the discovered cluster: no cluster= on the command line read as auto."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "my_exp.yaml").write_text("defaults:\n  - config\n  - override cluster: cpu2\n  - _self_\n")
    (conf / "base_exp.yaml").write_text("defaults:\n  - config\n  - override /cluster: cpu_hetero4\n  - _self_\n")
    (conf / "child_exp.yaml").write_text("defaults:\n  - base_exp\n  - _self_\n")
    (conf / "no_cluster.yaml").write_text("defaults:\n  - config\n  - override model: llama_tiny\n  - _self_\n")
    for name in ("my_exp", "child_exp"):
        for argv in (["-cd", str(conf), "-cn", name, "dry_run=true"], [f"--config-dir={conf}", f"--config-name={name}"]):
            assert take_auto_cluster(argv) == argv
            assert auto_cluster() is None, argv
    # a primary config that chooses none, or a cluster= on the command line: as before
    assert take_auto_cluster(["-cd", str(conf), "-cn", "no_cluster"]) == ["-cd", str(conf), "-cn", "no_cluster"]
    assert auto_cluster() == "default"
    assert take_auto_cluster(["-cd", str(conf), "-cn", "my_exp", "cluster=auto"]) == ["-cd", str(conf), "-cn", "my_exp"]
    assert auto_cluster() == "given"


def test_the_job_leaves_no_auto_flag_behind(no_launcher, capsys):
    """A job of this process that ends (here: refused at its command line) does not leave cluster=auto set for
    the next in-process run (tests and the docs runner call the app in-process)."""
    from lightning_hexiscale.cli.train import main

    assert main(["cluster=auto", "trainer.max_step=3"]) == 2
    assert "trainer.max_step" in capsys.readouterr().err
    assert AUTO_ENV not in os.environ


def test_the_job_discovers_one_rank_per_gpu_on_a_cuda_machine(no_launcher, tmp_path):
    """On a (mocked) 2-GPU machine: 2 NCCL ranks, bf16-mixed by default, the banner says so; the discovered
    file replaces the cluster node and goes to the popen children."""
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.profiling.discover import Discovery

    no_launcher.setattr(torch.cuda, "is_available", lambda: True)
    no_launcher.setattr(torch.cuda, "device_count", lambda: 2)
    found = tmp_path / "found.yaml"
    found.write_text((ROOT / "conf" / "cluster" / "cpu2.yaml").read_text())
    calls = []

    def fake_run_discover(args, model):
        calls.append((args.local, args.precision, model.name))
        return Discovery(path=str(found), reused=False, fingerprint="f" * 16, seconds=1.0, count=None,
                         cache_path=str(found))

    no_launcher.setattr("lightning_hexiscale.cli.discover.run_discover", fake_run_discover)
    lines = []
    cfg = compose(["model=llama_tiny"])
    assert train_discover.discover_for_train(cfg, lines.append, "default") == str(found.resolve())
    assert calls == [(2, "bf16-mixed", "llama_tiny")]
    assert lines == ["cluster defaults to auto (discovered and cached): discovering this machine's cluster for "
                     "llama_tiny (bf16-mixed) on 2 local ranks, one per CUDA GPU (NCCL, spawned), or reusing the "
                     "cached one; pass cluster=<preset or file> to skip discovery"]
    assert cfg.cluster.name == "cpu2" and str(found.resolve()) in os.environ[FILES_ENV]


def test_cluster_auto_elsewhere_says_to_discover_first():
    """``hexiscale plan cluster=auto`` (any command composing conf/config.yaml): not a preset; the fix
    names ``hexiscale discover`` and the presets."""
    from lightning_hexiscale.config.schema import compose

    with pytest.raises(ConfigError, match=r"cluster = 'auto'.*hexiscale discover --local 4 .*cpu_demo"):
        compose(["cluster=auto"])
