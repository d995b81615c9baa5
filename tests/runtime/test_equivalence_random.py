"""Equivalence on plans nobody picked: random asymmetric plans == the plain Llama in one process.

The hand-written plans of ``test_equivalence.py`` / ``test_equivalence_zero.py`` cover the cases we
thought of; here a seeded generator draws plans the way a user's file or a search might write them:
2-6 ranks with device ids in any order, 1-3 pipelines of their own batch and micro-batch sizes, 1-4
stages per pipeline with any TP degree the heads allow (often one degree t > 1 for all of them:
the scatter/gather path between stages) and uneven layer splits, either schedule,
recomputation on or off, DDP / ZeRO-2 / ZeRO-3, SGD or AdamW. Each trains the tiny LLaMA in float64
for 3 steps on forked gloo ranks under the NCCL-semantics harness (``run_ranks``), and the loss of
every step and every copy of every parameter element is compared with the single-process reference
(``test_equivalence.reference``, atol 1e-6).
"""

from __future__ import annotations

import random

import pytest
import torch
from test_equivalence import SEED, STEPS, assert_matches_reference, make_optimizer, reference, run_steps

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import DP_SHARDINGS, SCHEDULES, Plan
from lightning_hexiscale.runtime.engine import PipelineEngine

SEEDS = range(12)


def _split(rng: random.Random, items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` non-empty runs, in order, at random places."""
    cuts = sorted(rng.sample(range(1, len(items)), parts - 1))
    return [items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)])]


def random_plan(seed: int, config: LlamaConfig, max_world: int = 6) -> Plan:
    """A valid plan drawn from ``seed`` (draws that break a rule, e.g. a TP degree beyond the KV
    heads, are drawn again)."""
    rng = random.Random(seed)
    layers = list(range(config.num_layers))
    for _ in range(1000):
        world = rng.randint(2, max_world)
        devices = list(range(world))
        rng.shuffle(devices)  # rank order is not pipeline order
        pipelines = []
        for group in _split(rng, devices, rng.randint(1, min(3, world))):
            even = [s for s in range(2, min(len(group) // 2, len(layers)) + 1) if len(group) % s == 0]
            if even and rng.random() < 0.5:  # stages of one TP degree t > 1: the scatter/gather path
                stages = rng.choice(even)
                t = len(group) // stages
                cut = [group[k * t:(k + 1) * t] for k in range(stages)]
            else:
                stages = rng.randint(1, min(len(group), len(layers)))
                cut = _split(rng, group, stages)
            micro = rng.randint(1, 3)
            pipelines.append({"batch_size": micro * rng.randint(1, 4), "micro_batch_size": micro,
                              "stages": [{"devices": d, "layers": [span[0], span[-1] + 1]}
                                         for d, span in zip(cut, _split(rng, layers, stages))]})
        plan = Plan.from_dict({"num_layers": config.num_layers, "schedule": rng.choice(SCHEDULES),
                               "recompute": rng.random() < 0.5, "dp_sharding": rng.choice(DP_SHARDINGS),
                               "pipelines": pipelines})
        try:
            return plan.validate(model=config)
        except PlanError:
            continue
    raise AssertionError(f"seed {seed}: no valid plan in 1000 draws")


def _worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig, optimizer: str) -> dict:
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(make_optimizer(optimizer, engine.parameters()))
    losses = run_steps(engine, opt, config, plan.global_batch, range(STEPS))
    return {"losses": losses, "shards": engine.local_shards()}


def test_the_generator_draws_varied_plans(tiny_gqa, tiny_mha):
    """Not a vacuous sample: across the seeds the plans differ in every dimension drawn."""
    plans = [random_plan(s, tiny_mha if s % 2 else tiny_gqa) for s in SEEDS]
    assert len({p.world_size for p in plans}) >= 3
    assert {len(p.pipelines) for p in plans} >= {1, 2}
    assert {p.dp_sharding for p in plans} == set(DP_SHARDINGS)
    assert {p.schedule for p in plans} == set(SCHEDULES) and {p.recompute for p in plans} == {False, True}
    degrees = {len(st.devices) for p in plans for pipe in p.pipelines for st in pipe.stages}
    assert {1, 2} <= degrees
    assert any(len(pipe.stages) > 1 for p in plans for pipe in p.pipelines)
    assert any(len({pipe.batch_size for pipe in p.pipelines}) > 1 for p in plans)
    # adjacent stages of one TP degree, one of them listed out of rank order (the case that trained wrongly)
    assert any(len(a.devices) == len(b.devices) > 1 and (list(a.devices) != sorted(a.devices)
                                                       or list(b.devices) != sorted(b.devices))
               for p in plans for pipe in p.pipelines for a, b in zip(pipe.stages, pipe.stages[1:]))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_plan_trains_as_one_process(run_ranks, tiny_gqa, tiny_mha, seed):
    config = tiny_mha if seed % 2 else tiny_gqa
    plan = random_plan(seed, config)
    optimizer = "adamw" if seed % 3 == 0 else "sgd"
    results = run_ranks(plan.world_size, _worker, plan.to_dict(), config, optimizer)
    ref_losses, ref_state = reference(config, plan.global_batch, optimizer)
    assert_matches_reference(results, ref_losses, ref_state)
