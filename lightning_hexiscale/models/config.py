"""LLaMA shape descriptions and the parameter / FLOP counts the cost model uses.

A :class:`LlamaConfig` is pure data: it knows its shapes, its exact parameter counts and how its
attention heads and FFN columns split over a tensor-parallel group. It imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_hexiscale.errors import ConfigError


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous [start, end) ranges, sizes differing by at most 1.

    The first ``n % parts`` ranges get one extra element: 52 heads over 8 ranks -> 7,7,7,7,6,6,6,6.
    """
    if parts < 1 or n < parts:
        raise ValueError(f"cannot split {n} items into {parts} non-empty parts")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a LLaMA decoder (RMSNorm, RoPE, SwiGLU MLP, causal attention with GQA)."""

    name: str
    """Preset name, e.g. ``llama2_7b``."""
    hidden_size: int
    """Model width H."""
    num_layers: int
    """Number of transformer layers L."""
    num_heads: int
    """Query heads; ``hidden_size`` must be a multiple of it."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    ffn_hidden_size: int
    """Width F of the SwiGLU MLP (gate, up: H->F; down: F->H)."""
    vocab_size: int
    """Vocabulary size V."""
    seq_len: int
    """Training sequence length S in tokens."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.{key}", v, "must be a positive integer", "fix the model YAML")
        if self.hidden_size % self.num_heads:
            raise ConfigError("model.num_heads", self.num_heads,
                              f"must divide hidden_size={self.hidden_size}", "choose a head count that divides the width")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads={self.num_heads} (grouped-query attention)",
                              "choose a divisor of num_heads")
        if self.head_dim % 2:
            raise ConfigError("model.hidden_size", self.hidden_size,
                              f"head_dim = hidden_size / num_heads = {self.head_dim} must be even for RoPE",
                              "choose an even head dimension")

    # ---- derived shapes ------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Derived: H / num_heads."""
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Derived: num_kv_heads * head_dim (width of the K and V projections)."""
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        """Derived: query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    # ---- parameter counts ----------------------------------------------------------------
    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: q,o (H*H each), k,v (H*kv_dim each), gate,up,down (H*F each).

        Equals 12*H^2 for a classic layer (kv_dim = H, F = 8H/3): 4H^2 + 3*H*(8H/3) = 12H^2.
        """
        h = self.hidden_size
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn_hidden_size

    @property
    def layer_params(self) -> int:
        """All parameters of one layer: the matmuls plus two RMSNorm weights (2H)."""
        return self.layer_matmul_params + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Token embedding V*H (first stage)."""
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final RMSNorm (H) and untied LM head (V*H) (last stage)."""
        return self.hidden_size + self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    # ---- FLOPs ---------------------------------------------------------------------------
    def layer_forward_flops(self, tokens_batch: int) -> float:
        """Forward FLOPs of one layer for ``tokens_batch`` sequences of ``seq_len`` tokens.

        2 * B * S * P_matmul (each weight: one multiply-add per token) plus 4 * B * S^2 * H for
        the attention scores QK^T and the weighted sum AV (no causal discount, as in Appendix B).
        With P_matmul = 12H^2 this is 24*B*S*H^2*(1 + S/(6H)), the paper's Comp-TP-Fwd numerator.
        """
        b, s, h = tokens_batch, self.seq_len, self.hidden_size
        return 2.0 * b * s * self.layer_matmul_params + 4.0 * b * s * s * h

    def head_forward_flops(self, tokens_batch: int) -> float:
        """Forward FLOPs of the LM head: 2 * B * S * H * V."""
        return 2.0 * tokens_batch * self.seq_len * self.hidden_size * self.vocab_size

    def model_flops_per_iteration(self, global_batch: int) -> float:
        """Model FLOPs of one training iteration without recomputation: 3x forward (fwd + 2x bwd)."""
        fwd = self.num_layers * self.layer_forward_flops(global_batch) + self.head_forward_flops(global_batch)
        return 3.0 * fwd

    # ---- tensor-parallel splits ----------------------------------------------------------
    def check_tp(self, tp: int, key: str = "plan.tp") -> None:
        """A TP group of ``tp`` ranks needs at least one key/value head per rank.

        Heads are split in whole key/value groups (a KV head with its query heads), as evenly as
        possible: TP need not divide the head count (Llama-30B's 52 heads over TP 8 -> 7,7,7,7,6,6,6,6).
        """
        if tp < 1 or tp > self.num_kv_heads:
            raise ConfigError(key, tp,
                              f"a TP group needs at least one key/value head per rank; {self.name} has "
                              f"{self.num_kv_heads} KV heads, so TP must be between 1 and {self.num_kv_heads}",
                              f"use a stage with at most {self.num_kv_heads} devices")

    def kv_head_split(self, tp: int) -> list[tuple[int, int]]:
        """[start, end) of the KV heads held by each TP rank (query heads follow their KV head)."""
        self.check_tp(tp)
        return split_even(self.num_kv_heads, tp)

    def ffn_split(self, tp: int) -> list[tuple[int, int]]:
        """[start, end) of the FFN columns held by each TP rank."""
        self.check_tp(tp)
        return split_even(self.ffn_hidden_size, tp)

    def max_shard_fraction(self, tp: int) -> float:
        """Largest share of a layer's matmul weights on one rank of a TP group of ``tp``.

        Equals 1/tp when tp divides heads and FFN; slightly more for uneven splits.
        """
        h, d = self.hidden_size, self.head_dim
        kv = max(e - s for s, e in self.kv_head_split(tp))
        f = max(e - s for s, e in self.ffn_split(tp))
        attn = 2 * h * (kv * self.heads_per_kv * d) + 2 * h * (kv * d)
        return (attn + 3 * h * f) / self.layer_matmul_params

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, cfg) -> LlamaConfig:
        """From a ModelConfig node (DictConfig) or a plain dict with the same keys."""
        from omegaconf import DictConfig, OmegaConf

        d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ConfigError(f"model.{unknown[0]}", d[unknown[0]], f"unknown key; allowed: {sorted(allowed)}",
                              "remove or rename it")
        return cls(**d)

    @classmethod
    def load(cls, name_or_path: str) -> LlamaConfig:
        """A preset name (conf/model/NAME.yaml) or a path to a model YAML."""
        from lightning_hexiscale.config.schema import ModelConfig, load_preset

        return cls.from_config(load_preset("model", name_or_path, ModelConfig))
