"""LLaMA shape descriptions and the parameter / FLOP counts the cost model uses.

A :class:`LlamaConfig` is pure data: it knows its shapes, its exact parameter counts and how its
attention heads, FFN columns and vocabulary split over a tensor-parallel group. It imports no torch.
Llama 3.x adds two things to the Llama 2 shape: RoPE frequency scaling (:class:`RopeScaling`, type
``llama3``) and, for the 1B/3B models, an LM head tied to the token embedding.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import MISSING as MISSING_FIELD
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lightning_hexiscale.config.file_errors import expand_user
from lightning_hexiscale.errors import ConfigError, shown


MAX_MODEL_DIM = 2**24
"""Largest width, head count, vocabulary or context a model may declare (16,777,216): 16x the widest
published LLaMA-family dimension (vocabularies of 256K, contexts of 1M), and far below where the cost
model's integer arithmetic overflows."""
MAX_ROPE_THETA = 1e12
"""Largest RoPE base (``rope_theta``): released models use 1e4 (Llama 2) to 5e5 (Llama 3), long-context
variants a few 1e9. At or below 1 the frequencies theta^(-2i/d) do not fall with i (1: every pair turns
alike); far above 1e12 the slow pairs' angles underflow in float32 tables (1e308: most pairs never turn)."""
MAX_LAYERS = 65_536
"""Most transformer layers a model may declare (Llama 3.1 405B has 126)."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3``), as transformers computes it.

    With wavelength w_i = 2*pi / inv_freq_i, L = original_max_position_embeddings, the low- and
    high-frequency wavelength bounds are w_lo = L / low_freq_factor and w_hi = L / high_freq_factor:

    - w_i < w_hi (high frequencies): unchanged;
    - w_i > w_lo (low frequencies): inv_freq_i / factor;
    - in between: (1 - s) * inv_freq_i / factor + s * inv_freq_i, s = (L / w_i - low_freq_factor) /
      (high_freq_factor - low_freq_factor).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ConfigError("model.rope_scaling.rope_type", self.rope_type,
                              "only the llama3 RoPE scaling is implemented (Llama 3.1 / 3.2); "
                              "other types would silently compute different attention",
                              "use rope_type: llama3, or rope_scaling: null for plain RoPE")
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, key)  # .inf passed: every scaled frequency became 0 or nan
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"model.rope_scaling.{key}", v, "must be a finite positive number",
                                  "copy it from the model's config.json (Llama 3.1: factor 8.0, low_freq_factor 1.0, "
                                  "high_freq_factor 4.0)")
            object.__setattr__(self, key, float(v))
        if not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError("model.rope_scaling.high_freq_factor", self.high_freq_factor,
                              f"must exceed low_freq_factor={self.low_freq_factor}", "Llama 3.1 uses 4.0 and 1.0")
        L = self.original_max_position_embeddings
        if isinstance(L, bool) or not isinstance(L, int) or not 1 <= L <= MAX_MODEL_DIM:
            raise ConfigError("model.rope_scaling.original_max_position_embeddings", L,
                              f"must be a whole number from 1 to {MAX_MODEL_DIM:,}", "Llama 3.1 uses 8192")

    def scale(self, inv_freq: list[float]) -> list[float]:
        """The scaled inverse frequencies (formula in the class doc), one per rotary pair."""
        L, lo, hi, f = self.original_max_position_embeddings, self.low_freq_factor, self.high_freq_factor, self.factor
        w_lo, w_hi = L / lo, L / hi
        out = []
        for x in inv_freq:
            w = 2 * math.pi / x
            if w < w_hi:
                out.append(x)
            elif w > w_lo:
                out.append(x / f)
            else:
                s = (L / w - lo) / (hi - lo)
                out.append((1 - s) * x / f + s * x)
        return out


def _rope_scaling(value: Any) -> RopeScaling | None:
    if value is None or isinstance(value, RopeScaling):
        return value
    if not isinstance(value, dict):
        raise ConfigError("model.rope_scaling", value, "must be a mapping or null",
                          "write {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
                          "original_max_position_embeddings: 8192}")
    d = dict(value)
    if "type" in d and "rope_type" not in d:  # the older transformers spelling
        d["rope_type"] = d.pop("type")
    allowed = {f.name for f in fields(RopeScaling)}
    unknown = sorted(set(d) - allowed)
    if d.get("rope_type", "llama3") != "llama3":
        RopeScaling(rope_type=d["rope_type"])  # raises the ConfigError naming the type
    if unknown:
        raise ConfigError(f"model.rope_scaling.{unknown[0]}", d[unknown[0]], f"unknown key; allowed: {sorted(allowed)}",
                          "remove or rename it")
    missing = sorted(allowed - set(d) - {"rope_type"})
    if missing:
        raise ConfigError(f"model.rope_scaling.{missing[0]}", None, "the llama3 scaling needs every parameter",
                          "copy them from the model's config.json")
    return RopeScaling(**d)


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
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling (Llama 3.1 / 3.2); a dict is converted, any type but llama3 is a ConfigError."""
    tie_word_embeddings: bool = False
    """The LM head is the token embedding (one parameter ``embed.weight``; Llama 3.2 1B / 3B)."""
    max_position_embeddings: int | None = None
    """Longest context the weights support (HF config.json); None = ``seq_len``. Only checked and
    exported: RoPE tables are computed for the sequence at hand."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():  # '' was accepted: plans record it as meta.model
            raise ConfigError("model.name", self.name, "a model needs a name: plans record it (meta.model) and the "
                              "tables print it", "give it one, e.g. name: my_llama")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_len"):
            v = getattr(self, key)
            if isinstance(v, numbers.Integral) and not isinstance(v, (int, bool)):  # numpy's int64: a plain int, as
                v = int(v)  # a plan's meta.model_shape and YAML (safe_dump refused numpy's) need
                object.__setattr__(self, key, v)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.{key}", v, "must be a positive integer",
                                  f"write a whole number >= 1 in the model file (or override model.{key}=N)")
            most = MAX_LAYERS if key == "num_layers" else MAX_MODEL_DIM
            if v > most:  # num_layers: 2**70 was an OverflowError traceback in the search (a C long)
                raise ConfigError(f"model.{key}", v, f"must be at most {most:,} (no real model comes near it)",
                                  f"check the model file (or the override model.{key}=N) for a typo")
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError("model.tie_word_embeddings", self.tie_word_embeddings, "must be true or false",
                              "write true (the LM head reuses the token embedding, Llama 3.2 1B / 3B) or false")
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and 1 < self.rope_theta <= MAX_ROPE_THETA):  # 1.5 and 1e308 were taken (see MAX_ROPE_THETA)
            raise ConfigError("model.rope_theta", self.rope_theta, f"the RoPE base must be a number above 1 and at most "
                              f"{MAX_ROPE_THETA:.0e} (theta^(-2i/d) are the rotation frequencies)",
                              "Llama 2 uses 10000, Llama 3 500000")
        eps = self.rms_norm_eps  # nan, 0 or below: every RMSNorm output would be nan (or inf) from the first step;
        # 1 or more outweighs the activations' mean square (~1): RMSNorm then shrinks them instead of normalising
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1):
            raise ConfigError("model.rms_norm_eps", eps, "must be a small positive number (below 1)", "Llama uses 1e-5 (Llama 3: 1e-5, "
                              "Llama 2: 1e-5 or 1e-6)")
        mp = self.max_position_embeddings
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp > MAX_MODEL_DIM):
            raise ConfigError("model.max_position_embeddings", mp, f"must be a whole number from seq_len to {MAX_MODEL_DIM:,}",
                              "copy it from the model's config.json, or write null (= seq_len)")
        if mp is not None and mp < self.seq_len:
            raise ConfigError("model.seq_len", self.seq_len,
                              f"must not exceed max_position_embeddings={mp} (the longest context the weights support)",
                              f"use model.seq_len <= {mp}")
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
        """Parameters the head adds to the model: final RMSNorm (H) plus the LM head V*H when untied
        (a tied head is the embedding; a last stage that is not also the first holds a copy of it,
        see :meth:`stage_head_params`)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def stage_head_params(self, is_first: bool) -> int:
        """Head parameters a LAST stage holds (whole, before any TP split): norm H + LM head V*H,
        except a tied head on a stage that also embeds (the one shared matrix is counted there)."""
        shared = self.tie_word_embeddings and is_first
        return self.hidden_size + (0 if shared else self.vocab_size * self.hidden_size)

    @property
    def total_params(self) -> int:
        """Unique parameters: L * layer + embedding + norm (+ LM head when untied)."""
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    # ---- RoPE ----------------------------------------------------------------------------
    def rope_inv_freq(self) -> list[float]:
        """Inverse frequencies theta^(-2i/d), i < d/2, scaled by :attr:`rope_scaling` when set.

        Plain floats (float64 arithmetic), so every rank and the single-process reference compute
        the same values; :func:`lightning_hexiscale.models.llama.rope_tables` turns them into tables.
        """
        d = self.head_dim
        inv = [self.rope_theta ** (-(2 * i) / d) for i in range(d // 2)]
        return self.rope_scaling.scale(inv) if self.rope_scaling is not None else inv

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
        """Forward FLOPs of the LM head: 2 * B * S * H * V (tied or not: the matmul is the same)."""
        return 2.0 * tokens_batch * self.seq_len * self.hidden_size * self.vocab_size

    def model_flops_per_iteration(self, global_batch: int) -> float:
        """Model FLOPs of one training iteration without recomputation: 3x forward (fwd + 2x bwd)."""
        fwd = self.num_layers * self.layer_forward_flops(global_batch) + self.head_forward_flops(global_batch)
        return 3.0 * fwd

    # ---- tensor-parallel splits ----------------------------------------------------------
    def check_tp(self, tp: int, key: str = "plan.tp", fix: str | None = None) -> None:
        """A TP group of ``tp`` ranks needs at least one key/value head per rank.

        Heads are split in whole key/value groups (a KV head with its query heads), as evenly as
        possible: TP need not divide the head count (Llama-30B's 52 heads over TP 8 -> 7,7,7,7,6,6,6,6).
        ``fix``: the error's fix (default: a plan's, a stage of fewer devices).
        """
        if tp < 1 or tp > self.num_kv_heads:
            raise ConfigError(key, tp,
                              f"a TP group needs at least one key/value head per rank; {self.name} has "
                              f"{self.num_kv_heads} KV heads, so TP must be between 1 and {self.num_kv_heads}",
                              fix or f"use a stage with at most {self.num_kv_heads} devices")

    def check_measured_tp(self, degrees, key: str = "--layer-tp") -> None:
        """:meth:`check_tp` of each TP degree to measure layer times at (``hexiscale profile``,
        ``discover``, ``calibrate``), whose fix is other degrees, not a smaller stage."""
        powers = [2 ** k for k in range(self.num_kv_heads.bit_length())]
        example = f"{key} {','.join(map(str, powers))}" if key.startswith("--") else f"{key}={powers}"
        for t in degrees:
            self.check_tp(t, key, f"measure TP degrees between 1 and {self.num_kv_heads}, e.g. {example}")

    def kv_head_split(self, tp: int) -> list[tuple[int, int]]:
        """[start, end) of the KV heads held by each TP rank (query heads follow their KV head)."""
        self.check_tp(tp)
        return split_even(self.num_kv_heads, tp)

    def ffn_split(self, tp: int) -> list[tuple[int, int]]:
        """[start, end) of the FFN columns held by each TP rank."""
        self.check_tp(tp)
        return split_even(self.ffn_hidden_size, tp)

    def vocab_split(self, tp: int) -> list[tuple[int, int]]:
        """[start, end) of the vocabulary rows (embedding and LM head) held by each TP rank: the
        vocabulary-parallel embedding, head and cross-entropy of a stage with TP ``tp``."""
        self.check_tp(tp)
        return split_even(self.vocab_size, tp)

    def max_vocab_fraction(self, tp: int) -> float:
        """Largest share of the vocabulary on one rank of a TP group of ``tp``: ceil(V / tp) / V."""
        return max(e - s for s, e in self.vocab_split(tp)) / self.vocab_size

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
        """Plain data (``rope_scaling`` as a dict or None); ``LlamaConfig(**d)`` inverts it."""
        return asdict(self)

    # ---- Hugging Face config.json ----------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "hf", seq_len: int | None = None,
                where: str = "config.json") -> LlamaConfig:
        """From a Hugging Face Llama ``config.json`` (either transformers generation): its parsed
        mapping, or a transformers ``PretrainedConfig`` (``AutoConfig.from_pretrained(...)``, read by its
        ``to_dict()``); ``seq_len`` defaults to the pre-training context (see
        :func:`~lightning_hexiscale.config.hf_model.model_fields_from_hf`)."""
        from collections.abc import Mapping

        from lightning_hexiscale.config.hf_model import model_fields_from_hf

        if not isinstance(hf, Mapping) and callable(getattr(hf, "to_dict", None)):
            hf = hf.to_dict()
        if not isinstance(hf, Mapping):  # was an AttributeError ('int' object has no attribute 'get')
            raise ConfigError("LlamaConfig.from_hf(hf)", shown(hf), f"is of type {type(hf).__name__}; it must be "
                              "the mapping of a config.json or a transformers PretrainedConfig",
                              "pass json.load(open('DIR/config.json')), or LlamaConfig.load('hf:DIR')")
        return cls(**model_fields_from_hf(hf, name, seq_len, where))

    def to_hf(self, torch_dtype: str = "float32", extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """A ``config.json`` that ``transformers.LlamaForCausalLM`` loads as this shape."""
        from lightning_hexiscale.config.hf_model import hf_config_from_fields

        return hf_config_from_fields(self.to_dict(), torch_dtype, extra)

    def check_matches(self, other: LlamaConfig, source: str) -> None:
        """ConfigError on the first field (other than the name and the training ``seq_len``) where
        ``other`` (e.g. read from ``source``'s config.json) differs; ``max_position_embeddings`` only
        when this config sets it (the Llama 2 presets leave it open)."""
        for f in fields(self):
            if f.name in ("name", "seq_len") or (f.name == "max_position_embeddings" and self.max_position_embeddings is None):
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                # A model named hf:<dir> is that directory's config.json: a difference is a model.* override
                fix = ("choose the model preset that matches the weights, or use model=hf:<dir>"
                       if not self.name.startswith("hf:") else
                       f"drop the model.{f.name} override: with model={self.name} the model is the directory's "
                       "config.json (a model other than the one the weights were trained as is not supported)")
                raise ConfigError(f"model.{f.name}", _show(mine),
                                  f"the weights in {source} have {f.name}={_show(theirs)}", fix)
        if other.max_position_embeddings is not None and self.seq_len > other.max_position_embeddings:
            raise ConfigError("model.seq_len", self.seq_len,
                              f"the weights in {source} support at most {other.max_position_embeddings} positions",
                              f"use model.seq_len <= {other.max_position_embeddings}")

    @classmethod
    def from_config(cls, cfg) -> LlamaConfig:
        """From a ModelConfig node (DictConfig) or a plain dict with the same keys."""
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(cfg, (DictConfig, dict)):  # a str / list / None was dict()'s TypeError or ValueError
            raise ConfigError("model", shown(cfg),
                              "LlamaConfig.from_config takes a mapping of the model's fields",
                              "pass e.g. {'name': 'm', 'hidden_size': 128, ...}, or LlamaConfig.load('llama_tiny') for a preset")
        d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ConfigError(f"model.{unknown[0]}", d[unknown[0]], f"unknown key; allowed: {sorted(allowed)}",
                              "remove or rename it")
        required = [f.name for f in fields(cls) if f.default is MISSING_FIELD and f.default_factory is MISSING_FIELD]
        missing = [k for k in required if k not in d]
        if missing:  # was the constructor's TypeError ("missing 8 required positional arguments")
            raise ConfigError(f"model.{missing[0]}", None, f"a required key is missing (the model needs {', '.join(required)})",
                              f"add {missing[0]}: ... (see the docs' Models (docs/guide/models.md) page)")
        return cls(**d)

    @classmethod
    def load(cls, name_or_path: str, *, key: str | None = None) -> LlamaConfig:
        """A preset name (conf/model/NAME.yaml), a path to a model YAML, or ``hf:/path/to/dir``
        (the shape of a local Hugging Face directory, from its config.json). ``key``: what named it
        (e.g. the flag ``--model``), for the errors about the name and the file as a whole; keys inside
        the file keep their own names (``model.hidden_size``). Default ``model``."""
        from lightning_hexiscale.config.hf_model import parse_hf_ref
        from lightning_hexiscale.config.schema import ModelConfig, check_name_or_path, load_preset

        check_name_or_path(name_or_path, key or "model", "llama_tiny")  # before parse_hf_ref reads it as a str
        hf_dir = parse_hf_ref(name_or_path)
        if hf_dir is not None:
            return cls.from_hf_dir(hf_dir, key=key or "model")
        return cls.from_config(load_preset("model", name_or_path, ModelConfig, key=key))

    @classmethod
    def from_hf_dir(cls, directory: str | Path, seq_len: int | None = None, key: str = "model") -> LlamaConfig:
        """The shape of a LOCAL Hugging Face directory, from its config.json (:meth:`from_hf`), named
        ``hf:<absolute dir>``. ``key``: what named the directory, for the errors about it
        (:func:`~lightning_hexiscale.config.hf_model.read_hf_config`)."""
        from lightning_hexiscale.config.hf_model import read_hf_config

        if not isinstance(directory, (str, os.PathLike)):  # 3, None: pathlib's TypeError
            raise ConfigError("LlamaConfig.from_hf_dir(directory)", shown(directory), "must be the path of a local "
                              "Hugging Face model directory (a str or Path)",
                              "pass e.g. LlamaConfig.from_hf_dir('/models/Llama-3.2-1B')")
        d = expand_user(directory)
        return cls.from_hf(read_hf_config(d, key), f"hf:{d.resolve()}", seq_len, where=str(d / "config.json"))


def _show(v: Any) -> Any:
    return asdict(v) if isinstance(v, RopeScaling) else v
