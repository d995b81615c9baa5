"""Trainer(strategy="hexiscale").fit on 4 CPU ranks == the same LightningModule on one process.

Heterogeneous plan (paper Fig. 1 bottom, shrunk): pipeline 0 is one TP-2 stage with batch 4 in
micro-batches of 2; pipeline 1 is two TP-1 stages with batch 2 in micro-batches of 1. Float64,
AdamW, gradient clipping by norm that is active on every step, accumulate_grad_batches=2, and a
validation pass: losses per batch, validation loss and every copy of every parameter element on
every rank equal the one-process run to 1e-6.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from strategy_helpers import (TINY, assert_matches, hexiscale_trainer, loader, module, plan_of, read_ranks,
                              single_trainer)

from lightning_hexiscale.lightning.example import LlamaLitModule

PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], cluster="cpu_hetero4")
G = PLAN.global_batch  # 6
TRAIN_KW = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5, limit_val_batches=2,
                val_check_interval=None, check_val_every_n_epoch=1, max_epochs=1)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fit_equals_single_process(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    train, val = loader(G * 6, G), loader(G * 2, G, seed=1)
    single_trainer(ref_dir, **TRAIN_KW).fit(module(), train, val)
    hexiscale_trainer(PLAN, run_dir, **TRAIN_KW).fit(module(), train, val)
    ref = read_ranks(ref_dir, 1)[0]
    results = read_ranks(run_dir, PLAN.world_size)
    assert len(ref["losses"]) == 6
    assert_matches(results, ref, atol=1e-6)
    for res in results:  # the validation loss every rank logs is the global one
        assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_validation_loss_of_a_short_last_batch_equals_single_process(tmp_path):
    """The ranks see unequal slices of each batch (4 and 2 of 6; of the last, 3 and 2 of 5), so the
    samples Lightning's epoch mean counts per rank (11 and 6) do not divide evenly over the ranks:
    the mean of the counts must not be truncated to an integer (it was: 8 for 8.5, val_loss 17/16 too high)."""
    plan = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])
    val = loader(17, 6, seed=1)  # batches of 6, 6 and 5
    ref = single_trainer(tmp_path).validate(module(), val)[0]["val_loss"]
    got = hexiscale_trainer(plan, tmp_path).validate(module(), val)[0]["val_loss"]
    assert got == pytest.approx(ref, abs=1e-6)



class Warned(pl.Callback):
    """Each rank's warnings from setup to teardown, written to ``warned<rank>.json`` (a fork
    worker's warnings would otherwise end in a copy of pytest's record that nobody reads)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir

    def setup(self, trainer, pl_module, stage):
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")

    def teardown(self, trainer, pl_module, stage):
        self._catch.__exit__(None, None, None)
        (self.out_dir / f"warned{trainer.global_rank}.json").write_text(json.dumps([str(w.message) for w in self._seen]))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_last_validation_batch_left_out_is_said_once(tmp_path):
    """13 samples in batches of 6 over pipelines of 4 and 2: the last batch (1 sample) cannot give
    both pipelines one and is left out, so val_loss covers the first 12 samples, which rank 0 says."""
    plan = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])
    trainer = hexiscale_trainer(plan, tmp_path, callbacks=[Warned(tmp_path)])
    got = trainer.validate(module(), loader(13, 6, seed=1))[0]["val_loss"]
    assert got == pytest.approx(single_trainer(tmp_path).validate(module(), loader(12, 6, seed=1))[0]["val_loss"],
                                abs=1e-6)
    said = [[m for m in json.loads((tmp_path / f"warned{r}.json").read_text()) if "left out" in m] for r in (0, 1)]
    assert said == [["eval_dataloader: the last batch holds 1 of the 13 samples, too few to give each of the plan's 2 "
                     "pipelines one, so it is left out (one device would use it); use a batch size that divides 13 "
                     "or leaves at least 2 samples in the last batch"], []]


class _LogsWithoutSync(LlamaLitModule):
    """The validation loss logged as one-device code logs it: no sync_dist."""

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["sync_dist, pipelines of 1 and 2 ranks", "no sync_dist"])
def test_validation_loss_is_weighted_by_the_global_batch(tmp_path, case):
    """Lightning weighs each batch's logged loss by the batch size it finds in the batch: here the
    rank's slice (4 or 2 of 6, 3 or 2 of the last 5), although the loss is the global batch's. The
    epoch mean then weighed the last batch 7/5 where the others weigh 8/6 when the 2 pipelines have
    1 and 2 ranks (sync_dist: 3.2e-4 too low), and without sync_dist rank 0 weighed its own slices
    (4, 4, 3: 6.7e-4 too high); one device weighs 6, 6 and 5."""
    if case == "no sync_dist":
        plan, make = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])]), _LogsWithoutSync
    else:
        plan, make = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 2)), ([2], (2, 4))])]), LlamaLitModule
    val = loader(17, 6, seed=1)  # batches of 6, 6 and 5
    ref = single_trainer(tmp_path).validate(make(TINY, dtype=torch.float64, init_seed=7), val)[0]["val_loss"]
    got = hexiscale_trainer(plan, tmp_path).validate(make(TINY, dtype=torch.float64, init_seed=7), val)
    assert got[0]["val_loss"] == pytest.approx(ref, abs=1e-9)


class _Tested(LlamaLitModule):
    """A ``test_step`` as one-device code writes it (the loss of the batch, logged with sync_dist)."""

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_trainer_test_after_fit_equals_single_process(tmp_path):
    """``trainer.test`` after ``fit`` with the same Trainer (pipelines of 1 and 2 ranks, test batches of
    6, 6 and 5 sequences): the test loop runs the plan forward only, on the fit's weights. Forked
    ranks keep those weights, so the call names the fit's last checkpoint, as the strategy's error
    for ``ckpt_path=None`` says; one device tests its module in memory."""
    plan = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 2)), ([2], (2, 4))])])
    train, test = loader(12, 6), loader(17, 6, seed=1)
    for d in ("ref", "run", "untrained"):
        (tmp_path / d).mkdir()
    ref_trainer = single_trainer(tmp_path / "ref", max_steps=2)
    model = _Tested(TINY, dtype=torch.float64, init_seed=7)
    ref_trainer.fit(model, train)
    ref = ref_trainer.test(model, test, verbose=False)[0]["test_loss"]
    saving = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "run" / "ck", save_last=True)
    trainer = hexiscale_trainer(plan, tmp_path / "run", max_steps=2, enable_checkpointing=True, callbacks=[saving])
    model = _Tested(TINY, dtype=torch.float64, init_seed=7)
    trainer.fit(model, train)
    got = trainer.test(model, test, ckpt_path="last", verbose=False)[0]["test_loss"]
    untrained = single_trainer(tmp_path / "untrained").test(_Tested(TINY, dtype=torch.float64, init_seed=7), test,
                                                           verbose=False)[0]["test_loss"]
    assert got == pytest.approx(ref, abs=1e-9) and abs(untrained - ref) > 1e-3
