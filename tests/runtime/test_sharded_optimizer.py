"""runtime/zero.py's ShardedOptimizer as the optimizer Lightning holds under ZeRO: its ``state_dict``
/ ``load_state_dict`` restore the chunks' state exactly (a run whose state was cleared and reloaded
between two steps equals an uninterrupted one), and it refuses a state of another layout."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_equivalence import SEED, make_batch, plan_of

from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine

PLAN = plan_of([(3, 1, [([0], (0, 4))]), (1, 1, [([1], (0, 4))])], 4)


def _run(plan, config, reload: bool):
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    for step in range(2):
        if reload and step == 1:
            saved = copy.deepcopy(opt.state_dict())
            for inner in opt.inner:
                inner.state.clear()
            assert not opt.state
            opt.load_state_dict(saved)
        tokens, targets = make_batch(config, plan.global_batch, step)
        engine.fit_step(tokens, targets, opt)
    return engine.local_shards(), opt


def _worker(rank: int, world: int, plan_dict: dict, config):
    plan = Plan.from_dict(plan_dict)
    straight, _ = _run(plan, config, reload=False)
    reloaded, opt = _run(plan, config, reload=True)
    other = copy.deepcopy(opt.state_dict())
    other["param_groups"][0]["lr"] = 2e-2  # the saved hyper-parameters come back too
    opt.load_state_dict(other)
    with pytest.raises(ValueError, match="another plan or rank"):
        opt.load_state_dict({"inner": [], "param_groups": []})
    return {"same": all(torch.equal(straight[k][0], reloaded[k][0]) for k in straight),
            "lr": opt.param_groups[0]["lr"], "state": len(opt.state)}


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_state_dict_round_trip(run_ranks, tiny_gqa, sharding):
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    for res in run_ranks(plan.world_size, _worker, plan.to_dict(), tiny_gqa):
        assert res["same"] and res["state"] > 0 and res["lr"] == 2e-2, res
