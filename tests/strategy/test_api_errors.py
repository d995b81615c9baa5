"""Python API errors surface once and clearly: a wrong cluster or plan file when the strategy is
built, a world size that does not match the plan when the Trainer is built, a bad training loader
or ckpt_path before any process starts, and an error every rank finds in setup as that one typed
error from ``trainer.fit`` (not Lightning's teardown "Cannot copy out of meta tensor", not one
traceback per rank), with the fork launcher and with the default popen launcher (a script, since
popen re-runs its script per rank). A rank that dies makes ``fit`` raise one RankFailure naming it,
and the launching process is not killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from strategy_helpers import PG_TIMEOUT, loader, module, plan_of

from lightning_hexiscale.errors import ConfigError, PlanError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

HERE = Path(__file__).parent
PLAN = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])


def _trainer(strategy, devices=2):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_files_are_read_when_the_strategy_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(cluster\) = 'nonexistent': no such preset"):
        HexiScaleStrategy(cluster="nonexistent")
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(plan\) = '.*nope.yaml': no such plan file"):
        HexiScaleStrategy(plan=str(tmp_path / "nope.yaml"))
    with pytest.raises(PlanError, match="device 2"):  # a device the cluster does not have
        HexiScaleStrategy(cluster="cpu2", plan=plan_of([(2, 1, [([0, 2], (0, 4))])]))


def test_world_size_is_checked_when_the_trainer_is_built():
    with pytest.raises(ConfigError, match=r"Trainer\(num_nodes, devices\) = '3 processes.*the plan runs 2"):
        _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork"), devices=3)


def test_loader_and_checkpoint_are_checked_before_launch(tmp_path, capfd):
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(ConfigError, match=r"train_dataloader.batch_size = 4: the plan takes 6"):
        trainer.fit(module(), loader(12, 4))
    with pytest.raises(ConfigError, match=r"ckpt_path = '.*gone.ckpt': no such checkpoint"):
        trainer.fit(module(), loader(12, 6), ckpt_path=str(tmp_path / "gone.ckpt"))
    assert "Initializing distributed" not in capfd.readouterr().err  # no process was started


@pytest.mark.timeout(60)
def test_setup_error_of_every_rank_is_raised_once_fork(capfd):
    plan6 = plan_of([(4, 2, [([0], (0, 6))]), (2, 1, [([1], (0, 6))])], num_layers=6)
    trainer = _trainer(HexiScaleStrategy(plan=plan6, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(PlanError, match=r"plan.num_layers = 6: the model tiny_test has 4 layers"):
        trainer.fit(module(), loader(12, 6))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "meta tensor" not in err and "Terminating process" not in err, err


def _job(case: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "MASTER_", "WORLD_", "RANK"))}
    env["PYTHONPATH"] = f"{HERE}{os.pathsep}{HERE.parents[1]}"
    return subprocess.run([sys.executable, str(HERE / "api_error_job.py"), case], env=env, capture_output=True,
                          text=True, timeout=100)


@pytest.mark.timeout(120)
def test_setup_error_of_every_rank_is_raised_once_popen():
    out = _job("layers")
    caught = [ln for ln in out.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert out.returncode == 0 and "ALIVE" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
    assert caught == ["CAUGHT PlanError: plan.num_layers = 6: the model tiny_test has 4 layers. Fix: plan for the "
                      "same model, or choose the model the plan was made for"], out.stdout
    assert "Traceback" not in out.stderr and "meta tensor" not in out.stderr, out.stderr[-3000:]


@pytest.mark.timeout(120)
def test_dead_rank_is_one_rank_failure_popen():
    out = _job("kill")
    caught = [ln for ln in out.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert out.returncode == 0 and "ALIVE" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
    assert len(caught) == 1 and caught[0].startswith("CAUGHT RankFailure: rank 0 stopped because another rank "
                                                      "failed: rank 1 stopped without reporting an error"), caught
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
