"""The engine's non-finite check (``PipelineEngine.nonfinite_ranks``): one collective after the
backward, before the gradient sync, whose answer (the ranks whose loss or gradients are not finite,
by kind) is the same on every rank; a TP-2 stage and a second pipeline, on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import make_batch, plan_of

from lightning_hexiscale.runtime.engine import PipelineEngine

PLAN = plan_of([(2, 1, [([0, 1], (0, 2)), ([2], (2, 4))]), (2, 1, [([3], (0, 4))])], 4)


def _check(rank: int, world: int, config, poison: dict[int, str]) -> dict[int, int]:
    engine = PipelineEngine(PLAN, config, seed=0, device=torch.device("cpu"), dtype=torch.float64)
    tokens, targets = make_batch(config, PLAN.global_batch, 0)
    loss = torch.tensor(engine.step.micro_step(engine.local_batch(tokens), engine.local_batch(targets)))
    what = poison.get(rank, "")
    if "loss" in what:
        loss = torch.tensor(float("nan"))
    if "grad" in what:
        next(p for p in engine.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    bad = engine.step.nonfinite_ranks(loss)
    engine.step.discard()  # what a skipped step does: the sync the backward started completes
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("poison,want", [({}, {}), ({1: "grad"}, {1: 2}), ({3: "loss"}, {3: 1}),
                                         ({0: "loss grad", 2: "grad"}, {0: 3, 2: 2})],
                         ids=["finite", "tp-rank-grad", "other-pipeline-loss", "both"])
def test_every_rank_gets_the_same_answer(run_ranks, tiny_gqa, poison, want):
    assert run_ranks(PLAN.world_size, _check, tiny_gqa, poison) == [want] * PLAN.world_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_finite_sees_every_kind_of_non_finite_element(dtype):
    from lightning_hexiscale.runtime.grad_sync import finite

    t = torch.randn(1000, dtype=dtype) * 1e3
    assert bool(finite(t)) and bool(finite(torch.empty(0, dtype=dtype)))
    assert bool(finite(torch.full((4,), torch.finfo(dtype).max, dtype=dtype)))  # large but finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 517, 999):
            u = t.clone()
            u[where] = bad
            assert not bool(finite(u)), (bad, where)
