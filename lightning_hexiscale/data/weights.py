"""Initialise the model from Hugging Face LLaMA weights in a LOCAL directory (no download).

Reads ``*.safetensors`` files directly, without the ``safetensors`` package: the format is an
8-byte little-endian header length n, n bytes of JSON ``{name: {dtype, shape, data_offsets: [a, b]},
"__metadata__": {...}}``, then the raw little-endian tensor bytes, tensor ``name`` at bytes
[8 + n + a, 8 + n + b). Files are memory-mapped and a tensor is read only when asked for, so each
rank of a plan reads just its own layers.

HF names map onto :class:`~lightning_hexiscale.models.llama.Llama`'s global names
(``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.attn.q_proj.weight``,
``input_layernorm`` -> ``attn_norm``, ``post_attention_layernorm`` -> ``mlp_norm``,
``model.embed_tokens`` -> ``embed``, ``model.norm`` -> ``norm``); a missing ``lm_head.weight``
means tied embeddings. HF's LLaMA applies RoPE in the same rotate-half layout as ``Llama``, so the
q/k weights load unpermuted. ``config.json``, when present, is checked against the LlamaConfig.

Contract with the strategy: :func:`attach_weights` sets ``module.init_state_dict`` to a lazy mapping
(global name -> full tensor); the strategy slices this rank's shards from it, and the example module
loads it whole on one device.
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

_RENAMES = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.norm\.", "norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.attn."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.mlp."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
]


def hf_to_global(name: str) -> str | None:
    """Our global parameter name for an HF LLaMA tensor name; None for tensors we do not use."""
    if name == "lm_head.weight":
        return name
    for pattern, repl in _RENAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    return None  # e.g. rotary_emb.inv_freq buffers


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file: ``names()`` and ``read(name)`` (a CPU tensor copy)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            try:
                self.header = json.loads(f.read(n))
            except ValueError:
                raise ConfigError("trainer.weights", str(path), "not a safetensors file (bad header)", "check the file") from None
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def names(self) -> list[str]:
        return list(self.header)

    def read(self, name: str) -> torch.Tensor:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ConfigError("trainer.weights", f"{self.path.name}:{name}", f"dtype {info['dtype']} is not supported",
                              f"convert the weights to one of {sorted(_DTYPES)}")
        a, b = info["data_offsets"]
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            raw = bytearray(mm[self.base + a:self.base + b])
        t = torch.frombuffer(raw, dtype=_DTYPES[info["dtype"]]) if raw else torch.empty(0, dtype=_DTYPES[info["dtype"]])
        return t.reshape(info["shape"]).clone()


class HFLlamaWeights(Mapping):
    """Global name -> full tensor over every ``*.safetensors`` file of a local HF LLaMA directory (lazy)."""

    def __init__(self, directory: str | Path, config: LlamaConfig | None = None):
        d = Path(directory)
        files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
        if not files:
            raise ConfigError("trainer.weights", str(d), "no *.safetensors files in this local directory",
                              "point to a downloaded HF LLaMA directory (nothing is downloaded here)")
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in files:
            sf = SafetensorsFile(f)
            for name in sf.names():
                ours = hf_to_global(name)
                if ours is not None:
                    self._where[ours] = (sf, name)
        if "lm_head.weight" not in self._where and "embed.weight" in self._where:
            self._where["lm_head.weight"] = self._where["embed.weight"]  # tied embeddings
        if config is not None:
            check_hf_config(d, config)

    def __getitem__(self, name: str) -> torch.Tensor:
        sf, hf_name = self._where[name]
        return sf.read(hf_name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def check_hf_config(directory: Path, config: LlamaConfig) -> None:
    """Compare ``config.json`` (if any) with the model shape; ConfigError on the first difference."""
    f = directory / "config.json"
    if not f.is_file():
        return
    hf = json.loads(f.read_text())
    pairs = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size", "vocab_size": "vocab_size"}
    for ours, theirs in pairs.items():
        if theirs in hf and hf[theirs] != getattr(config, ours):
            raise ConfigError(f"model.{ours}", getattr(config, ours),
                              f"the weights in {directory} have {theirs}={hf[theirs]}",
                              "choose the model preset that matches the weights")


def attach_weights(module, directory: str | Path) -> None:
    """Make ``module`` start from the weights in ``directory`` (see the module doc's contract)."""
    module.init_state_dict = HFLlamaWeights(directory, getattr(module, "config", None))
