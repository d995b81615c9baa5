"""Memory terms of the fast path (planner/cost/memory.py, cost_model.py), each against the runtime's
allocation it prices: main grads' compute copies (backward only, replacing autocast's casts), the
chunked loss's bf16 logits, cast-once at TP 1; the measured side is tests/runtime/test_fast_path.py
(saved tensors, MemTracker) and benchmarks/bench_memory.py (resident memory of whole runs)."""

import dataclasses

import pytest

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner import Workload
from lightning_hexiscale.planner.cost.estimate import stage_memory_at

M = LlamaConfig(name="t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=704,
                vocab_size=256, seq_len=32)


def mixed(fast: FastPath, model: LlamaConfig = M) -> Workload:
    return dataclasses.replace(Workload.from_precision(model, "bf16-mixed", fast_path=fast), reserve_bytes=0.0,
                               device="cpu")


def phases(fast: FastPath, inflight: int, recompute: bool = False, model: LlamaConfig = M, last: bool = True,
           pipelines: int = 2):
    return stage_memory_at(mixed(fast, model), "ddp", pipelines, recompute, True, last, inflight, 1, 1).phases


def test_main_grads_one_copy_in_backward_only():
    """One bf16 copy of every matmul weight in the backward phase, whatever is in flight; nothing in
    the gradient sync and the optimizer step (the executor frees the copies after the last backward)."""
    on, off = FastPath(main_grads=True, chunked_loss=False), FastPath(main_grads=False, chunked_loss=False)
    copy = cm.main_grad_copy_bytes(M.layer_matmul_params, 2)
    for n in (2, 8):
        b_on, *rest_on = phases(on, n)
        b_off, *rest_off = phases(off, n)
        # autocast: two casts and the shared cast's pending gradients per layer; main grads: one copy
        shared_grads = cm.shared_cast_grad_bytes(M.layer_matmul_params, 2)
        assert b_off[1] - b_on[1] == pytest.approx(2 * copy + shared_grads - copy)
        assert rest_on == rest_off  # sync and step phases untouched
    head = M.vocab_size * M.hidden_size
    assert phases(on, 2, model=M)[0][0] - phases(on, 2, last=False)[0][0] >= head * 2  # the untied head's copy


def test_main_grads_auto_off_under_recompute_and_zero3():
    """Under recomputation autocast keeps one layer's casts, the copies would keep all layers': auto
    prices (and runs) the autocast path there; explicit main grads price every layer's copy."""
    auto = phases(FastPath(chunked_loss=False), 4, recompute=True)
    off = phases(FastPath(main_grads=False, chunked_loss=False), 4, recompute=True)
    forced = phases(FastPath(main_grads=True, chunked_loss=False), 4, recompute=True)
    assert auto == off
    one_layer_casts = cm.autocast_weight_bytes(M.layer_matmul_params, 2)
    assert forced[0][1] - off[0][1] == pytest.approx(cm.main_grad_copy_bytes(M.layer_matmul_params, 2))
    assert forced[0][0] - off[0][0] == pytest.approx(-one_layer_casts + 2 * M.vocab_size * M.hidden_size
                                                     - cm.autocast_weight_bytes(M.vocab_size * M.hidden_size, 2))
    assert not FastPath().resolve("cpu", True, "zero3").main_grads


def test_chunked_loss_prices_bf16_logits_per_micro_batch_in_flight():
    """The last stage's backward: plain loss 3 float32 copies of the logits (once); chunked: the bf16
    logits of each micro-batch in flight, their bf16 gradient and one float32 chunk."""
    big = dataclasses.replace(M, vocab_size=4 * M.vocab_size)
    tokens = M.seq_len
    for n in (1, 4):
        plain = phases(FastPath(main_grads=False, chunked_loss=False), n, model=big)[0][0]
        chunked = phases(FastPath(main_grads=False, chunked_loss=True), n, model=big)[0][0]
        V = big.vocab_size
        want = cm.chunked_loss_bytes(tokens, V, 2, tokens, n) - cm.logits_bytes(tokens, V)
        assert chunked - plain == pytest.approx(want)
        # and it is what the formula says: bf16 logits x (n + 1), statistics, one float32 chunk
        assert cm.chunked_loss_bytes(tokens, V, 2, tokens, n) == tokens * (n * (2 * V + 17) + 2 * V + 4 * V)
    # a chunk of 5 tokens bounds the float32 part whatever the micro-batch
    assert cm.chunked_loss_bytes(4096, 1000, 2, 5) == 4096 * (2000 + 17) + 4096 * 2000 + 5 * 4000


def test_cast_once_at_tp1_stores_two_casts_not_five():
    tokens, h, kv, f = 32, 256, 256, 704
    five = cm.stored_activation_bytes(tokens, h, kv, f, 1, 2, mixed=True)
    two = cm.stored_activation_bytes(tokens, h, kv, f, 1, 2, mixed=True, cast_once=True)
    assert five - two == 3 * tokens * h * 2  # q, k, v's and gate, up's casts -> one per norm
    assert two == tokens * (4 * 4 * h + (2 * h + 2 * h + 2 * kv + 4 * f) * 2)
    on = phases(FastPath(cast_once=True, main_grads=False, chunked_loss=False), 2)
    off = phases(FastPath(cast_once=False, main_grads=False, chunked_loss=False), 2)
    # two micro-batches in flight, less the one whose stored tensors the first backward frees as
    # the (larger) gradients appear
    assert off[0][1] - on[0][1] == pytest.approx((2 - 1) * (five - two))
