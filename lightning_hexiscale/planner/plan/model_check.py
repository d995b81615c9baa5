"""Which model a plan was made for: its recorded shape (``meta.model_shape``) checked against the
model it is about to price or run (:meth:`Plan.check_model`).

A plan's layout (layers per stage, TP degrees), batches and price belong to one model shape; two
models of the same depth (Llama-2 7B and Llama-3 8B: 32 layers) pass :meth:`Plan.validate`, so
without this check one's plan was priced and run as the other's without a word.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_hexiscale.errors import HexiScaleError, PlanError, check_argument_types

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.models.config import LlamaConfig


MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                      "tie_word_embeddings")
"""The model fields a plan's layout and price depend on (``seq_len`` is a run setting: not among them)."""


def check_meta_record(meta: dict, names: tuple[str, ...] = (), where: str = "plan.meta") -> None:
    """What a plan's ``meta`` records about the model it was made for: ``model_shape``, when present,
    maps :data:`MODEL_SHAPE_FIELDS` to whole numbers (``tie_word_embeddings`` to true/false); and each
    of ``names`` (``"cluster"``, ``"model"``: the keys a caller is about to load, none given by the
    user), when present, names a preset or file. A hand-edited type or misspelling
    (``model_shape: {hiden_size: 128}``, ``model_shape: big``) made the record unread, and the plan was
    priced and run on a model it was never checked against; ``cluster: [a, b]`` sent ``hexiscale
    train`` to discover the local machine."""
    import difflib

    for key in names:
        value = meta.get(key)
        if key in meta and (not isinstance(value, str) or not value.strip()):
            raise PlanError(f"{where}.{key}", value, "names a preset or a file: a string",
                            f"write meta: {{{key}: NAME}}, or pass {key}=NAME")
    if "model_shape" not in meta:
        return
    shape = meta["model_shape"]
    fix = "remove meta.model_shape, or restore what `hexiscale plan --out` wrote"
    if not isinstance(shape, dict):
        raise PlanError(f"{where}.model_shape", shape, f"must be a mapping of the model's {', '.join(MODEL_SHAPE_FIELDS)}",
                        fix)
    for field, value in shape.items():
        if field not in MODEL_SHAPE_FIELDS:
            near = difflib.get_close_matches(str(field), MODEL_SHAPE_FIELDS, n=1, cutoff=0.6)
            raise PlanError(f"{where}.model_shape.{field}", value, f"unknown field; the fields are {list(MODEL_SHAPE_FIELDS)}",
                            f"did you mean {near[0]}? rename it" if near else fix)
        boolean = field == "tie_word_embeddings"
        if isinstance(value, bool) != boolean or (not boolean and (not isinstance(value, int) or value < 1)):
            raise PlanError(f"{where}.model_shape.{field}", value,
                            "must be true or false" if boolean else "must be a positive integer", fix)


def model_shape(model: LlamaConfig) -> dict[str, Any]:
    """The :data:`MODEL_SHAPE_FIELDS` of ``model``, as a plan's ``meta.model_shape`` records them."""
    return {f: getattr(model, f) for f in MODEL_SHAPE_FIELDS}


def check_plan_model(plan: Any, model: LlamaConfig) -> None:
    """See :meth:`Plan.check_model` (``plan`` is a :class:`Plan`; not imported here, which imports this)."""
    from lightning_hexiscale.models.config import LlamaConfig

    if not isinstance(model, LlamaConfig):  # a preset name was an AttributeError ('str' has no 'name')
        check_argument_types("Plan.check_model", (("model", model, LlamaConfig,
                                                   "pass a LlamaConfig: LlamaConfig.load(name_or_path)"),), PlanError)
    shape, where = plan.meta.get("model_shape"), "meta.model_shape"
    name = plan.meta.get("model")
    if not isinstance(shape, dict):
        if not isinstance(name, str) or name == model.name:
            return
        shape, where = named_model_shape(name), "meta.model"
        if shape is None:
            return
    diffs = [f for f in MODEL_SHAPE_FIELDS if f in shape and shape[f] != getattr(model, f)]
    if not diffs:
        return
    made_for = name if isinstance(name, str) else "another model"
    if isinstance(name, str) and name == model.name:  # same name: model.* overrides differ
        made_for = f"{name} with " + ", ".join(f"{f}={shape[f]}" for f in diffs)
        use = "pass the same overrides (" + " ".join(f"model.{f}={shape[f]}" for f in diffs) + ")"
    else:
        use = f"use the model it was made for (model={made_for})"
        made_for += " (" + ", ".join(f"{f}={shape[f]}" for f in diffs) + ")"
    here = ", ".join(f"{f}={getattr(model, f)}" for f in diffs)
    raise PlanError(f"plan.{where}", name if where == "meta.model" else {f: shape[f] for f in diffs},
                    f"the plan was made for {made_for}; the model here, {model.name}, has {here}: the "
                    "layout, batches and price belong to the plan's model",
                    f"{use}, or make a plan for this model (hexiscale plan model={model.name} ...); to price "
                    "this layout for it anyway, remove meta.model and meta.model_shape from the plan file")


def named_model_shape(name: str) -> dict[str, Any] | None:
    """The :func:`model_shape` of the preset, model file or ``hf:`` directory ``name`` (as
    ``LlamaConfig.load`` reads it), or None when it does not load here. Cached by name and by the
    read file's path, size and modification time: ``estimate()`` checks every plan it prices, and a
    plan naming another model reloaded and re-validated its YAML on each call; a file edited in place
    is read again. A new dict each call, so a caller's changes never reach the cache."""
    shape = _load_shape(name, _source_stamp(name))
    return None if shape is None else dict(shape)


def _source_stamp(name: str) -> tuple[str, int, int] | None:
    """(path, mtime in ns, size in bytes) of the file ``LlamaConfig.load(name)`` reads; None when none is found."""
    from lightning_hexiscale.config.file_errors import expand_user, is_file
    from lightning_hexiscale.config.hf_model import parse_hf_ref
    from lightning_hexiscale.config.schema import conf_dir

    try:
        hf_dir = parse_hf_ref(name)
        p = expand_user(hf_dir) / "config.json" if hf_dir is not None else Path(name)
        if hf_dir is None and not is_file(p):
            p = conf_dir() / "model" / f"{name}.yaml"
        st = p.stat()
        return str(p.resolve()), st.st_mtime_ns, st.st_size
    except (HexiScaleError, OSError, ValueError):  # no such file, a name the OS refuses
        return None


@functools.lru_cache(maxsize=32)
def _load_shape(name: str, stamp: tuple[str, int, int] | None) -> tuple[tuple[str, Any], ...] | None:
    """``stamp`` is only the cache key. A tuple of (field, value) pairs: immutable, so the cache is safe to share."""
    from lightning_hexiscale.models.config import LlamaConfig

    try:
        return tuple(model_shape(LlamaConfig.load(name)).items())
    except (HexiScaleError, OSError, ValueError):
        return None
