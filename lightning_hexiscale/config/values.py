"""What a key takes: a value of the command line against its typed node (:func:`check_value_type`), and
the value a "did you mean" proposes for a key (:func:`did_you_mean`), which the key must take.

OmegaConf's own refusals named the whole command line ("Error merging override dry_run=maybe") or the
Python types ("Invalid type assigned: int is not a subclass of TrainerConfig") and no fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

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


def did_you_mean(root: DictConfig | None, key: str, value: Any, others: str = "") -> str:
    """The fix that proposes ``key`` for a key that does not exist, with ``value`` when ``key`` takes it,
    else the rule ``key`` has and a value it takes: ``planner.recompute=maybe`` proposed
    ``train.recompute=maybe``, which is refused in turn. ``root``: the composed config (or the schema's
    defaults) whose field ``key`` is; ``others``: further candidates, written after the first."""
    refused = None if root is None else _refusal(root, key, str(value))
    if refused is None:
        return f"did you mean {key}?{others} (e.g. {key}={value})"
    rule, example = refused
    return f"did you mean {key}?{others} ({key}: {rule}" + (f"; e.g. {key}={example})" if example is not None else ")")


def _refusal(root: DictConfig, key: str, value: str) -> tuple[str, str | None] | None:
    """(the rule, a value it takes: the current one) when ``key`` of ``root`` refuses ``value``, by its
    type (:func:`check_value_type`) or by the checks its section passes before any process starts
    (:func:`_section_check`); None when it takes it, or when ``key`` is not a field of ``root``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parent_key, _, name = key.rpartition(".")
    try:
        parent = OmegaConf.select(root, parent_key, throw_on_missing=False) if parent_key else root
    except Exception:  # noqa: BLE001 -- a key that does not select: nothing to say about its values
        return None
    if not isinstance(parent, DictConfig) or name not in parent:
        return None
    node = parent._get_node(name)
    current = None if isinstance(node, (DictConfig, ListConfig)) or node._value() is None else as_override(node._value())
    try:
        check_value_type(parent, name, key, value)
        check = _section_check(key.split(".")[0])
        if check is None or "${" in value:
            return None
        # as Hydra reads it: yes is the text 'yes' there (YAML's flag), which train.recompute refuses
        (override,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
        parsed = override.value()
        changed = OmegaConf.create(OmegaConf.to_container(root, resolve=False))
        OmegaConf.update(changed, key, parsed, merge=False)
        try:
            check(changed)
        except ConfigError as e:
            if e.key == key:
                raise
        except Exception:  # noqa: BLE001 -- another key's value (e.g. MISSING) stopped the check: not this key
            return None
    except ConfigError as e:
        return e.rule, current
    except HydraException:  # a value the grammar cannot read: its own error says so
        return None
    return None


SECTION_CHECKS: dict[str, Callable[[DictConfig], None]] = {}
"""Root section -> the check its values pass in a composed config before any process starts, raising a
ConfigError keyed by the value's key: what a value the fix proposes must pass too. Each registers its own
(:func:`register_section_check`): ``trainer``/``data`` the recipe's checks (``config/recipe.py``),
``train``/``planner`` the search's settings, which the planner owns and this layer may not import
(``cli/common.py``); unregistered, a proposed value is checked against its type alone."""


def register_section_check(sections: tuple[str, ...], check: Callable[[DictConfig], None]) -> None:
    """Check the values of each of ``sections`` with ``check`` (see :data:`SECTION_CHECKS`)."""
    for section in sections:
        SECTION_CHECKS[section] = check


def _section_check(section: str) -> Callable[[DictConfig], None] | None:
    """The check of ``section``'s values (:data:`SECTION_CHECKS`), or None."""
    return SECTION_CHECKS.get(section)
