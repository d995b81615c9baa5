"""Bytes on the wire = bytes the cost model prices.

One optimizer step of a plan with every link class (a scatter/gather boundary between two TP-2
stages, leader boundaries with TP broadcasts into TP-2 stages both ways, TP inside stages with the
vocabulary-parallel embedding, head and loss, data parallelism across TP-asymmetric pipelines) runs
on 8 gloo ranks under
the NCCL-semantics recorder, in fp32 and bf16-mixed, ddp and zero2 (and reduce_dtype=fp32 under
bf16-mixed). The bytes each rank moves per link class, counted from the trace with the cost model's
conventions (tests/nccl_semantics.step_bytes), must equal ``planner.cost.wire.wire_bytes`` for the same
plan and dtypes, exactly. A second plan does the same for a tied embedding (its first/last-stage
exchange, at the float32 master dtype).
"""

from __future__ import annotations

import dataclasses

import nccl_semantics
import pytest
import torch
from test_equivalence import SEED, make_batch, plan_of

from lightning_hexiscale.planner.cost.wire import CLASSES, wire_bytes
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.schedule import global_loss
from lightning_hexiscale.runtime.topology import link_pairs, role_of

# pipeline 0: TP-2 (layer 0, vocabulary-parallel embedding) -> TP-2 (layer 1: scatter/gather path)
# -> TP-1 (layer 2: leader path, broadcast back into the TP-2 stage) -> TP-2 (layer 3 and the
# vocabulary-parallel head and loss: broadcast forward); pipeline 1: one TP-1 stage
PLAN = plan_of([(4, 2, [([0, 1], (0, 1)), ([2, 3], (1, 2)), ([4], (2, 3)), ([5, 6], (3, 4))]),
                (2, 1, [([7], (0, 4))])], 4, recompute=True)
# (name, autocast, dp_sharding, reduce_dtype, bytes: activations, reduction, gathered parameters)
CONFIGS = [("fp32-ddp", None, "ddp", None, (4, 4, 4)),
           ("fp32-zero2", None, "zero2", None, (4, 4, 4)),
           ("bf16mixed-ddp", torch.bfloat16, "ddp", None, (2, 2, 2)),
           ("bf16mixed-zero2", torch.bfloat16, "zero2", None, (2, 2, 2)),
           ("bf16mixed-ddp-reduce-fp32", torch.bfloat16, "ddp", "fp32", (2, 4, 2))]


def _worker(rank, world, plan_dict, config):
    rec = nccl_semantics.current()
    for name, autocast, sharding, reduce, _ in CONFIGS:
        plan = dataclasses.replace(Plan.from_dict(plan_dict), dp_sharding=sharding, reduce_dtype=reduce)
        rec.mark("setup")
        engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float32, autocast_dtype=autocast)
        opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        tokens, targets = make_batch(config, plan.global_batch, 0)
        rec.mark(f"{name}:run")
        loss = engine.step.run_pipeline(engine.local_batch(tokens), engine.local_batch(targets), engine.loss_scale,
                                        last=True)
        rec.mark(f"{name}:sync")
        engine.step.sync()
        rec.mark(f"{name}:step")
        opt.step()
        rec.mark("loss")
        global_loss(loss, engine.role, engine.loss_device)
    return None


def measured(traces, plan: Plan, name: str) -> dict[int, dict[str, float]]:
    """Bytes per rank and link class in config ``name``: the pipeline run's p2p and TP-group
    broadcast / all-gather are PP, its TP-group all-reduces TP, its other collectives (the gradient
    buckets started during the last backward: ddp all-reduces, ZeRO-2 reduce-scatters) DP; the sync
    and step phases are DP."""
    links = set(link_pairs(plan))
    out = {}
    for r, trace in enumerate(traces):
        tp_group = tuple(sorted(role_of(plan, r).stage_ranks))
        got = dict.fromkeys(CLASSES, 0.0)
        for step in trace:
            if step.phase == f"{name}:run":
                if step.kind != "coll":
                    assert all(op.group in links for op in step.ops), step
                    cls = "pp"
                elif step.group == tp_group:
                    cls = "tp" if step.coll == "all_reduce" else "pp"
                else:
                    where = step.where.split(":")[0]
                    assert (step.coll, where) == ("all_reduce", "grad_sync.py") or (
                        step.coll in nccl_semantics.REDUCE_SCATTERS and where == "zero.py"), step
                    cls = "dp"
            elif step.phase in (f"{name}:sync", f"{name}:step"):
                cls = "dp"
            else:
                continue
            got[cls] += nccl_semantics.step_bytes(step)
        out[r] = got
    return out


