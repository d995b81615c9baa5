"""A plain single-device LLaMA decoder in PyTorch: no parallelism inside.

Structure (the runtime splits the model along these names, so they are part of the API)::

    Llama
      embed          nn.Embedding(V, H)
      layers         nn.ModuleList of TransformerBlock
        attn_norm    RMSNorm(H)
        attn         Attention: q_proj (H -> nq*d), k_proj, v_proj (H -> nkv*d), o_proj (nq*d -> H)
        mlp_norm     RMSNorm(H)
        mlp          MLP: gate_proj, up_proj (H -> F), down_proj (F -> H)
      norm           RMSNorm(H)
      lm_head        nn.Linear(H, V); with ``tie_word_embeddings`` a TiedLMHead that multiplies by
                     ``embed.weight`` (one shared parameter: no ``lm_head.weight`` of its own)

All linears are bias-free. Query head j uses key/value head ``j // heads_per_kv`` (grouped-query
attention), so the query heads of KV heads [s, e) are the contiguous rows [s*g*d, e*g*d) of q_proj:
this is what lets tensor parallelism split attention in whole KV groups.

Initialisation is per parameter and independent of every other parameter: the values of a
parameter are drawn from a CPU ``torch.Generator`` seeded from (seed, global parameter name), see
:func:`init_tensor`. A rank that materialises only its own layers (or a shard of them) therefore
gets bit-identical values to the full model built in one process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hexiscale.errors import ConfigError, shown
from lightning_hexiscale.models.attention import (  # noqa: F401 (re-exported: the kernels' old home)
    AttentionFn, attention, flash_attn_available, flash_attn_supported, sdpa_attention)
from lightning_hexiscale.models.config import LlamaConfig

INIT_STD = 0.02
"""Standard deviation of the normal init of every matrix (GPT-2 / LLaMA convention)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and the loss run in at least float32 (bf16 statistics lose too much); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, last dim) + eps) * weight in at least float32, returned in x's dtype
    (written out: four element-wise kernels forward; the reference)."""
    xf = x.to(_compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` through ``F.rms_norm`` (one fused kernel on CUDA where torch has it; the
    same formula, term for term, elsewhere)."""
    xf = x.to(_compute_dtype(x.dtype))
    return F.rms_norm(xf, (xf.shape[-1],), weight.to(xf.dtype), eps).to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2, last dim) + eps) * weight, computed in at least float32.

    ``norm_fn(x, weight, eps)`` is the kernel: :func:`rms_norm` by default; the runtime may set
    :func:`fused_rms_norm` or a compiled region (same formula)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32,
                inv_freq: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary position embeddings, each (seq_len, head_dim).

    Frequencies inv_freq[i] = theta^(-2i/d) for i < d/2 (or the given ``inv_freq``, e.g. Llama 3.1's
    scaled ones from :meth:`LlamaConfig.rope_inv_freq`); angle[p, i] = p * inv_freq[i]; the tables
    repeat the d/2 angles twice ("rotate half" layout). Computed in float64, then cast, so that every
    rank and the single-process reference get the same bits.
    """
    if inv_freq is None:
        freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    else:
        freq = torch.tensor(inv_freq, dtype=torch.float64)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


class RopeCache:
    """The model's RoPE tables, built once per (sequence length, device, dtype) and kept on the device.

    Building the tables costs a float64 outer product and a host-to-device copy; a training step
    asks for them once per stage forward (and again per recomputed block), always with the same
    key, so they are cached here instead of rebuilt per call. Not a module buffer on purpose: the
    tables depend on the sequence length and would otherwise land in state dicts and checkpoints.
    """

    def __init__(self, config: LlamaConfig, max_entries: int = 8):
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.inv_freq = config.rope_inv_freq()
        self.max_entries = max_entries
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, torch.device(device), dtype)
        hit = self._tables.get(key)
        if hit is None:
            if len(self._tables) >= self.max_entries:
                self._tables.pop(next(iter(self._tables)))
            # Built outside inference mode even when asked inside it (Lightning's validate/predict):
            # a table made there is an inference tensor, and a later training forward that reuses
            # it fails ("Inference tensors cannot be saved for backward"); a normal tensor serves both.
            with torch.inference_mode(False):
                hit = rope_tables(seq_len, self.head_dim, self.theta, device, dtype, self.inv_freq)
            self._tables[key] = hit
        return hit


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, S, d) by the position tables: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` of queries and keys (one region: the runtime may compile it)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (one region: the runtime may compile it into one kernel each way)."""
    return F.silu(gate) * up


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention.

    ``num_heads`` / ``num_kv_heads`` are the heads this module computes; the runtime lowers them
    (and the projection widths) on a tensor-parallel rank. ``attention_fn`` is the kernel
    (B, nq, S, d) x 2 x (B, nkv, S, d) -> (B, nq, S, d): :func:`.attention.attention` (flash-attn on
    capable CUDA devices, SDPA otherwise; see :mod:`lightning_hexiscale.models.attention`).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.kv_dim, bias=False)
        self.v_proj = nn.Linear(h, config.kv_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.attention_fn: AttentionFn = attention
        self.rope_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_qk

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope_fn(q, k, cos, sin)
        out = self.attention_fn(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); ``act_fn(gate, up)`` is :func:`swiglu` (or a compiled region)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.act_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def _param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, global parameter name); stable across processes and runs."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_tensor(name: str, shape: tuple[int, ...] | torch.Size, seed: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full initial value of the parameter called ``name`` (a global name, e.g.
    ``layers.3.attn.q_proj.weight``), on CPU.

    Norm weights (names ending in ``norm.weight``) are ones; every other parameter is
    N(0, INIT_STD^2), drawn in float32 from a generator seeded by :func:`_param_seed` and then cast,
    so a float64 and a float32 model start from the same values up to float32 rounding.
    """
    # device="cpu" explicitly: Lightning builds the module inside a default-device context (CUDA
    # under Trainer(accelerator="gpu")), where a tensor made without one lands on that device and
    # the CPU generator cannot draw into it.
    if name.endswith("norm.weight"):
        return torch.ones(tuple(shape), dtype=dtype, device="cpu")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_param_seed(seed, name))
    draw = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    return draw.normal_(0.0, INIT_STD, generator=gen).to(dtype)


class TiedLMHead(nn.Module):
    """LM head that IS the token embedding: ``logits = x @ embed.weight^T``.

    It holds a reference to the embedding module, not to its parameter, and registers nothing: the
    model has one parameter (``embed.weight``) whatever ``to``/``to_empty`` do to the Parameter
    object, and state dicts carry the matrix once, under ``embed.weight``.
    """

    def __init__(self, embed: nn.Module):
        super().__init__()
        self._embed = (embed,)  # a tuple: not registered as a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embed[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Llama(nn.Module):
    """The whole decoder on one device: ``forward(tokens (B, S)) -> logits (B, S, V)``.

    Build it under ``torch.device("meta")`` to get shapes without memory, then
    ``to_empty(device=...)`` and :meth:`init_weights` to materialise it.
    """

    def __init__(self, config: LlamaConfig):
        if not isinstance(config, LlamaConfig):  # a preset name was an AttributeError (no 'vocab_size')
            raise ConfigError("Llama(config)", shown(config), f"is of type {type(config).__name__}; it must be a "
                              "LlamaConfig", "pass Llama(LlamaConfig.load(name_or_path)), e.g. LlamaConfig.load('llama_tiny')")
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (TiedLMHead(self.embed) if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rope = RopeCache(config)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> Llama:
        """Set every parameter to :func:`init_tensor` (name, shape, seed); materialises meta params."""
        if any(p.is_meta for p in self.parameters()):
            self.to_empty(device="cpu")
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, seed, p.dtype))
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        # RoPE tables in the norms' compute dtype (float32, or float64 for a float64 model).
        cos, sin = self.rope(tokens.shape[1], x.device, _compute_dtype(x.dtype))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all B*S tokens, in at least float32."""
        return causal_lm_loss(logits, targets)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens: logits (B, S, V), targets (B, S) -> scalar."""
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat.to(_compute_dtype(flat.dtype)), targets.reshape(-1))
