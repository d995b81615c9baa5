"""The gradient buckets started during the last backward are the same on every member of each
bucket's group, whatever the plan, precision and bucket cap: one collective order on every rank.

Which buckets start inside the backward (:class:`~lightning_hexiscale.runtime.grad_sync.BoundaryStarts`)
must not depend on local facts such as whether autograd keeps a block's input alive (it does not for a
16-bit input that RMSNorm upcasts): a bucket started in the backward by one member and only in the
sync by another puts the world collectives in between in opposite orders on the two members. The
Lightning path has two there (the loss all-reduce, then the non-finite check); each step below runs
in that order: ``run_pipeline(arm=True)``, :func:`global_loss`, a world all-reduce, ``sync_grads``.
The sweep covers asymmetric pipelines (different layer splits, TP 1/2/3, 1 to 3 stages, GPipe and
1F1B, recompute), 16-, 32- and 64-bit parameters and bf16 autocast, ddp and ZeRO-2, bucket caps of
one item, a few KiB and the default; ``run_ranks`` replays every trace under NCCL's rules (the
16-bit cases fail that replay with the weakly referenced boundaries of the merge, where first
stages started nothing early). Each rank also checks that it started exactly the plan's early set
(every block and head bucket) during the backward, each at a block boundary (none left to
``BoundaryStarts.finish`` after the backward: the overlap the planner prices).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_equivalence import SEED, make_batch, plan_of

from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.grad_sync import DEFAULT_BUCKET_CAP_BYTES
from lightning_hexiscale.runtime.schedule import global_loss

PLANS = {
    # the merge's failing shape: one TP-2 stage next to a two-stage pipeline
    "tp2_pp2": lambda: plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], 4),
    # uneven splits on both sides, TP in a later stage, GPipe with recompute
    "pp2tp2_pp2": lambda: plan_of([(2, 1, [([0], (0, 1)), ([1, 2], (1, 4))]), (2, 1, [([3], (0, 3)), ([4], (3, 4))])],
                                   4, schedule="gpipe", recompute=True),
    # three pipelines: TP 3 (uneven heads), three stages, one device
    "tp3_pp3_1": lambda: plan_of([(2, 1, [([0, 1, 2], (0, 4))]), (3, 1, [([3], (0, 1)), ([4], (1, 2)), ([5], (2, 4))]),
                                  (1, 1, [([6], (0, 4))])], 4),
}

# (parameter dtype, autocast dtype)
PRECISIONS = {"16-true": (torch.float16, None), "bf16-true": (torch.bfloat16, None), "32-true": (torch.float32, None),
              "64-true": (torch.float64, None), "bf16-mixed": (torch.float32, torch.bfloat16)}

CASES = [(plan, sharding, precision, cap)
         for plan, sharding, precision, cap in [
             ("tp2_pp2", "ddp", "16-true", DEFAULT_BUCKET_CAP_BYTES),
             ("tp2_pp2", "zero2", "bf16-true", DEFAULT_BUCKET_CAP_BYTES),
             ("tp2_pp2", "ddp", "bf16-mixed", 1),
             ("tp2_pp2", "zero2", "64-true", 1),
             ("tp2_pp2", "ddp", "32-true", 4096),
             ("pp2tp2_pp2", "ddp", "bf16-true", 1),
             ("pp2tp2_pp2", "zero2", "16-true", 4096),
             ("pp2tp2_pp2", "zero2", "bf16-mixed", DEFAULT_BUCKET_CAP_BYTES),
             ("tp3_pp3_1", "ddp", "bf16-true", 4096),
             ("tp3_pp3_1", "zero2", "32-true", 1),
         ]]


def _worker(rank, world, plan_dict, config, precision, cap):
    plan = Plan.from_dict(plan_dict)
    dtype, autocast = PRECISIONS[precision]
    engine = PipelineEngine(plan, config, seed=SEED, dtype=dtype, autocast_dtype=autocast, bucket_cap_bytes=cap)
    opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.01))
    syncer = engine.grad_sync if engine.grad_sync is not None else engine.zero
    started, late = [], []
    for step in range(2):
        tokens, targets = make_batch(config, plan.global_batch, step)
        for p in engine.stage.parameters():
            p.grad = None
        loss = engine.step.run_pipeline(engine.local_batch(tokens), engine.local_batch(targets), engine.loss_scale,
                                        last=True)
        global_loss(loss, engine.role, engine.loss_device)  # the Lightning path's order: loss, check, sync
        dist.all_reduce(torch.zeros(world))
        engine.step.sync()
        started.append(syncer.overlapped_buckets)
        late.append(syncer.starts.started_after_backward)
        opt.step()
    return started, late, syncer.starts.early, len(syncer.starts.sizes)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan_id,sharding,precision,cap", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_early_buckets_are_the_plans_on_every_member(run_ranks, tiny_mha, plan_id, sharding, precision, cap):
    plan = PLANS[plan_id]()
    plan = Plan.from_dict({**plan.to_dict(), "dp_sharding": sharding})
    results = run_ranks(plan.world_size, _worker, plan.to_dict(), tiny_mha, precision, cap)
    total = 0
    for rank, (started, late, early, n) in enumerate(results):
        assert started == [early, early], (rank, started, early, n)  # the whole early set, every step
        assert late == [0, 0], (rank, late)  # each at a block boundary inside the backward, none after it
        assert n - early <= 3, (rank, n, early)  # only the embedding's buckets wait for the sync
        total += early
    assert total > 0
