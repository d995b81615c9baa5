"""Hugging Face ``config.json`` <-> the model schema (:class:`~lightning_hexiscale.config.schema.ModelConfig`
fields), as pure dictionaries: no torch, no transformers.

It lives in the config layer because ``model=hf:/path/to/dir`` is resolved while composing the
configuration (:func:`lightning_hexiscale.config.schema.compose`), below the models layer;
:meth:`lightning_hexiscale.models.config.LlamaConfig.from_hf` builds on it.

Both generations of Llama ``config.json`` are read:

- transformers 4.x: ``rope_theta`` at the top level and ``rope_scaling`` =
  ``{rope_type (or type): llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}``;
- transformers 5.x: ``rope_parameters`` = ``{rope_type: default | llama3, rope_theta, ...}``.

Only what this project's :class:`~lightning_hexiscale.models.llama.Llama` computes is accepted:
SiLU, no biases, no quantization, head_dim = hidden / heads, RoPE of type ``default`` or ``llama3``. Anything else is a
:class:`ConfigError` that names the key (``model.rope_scaling.rope_type = 'yarn'`` ...), never a
silently different model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_hexiscale.config.file_errors import expand_user, is_dir, is_file
from lightning_hexiscale.errors import ConfigError

HF_PREFIX = "hf:"
"""``model=hf:/path/to/dir``: the model shape comes from that directory's config.json and training
starts from its weights. Such a model is named ``hf:<absolute dir>``, so a plan's ``meta.model``
composes again (``hexiscale estimate --plan plan.yaml``)."""

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""Parameters of the ``llama3`` RoPE scaling (Llama 3.1 / 3.2)."""

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def as_given(key: str, directory: str | Path) -> str:
    """A Hugging Face ``directory`` as ``key`` takes it: ``trainer.weights=D`` (a bare directory),
    ``model=hf:D``, ``--model hf:D``, ``LlamaLitModule(config='hf:D')`` (:func:`written`)."""
    from lightning_hexiscale.config.suggest import written

    return written(key, str(directory) if key == "trainer.weights" else f"{HF_PREFIX}{directory}")


