"""``PipelineEngine.fit_step`` equals one process: the step with clipping by the global norm, and its
non-finite policies, on 4 gloo ranks (a TP-2 stage and a second pipeline of two stages).

The reference is the plain ``Llama`` in one process: loss, backward, ``torch.nn.utils.clip_grad_norm_``
and SGD, float64. The clip is set below the gradient's norm so that clipping acts on every step; the
norm fit_step reports must equal the reference's. ``tests/lightning/test_fit_step_trace.py`` shows
that the Trainer's step issues the same communication.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_equivalence import ATOL, SEED, assert_matches_reference, make_batch, plan_of

from lightning_hexiscale.errors import NonFiniteError
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine

PLAN = plan_of([(2, 1, [([0, 1], (0, 4))]), (4, 2, [([2], (0, 2)), ([3], (2, 4))])], 4)
STEPS = 2
LR = 0.5
CLIP = 0.05


def _reference(config) -> tuple[list[float], list[float], dict]:
    model = Llama(config).to(torch.float64).init_weights(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(config, PLAN.global_batch, step)
        opt.zero_grad()
        loss = model.loss(model(tokens), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int, plan_dict: dict, config) -> dict:
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=LR))
    outs = [engine.fit_step(*make_batch(config, plan.global_batch, step), opt, clip_norm=CLIP)
            for step in range(STEPS)]
    return {"losses": [o.loss for o in outs], "norms": [o.grad_norm for o in outs],
            "skipped": [o.nonfinite for o in outs],
            "shards": {k: (t.clone(), d, s, e) for k, (t, d, s, e) in engine.local_shards().items()}}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharding", ["ddp", "zero2"])
def test_fit_step_with_clipping_equals_one_process(run_ranks, tiny_gqa, sharding):
    ref_losses, ref_norms, ref_state = _reference(tiny_gqa)
    assert min(ref_norms) > CLIP  # clipping acts on every step, so a step without it would differ
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    results = run_ranks(plan.world_size, _train, plan.to_dict(), tiny_gqa)
    assert_matches_reference(results, ref_losses, ref_state)
    for rank, res in enumerate(results):
        assert res["norms"] == pytest.approx(ref_norms, abs=ATOL), f"rank {rank} norms"
        assert res["skipped"] == [{}] * STEPS


def _poisoned(rank: int, world: int, plan_dict: dict, config, policy: str):
    """Rank 3 (pipeline 1's last stage) holds an inf weight: every rank's step is non-finite."""
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=LR))
    if rank == 3:
        with torch.no_grad():
            next(iter(engine.parameters())).view(-1)[0] = float("inf")
    before = {k: t.clone() for k, (t, _, _, _) in engine.local_shards().items()}
    try:
        out = engine.fit_step(*make_batch(config, plan.global_batch, 0), opt, clip_norm=CLIP, nonfinite=policy)
    except NonFiniteError as exc:
        return {"raised": str(exc)}
    after = engine.local_shards()
    unchanged = all(torch.equal(before[k], t) or not torch.isfinite(before[k]).all()
                    for k, (t, _, _, _) in after.items())
    grads = [p.grad for p in engine.parameters() if p.grad is not None]
    return {"nonfinite": out.nonfinite, "unchanged": unchanged, "grads_left": len(grads)}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharding", ["ddp", "zero2"])
def test_a_nonfinite_step_is_skipped_or_stops_on_every_rank(run_ranks, tiny_gqa, sharding):
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    skipped = run_ranks(plan.world_size, _poisoned, plan.to_dict(), tiny_gqa, "skip")
    for rank, res in enumerate(skipped):
        assert res["nonfinite"] and 3 in res["nonfinite"], f"rank {rank}: {res}"
        assert res["nonfinite"] == skipped[0]["nonfinite"], f"rank {rank} decided differently"
        assert res["unchanged"] and res["grads_left"] == 0, f"rank {rank}: the update was not dropped: {res}"
    stopped = run_ranks(plan.world_size, _poisoned, plan.to_dict(), tiny_gqa, "stop")
    for rank, res in enumerate(stopped):
        assert "rank(s) [" in res.get("raised", "") and "3" in res["raised"], f"rank {rank}: {res}"


def test_fit_step_names_a_bad_policy():
    class _Bare(PipelineEngine):
        def __init__(self):  # no process group needed: the policy is checked first
            pass

    with pytest.raises(Exception, match=r"fit_step\(nonfinite\).*'stop' or 'skip'"):
        _Bare().fit_step(torch.zeros(1, 1), torch.zeros(1, 1), None, nonfinite="ignore")
