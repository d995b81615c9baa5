"""trainer.predict under the strategy gives, on global rank 0, the logits one device computes for every
batch: each pipeline runs the forward of its slice, and the last stages' outputs are gathered to
rank 0 in batch order. 4 ranks (a TP-2 pipeline next to a two-stage pipeline), float64, batches of
5 split 3 + 2 over the pipelines and a last short batch of 2.

With the fork launcher Lightning returns no predictions (its rule for spawn/fork), so a callback
on rank 0 keeps them; with the default popen launcher rank 0 is the caller's process and
``trainer.predict`` returns them there (checked by hand: 3 batches equal to one device to 1e-9; not
in the suite, a popen run costs ~20 s)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import nccl_semantics
from lightning.pytorch.callbacks import BasePredictionWriter
from strategy_helpers import PG_TIMEOUT, TINY, NcclTrace, module, plan_of
from torch.utils.data import DataLoader

from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])])


def predict_data() -> DataLoader:
    return DataLoader(generated_corpus(12, TINY.seq_len, seed=4), batch_size=5)


class KeepOnRankZero(pl.Callback):
    def __init__(self, path: Path):
        self.path, self.outputs = path, []

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == 0:
            self.outputs.append(outputs)
        else:
            assert outputs is None

    def on_predict_end(self, trainer, module):
        if trainer.global_rank == 0:
            torch.save(self.outputs, self.path)


def _trainer(**kw):
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


def assert_one_device_logits(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in ref] == [(5, 16, 256), (5, 16, 256), (2, 16, 256)]
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype == torch.float64
        assert (a - b).abs().max().item() < 1e-9


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_predict_gathers_the_one_device_logits_on_rank_zero(tmp_path):
    ref = _trainer(devices=1).predict(module(), predict_data())
    keep = KeepOnRankZero(tmp_path / "pred.pt")
    _trainer(strategy=HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT), devices=PLAN.world_size,
             callbacks=[NcclTrace(tmp_path), keep]).predict(module(), predict_data(), return_predictions=False)
    assert_one_device_logits(torch.load(tmp_path / "pred.pt"), ref)
    # the forward walk and the gather to rank 0, replayed under NCCL's rules (tests/nccl_semantics.py)
    report = nccl_semantics.replay([torch.load(tmp_path / f"trace{r}.pt", weights_only=False)
                                    for r in range(PLAN.world_size)])
    assert report.ok, str(report)


class IndexWriter(BasePredictionWriter):
    """A prediction writer: the batch indices and prediction shapes it is handed, per batch and at
    the epoch's end, written by rank 0 to ``path``."""

    def __init__(self, path: Path):
        super().__init__("batch_and_epoch")
        self.path, self.batches = path, []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((list(batch_indices), None if prediction is None else tuple(prediction.shape)))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        if trainer.global_rank == 0:
            torch.save({"batches": self.batches, "epoch": batch_indices}, self.path)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_prediction_writer_gets_the_global_batch_indices(tmp_path):
    """BasePredictionWriter maps predictions to samples by their batch indices: Lightning records
    them in its wrapper around the loader's batch sampler, which the strategy's per-pipeline loader
    replaced, so the writer got [] for every batch (and Lightning's "Couldn't infer the batch
    indices" warning). Rank 0 holds the whole batch's logits: it gets the whole batch's indices."""
    def data():
        return DataLoader(generated_corpus(12, TINY.seq_len, seed=4), batch_size=5, shuffle=True,
                          generator=torch.Generator().manual_seed(3))

    one_device = _trainer(devices=1, callbacks=[IndexWriter(tmp_path / "one.pt")])
    one_device.predict(module(), data(), return_predictions=False)
    _trainer(strategy=HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT), devices=PLAN.world_size,
             callbacks=[IndexWriter(tmp_path / "run.pt")]).predict(module(), data(), return_predictions=False)
    one, run = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "run.pt")
    assert [len(b) for b, _ in one["batches"]] == [5, 5, 2] and sorted(sum(one["epoch"][0], [])) == list(range(12))
    assert run == one
