"""Per-layer roofline of uncalibrated CUDA compute: GEMM FLOPs at an achievable fraction of the
datasheet peak, memory-bound work at the device-memory bandwidth (pure terms, no torch).

A training step is a sequence of kernels, each limited either by the tensor cores (the matmuls
and the attention kernel) or by device memory (norms, RoPE, the SwiGLU product, casts, residual
adds, the loss's softmax, gradient accumulation). Summing the two ceilings,

    time = FLOPs / (peak * gemm_efficiency)  +  bytes / (bandwidth * hbm_efficiency),

prices each class at its own ceiling; FLOPs / peak alone (the paper's Comp-TP-Fwd at efficiency 1)
prices a memory-bound kernel as free, and more so on a GPU whose FLOP-to-bandwidth ratio is high
(an H800 does 989 TFLOP/s on 3.35 TB/s, an H20 148 on 4.0): a mixed plan split by FLOPs alone puts
too many layers on the fast GPU.

The bytes are those of the runtime's kernels today (``models/llama.py``, ``runtime/parallelize.py``,
``runtime/tensor_parallel.py``: unfused RMSNorm in float32, unfused RoPE and SwiGLU, autocast
casts, per-micro-batch weight-gradient accumulation); a fused stage moves fewer, and a probe run
(``recipes/mfu_probe.py``) or a measured layer table (``hexiscale profile --model``) replaces the
estimate. Notation: T tokens of one micro-batch (B_mb * S), H hidden size, F FFN width, q = query
width (heads * head_dim), kv the key/value width, t the TP degree, B the compute dtype's bytes
(2 for bf16), P the parameters' bytes (4 under bf16-mixed), R = P the residual stream's bytes
(the embedding output has the parameters' dtype), C = max(4, B) the norms' and the loss's compute
bytes. Every function returns bytes for one micro-batch on one rank.
"""

from __future__ import annotations

from lightning_hexiscale.models.config import LlamaConfig

DEFAULT_GEMM_EFFICIENCY = 0.70
"""Fraction of the datasheet's dense 16-bit peak the roofline prices GEMMs (and attention) at when
no probe measured it: cuBLAS reaches about 70-80 % of it on large bf16 GEMMs on A100 and H100
(8192^3), less on thin shapes. Attention is counted without the causal discount (Appendix B), which
the causal kernel's lower efficiency roughly offsets. ``gpu_types.<type>.gemm_efficiency``
overrides it (the probe's GEMM ceiling at the stage's shapes)."""
DEFAULT_HBM_EFFICIENCY = 0.80
"""Fraction of the datasheet memory bandwidth that streaming element-wise kernels reach (about
80-90 % on A100 / H100 for large copies); ``gpu_types.<type>.hbm_efficiency`` overrides it."""


def roofline_s(flops: float, nbytes: float, peak_flops: float, bandwidth_Bps: float,
               gemm_efficiency: float = DEFAULT_GEMM_EFFICIENCY,
               hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY) -> float:
    """Seconds of a kernel sequence: flops / (peak_flops * gemm_efficiency) + nbytes /
    (bandwidth_Bps * hbm_efficiency). FLOPs, FLOP/s, bytes, bytes/s."""
    return flops / (peak_flops * gemm_efficiency) + nbytes / (bandwidth_Bps * hbm_efficiency)


def rms_norm_bytes(elements: float, residual_bytes: int, compute_bytes: int) -> float:
    """Forward of one unfused RMSNorm (``models/llama.RMSNorm``) over ``elements`` values:

        elements * [ 2*(R + C) if R != C  (upcast and downcast)
                     + 2C (x^2) + C (mean) + 2C (x * rsqrt) + 2C (* weight) ]

    i.e. 7C = 28 bytes per element in float32, plus the casts of a 16-bit residual stream."""
    casts = 2 * (residual_bytes + compute_bytes) if residual_bytes != compute_bytes else 0
    return elements * (casts + 7 * compute_bytes)