def priced_and_moved(traces, drawn: Plan, config, **kw):
    """Per configuration of CONFIGS: (name, plan, {device: priced bytes per class} from wire_bytes,
    {rank: moved bytes per class} from the traces)."""
    for name, _, sharding, reduce, (b_act, b_red, b_par) in CONFIGS:
        plan = dataclasses.replace(drawn, dp_sharding=sharding, reduce_dtype=reduce)
        yield name, plan, wire_bytes(plan, config, b_act, b_red, b_par, **kw), measured(traces, plan, name)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_runtime_moves_the_bytes_the_cost_model_prices(run_ranks_traced_fixture, tiny_gqa):
    _, traces = run_ranks_traced_fixture(PLAN.world_size, _worker, PLAN.to_dict(), tiny_gqa)
    assert nccl_semantics.replay(traces).ok
    for name, plan, priced, got in priced_and_moved(traces, PLAN, tiny_gqa):
        for r, device in enumerate(plan.device_order):
            for cls in CLASSES:
                assert got[r][cls] == pytest.approx(priced[device][cls], rel=1e-12), (name, r, cls, got[r], priced[device])
        # every class is exercised somewhere
        assert all(sum(g[c] for g in got.values()) > 0 for c in CLASSES)
    # bf16-mixed halves PP traffic and, with the default reduce dtype, DP traffic; TP nearly (the
    # cross-entropy's per-token scalars stay float32)
    fp32, bf16 = measured(traces, PLAN, "fp32-ddp"), measured(traces, PLAN, "bf16mixed-ddp")
    total = {(name, c): sum(g[c] for g in run.values()) for name, run in (("fp32", fp32), ("bf16", bf16)) for c in CLASSES}
    for c in ("pp", "dp"):
        assert total[("bf16", c)] == pytest.approx(total[("fp32", c)] / 2)
    assert 0.5 * total[("fp32", "tp")] < total[("bf16", "tp")] < 0.55 * total[("fp32", "tp")]


# tied embeddings: pipeline 0's TP-2 first stage and TP-1 last stage exchange the tied rows pairwise
# (rank 2 pairs with ranks 0 and 1, half of the vocabulary each); pipeline 1 is one stage (no
# exchange, one copy of the tied matrix in the sync)
TIED_PLAN = plan_of([(4, 2, [([0, 1], (0, 2)), ([2], (2, 4))]), (2, 1, [([3], (0, 4))])], 4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tied_embedding_exchange_is_priced(run_ranks_traced_fixture, tiny_gqa):
    """The first/last-stage exchange of a tied embedding (gradient sum, then the summed gradient
    under ddp or the updated weights under ZeRO-2) moves the float32 master rows, also under
    bf16-mixed; wire_bytes prices it, and counts the tied matrix once in the gradient sync."""
    tied = dataclasses.replace(tiny_gqa, tie_word_embeddings=True)
    _, traces = run_ranks_traced_fixture(TIED_PLAN.world_size, _worker, TIED_PLAN.to_dict(), tied)
    assert nccl_semantics.replay(traces).ok
    for name, _, sharding, reduce, (b_act, b_red, b_par) in CONFIGS:
        plan = dataclasses.replace(TIED_PLAN, dp_sharding=sharding, reduce_dtype=reduce)
        priced = wire_bytes(plan, tied, b_act, b_red, b_par, master_bytes=4)
        got = measured(traces, plan, name)
        for r, device in enumerate(plan.device_order):
            for cls in CLASSES:
                assert got[r][cls] == pytest.approx(priced[device][cls], rel=1e-12), (name, r, cls, got[r], priced[device])
