"""Evaluation and prediction on plans nobody picked == the plain Llama in one process.

For seeded random plans (``test_equivalence_random.random_plan``) each pipeline takes its own number
of rows (1-5, whatever its micro-batch size: an evaluation batch need not divide by it), each plan
is run as drawn and with every stage's devices in descending order, and
``PipelineEngine.eval_loss`` must give the token-mean loss of all the rows and ``predict_logits``
the logits of all the rows in pipeline order on plan rank 0, as the single-process model computes
them (float64, atol 1e-6). Under the NCCL-semantics harness (``run_ranks``): forward-only walks
exchange chunks of any size between stages, and ZeRO-3 gathers every block for them.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_equivalence import SEED
from test_equivalence_random import random_plan

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine

SEEDS = range(9)
ATOL = 1e-6


def _rows(seed: int, plan: Plan, config: LlamaConfig) -> tuple[list[int], torch.Tensor]:
    """Rows per pipeline and the whole batch (sum of rows, seq_len + 1) of token ids."""
    rng = random.Random(seed)
    rows = [rng.randint(1, 5) for _ in plan.pipelines]
    gen = torch.Generator().manual_seed(seed)
    return rows, torch.randint(0, config.vocab_size, (sum(rows), config.seq_len + 1), generator=gen)


def descending(plan: Plan) -> Plan:
    """``plan`` with every stage's devices listed in descending order (the leader is the last rank):
    TP rank order is then not rank order."""
    d = plan.to_dict()
    return Plan.from_dict({**d, "pipelines": [
        {**p, "stages": [{**st, "devices": sorted(st["devices"], reverse=True)} for st in p["stages"]]}
        for p in d["pipelines"]]})


def _worker(rank: int, world: int, plan_dicts: list[dict], config: LlamaConfig, seed: int) -> list[dict]:
    out = []
    for plan_dict in plan_dicts:
        plan = Plan.from_dict(plan_dict)
        engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
        rows, batch = _rows(seed, plan, config)
        start = sum(rows[:engine.role.pipeline])
        mine = batch[start:start + rows[engine.role.pipeline]]
        loss = engine.eval_loss(mine[:, :-1], mine[:, 1:])
        out.append({"loss": loss, "logits": engine.predict_logits(mine[:, :-1])})
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS)
def test_evaluation_and_prediction_of_a_random_plan_are_one_processes(run_ranks, tiny_gqa, tiny_mha, seed):
    config = tiny_mha if seed % 2 else tiny_gqa
    plan = random_plan(seed + 50, config)
    results = run_ranks(plan.world_size, _worker, [plan.to_dict(), descending(plan).to_dict()], config, seed)
    _rows_, batch = _rows(seed, plan, config)
    model = Llama(config).to(torch.float64).init_weights(SEED)
    with torch.no_grad():
        logits = model(batch[:, :-1])
        loss = model.loss(logits, batch[:, 1:]).item()
    for order, name in enumerate(("as drawn", "descending")):
        got = [r[order] for r in results]
        for rank, r in enumerate(got):
            assert r["loss"] == pytest.approx(loss, abs=ATOL), f"{name}, rank {rank}: eval loss"
        assert got[0]["logits"] is not None and all(r["logits"] is None for r in got[1:])
        assert got[0]["logits"].shape == logits.shape
        err = (got[0]["logits"] - logits).abs().max().item()
        assert err < ATOL, f"{name}: logits differ by {err:.3g}"