def layer_forward_bytes(model: LlamaConfig, tokens: int, tp: int, dtype_bytes: int, param_bytes: int,
                        mixed: bool) -> float:
    """Memory-bound bytes of one transformer layer's forward on one TP rank:

        norms     2 * rms_norm_bytes(T*H)                     (replicated on every TP rank)
        casts     n * T*H * (R + B), n = 5 at t = 1, 2 under TP   (mixed precision only: autocast
                                                              casts the norm output per linear at
                                                              t = 1, once before the TP region)
        RoPE      10 * B * T*(q + kv)/t                       (neg, cat, two products, a sum)
        attn out  2 * B * T*q/t                               (transpose + reshape copy)
        SwiGLU    5 * B * T*F/t                               (silu: read + write; product: 2 reads + write)
        residual  2 * T*H * (2R + B)                          (two adds into the residual stream)
    """
    T, H, F = tokens, model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_heads * model.head_dim, model.kv_dim
    B, R, C = dtype_bytes, param_bytes, max(4, dtype_bytes)
    casts = ((5 if tp == 1 else 2) * T * H * (R + B)) if mixed else 0.0
    return (2 * rms_norm_bytes(T * H, R, C) + casts + 10 * B * T * (q + kv) / tp + 2 * B * T * q / tp
            + 5 * B * T * F / tp + 2 * T * H * (2 * R + B))


def grad_accumulate_bytes(params: float, dtype_bytes: int, param_bytes: int, mixed: bool) -> float:
    """Bytes of adding one micro-batch's weight gradients into ``.grad``: read both, write one
    (3P per parameter), after casting the B_type gradient to P under mixed precision (B + P)."""
    return params * (3 * param_bytes + ((dtype_bytes + param_bytes) if mixed else 0))


def layer_backward_bytes(model: LlamaConfig, tokens: int, tp: int, dtype_bytes: int, param_bytes: int,
                         mixed: bool, matmul_fraction: float) -> float:
    """Memory-bound bytes of one transformer layer's backward on one TP rank:

        2 * layer_forward_bytes  +  grad_accumulate_bytes(layer matmul params * matmul_fraction)

    An element-wise op's backward reads its output gradient and its saved input(s) and writes the
    input gradient(s): about twice its forward's traffic (RMSNorm's backward is about nine float32
    kernels against four forward). ``matmul_fraction``: the rank's share of the layer's matmul
    weights (1/t for even splits)."""
    fwd = layer_forward_bytes(model, tokens, tp, dtype_bytes, param_bytes, mixed)
    return 2 * fwd + grad_accumulate_bytes(model.layer_matmul_params * matmul_fraction, dtype_bytes, param_bytes,
                                           mixed)


def loss_bytes(tokens: int, vocab_local: float, dtype_bytes: int) -> float:
    """Forward + backward bytes of the cross-entropy over T x V_r logits (``runtime/tensor_parallel``'s
    vocabulary-parallel loss, the same passes as ``F.cross_entropy`` on float32 logits at t = 1):

        T*V_r * [ (B + C) cast + C max + 2C shift + 2C exp + C sum + 2C normalise     (forward)
                  + 2C copy + 2C scale + (C + B) cast back ]                          (backward)
      = T*V_r * (2B + 14C)
    """
    B, C = dtype_bytes, max(4, dtype_bytes)
    return tokens * vocab_local * (2 * B + 14 * C)


def head_bytes(model: LlamaConfig, tokens: int, tp: int, dtype_bytes: int, param_bytes: int, mixed: bool) -> float:
    """Memory-bound bytes of a last stage's final norm, LM head and loss, forward + backward, one
    micro-batch on one TP rank (V_r = the rank's largest vocabulary share):

        3 * rms_norm_bytes(T*H)  +  loss_bytes(T, V_r)  +  grad_accumulate_bytes(V_r * H)
    (the norm's forward and its backward at twice that; the head weight's gradient accumulation)."""
    H = model.hidden_size
    v_local = model.vocab_size * model.max_vocab_fraction(tp)
    return (3 * rms_norm_bytes(tokens * H, param_bytes, max(4, dtype_bytes)) + loss_bytes(tokens, v_local, dtype_bytes)
            + grad_accumulate_bytes(v_local * H, dtype_bytes, param_bytes, mixed))


def embedding_bytes(model: LlamaConfig, tokens: int, tp: int, param_bytes: int) -> float:
    """Memory-bound bytes of a first stage's embedding, forward + backward, one micro-batch on one TP
    rank (V_r rows): the lookup (read + write T*H*P), the dense backward's zero-filled V_r x H
    gradient and its scatter of T rows, and the accumulation into ``.grad``:

        2 * T*H*P  +  V_r*H*P  +  2 * T*H*P  +  3 * V_r*H*P
    """
    H = model.hidden_size
    v_local = model.vocab_size * model.max_vocab_fraction(tp)
    return 4 * tokens * H * param_bytes + 4 * v_local * H * param_bytes
