"""Lightning's own callbacks under the strategy give what they give on one device (2 forked ranks,
pipelines of 4 and 2, float64): the strategy's step must survive what a callback does to the loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import StochasticWeightAveraging
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
    search: under popen every rank gets one device's losses, suggestion and module learning rate
    (under spawn/fork it is refused before launch: test_api_errors.py)."""
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "MASTER_", "WORLD_", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (here, here.parent, here.parents[1])))  # lightning/, tests/, root
    for case in ("single", "hexiscale"):
        out = subprocess.run([sys.executable, str(here / "lr_find_job.py"), case, str(tmp_path / case)], env=env,
                             capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stderr[-3000:]
    want = (tmp_path / "single" / "rank0.txt").read_text()
    assert "SUGGEST None" not in want
    for rank in (0, 1):
        assert (tmp_path / "hexiscale" / f"rank{rank}.txt").read_text() == want