def read_hf_config(directory: str | Path, key: str = "model") -> dict[str, Any]:
    """The parsed ``config.json`` of a LOCAL Hugging Face model directory (nothing is downloaded).
    ``key``: what named the directory (``model``, ``trainer.weights``, ``--model``,
    ``LlamaLitModule(config)``); the errors are keyed by it and their fixes written as it takes a
    directory (:func:`as_given`); the directory is shown as that key takes it (``model = 'hf:/dir'``)."""
    d = expand_user(directory)
    f = d / "config.json"
    shown = str(directory) if key == "trainer.weights" else f"{HF_PREFIX}{directory}"
    if is_file(d):  # e.g. the model.safetensors inside the directory
        raise ConfigError(key, shown, "is a file; a Hugging Face model is the directory holding config.json "
                          "and *.safetensors", f"give the directory: {as_given(key, d.parent)}")
    if not is_dir(d):  # is_dir: a name longer than the OS allows is no directory (Path.is_dir raised OSError)
        raise ConfigError(key, shown, "no such local directory (nothing is downloaded)",
                          "point to a directory holding config.json and *.safetensors, e.g. one made by "
                          "`huggingface-cli download meta-llama/Llama-3.2-1B --local-dir DIR`")
    if not f.is_file():
        if (d / "COMPLETE").is_file() or (d / "meta.pt").is_file():  # the markers of runtime/checkpoint.py
            # the recipe resumes by its key, a Lightning script by fit's ckpt_path; a flag (discover's
            # --model) reads only the shape, so resuming is no answer there
            resume = ("" if key.startswith("--") else f"resume it with trainer.fit(..., ckpt_path={str(d)!r}), or "
                      if "(" in key else f"resume it with trainer.resume={d}, or ")
            raise ConfigError(key, shown, "a checkpoint of the hexiscale strategy, not a Hugging Face model directory",
                              f"{resume}turn it into one with `hexiscale export {d} --hf OUT` and use "
                              f"{as_given(key, 'OUT')}")
        if (d / "adapter_config.json").is_file():  # what peft's save_pretrained writes: the LoRA matrices only
            raise ConfigError(key, shown, "a PEFT (LoRA) adapter, not a model: it holds only the adapter's weights",
                              "merge it into its base model first: peft.PeftModel.from_pretrained(base, DIR)"
                              f".merge_and_unload().save_pretrained(OUT), then use {as_given(key, 'OUT')}")
        raise ConfigError(key, shown, "the directory has no config.json", "point to a Hugging Face model directory")
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise ConfigError(key, str(f), f"not valid JSON ({e})", "fix or re-download config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(key, str(f), "config.json must hold a JSON object", "re-download config.json")
    return data


def _number(value: Any, key: str, theirs: str, where: str) -> float:
    """``value`` as a float, or a ConfigError naming config.json's key (null or text there used to
    fail deep inside ``float()`` / ``int()`` with a TypeError)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, value, f"{where}: {theirs} must be a number",
                          f"write the value of the model's original config.json, or remove {theirs} for "
                          "transformers' default") from None


def hf_rope(hf: dict[str, Any], where: str = "config.json") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config.json generation (see module doc)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise ConfigError("model.rope_scaling", params, f"{where} has per-layer-type RoPE parameters",
                          "only Llama models with one RoPE for all layers are supported")
    if isinstance(params, dict):
        scaling, theta = params, params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        scaling, theta = hf.get("rope_scaling"), hf.get("rope_theta", 10000.0)
    theta = _number(theta, "model.rope_theta", "rope_theta", where)
    if scaling is None or scaling == {}:  # 0, "" or [] are no mapping: refused below, not read as none
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError("model.rope_scaling", scaling, f"{where}: rope_scaling must be a mapping or null",
                          "copy it from the model's original config.json (Llama 3.1: {rope_type: llama3, factor: "
                          "8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192})")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError("model.rope_scaling.rope_type", rope_type,
                          f"{where}: RoPE type {rope_type!r} is not implemented (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
                          "use a Llama checkpoint with default or llama3 RoPE scaling")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("model.rope_scaling.partial_rotary_factor", scaling["partial_rotary_factor"],
                          "partial rotary embeddings are not implemented", "use a Llama checkpoint")
    if rope_type == "default":
        return theta, None
    out: dict[str, Any] = {"rope_type": "llama3"}
    for k in LLAMA3_ROPE_KEYS:
        if k in scaling:
            out[k] = scaling[k]
        elif k == "original_max_position_embeddings" and "max_position_embeddings" in hf:
            out[k] = hf["max_position_embeddings"]  # what transformers falls back to
        else:
            raise ConfigError(f"model.rope_scaling.{k}", None, f"{where}: llama3 RoPE scaling needs {k}",
                              f"add rope_scaling.{k} to config.json, as in the model's original config.json "
                              "(Llama 3.1: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, "
                              "original_max_position_embeddings 8192)")
    for k in ("factor", "low_freq_factor", "high_freq_factor"):  # null / text was float()'s TypeError / ValueError
        out[k] = _number(out[k], f"model.rope_scaling.{k}", f"rope_scaling.{k}", where)
    out["original_max_position_embeddings"] = _whole(out["original_max_position_embeddings"],
                                                     "model.rope_scaling.original_max_position_embeddings",
                                                     "rope_scaling.original_max_position_embeddings", where)
    return theta, out


def _whole(value: Any, key: str, theirs: str, where: str) -> int:
    """``value`` as an int: a number without a fraction (1.5 was truncated to 1 by ``int()``)."""
    x = _number(value, key, theirs, where)
    if not (x == x and abs(x) != float("inf") and float(x).is_integer()):
        raise ConfigError(key, value, f"{where}: {theirs} must be a whole number",
                          "write the value of the model's original config.json") from None
    return int(x)


def model_fields_from_hf(hf: dict[str, Any], name: str, seq_len: int | None = None,
                         where: str = "config.json") -> dict[str, Any]:
    """ModelConfig fields (``name``, ``hidden_size``, ..., ``tie_word_embeddings``) for a Llama config.json.

    ``seq_len`` (the training sequence length) defaults to the context the model was pre-trained
    with: ``rope_scaling.original_max_position_embeddings`` for Llama 3.1/3.2 (8192), else
    ``max_position_embeddings``; override it with ``model.seq_len=...``.
    """
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError("model", f"model_type={model_type!r}", f"{where}: only Llama models are supported",
                          "use a Llama checkpoint (Llama 2, Llama 3.x)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("model.hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu)", "use a Llama checkpoint")
    quant = hf.get("quantization_config")
    if quant:  # FP8 / GPTQ / AWQ / bitsandbytes: the stored matrices are meaningless without their scales
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ConfigError("model.quantization_config", method, f"{where} describes a quantized checkpoint, whose "
                          "weights are stored with scales (or packed) that this Llama does not apply",
                          "use the unquantized checkpoint of the model (bfloat16 / float16 / float32 safetensors)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"model.{flag}", hf[flag], "linear layers have no bias here", "use a Llama checkpoint")
    need = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "ffn_hidden_size": "intermediate_size", "vocab_size": "vocab_size"}
    out: dict[str, Any] = {"name": name}
    for ours, theirs in need.items():
        if theirs not in hf:
            raise ConfigError(f"model.{ours}", None, f"{where} has no {theirs}",
                              f"add {theirs} to config.json, as in the model's original config.json (or download the "
                              "checkpoint again)")
        out[ours] = hf[theirs]
    # null or absent: multi-head attention (transformers' rule); 0, "" or [] are refused by LlamaConfig, not
    # read as absent
    kv = hf.get("num_key_value_heads")
    out["num_kv_heads"] = out["num_heads"] if kv is None else kv
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * out["num_heads"] != out["hidden_size"]:
        raise ConfigError("model.head_dim", head_dim, f"must equal hidden_size / num_attention_heads = "
                          f"{out['hidden_size']} / {out['num_heads']}", "use a Llama checkpoint with standard heads")
    theta, scaling = hf_rope(hf, where)
    max_pos = _whole(hf.get("max_position_embeddings", 2048), "model.max_position_embeddings",
                     "max_position_embeddings", where)
    # 1e-6: transformers' LlamaConfig default
    out["rms_norm_eps"] = _number(hf.get("rms_norm_eps", 1e-6), "model.rms_norm_eps", "rms_norm_eps", where)
    out["rope_theta"] = theta
    out["rope_scaling"] = scaling
    tie = hf.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):  # bool() made "abc", -1 and [1] true
        raise ConfigError("model.tie_word_embeddings", tie, f"{where}: tie_word_embeddings must be true or false",
                          "write the value of the model's original config.json (false for Llama 2 / 3, 3.1)")
    out["tie_word_embeddings"] = bool(tie)  # null or absent: LlamaConfig's default, false
    out["max_position_embeddings"] = max_pos
    if seq_len is None:
        seq_len = min(max_pos, scaling["original_max_position_embeddings"]) if scaling else max_pos
    out["seq_len"] = int(seq_len)
    return out


def hf_config_from_fields(fields: dict[str, Any], torch_dtype: str = "float32",
                          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Llama ``config.json`` that ``transformers.LlamaForCausalLM.from_pretrained`` loads (4.x and 5.x
    both read ``rope_theta`` + ``rope_scaling``). ``extra``: e.g. ``bos_token_id`` / ``eos_token_id``."""
    f = fields
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": f["hidden_size"], "intermediate_size": f["ffn_hidden_size"],
        "num_hidden_layers": f["num_layers"], "num_attention_heads": f["num_heads"],
        "num_key_value_heads": f["num_kv_heads"], "head_dim": f["hidden_size"] // f["num_heads"],
        "hidden_act": "silu", "vocab_size": f["vocab_size"],
        "max_position_embeddings": f.get("max_position_embeddings") or f["seq_len"],
        "rms_norm_eps": f["rms_norm_eps"], "rope_theta": f["rope_theta"],
        "rope_scaling": dict(f["rope_scaling"]) if f.get("rope_scaling") else None,
        "tie_word_embeddings": bool(f.get("tie_word_embeddings", False)),
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": torch_dtype,
    }
    out.update(extra or {})
    return out


