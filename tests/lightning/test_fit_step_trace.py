"""``PipelineEngine.fit_step`` (what calibration, check-estimate and the benchmarks time) is the step
``Trainer.fit`` runs under the strategy: the same communication, call for call, on every rank.

One ``Trainer.fit`` of two steps with gradient clipping (the recipe's default) records each rank's
communication trace (``nccl_semantics``). The window of the second step (``on_train_batch_start`` ->
``on_train_batch_end``; the first step may hold one-time work) is compared, step by step, with the
window of one ``engine.fit_step(..., clip_norm=1.0)`` that a callback runs on the same engine at the
end of the fit: the same kinds, collectives, groups, peers, sizes and dtypes, in the same order.
A fit_step without the non-finite check, the clipping or the arm of the overlapped sync differs
(the test names the first different call).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import lightning.pytorch as pl

import nccl_semantics
from strategy_helpers import TINY, hexiscale_trainer, loader, module, plan_of, read_ranks

# pipeline 0: ranks 0, 1 (one TP-2 stage); pipeline 1: ranks 2, 3 (two stages), unequal batches
PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], cluster="cpu_hetero4")
CLIP = 1.0


class StepWindows(pl.Callback):
    """Trace indices around the Trainer's second step, then around one engine.fit_step at the end."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.windows: dict[str, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.windows["trainer"] = [len(nccl_semantics.current().steps)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.windows["trainer"].append(len(nccl_semantics.current().steps))

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.pipeline_model.engine
        opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=1e-3))
        gen = torch.Generator().manual_seed(5)
        seq = torch.randint(0, TINY.vocab_size, (PLAN.global_batch, TINY.seq_len + 1), generator=gen)
        steps = nccl_semantics.current().steps
        start = len(steps)
        out = engine.fit_step(seq[:, :-1], seq[:, 1:], opt, clip_norm=CLIP)
        self.windows["fit_step"] = [start, len(steps)]
        torch.save({"windows": self.windows, "norm": out.grad_norm},
                   self.out_dir / f"windows{trainer.global_rank}.pt")


def _calls(steps) -> list[tuple]:
    """What NCCL sees of each call: kind, collective, group, p2p ops, sizes, dtype, root, reduce op."""
    return [(s.kind, s.group, s.ops, s.signature()) for s in steps]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "zero3"])
def test_fit_step_issues_the_trainers_communication(tmp_path, sharding):
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    g = plan.global_batch
    hexiscale_trainer(plan, tmp_path, callbacks=[StepWindows(tmp_path)], max_steps=2, max_epochs=1,
                      limit_val_batches=0, gradient_clip_val=CLIP).fit(module(), loader(g * 2, g))
    read_ranks(tmp_path, plan.world_size)  # NCCL replay of the whole run, the fit_step included
    for rank in range(plan.world_size):
        steps = torch.load(tmp_path / f"trace{rank}.pt", weights_only=False)
        got = torch.load(tmp_path / f"windows{rank}.pt", weights_only=False)
        (a, b), (c, d) = got["windows"]["trainer"], got["windows"]["fit_step"]
        trainer_calls, engine_calls = _calls(steps[a:b]), _calls(steps[c:d])
        assert trainer_calls, f"rank {rank}: no communication recorded in the Trainer's step"
        for i, (t, e) in enumerate(zip(trainer_calls, engine_calls)):
            assert t == e, (f"rank {rank}, call {i}: Trainer.fit issued {steps[a + i]}, fit_step issued "
                            f"{steps[c + i]}")
        assert len(trainer_calls) == len(engine_calls), (
            f"rank {rank}: Trainer.fit's step made {len(trainer_calls)} communication calls, fit_step "
            f"{len(engine_calls)}")
        assert got["norm"] is not None and got["norm"] > 0
