"""Resume on another plan, for plans nobody picked: save under random plan A, resume under random plan
B == the plain Llama in one process.

A seeded pair of plans (``test_equivalence_random.random_plan``: any world of 2-6 ranks, pipelines,
TP degrees, uneven layers, schedule, recomputation, DDP / ZeRO-2 / ZeRO-3) for the tiny LLaMA in
float64 with AdamW: one step under A, a sharded checkpoint (model and optimizer state,
``runtime.checkpoint``), then a fresh engine under B loads it and takes two more steps. The losses of
steps 2 and 3 and every copy of every parameter element after them must equal three steps of the
single-process reference (atol 1e-6): a parameter or an Adam moment read into the wrong slice, or
one left fresh, changes them. All ranks run under the NCCL-semantics harness (``run_ranks``).
"""

from __future__ import annotations

import pytest
import torch
from test_equivalence import SEED, STEPS, assert_matches_reference, reference, run_steps
from test_equivalence_random import random_plan

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.engine import PipelineEngine

SEEDS = range(6)
LR = 1e-2


def _engine(plan_dict: dict, config: LlamaConfig):
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    # the reference's optimizer (test_equivalence.make_optimizer("adamw", ...))
    opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1))
    return plan, engine, opt


def _save_worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig, path: str) -> float:
    plan, engine, opt = _engine(plan_dict, config)
    loss = run_steps(engine, opt, config, plan.global_batch, range(1))[0]
    ckpt.save(path, engine, getattr(opt, "user", opt), lightning_state={"global_step": 1})
    return loss


def _resume_worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig, path: str) -> dict:
    plan, engine, opt = _engine(plan_dict, config)  # drawn from SEED: the load must overwrite all of it
    ckpt.load_model(path, engine)
    ckpt.load_optimizer(path, engine, opt)
    losses = run_steps(engine, opt, config, plan.global_batch, range(1, STEPS))
    return {"losses": losses, "shards": engine.local_shards()}


def plan_pair(seed: int, config: LlamaConfig) -> tuple[Plan, Plan]:
    """Two plans of the same global batch: B is drawn until its batch matches A's."""
    a = random_plan(seed, config)
    for k in range(1, 10_000):
        b = random_plan(seed * 10_007 + k, config)
        if b.global_batch == a.global_batch and b.to_dict()["pipelines"] != a.to_dict()["pipelines"]:
            return a, b
    raise AssertionError(f"seed {seed}: no second plan of global batch {a.global_batch}")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_plan_resumes_another_ones_checkpoint_as_one_process(run_ranks, tiny_gqa, tiny_mha, tmp_path, seed):
    config = tiny_mha if seed % 2 else tiny_gqa
    a, b = plan_pair(seed, config)
    path = str(tmp_path / "ckpt")
    first = run_ranks(a.world_size, _save_worker, a.to_dict(), config, path)
    resumed = run_ranks(b.world_size, _resume_worker, b.to_dict(), config, path)
    ref_losses, ref_state = reference(config, a.global_batch, "adamw")
    assert first == pytest.approx([ref_losses[0]] * a.world_size, abs=1e-6)
    assert_matches_reference(resumed, ref_losses[1:], ref_state)
