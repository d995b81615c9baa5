"""Lightning's own callbacks under the strategy give what they give on one device (2 forked ranks,
pipelines of 4 and 2, float64): the strategy's step must survive what a callback does to the loop."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import assert_matches, hexiscale_trainer, loader, module, plan_of, read_ranks, single_trainer

PLAN = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_stochastic_weight_averaging_equals_single_process(tmp_path):
    """StochasticWeightAveraging sets the fit loop's ``_skip_backward`` back to False at every epoch
    end; the strategy set it once, at setup, so from the second epoch on Lightning zeroed the
    gradients the pipeline schedule had just produced: every later loss was off (3.069468 where one
    device gives 3.069451 at the second step of epoch 1, 2.992585 for 2.991763 at the end)."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    kw = dict(max_epochs=3, limit_val_batches=0)
    train = loader(30, 6)

    def swa():
        return [StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)]

    single_trainer(ref_dir, callbacks=swa(), **kw).fit(module(), train)
    hexiscale_trainer(PLAN, run_dir, callbacks=swa(), **kw).fit(module(), train)
    ref = read_ranks(ref_dir, 1)[0]
    assert len(ref["losses"]) == 15
    assert_matches(read_ranks(run_dir, PLAN.world_size), ref, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_learning_rate_finder_under_popen_equals_single_process(tmp_path):
    """``Tuner.lr_find`` runs inside fit and restores the weights from its own checkpoint after the
    search: under popen every rank gets one device's losses (to 1e-12), suggestion and module learning rate
    (under spawn/fork it is refused before launch: test_api_errors.py)."""
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "MASTER_", "WORLD_", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (here, here.parent, here.parents[1])))  # lightning/, tests/, root
    out = subprocess.run([sys.executable, str(here / "lr_find_job.py"), "hexiscale", str(tmp_path / "hexiscale")],
                         env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    # the one-device reference needs no launcher: in this process (a fresh interpreter cost seconds of imports)
    import lr_find_job

    threads = torch.get_num_threads()
    try:
        lr_find_job.run("single", str(tmp_path / "single"))
    finally:
        torch.set_num_threads(threads)
    want = (tmp_path / "single" / "rank0.txt").read_text()
    assert "SUGGEST None" not in want
    for rank in (0, 1):
        got = _finder_result((tmp_path / "hexiscale" / f"rank{rank}.txt").read_text())
        losses, rest = _finder_result(want)
        # to 1e-12: float64 sums in two processes may differ in their last bit (the vectorised
        # reductions' order depends on the buffers' alignment; seen once in a full run, 1 ulp)
        assert got == (pytest.approx(losses, rel=1e-12, abs=0), rest)


def _finder_result(text: str) -> tuple[list[float], str]:
    """``LOSSES [...] SUGGEST lr MODULE_LR lr`` (lr_find_job.py) -> (the losses, the rest as written)."""
    losses, rest = text.removeprefix("LOSSES ").split(" SUGGEST ", 1)
    return [float(x) for x in losses.strip("[]").split(",")], rest


def _lr_column(log_dir: Path) -> dict[str, list[float]]:
    """The learning-rate columns of the CSVLogger's metrics.csv: {name: values by row}."""
    with open(next(log_dir.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r[k]] for k in rows[0] if k.startswith("lr-")}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_learning_rate_monitor_under_zero_logs_one_devices_names(tmp_path):
    """LearningRateMonitor names its metric after the optimizer's class: under zero2 Lightning holds
    the engine's sharded optimizer, so the learning rate was logged as lr-ShardedOptimizer where one
    device logs lr-AdamW (a dashboard or a monitor on lr-AdamW found nothing)."""
    kw = dict(max_steps=3, log_every_n_steps=1)
    single_trainer(tmp_path, callbacks=[LearningRateMonitor("step")], logger=CSVLogger(str(tmp_path / "one")),
                   **kw).fit(module(warmup_steps=2), loader(18, 6))
    hexiscale_trainer(PLAN, tmp_path, callbacks=[LearningRateMonitor("step")], logger=CSVLogger(str(tmp_path / "run")),
                      strategy_kw=dict(dp_sharding="zero2"), **kw).fit(module(warmup_steps=2), loader(18, 6))
    want = _lr_column(tmp_path / "one")
    assert want == {"lr-AdamW": [0.005, 0.01, 0.01]}
    assert _lr_column(tmp_path / "run") == want
