"""What a newcomer meets first: ``hexiscale train --help`` answers without importing torch (it took
16 s when every subcommand was imported up front), and a run whose output goes to a file or a pipe
prints plain loss lines, no progress bar (its ``\\r`` redraws piled up there), and ends by naming
where the checkpoint and the logs are. A sweep point printing what a single run prints is checked on
the sweep of tests/lightning/test_train_command.py (test_train_multirun_sweep)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_help_imports_no_torch():
    code = ("import sys; from lightning_hexiscale.cli.main import main; code = main(['train', '--help']); "
            "assert code == 0; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exit status:" in out.stdout and out.stdout.strip().splitlines()[-1] == "False", out.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_into_a_pipe_has_no_bar_and_ends_naming_checkpoint_and_logs(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), "cluster=cpu2", "model=llama_tiny",
                          "train.global_batch=8", "trainer.max_steps=2", "trainer.val_every=0", "trainer.log_every=1",
                          f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=250, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\r" not in out.stdout + out.stderr  # trainer.progress_bar=null: no bar into a pipe
    assert "validation_step" not in out.stderr  # validation off on purpose (val_every=0): no notice about it
    assert "step     2  loss" in out.stdout
    last = run / "checkpoints" / "last.ckpt"
    assert out.stdout.strip().splitlines()[-1] == (f"checkpoint: {last} (resume with trainer.resume={last}); "
                                                   f"logs: {run / 'logs' / 'version_0'}")
    # resumed in another run directory: ModelCheckpoint's "dirpath has changed" (once per rank) is noise here
    again = subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), "cluster=cpu2", "model=llama_tiny",
                            "train.global_batch=8", "trainer.max_steps=3", "trainer.val_every=0",
                            f"trainer.resume={last}", f"hydra.run.dir={tmp_path / 'again'}"],
                           capture_output=True, text=True, timeout=250, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "steps 3-3, resumed at step 2" in again.stdout, again.stdout[-3000:]
    assert "dirpath has changed" not in again.stderr, again.stderr[-3000:]


def test_one_of_a_kind_is_singular():
    from lightning_hexiscale.config.cluster import Cluster

    one = Cluster.from_config({"name": "one", "machines": [{"gpu": "A800", "count": 1, "intra_bandwidth": "200 GB/s"}]})
    assert one.summary().splitlines()[0].startswith("cluster one: 1 device on 1 machine, ")
