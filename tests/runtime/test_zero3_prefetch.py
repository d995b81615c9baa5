"""ZeRO-3 prefetch: the gather of a stage's next block is issued before the current block's compute
ends (forward and backward), as the planner prices it (eq. 5: max(T_f, T_comm) per use).

Each rank labels its communication trace (``nccl_semantics`` phases) at the start of every block use
of its training run, before that use's gather: ``use:0``, ``use:1``, ... (a forward pre-hook and, for
the backward, a hook on the block output's gradient, both ahead of the gatherer's). A use's gather is
one receive-only ``batch_isend_irecv`` per holder group (g_j batches for use j). Without prefetch the
receives of use j are all issued under label ``use:j``; with prefetch the receives of use k+1 are
issued before label ``use:k+1``, i.e. during use k's compute, also across ops (the global sequence
of :func:`comm_order.stage_events` puts an op's first use before the pipeline exchanges that precede
the op): the batches issued up to the end of ``use:k`` number g_0 + ... + g_(k+1). The traces are replayed under NCCL's rules; equivalence with
the one-process reference is ``test_equivalence_zero``'s (zero3 cases). Memory: after every gather
(the only place blocks become whole) at most two blocks are whole, the current and the prefetched
one, as the memory estimate prices.
"""

from __future__ import annotations

import dataclasses

import nccl_semantics
import pytest
import torch
from test_equivalence import SEED, make_batch, plan_of

from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.comm_order import stage_events
from lightning_hexiscale.runtime.engine import PipelineEngine
from grad_step import train_step

# pipeline 0: rank 0, one stage (layers 0-3, 2 micro-batches); pipeline 1: ranks 1 -> 2 (layers 0-1, 2-3)
PLAN = dataclasses.replace(plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 2)), ([2], (2, 4))])], 4),
                           dp_sharding="zero3")
PIPELINES = ({0}, {1, 2})


def _worker(rank, world, plan_dict, config):
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    rec = nccl_semantics.current()
    uses = [0]

    def mark() -> None:
        rec.mark(f"use:{uses[0]}")
        uses[0] += 1

    def on_forward(_m, args):
        if torch.is_grad_enabled():
            mark()

    def on_output(_m, _args, out):
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda _g: mark())

    z3, held = engine.zero3, []
    gather = z3.gather

    def counting_gather(unit):  # blocks held whole after a gather: installed ones + the prefetched one
        gather(unit)
        held.append(sum(z3.gathered.values()) + (z3.prefetched is not None))

    z3.gather = counting_gather
    for block in engine.stage.layers.values():
        block.register_forward_pre_hook(on_forward, prepend=True)
        block.register_forward_hook(on_output, prepend=True)
    tokens, targets = make_batch(config, plan.global_batch, 0)
    rec.mark("run")
    train_step(engine, tokens, targets)
    rec.mark("step")
    opt.step()
    role = engine.role
    events = stage_events(plan, role.pipeline, role.stage)
    layers = [ev[1] for ev in events if ev[0] == "u"]
    groups = {layer: len(engine.zero3._by_group(f"layers.{layer}")) for layer in set(layers)}
    return {"layers": layers, "groups": groups, "uses": uses[0], "held": max(held)}


def _gather_batches(steps) -> list[str]:
    """Phase of every receive-only batch on a cross-pipeline group (this rank's block gathers)."""
    return [s.phase for s in steps if s.kind == "batch" and all(op.op == "recv" for op in s.ops)
            and all(set(s.group) & p for p in PIPELINES)]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_zero3_gathers_the_next_block_during_the_current_one(run_ranks_traced_fixture, tiny_gqa):
    results, traces = run_ranks_traced_fixture(PLAN.world_size, _worker, PLAN.to_dict(), tiny_gqa)
    report = nccl_semantics.replay(traces)
    assert report.ok, str(report)
    # memory: at most two blocks whole at once (the current one and the prefetched next one), what the
    # planner's memory estimate holds for ZeRO-3 (estimate.stage_memory_at: "the gathered current and
    # next layer")
    assert [r["held"] for r in results] == [2] * PLAN.world_size
    checked = 0
    for rank, (res, steps) in enumerate(zip(results, traces)):
        layers, g = res["layers"], res["groups"]
        assert res["uses"] == len(layers), f"rank {rank}: {res['uses']} marked uses, {len(layers)} planned"
        phases = _gather_batches(steps)
        # the run's first gather may be posted at its first pipeline exchange, before use 0 ("run")
        assert all(p == "run" or p.startswith("use:") for p in phases), f"rank {rank}: {set(phases)}"
        index = [-1 if p == "run" else int(p.split(":")[1]) for p in phases]
        for k in range(len(layers) - 1):
            issued = sum(i <= k for i in index)  # gather batches issued before use k+1 starts
            want = sum(g[layer] for layer in layers[:k + 2])
            assert issued == want, (f"rank {rank}: by the end of use {k} (block {layers[k]}) {issued} gather batches "
                                    f"were issued, {want} with the next block's (block {layers[k + 1]}) prefetched")
            checked += 1
    assert checked >= 20  # every use of every rank but its last
