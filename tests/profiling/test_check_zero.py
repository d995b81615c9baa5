"""profiling/check.py measures a ZeRO plan with the engine's sharded optimizer, whose step (the
parameter all-gather the cost model prices) is part of the measured step time."""

from __future__ import annotations

import pytest

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.profiling.check import measure_plan_rank
from lightning_hexiscale.profiling.launch import run_local

MODEL = LlamaConfig(name="z", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                    vocab_size=64, seq_len=8)


def _plan(sharding: str) -> dict:
    return Plan.from_dict({"num_layers": 2, "schedule": "1f1b", "recompute": False, "dp_sharding": sharding,
                           "pipelines": [{"batch_size": 2, "micro_batch_size": 1,
                                          "stages": [{"devices": [r], "layers": [0, 2]}]} for r in range(2)]}).to_dict()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharding, optimizer", [("ddp", "AdamW"), ("zero2", "ShardedOptimizer")])
def test_measure_plan_rank_steps_the_engines_optimizer(sharding, optimizer):
    per_rank = run_local(2, measure_plan_rank, _plan(sharding), MODEL, 2, 1, "32-true", timeout_s=50)
    for r in per_rank:
        assert r["optimizer"] == optimizer
        if sharding != "ddp":  # the sharded step (the gather) is inside the measured step
            assert all(s >= o for s, o in zip(r["step_s"], r["optimizer_s"]))
