"""Memory terms by precision (planner/cost/estimate.py, cost_model.py): what the runtime allocates under
32-true, bf16-mixed and bf16-true. Each test fails on a planner that prices bf16-mixed at 16 bits."""

import dataclasses

import pytest

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner import Workload
from lightning_hexiscale.planner.cost.estimate import stage_memory_at

M = LlamaConfig(name="t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=704,
                vocab_size=256, seq_len=32)


def test_from_precision_dtypes():
    mixed, true, fp32 = (Workload.from_precision(M, p) for p in ("bf16-mixed", "bf16-true", "32-true"))
    assert (mixed.dtype_bytes, mixed.param_bytes, mixed.optimizer_bytes_per_param, mixed.mixed) == (2, 4, 8.0, True)
    assert (true.dtype_bytes, true.param_bytes, true.optimizer_bytes_per_param, true.mixed) == (2, 2, 4.0, False)
    assert (fp32.dtype_bytes, fp32.param_bytes, fp32.optimizer_bytes_per_param, fp32.mixed) == (4, 4, 8.0, False)


def test_states_priced_in_the_parameter_dtype():
    # DDP: P + P + K with P = 4 under bf16-mixed (was B = 2)
    assert cm.runtime_state_bytes_per_param("ddp", 2, 2, 8.0, param_bytes=4) == 16
    # ZeRO-2 mixed: float32 master chunks (P/k) on top; no flat copy in the step
    assert cm.runtime_state_bytes_per_param("zero2", 2, 2, 8.0, "backward", param_bytes=4) == 4 + 4 + 2 + 4
    assert cm.runtime_state_bytes_per_param("zero2", 2, 2, 8.0, "step", param_bytes=4) == 4 + 2 + 2 + 4
    assert cm.runtime_state_bytes_per_param("zero3", 2, 2, 8.0, "backward", param_bytes=4) == 2 + 2 + 4 + 4
    # unchanged without param_bytes (fp32 / Appendix B callers)
    assert cm.runtime_state_bytes_per_param("zero2", 2, 4, 8.0, "step") == 4 + 2 + 4 + 4


def test_mixed_activations_measured_layout():
    # saved-tensor hooks on one models/llama.py block under CPU autocast, tp=1, 32 tokens (measured:
    # 443,136 bytes without the block input, 32 * 256 * 4 = 32,768 more with it; rope tables and
    # the per-row rsqrt / log-sum-exp scalars, 17,664 bytes, are not modelled)
    got = cm.stored_activation_bytes(32, 256, 256, 704, 1, 2, mixed=True)
    assert got == pytest.approx(443_136 + 32_768 - 17_664, rel=0.01)
    assert got > cm.stored_activation_bytes(32, 256, 256, 704, 1, 2)


def test_autocast_copies_at_most_two():
    # the autocast path: the fast path's main grads, cast-once and chunked loss off (their terms:
    # tests/planner/cost/test_fast_path_memory.py)
    w = dataclasses.replace(Workload.from_precision(M, "bf16-mixed", fast_path=FastPath.off()), reserve_bytes=0.0,
                            device="cpu")
    peak = {n: stage_memory_at(w, "ddp", 1, False, True, True, n, 1, 1).peak(M.num_layers) for n in (1, 2, 8)}
    act = cm.stored_activation_bytes(32, 256, 256, 704, 1, 2, mixed=True)
    casts = M.layer_matmul_params * 2
    head = M.vocab_size * 256 * 2
    # 8 vs 2 in flight: only the stored activations grow (the casts are shared: two copies)
    assert peak[8] - peak[2] == pytest.approx(6 * M.num_layers * act)
    # 1 -> 2: the second copy of the casts, the shared cast's pending bf16 gradients (one more
    # copy), one more micro-batch's activations; with one in flight its backward frees the casts
    # as the gradients appear, which the 1-micro-batch peak nets
    grad = M.layer_params * 4
    one_freed = min(act + casts, grad)
    two_freed = min(act, grad)
    assert peak[2] - peak[1] == pytest.approx(M.num_layers * (act + 2 * casts + one_freed - two_freed) + head)
    # recomputation: only the recomputed layer's casts, whatever is in flight
    rec1 = stage_memory_at(w, "ddp", 1, True, True, True, 1, 1, 1).peak(M.num_layers)
    rec8 = stage_memory_at(w, "ddp", 1, True, True, True, 8, 1, 1).peak(M.num_layers)
    assert rec8 - rec1 == pytest.approx(7 * M.num_layers * 32 * 256 * 4)


def test_bf16_mixed_costs_more_than_bf16_true():
    for sharding in ("ddp", "zero2", "zero3"):
        peak = {p: stage_memory_at(Workload.from_precision(M, p, reserve_bytes=0.0, device="cpu",
                                                           fast_path=FastPath.off()), sharding, 2, False,
                                   True, True, 4, 1, 1).peak(M.num_layers) for p in ("bf16-mixed", "bf16-true")}
        # ZeRO-3 under bf16-true keeps each stored micro-batch's gathered (bf16) weights, which
        # bf16-mixed replaces by its shared casts: the gap is smaller there
        assert peak["bf16-mixed"] > (1.25 if sharding == "zero3" else 2.0) * peak["bf16-true"], sharding
