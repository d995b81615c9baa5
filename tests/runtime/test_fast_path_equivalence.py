"""The fast path on gloo ranks (NCCL-semantics harness included) against the single-process
reference of test_equivalence.py: float64, every switch but compile on, main grads forced on
(compute copies in float64: the same mechanism as bf16, exact) and a chunk of 3 tokens, so that the
vocabulary-parallel chunked loss, main grads under TP, the gradient sync's bucket starts and ZeRO-2
all run; and bf16-mixed with main grads on equals it off, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_equivalence import SEED, STEPS, assert_matches_reference, make_batch, make_optimizer, plan_of, reference

from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.engine import PipelineEngine
from grad_step import train_step


def fast_fp64(vocab: int) -> dict:
    """Every switch on except compile; main grads forced; 3-token loss chunks (float64 logits)."""
    return {"compile": False, "fused_norm": True, "cast_once": True, "main_grads": True, "fused_adamw": True,
            "chunked_loss": True, "loss_chunk_bytes": 3 * vocab * 8}


def _worker(rank: int, world: int, plan_dict: dict, config, optimizer: str, fast: dict, dtype: torch.dtype,
            autocast: torch.dtype | None, steps: int):
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=SEED, dtype=dtype, autocast_dtype=autocast, fast_path=fast)
    opt = engine.wrap_optimizer(make_optimizer(optimizer, engine.parameters()))
    losses = [0.0] * steps
    for step in range(steps):
        tokens, targets = make_batch(config, plan.global_batch, step)
        losses[step] = train_step(engine, tokens, targets)
        opt.step()
    fused = bool(engine.sharded_optimizer.inner[0].param_groups[0].get("fused")) if engine.sharded_optimizer \
        else bool(opt.param_groups[0].get("fused"))
    return {"losses": losses, "fast": engine.fast_path, "fused": fused,
            "overlapped": (engine.grad_sync or engine.zero).overlapped_buckets,
            "shards": {k: (t.clone(), d, s, e) for k, (t, d, s, e) in engine.local_shards().items()}}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sharding", ["ddp", "zero2"])
def test_fast_path_float64_equals_reference(run_ranks, tiny_gqa, sharding):
    """Fig. 1 (bottom): a one-stage TP-2 pipeline (vocabulary-parallel chunked loss over 2 ranks)
    next to a three-stage TP-1 pipeline; AdamW (fused), 3 steps, atol 1e-6 on every parameter copy."""
    plan = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 3)), ([4], (3, 4))])], 4)
    plan = dataclasses.replace(plan, dp_sharding=sharding)
    results = run_ranks(plan.world_size, _worker, plan.to_dict(), tiny_gqa, "adamw", fast_fp64(tiny_gqa.vocab_size),
                        torch.float64, None, STEPS)
    assert all(r["fast"].main_grads and r["fused"] for r in results)
    # 3 tokens of the whole vocabulary: 6 of the half a TP-2 rank holds
    assert results[0]["fast"].loss_chunk_tokens == 6 and results[4]["fast"].loss_chunk_tokens == 3
    assert all(r["overlapped"] > 0 for r in results)  # buckets started from the main grads' hooks
    ref_losses, ref_state = reference(tiny_gqa, plan.global_batch, "adamw")
    assert_matches_reference(results, ref_losses, ref_state)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fast_path_tied_embeddings_float64(run_ranks, tiny_gqa):
    """Tied embeddings over a two-stage pipeline (the head stays on autocast's path: its matrix is
    the embedding's) next to a one-stage pipeline, SGD."""
    tied = dataclasses.replace(tiny_gqa, tie_word_embeddings=True)
    plan = plan_of([(2, 1, [([0], (0, 2)), ([1], (2, 4))]), (2, 2, [([2], (0, 4))])], 4)
    results = run_ranks(plan.world_size, _worker, plan.to_dict(), tied, "sgd", fast_fp64(tied.vocab_size),
                        torch.float64, None, STEPS)
    ref_losses, ref_state = reference(tied, plan.global_batch, "sgd")
    assert_matches_reference(results, ref_losses, ref_state)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_main_grads_bf16_mixed_equal_autocast(run_ranks, tiny_gqa):
    """bf16-mixed, 1F1B with 2 micro-batches per pipeline: main grads on and off give the same losses
    and float32 weights, bit for bit (the same bf16 products, summed in float32)."""
    plan = plan_of([(4, 2, [([0], (0, 2)), ([1], (2, 4))]), (2, 1, [([2], (0, 4))])], 4)
    runs = [run_ranks(plan.world_size, _worker, plan.to_dict(), tiny_gqa, "adamw",
                      {"main_grads": on, "compile": False}, torch.float32, torch.bfloat16, 2) for on in (False, True)]
    assert [r["fast"].main_grads for r in runs[1]] == [True] * 3 and not runs[0][0]["fast"].main_grads
    for off, on in zip(*runs):
        assert off["losses"] == on["losses"]
        for name, (t, *_) in off["shards"].items():
            assert torch.equal(t, on["shards"][name][0]), name
