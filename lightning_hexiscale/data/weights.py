"""Hugging Face Llama weights in a LOCAL directory (no download), read with the ``safetensors`` library.

    config, weights = lightning_hexiscale.load_hf("/models/Llama-3.2-1B")
    weights["layers.3.attn.q_proj.weight"]                  # one full tensor, read on access
    weights.read_slice("lm_head.weight", 0, 0, 64128)        # only these rows are read from disk

``config.json`` gives the :class:`LlamaConfig` (:meth:`LlamaConfig.from_hf`); the weight files are
the ones transformers would read (``model.safetensors``, else those ``model.safetensors.index.json``
names, else every ``*.safetensors``), opened with ``safetensors.safe_open`` (memory-mapped, headers
only until a tensor is read) and read with ``get_slice``, so a tensor-parallel rank reads only its own rows
(or columns) of each matrix and a pipeline stage only its own layers
(:func:`lightning_hexiscale.runtime.parallelize.load_full_state_dict` asks for exactly those).

HF names map onto :class:`~lightning_hexiscale.models.llama.Llama`'s global names
(``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.attn.q_proj.weight``,
``input_layernorm`` -> ``attn_norm``, ``post_attention_layernorm`` -> ``mlp_norm``,
``model.embed_tokens`` -> ``embed``, ``model.norm`` -> ``norm``). HF's Llama applies RoPE in the
same rotate-half layout as ``Llama``, so q/k load unpermuted. A tied model (``tie_word_embeddings``)
has no ``lm_head.weight``: its head is ``embed.weight`` (an ``lm_head.weight`` in the files is ignored).

Contract with the strategy: :func:`attach_weights` sets ``module.init_state_dict`` to an
:class:`HFWeights` (global name -> full tensor, plus ``read_slice``); the strategy loads each rank's
shards from it, and the example module loads it whole on one device.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from lightning_hexiscale.config.file_errors import expand_user
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig

_NAME_PAIRS = [  # (HF prefix, our prefix); {} stands for the layer index
    ("model.embed_tokens.", "embed."),
    ("model.norm.", "norm."),
    ("model.layers.{}.self_attn.", "layers.{}.attn."),
    ("model.layers.{}.mlp.", "layers.{}.mlp."),
    ("model.layers.{}.input_layernorm.", "layers.{}.attn_norm."),
    ("model.layers.{}.post_attention_layernorm.", "layers.{}.mlp_norm."),
]


def _rename(name: str, to_ours: bool) -> str | None:
    if name == "lm_head.weight":
        return name
    for hf, ours in _NAME_PAIRS:
        src, dst = (hf, ours) if to_ours else (ours, hf)
        m = re.match(re.escape(src).replace(r"\{\}", r"(\d+)"), name)
        if m:
            return dst.format(*m.groups()) + name[m.end():]
    return None


def hf_to_global(name: str) -> str | None:
    """Our global parameter name for an HF Llama tensor name; None for tensors we do not use."""
    return _rename(name, to_ours=True)  # e.g. rotary_emb.inv_freq buffers -> None


def global_to_hf(name: str) -> str:
    """The HF Llama tensor name of one of our global parameter names."""
    out = _rename(name, to_ours=False)
    if out is None:
        raise KeyError(f"{name!r} is not a Llama parameter name")
    return out


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Global name -> full shape of every parameter of ``config``'s plain Llama (built on meta)."""
    from lightning_hexiscale.models.llama import Llama

    with torch.device("meta"):
        model = Llama(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
"""safetensors dtypes that hold the weights' values themselves (not quantized codes)."""


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(the safetensors files to read, the index's tensor -> file map or None), chosen as
    transformers' ``from_pretrained`` chooses: ``model.safetensors`` if present, else the files of
    ``model.safetensors.index.json``, else every ``*.safetensors`` file. Going by the index matters
    when stale shards of another revision or shard size lie beside the current ones."""
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE], None
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            listed = {str(k): str(v) for k, v in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError("trainer.weights", str(index), f"not a safetensors index (no weight_map: {e!r})",
                              "re-download the file, or delete it to read every *.safetensors file") from None
        # A listed file that is missing shows below as the tensors it should hold ("lack ... tensors").
        return sorted({directory / v for v in listed.values() if (directory / v).is_file()}), listed
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    pickled = sorted(directory.glob("pytorch_model*.bin")) if directory.is_dir() else []
    if not files and pickled:  # an older repository: the weights are there, in another format
        raise ConfigError("trainer.weights", str(directory), f"holds {pickled[0].name} (PyTorch pickles) but no "
                          "*.safetensors files, the only format read here (safely, and a rank's rows only)",
                          "convert it once: transformers.LlamaForCausalLM.from_pretrained(DIR)"
                          ".save_pretrained(NEW_DIR) writes safetensors, then use NEW_DIR")
    if not files:
        raise ConfigError("trainer.weights", str(directory), "no *.safetensors files in this local directory",
                          "point to a downloaded HF Llama directory (nothing is downloaded here)")
    return files, None


def _missing_error(directory: Path, config: LlamaConfig, missing: list[str], listed: dict[str, str] | None,
                   seen: set[str]) -> ConfigError:
    """Why tensors the model needs are not in the files, most specific cause first: shards the
    index names that are not in the directory (an interrupted download), a ``LlamaModel`` (the
    decoder saved without its LM head, names without ``model.``), a head of another task
    (``architectures``: e.g. LlamaForSequenceClassification's ``score.weight``), an untied
    config.json over a tied checkpoint."""
    first = global_to_hf(missing[0])
    what = f"the safetensors files lack {len(missing)} tensor(s) of {config.name}, e.g. {first}"
    absent = sorted({listed[global_to_hf(n)] for n in missing if listed is not None and global_to_hf(n) in listed
                     and not (directory / listed[global_to_hf(n)]).is_file()})
    if absent:
        return ConfigError("trainer.weights", str(directory),
                           f"{what}: {INDEX_FILE} puts them in {len(absent)} file(s) that are not in the directory: "
                           f"{', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}",
                           "download the missing file(s) again (an interrupted download?), e.g. "
                           f"`huggingface-cli download REPO {absent[0]} --local-dir {directory}`")
    if first.startswith("model.") and first[len("model."):] in seen:
        return ConfigError("trainer.weights", str(directory),
                           f"{what}: the files hold {first[len('model.'):]} (no 'model.' prefix), the decoder of a "
                           "transformers LlamaModel saved without an LM head",
                           "use the LlamaForCausalLM checkpoint of the model (with lm_head.weight)")
    if missing == ["lm_head.weight"]:
        try:
            archs = json.loads((directory / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            archs = []
        other = [a for a in archs if isinstance(a, str) and not a.endswith("ForCausalLM")]
        if other:
            return ConfigError("trainer.weights", str(directory),
                               f"{what}: config.json's architectures is {other[0]}, whose head is not a language "
                               "model head", "use a LlamaForCausalLM checkpoint (a causal LM with lm_head.weight)")
        what += " (an untied model needs lm_head.weight; set tie_word_embeddings in config.json if the head is the embedding)"
    return ConfigError("trainer.weights", str(directory), what, "use the complete checkpoint directory")


def _inside_the_model(name: str, num_layers: int) -> bool:
    """A tensor name of ours that would belong to a module the model builds: the embedding, the
    final norm or one of its ``num_layers`` layers (not RoPE's ``inv_freq`` buffer, which is
    recomputed; layers beyond the count are a checkpoint cut to fewer layers by its config.json)."""
    if name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight":
        return False
    m = re.match(r"layers\.(\d+)\.", name)
    return m is None or int(m.group(1)) < num_layers


class UnusedWeightsWarning(UserWarning):
    """The weight files hold layers beyond config.json's ``num_hidden_layers``, which are not loaded."""


def warn_unused_layers(directory: Path, config: LlamaConfig, layers: list[int]) -> None:
    """Say that the files' layers ``layers`` (beyond ``config.num_layers``) are not used, as transformers
    says of unused weights: a config.json cut to fewer layers than its files hold (deliberately, to train
    a shorter model from the first layers, or by mistake, e.g. another model's config.json) loaded the
    first layers without a word. A warning, not a refusal: the cut is a way to start a shorter model."""
    import warnings

    named = ", ".join(map(str, layers[:4])) + (f", ... {layers[-1]}" if len(layers) > 4 else "")
    warnings.warn(UnusedWeightsWarning(
        f"trainer.weights = {str(directory)!r}: the weight files hold {layers[-1] + 1} layers and "
        f"config.json's num_hidden_layers is {config.num_layers}, so layer(s) {named} (model.layers.N.*) are not used: "
        f"the model takes only the first {config.num_layers} layer(s). If that is not meant, set num_hidden_layers to "
        f"{layers[-1] + 1} in {directory / 'config.json'}"), stacklevel=3)


class HFWeights(Mapping):
    """Global name -> full tensor over the ``*.safetensors`` files of a local HF Llama directory.

    Lazy: opening reads the files' headers only; ``weights[name]`` reads one tensor, and
    :meth:`read_slice` reads a range of rows or columns of it (``safe_open(...).get_slice``). The
    open handles are not pickled (a spawned rank reopens the files).
    """

    def __init__(self, directory: str | Path, config: LlamaConfig):
        self.directory = expand_user(directory)
        self.config = config
        files, listed = _weight_files(self.directory)
        self._files = files
        self._handles: dict[Path, object] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        for f in files:
            try:
                names = list(self._open(f).keys())
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise ConfigError("trainer.weights", str(f), f"not a readable safetensors file ({e})",
                                  "re-download or re-export the file") from None
            for hf_name in names:
                if listed is not None and listed.get(hf_name) != f.name:
                    continue  # the index puts this tensor in another file (this copy is stale)
                ours = hf_to_global(hf_name)
                if ours is not None and not (ours == "lm_head.weight" and config.tie_word_embeddings):
                    if ours in self._where:
                        raise ConfigError("trainer.weights", str(self.directory),
                                          f"{hf_name} is in two files, {self._where[ours][0].name} and {f.name}, "
                                          "and no model.safetensors.index.json says which one holds it",
                                          "remove the stale file (or restore the index)")
                    self._where[ours] = (f, hf_name)
        want = expected_shapes(config)
        missing = [n for n in want if n not in self._where]
        if missing:
            seen = {n for f in files for n in self._open(f).keys()}
            raise _missing_error(self.directory, config, missing, listed, seen)
        for name, shape in want.items():
            get_dtype = getattr(self._slice(name), "get_dtype", None)  # (not in every safetensors 0.4.x)
            stored = get_dtype() if get_dtype is not None else "F32"
            if stored not in FLOAT_DTYPES:  # e.g. F8_E4M3 with a weight_scale beside it: read as is, silently wrong
                raise ConfigError("trainer.weights", f"{self._where[name][1]} ({stored})",
                                  f"a quantized or integer tensor; weights are read as {'/'.join(FLOAT_DTYPES)} "
                                  "values, without any scale", "use the unquantized checkpoint of the model")
            got = self.shape_of(name)
            if got != shape:
                raise ConfigError("trainer.weights", f"{global_to_hf(name)} {list(got)}",
                                  f"{config.name} needs shape {list(shape)}", "use the model the weights were made for")
        dropped = [n for n in self._where if n not in want and _inside_the_model(n, config.num_layers)]
        if dropped:  # e.g. q_proj.bias of a Qwen2-style checkpoint labelled llama: reading on would drop it
            raise ConfigError("trainer.weights", f"{self._where[dropped[0]][1]} (and {len(dropped) - 1} more)",
                              f"{config.name} has no such parameter (the Llama here has no biases and no extra "
                              "norms), so the model would silently differ from the checkpoint's",
                              "use a Llama checkpoint (model_type llama without attention_bias / mlp_bias tensors)")
        beyond = sorted({int(m.group(1)) for n in self._where if (m := re.match(r"layers\.(\d+)\.", n))
                         and int(m.group(1)) >= config.num_layers})
        if beyond:
            warn_unused_layers(self.directory, config, beyond)
        self._where = {n: self._where[n] for n in want}  # only what the model uses (layers beyond num_layers: a cut)

    def _open(self, f: Path):
        from safetensors import safe_open

        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return h

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def _slice(self, name: str):
        f, hf_name = self._where[name]
        return self._open(f).get_slice(hf_name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Full shape of a tensor, from the file header (no data read)."""
        return tuple(self._slice(name).get_shape())

    def read_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) [start, end) of a tensor; only those bytes are read."""
        sl = self._slice(name)
        if dim == 0:
            return sl[start:end]
        if dim == 1:
            return sl[:, start:end]
        raise ValueError(f"read_slice supports dim 0 or 1, got {dim}")

    def __getitem__(self, name: str) -> torch.Tensor:
        f, hf_name = self._where[name]
        return self._open(f).get_tensor(hf_name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf(directory: str | Path, seq_len: int | None = None,
            key: str = "trainer.weights") -> tuple[LlamaConfig, HFWeights]:
    """(config, weights) of a LOCAL Hugging Face Llama directory: the :class:`LlamaConfig` from its
    ``config.json`` (``seq_len`` defaults to the pre-training context, see
    :meth:`LlamaConfig.from_hf`) and a lazy mapping global name -> full tensor (:class:`HFWeights`).
    ``key``: what named the directory, for the errors about it and its config.json."""
    config = LlamaConfig.from_hf_dir(directory, seq_len, key)
    return config, HFWeights(directory, config)


def check_hf_config(directory: str | Path, config: LlamaConfig) -> LlamaConfig:
    """``config`` (e.g. a preset) against the directory's ``config.json``: a ConfigError names the
    first field that differs (shape, norm epsilon, RoPE theta and scaling, tied head) or a
    ``seq_len`` beyond the weights' context. Returns the directory's own config."""
    theirs = LlamaConfig.from_hf_dir(directory, key="trainer.weights")
    config.check_matches(theirs, str(expand_user(directory)))
    return theirs


def attach_weights(module, directory: str | Path) -> None:
    """Make ``module`` start from the weights in ``directory`` (see the module doc's contract); its
    ``config`` must match the directory's config.json (ConfigError otherwise), and takes the
    directory's ``max_position_embeddings`` when it leaves it open."""
    config = getattr(module, "config", None)
    if config is None:
        config, weights = load_hf(directory)
    else:
        theirs = check_hf_config(directory, config)
        if config.max_position_embeddings is None and theirs.max_position_embeddings is not None:
            # A preset that leaves the context open (the Llama 2 ones) would otherwise record its
            # training seq_len as the model's context in checkpoints and exported config.json files.
            config = module.config = dataclasses.replace(config, max_position_embeddings=theirs.max_position_embeddings)
        weights = HFWeights(directory, config)
    module.init_state_dict = weights
