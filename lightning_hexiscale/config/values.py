"""What a key takes: a value of the command line against its typed node (:func:`check_value_type`).

OmegaConf's own refusals named the whole command line ("Error merging override dry_run=maybe") or the
Python types ("Invalid type assigned: int is not a subclass of TrainerConfig") and no fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_hexiscale.errors import ConfigError

CONFIG_GROUPS = ("cluster", "model", "train", "planner")
"""The root keys that are config groups, a preset of ``conf/<group>/`` chosen by name (conf/config.yaml's
defaults); the other root keys are a value (``plan``, ``dry_run``) or a section set key by key (``trainer``,
``data``)."""


def check_value_type(parent: DictConfig, name: str, key: str, value: str) -> None:
    """``value`` (as the command line gave it) converts to the type of ``parent[name]``; ConfigError
    naming the key, the type and the current value as an example otherwise (Hydra's message named
    every override of the command line and no fix). A section or list given a single value
    (``trainer=5``), a single value given a list or mapping (``dry_run=[1]``) and null for a field
    that takes none (``dry_run=null``) are refused too (OmegaConf's "Invalid type assigned: int is not
    a subclass of TrainerConfig", "field 'dry_run' is not Optional")."""
    import yaml
    from omegaconf import AnyNode

    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        return  # Hydra's grammar (quotes, interpolations): Hydra reports it
    if isinstance(parsed, str) and "${" in parsed:
        return  # an interpolation: resolved (and checked) once composed
    node = parent._get_node(name)
    if isinstance(node, (DictConfig, ListConfig)):
        _check_section_value(node, key, value, parsed)
        return
    if isinstance(node, AnyNode) or (parsed is None and node._is_optional()):
        return
    words, example = _field_words(node)
    if parsed is None:
        raise ConfigError(key, value, f"must be {words}; null leaves no value, and this key needs one",
                          f"e.g. {key}={example}" if example is not None else f"give {words}")
    if isinstance(parsed, (dict, list)):
        raise ConfigError(key, value, f"must be {words}, not {'a list' if isinstance(parsed, list) else 'a mapping'}",
                          f"give one value, e.g. {key}={example}" if example is not None
                          else f"give {words}, or null to leave it unset")
    try:
        parent.copy()[name] = parsed  # the typed node converts or refuses it, as Hydra's merge would
    except Exception:  # noqa: BLE001 -- OmegaConf's ValidationError: the value does not fit the type
        fix = (f"e.g. {key}={example}" if example is not None else
               f"give {words}, or null to leave it unset" if words in _WORDS.values() else
               "see the configuration reference")
        raise ConfigError(key, value, f"must be {words}", fix) from None


_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _field_words(node: Any) -> tuple[str, str | None]:
    """(what a value node takes, in words; its current value as an override writes it, or None when it
    is null). A field that is null now (train.micro_batch_size) names its type from its node: was "must
    be the field's type. Fix: see the configuration reference"."""
    from omegaconf import BooleanNode, FloatNode, IntegerNode, StringNode

    current = node._value()
    typed = {IntegerNode: "int", FloatNode: "float", BooleanNode: "bool", StringNode: "str"}
    kind = type(current).__name__ if current is not None else next(
        (k for cls, k in typed.items() if isinstance(node, cls)), "the field's type")
    return _WORDS.get(kind, kind), None if current is None else as_override(current)


def as_override(value: Any) -> str:
    """A plain value as an override writes it: ``null``, ``true``/``false`` (Hydra reads "None" as text)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _check_section_value(node: DictConfig | ListConfig, key: str, value: str, parsed: Any) -> None:
    """A section (``trainer``, ``trainer.fast_path``) takes a mapping and a list (``cluster.machines``) a
    list: one value in their place is refused with a key below them to set instead."""
    if isinstance(node, DictConfig) and isinstance(parsed, dict) or isinstance(node, ListConfig) and isinstance(parsed, list):
        return
    if node._is_optional() and parsed is None:
        return
    given = "null" if parsed is None else "a list" if isinstance(parsed, list) else "a mapping" \
        if isinstance(parsed, dict) else "a single value"
    if isinstance(node, ListConfig):
        root = key.split(".")[0]
        raise ConfigError(key, value, f"is a list, not {given}", f"set a key of one entry ({key}.0.<key>=...), or write "
                          f"the list in a file of your own ({root}=my_{root}.yaml)")
    kind = OmegaConf.get_type(node)
    leaves = [(k, node._get_node(k)) for k in node if not isinstance(node._get_node(k), (DictConfig, ListConfig))]
    what = f"a section of keys ({kind.__name__})" if dataclasses.is_dataclass(kind) else "a mapping of keys"
    example = next((f"{key}.{k}={as_override(n._value())}" for k, n in leaves if n._value() is not None), f"{key}.<key>=...")
    names = [str(k) for k in node]
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "none yet"
    raise ConfigError(key, value, f"is {what}, not {given}", f"set its keys one at a time, e.g. {example} (its keys: {listed})")
