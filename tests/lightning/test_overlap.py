"""The data-parallel gradient sync overlaps the step's last backward on the Lightning path (ddp and
ZeRO-2), as the planner prices it: a trace test.

Each rank holding block 0 labels its communication trace (``nccl_semantics`` phases) every time the
backward of block 0 ends (the gradient of its input arrives): ``b0end:1``, ``b0end:2``, ... With
accumulate_grad_batches=2 and m micro-batches per batch, the step's last backward of block 0 ends at
label 2m. The first cross-pipeline gradient collective (all-reduce under ddp, reduce-scatter under
ZeRO-2) must be issued before that, i.e. under label 2m - 1: during the last micro-batch's backward
of the window's last batch (not earlier: the first batch of the window only accumulates). Without
the overlap every such collective comes after the backward, under label 2m. The run is replayed
under NCCL's rules (one collective order on every member) like every strategy run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import lightning.pytorch as pl

import nccl_semantics
from strategy_helpers import hexiscale_trainer, loader, module, plan_of, read_ranks

# pipeline 0: ranks 0, 1 (one TP-2 stage, 2 micro-batches); pipeline 1: ranks 2, 3 (two stages, 2 micro-batches)
PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], cluster="cpu_hetero4")
PIPELINE_RANKS = ({0, 1}, {2, 3})
M = 2
DP_COLLECTIVES = ("all_reduce",) + nccl_semantics.REDUCE_SCATTERS


class Block0Ends(pl.Callback):
    """Labels the trace at the end of every backward of block 0 (on the ranks that hold it)."""

    def on_train_start(self, trainer, pl_module):
        layers = trainer.strategy.pipeline_model.stage.layers
        if "0" not in layers:
            return
        count = [0]

        def mark(_grad):
            count[0] += 1
            nccl_semantics.current().mark(f"b0end:{count[0]}")

        def hook(_m, args, _out):
            if torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(mark)

        nccl_semantics.current().mark("train")
        layers["0"].register_forward_hook(hook)


def _dp_steps(steps, world):
    """The cross-pipeline gradient collectives of a trace (groups with a rank of each pipeline, not the world)."""
    return [s for s in steps if s.kind == "coll" and s.coll in DP_COLLECTIVES and len(s.group) < world
            and all(set(s.group) & ranks for ranks in PIPELINE_RANKS)]


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharding", ["ddp", "zero2"])
def test_first_gradient_bucket_starts_before_block0_last_backward_ends(tmp_path, sharding):
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    g = plan.global_batch
    hexiscale_trainer(plan, tmp_path, callbacks=[Block0Ends()], max_steps=1, accumulate_grad_batches=2,
                      max_epochs=1, limit_val_batches=0).fit(module(), loader(g * 2, g))
    read_ranks(tmp_path, plan.world_size)  # NCCL replay of the traces: one collective order everywhere
    for rank in (0, 1, 2):  # the ranks that hold block 0
        steps = torch.load(tmp_path / f"trace{rank}.pt", weights_only=False)
        labels = [s.phase for s in steps if s.phase.startswith("b0end:")]
        assert labels and labels[-1] == f"b0end:{2 * M}", f"rank {rank}: block 0 backward ends {sorted(set(labels))}"
        dp = _dp_steps([s for s in steps if s.phase], plan.world_size)
        assert dp, f"rank {rank}: no gradient collective in the trace"
        assert dp[0].phase == f"b0end:{2 * M - 1}", (
            f"rank {rank}: the first gradient bucket's {dp[0].coll} was issued at {dp[0].phase!r}, not during the "
            f"last backward of block 0 (between b0end:{2 * M - 1} and b0end:{2 * M})")
