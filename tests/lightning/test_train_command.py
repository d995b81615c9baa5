"""`hexiscale train`: the training job as a subcommand of the package's CLI. A two-step CPU run with
overrides through the console script (the popen launcher re-runs `hexiscale train ...` for the second
rank), a `-m` sweep (Hydra's multirun, spawned workers), `--help`, and a bad override's message.
``recipes/train.py`` runs the same app: tests/lightning/test_recipes.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_hexiscale.cli.main import main as hexiscale

HEXISCALE = Path(sys.executable).parent / "hexiscale"
"""The console script of the environment running the tests (pip install -e puts it beside python)."""

TINY = ["cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "trainer.progress_bar=false",
        "data.num_samples=64"]


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    if not HEXISCALE.is_file():
        pytest.skip(f"no console script at {HEXISCALE} (package not installed in this environment)")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    return subprocess.run([str(HEXISCALE), "train", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_two_cpu_steps_with_overrides(tmp_path):
    run = tmp_path / "run"
    out = _run([*TINY, "trainer.max_steps=2", "trainer.lr=1e-2", f"hydra.run.dir={run}"], tmp_path, timeout=140)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"training loss: first [\d.]+ -> last [\d.]+ after 2 steps", out.stdout), out.stdout[-2000:]
    assert "pipeline  batch/mb" in out.stdout  # the plan table
    ran = OmegaConf.load(run / "config.yaml")  # the overrides reached the job
    assert ran.trainer.max_steps == 2 and ran.trainer.lr == 1e-2 and ran.cluster.name == "cpu2"
    assert ran.train.global_batch == 8 and (run / "plan.yaml").is_file()
    assert (run / "checkpoints" / "last.ckpt" / "COMPLETE").is_file()
    assert out.stderr.strip() == "", out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_train_multirun_sweep(tmp_path):
    """-m dry_run=true,false: two jobs, one that only plans and one that trains (spawned ranks). The
    training point prints what a single run prints: spawned ranks (fresh interpreters) printed
    Lightning's "Initializing distributed" banner and torch's LeafSpec deprecation, which a single
    run filters (the progress bar left at its default: off into this pipe; validation off on purpose,
    so no notice about it)."""
    sweep = tmp_path / "sweep"
    tiny = [a for a in TINY if a != "trainer.progress_bar=false"]
    out = _run(["-m", *tiny, "trainer.max_steps=1", "trainer.val_every=0", "dry_run=true,false",
                f"hydra.sweep.dir={sweep}"], tmp_path, timeout=190)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("dry_run=true: planned only.") == 1, out.stdout[-3000:]
    assert out.stdout.count("final metrics:") == 1, out.stdout[-3000:]
    for noise in ("Initializing distributed", "LeafSpec", "distributed_backend=", "validation_step"):
        assert noise not in out.stdout + out.stderr, (noise, out.stderr[-3000:])
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"], jobs
    assert [OmegaConf.load(sweep / j / "config.yaml").dry_run for j in jobs] == [True, False]
    assert (sweep / "1" / "checkpoints" / "last.ckpt").exists() and not (sweep / "0" / "checkpoints").exists()


def test_train_help_lists_presets_and_keys(capsys):
    assert hexiscale(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: hexiscale train")
    for needed in ("hetero3", "llama_tiny", "trainer.max_steps=40", "data.kind=generated", "-m cluster=", "--cfg job"):
        assert needed in text, needed


def test_hexiscale_help_lists_train(capsys):
    with pytest.raises(SystemExit):
        hexiscale(["--help"])
    assert re.search(r"^\s+train\s", capsys.readouterr().out, re.MULTILINE)


def test_train_bad_override_names_the_key(capsys):
    assert hexiscale(["train", "cluster=nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hexiscale train: error:") and "cluster" in err and "nope" in err and "hetero3" in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_cfg_job_prints_the_composed_config(tmp_path, monkeypatch, capfd):
    """Hydra's own flags reach Hydra: --cfg job prints the config with the overrides and runs nothing."""
    monkeypatch.chdir(tmp_path)
    assert hexiscale(["train", "--cfg", "job", "cluster=cpu2", "trainer.max_steps=3"]) == 0
    out = capfd.readouterr()
    cfg = OmegaConf.create(out.out)
    assert cfg.cluster.name == "cpu2" and cfg.trainer.max_steps == 3
    assert not list(tmp_path.iterdir())  # nothing planned or written
