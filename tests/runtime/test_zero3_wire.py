"""ZeRO-3's block transfers as the runtime makes them = as the cost model counts them.

One optimizer step of a plan whose pipelines run different micro-batch counts (4 and 2), one of
them with a TP-2 stage, on 4 gloo ranks under the NCCL-semantics recorder. From the trace (the
run phase, calls made in ``runtime/zero3.py``): every send-only batch is a holder serving one use
of a block to one user, every receive-only batch a user gathering one use from one holder group.
The sends per (holder, user) must equal ``wire.zero3_served_uses`` (2 n_mb of the USER's pipeline
per shared block), each of the size eq. 4 prices (the shared part of the holder's TP shard / k), the gathers 2 n_mb of the rank's own pipeline per block and holder group, and
per block the serves in T_comm units (a chunk to every other pipeline) must be what
``estimate()``'s ``dp_comm_s`` charges (``zero_terms.zero3_served_per_layer``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import nccl_semantics
import pytest
import torch
from test_equivalence import SEED, make_batch, plan_of

from lightning_hexiscale.planner import Plan
from lightning_hexiscale.planner.cost import zero_terms
from lightning_hexiscale.planner.cost.wire import local_matrix_params, zero3_served_uses
from lightning_hexiscale.runtime.engine import PipelineEngine
from grad_step import train_step

# pipeline 0: ranks 0, 1 as one TP-2 stage (layers 0-3), batch 4 of micro-batch 1: n_mb 4;
# pipeline 1: rank 2 (layers 0-1) -> rank 3 (layers 2-3), batch 2 of micro-batch 1: n_mb 2
PLAN = dataclasses.replace(plan_of([(4, 1, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], 4),
                           dp_sharding="zero3")


def _worker(rank, world, plan_dict, config):
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    tokens, targets = make_batch(config, plan.global_batch, 0)
    rec = nccl_semantics.current()
    rec.mark("run")
    train_step(engine, tokens, targets)
    rec.mark("step")
    opt.step()
    z3 = engine.zero3
    groups = {int(u.split(".")[1]): len(z3._by_group(u)) for u in z3.units}
    return {"groups": groups}


def _share(holder: int, user: int) -> float:
    """Fraction of the holder's TP shard of a block that the user's TP shard covers (even splits)."""
    (t, r), (t2, r2) = [next((st.tp, st.devices.index(d)) for p in PLAN.pipelines for st in p.stages
                             if d in st.devices) for d in (holder, user)]
    return t * max(0.0, min((r + 1) / t, (r2 + 1) / t2) - max(r / t, r2 / t2))


def _zero3_batches(trace, op: str):
    return [s for s in trace if s.phase == "run" and s.kind == "batch" and "zero3.py" in s.where
            and all(o.op == op for o in s.ops)]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_zero3_serves_and_gathers_are_what_the_cost_model_counts(run_ranks_traced_fixture, tiny_gqa):
    results, traces = run_ranks_traced_fixture(PLAN.world_size, _worker, PLAN.to_dict(), tiny_gqa)
    report = nccl_semantics.replay(traces)
    assert report.ok, str(report)
    served, elements = Counter(), Counter()
    for rank, trace in enumerate(traces):
        for s in _zero3_batches(trace, "send"):
            assert len({o.peer for o in s.ops}) == 1, s  # one serve: one user
            served[(rank, s.ops[0].peer)] += 1
            elements[(rank, s.ops[0].peer)] += sum(o.numel for o in s.ops)
    want = zero3_served_uses(PLAN)
    assert dict(served) == want
    # the size of a serve: the part of the holder's TP shard of the block (matrices) that the user
    # holds, over the k pipelines, as eq. 4's bytes (dp_comm: share * layer / k) have it
    for (holder, user), n in served.items():
        st = next(st for p in PLAN.pipelines for st in p.stages if holder in st.devices)
        own = local_matrix_params(tiny_gqa, st.tp, st.devices.index(holder))
        assert elements[(holder, user)] / n == _share(holder, user) * own / PLAN.num_pipelines, (holder, user)
    # e.g. holder 2 (pipeline 1, n_mb 2) serves user 0 (pipeline 0, n_mb 4) 2 * 4 uses of each of its
    # 2 blocks; holder 0 serves user 2 only 2 * 2 per block
    assert want[(2, 0)] == 16 and want[(0, 2)] == 8
    n_mb = [p.num_micro_batches for p in PLAN.pipelines]
    for rank, (res, trace) in enumerate(zip(results, traces)):
        i = 0 if rank < 2 else 1
        gathers = len(_zero3_batches(trace, "recv"))
        assert gathers == 2 * n_mb[i] * sum(res["groups"].values()), f"rank {rank}"
        # served per block in T_comm units (its shard to the partners of every other pipeline: a
        # serve to a user holding part of it counts that part)
        units = sum(n * _share(rank, user) for (h, user), n in served.items() if h == rank)
        per_block = units / len(res["groups"]) / (len(n_mb) - 1)
        assert per_block == zero_terms.zero3_served_per_layer(n_mb, i), f"rank {rank}"
