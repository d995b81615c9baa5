"""Non-finite loss or gradients: found across all ranks, reported with the step, handled the same way
on every rank. The NaN is injected into the gradient of one TP-sharded weight on ONE rank (rank 1: the
second TP rank of pipeline 0's single TP-2 stage) at one step; every
rank must see it, because a rank that stepped while another skipped would leave the copies of the
model out of step (and hang the next collective if one rank raised alone).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from strategy_helpers import PG_TIMEOUT, Recorder, loader, module, plan_of, read_ranks

import lightning.pytorch as pl
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])])
BAD_STEP, BAD_RANK, STEPS = 2, 1, 4


class PoisonGrad(Callback):
    """Rank ``rank`` multiplies one gradient by NaN during step ``step``; records every rank's
    parameters after each step and the strategy's non-finite events."""

    def __init__(self, out_dir, rank: int, step: int):
        self.out_dir, self.rank, self.step = out_dir, rank, step
        self.handle = None
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            # A TP-sharded weight: a replicated one's gradient is the TP leader's after the sync. A
            # block's: under zero2 its reduce-scatter starts, and frees it, during the backward.
            shards = module.model.stage.shards()
            p = next(p for n, p in module.model.stage.named_parameters()
                     if shards[n].spec.shard_dim is not None and n.startswith("layers."))
            self.handle = p.register_hook(lambda g: g * float("nan"))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.snapshots.append({n: p.detach().clone() for n, p in module.model.stage.named_parameters()})

    def on_train_end(self, trainer, module):
        torch.save({"snapshots": self.snapshots, "events": trainer.strategy.nonfinite_events},
                   self.out_dir / f"poison{trainer.global_rank}.pt")


def _trainer(out_dir, nonfinite: str, poison: PoisonGrad, plan=PLAN) -> pl.Trainer:
    strategy = HexiScaleStrategy(plan=plan, start_method="fork", timeout=PG_TIMEOUT, nonfinite=nonfinite)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=PLAN.world_size, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Recorder(out_dir), poison])


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sharding", ["ddp", "zero2"])
def test_skip_drops_the_step_on_every_rank(tmp_path, sharding):
    # zero2: the poisoned gradient's reduce-scatter starts (and frees it) during the backward, before the check
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    _trainer(tmp_path, "skip", PoisonGrad(tmp_path, BAD_RANK, BAD_STEP), plan).fit(module(), loader(6 * STEPS, 6))
    runs = [torch.load(tmp_path / f"poison{r}.pt", weights_only=False) for r in range(PLAN.world_size)]
    want = [{"step": BAD_STEP, "epoch": 0, "batch": BAD_STEP, "ranks": [BAD_RANK], "what": "gradients",
             "action": "skip"}]
    for rank, run in enumerate(runs):
        assert run["events"] == want, f"rank {rank}: {run['events']}"
        snaps = run["snapshots"]
        assert len(snaps) == STEPS
        for name, t in snaps[BAD_STEP].items():  # the poisoned step left every parameter as it was
            assert torch.equal(t, snaps[BAD_STEP - 1][name]), f"rank {rank}: {name} changed in a skipped step"
        for step in (1, 3):  # the other steps trained
            assert any(not torch.equal(t, snaps[step - 1][n]) for n, t in snaps[step].items()), f"rank {rank} {step}"
        assert all(torch.isfinite(t).all() for t in snaps[-1].values())
    losses = [r["losses"] for r in read_ranks(tmp_path, PLAN.world_size)]
    assert all(ls == losses[0] for ls in losses) and all(map(lambda x: x == x, losses[0]))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_stop_raises_naming_the_step_and_rank(tmp_path):
    from lightning_hexiscale.errors import NonFiniteError

    with pytest.raises(NonFiniteError) as info:  # the typed error reaches the caller, once (from rank 0)
        _trainer(tmp_path, "stop", PoisonGrad(tmp_path, BAD_RANK, BAD_STEP)).fit(module(), loader(6 * STEPS, 6))
    text = str(info.value)
    assert f"non-finite gradients at optimizer step {BAD_STEP}" in text and f"rank(s) [{BAD_RANK}]" in text, text[-3000:]
    assert not list(tmp_path.glob("poison*.pt"))  # no rank went on to the end


def test_bad_policy_is_a_config_error():
    from lightning_hexiscale.errors import ConfigError

    with pytest.raises(ConfigError, match="nonfinite"):
        HexiScaleStrategy(nonfinite="ignore")
    with pytest.raises(ConfigError, match="timeout"):
        HexiScaleStrategy(timeout=0)
