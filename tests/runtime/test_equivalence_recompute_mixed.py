"""Recomputation per pipeline at run time: each rank's stage recomputes iff its own pipeline does
(``Pipeline.recompute``), and a plan with mixed flags trains exactly as the plain Llama in one
process (float64, atol 1e-6, as ``test_equivalence.py``), under DDP and under ZeRO-3 (whose
gathers serve the recomputed forward inside the backward)."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import (SEED, STEPS, assert_matches_reference, bf16_reference_losses, make_batch,
                              make_optimizer, reference)

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine
from grad_step import train_step


def _worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig, dtype: torch.dtype = torch.float64,
            autocast_dtype: torch.dtype | None = None, steps: int = STEPS):
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=dtype, autocast_dtype=autocast_dtype)
    opt = engine.wrap_optimizer(make_optimizer("sgd", engine.parameters()))
    losses = []
    for step in range(steps):
        tokens, targets = make_batch(config, plan.global_batch, step)
        losses.append(train_step(engine, tokens, targets))
        opt.step()
    return {"losses": losses, "shards": engine.local_shards(), "recompute": engine.stage.recompute,
            "pipeline": engine.role.pipeline, "main_grads": engine.main_grads is not None}


def mixed_plan(sharding: str) -> Plan:
    """Fig. 1 (bottom) of the paper: a one-stage TP-2 pipeline that recomputes (its TP all-reduces
    run again in the backward) next to a three-stage pipeline that does not."""
    return Plan.from_dict({
        "num_layers": 4, "schedule": "1f1b", "dp_sharding": sharding, "pipelines": [
            {"batch_size": 4, "micro_batch_size": 2, "recompute": True,
             "stages": [{"devices": [0, 1], "layers": [0, 4]}]},
            {"batch_size": 2, "micro_batch_size": 1, "recompute": False,
             "stages": [{"devices": [2], "layers": [0, 2]}, {"devices": [3], "layers": [2, 3]},
                        {"devices": [4], "layers": [3, 4]}]}]})


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharding", ["ddp", "zero3"])
def test_mixed_recomputation_matches_the_reference(run_ranks, tiny_gqa, sharding):
    plan = mixed_plan(sharding)
    assert plan.recomputes == (True, False)
    plan.validate(model=tiny_gqa)
    results = run_ranks(plan.world_size, _worker, plan.to_dict(), tiny_gqa)
    # each rank runs its own pipeline's flag: ranks 0-1 recompute, ranks 2-4 do not
    assert [(r["pipeline"], r["recompute"]) for r in results] == [(0, True)] * 2 + [(1, False)] * 3
    ref_losses, ref_state = reference(tiny_gqa, plan.global_batch, "sgd")
    assert_matches_reference(results, ref_losses, ref_state)



@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mixed_recomputation_under_bf16_autocast(run_ranks, tiny_gqa):
    """Under mixed precision the fast path keeps fp32 main gradients only where a pipeline does not
    recompute (``FastPath.resolve``): the recomputing pipeline sums its gradients without them, the
    other with them, and the two meet in the same all-reduce. Losses within bf16 noise of the
    single-process run under the same autocast (as ``test_equivalence``'s bf16 test)."""
    plan = mixed_plan("ddp")
    results = run_ranks(plan.world_size, _worker, plan.to_dict(), tiny_gqa, torch.float32, torch.bfloat16, 2)
    assert [(r["recompute"], r["main_grads"]) for r in results] == [(True, False)] * 2 + [(False, True)] * 3
    ref = bf16_reference_losses(tiny_gqa, plan.global_batch, 2)
    for res in results:
        assert res["losses"] == pytest.approx(ref, rel=2e-2)