def parse_hf_ref(value: str) -> str | None:
    """The directory of ``hf:/path/to/dir``, or None when ``value`` is not such a reference."""
    return value[len(HF_PREFIX):] if isinstance(value, str) and value.startswith(HF_PREFIX) else None


def hf_dirs_of(value: str) -> list[str] | None:
    """The directories of a ``model=`` override's value read with Hydra's grammar, so that an escaped
    ``hf\\:/dir`` (how a ``-m`` sweep's values come back) and a sweep ``hf:/a,hf:/b`` are seen: one
    directory per value, or None when no value is ``hf:``. A sweep that mixes ``hf:`` directories and
    presets is a ConfigError (``model=_hf`` with a ``trainer.weights`` sweep cannot express it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (ov,) = OverridesParser.create().parse_overrides([f"model={value}"])
        parsed = ov.value()
        values = list(parsed.list) if ov.is_sweep_override() and hasattr(parsed, "list") else [parsed]
    except (HydraException, ValueError):  # not Hydra's grammar: composing the override reports it
        values = [value]
    dirs = [parse_hf_ref(v) if isinstance(v, str) else None for v in values]
    if all(d is None for d in dirs):
        return None
    if any(d is not None and not d.strip() for d in dirs):  # "hf:" alone read the working directory
        raise ConfigError("model", value, "hf: needs the directory of a Hugging Face model after it",
                          "write model=hf:/path/to/dir (model=hf:. for the working directory)")
    if any(d is None for d in dirs):
        raise ConfigError("model", value, "a sweep over both hf: directories and model presets",
                          "sweep them apart: -m model=PRESET_A,PRESET_B, then -m model=hf:/dir_a,hf:/dir_b")
    return dirs
