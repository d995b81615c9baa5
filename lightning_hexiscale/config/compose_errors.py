"""What a Hydra override that does not compose says: one :class:`ConfigError` naming the key.

Hydra wraps every composition error in a message that names the whole command line and often no
fix; :func:`compose_error` reads which override it was and says what to write instead.
:func:`hydra_quoted` writes a value the way the override grammar reads it back.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Callable

from lightning_hexiscale.config.file_errors import clean_message
from lightning_hexiscale.config.values import CONFIG_GROUPS
from lightning_hexiscale.errors import ConfigError


def compose_error(e: Exception, overrides: list[str], preset_names: Callable[[str], list[str]],
                  schemas: dict[str, type], config_name: str = "config", config_dir: Path | None = None) -> ConfigError:
    """The one ConfigError for Hydra's composition error ``e`` on ``overrides``: the group whose preset
    is unknown (with the closest of ``preset_names(group)``), a value holding '=' unquoted, a '+' on a
    key that exists, a top-level key the root lacks (the root is named by Hydra, looked up in
    ``schemas``: name -> schema dataclass), a value the override grammar cannot read, a
    ``config_name`` that ``config_dir`` lacks; else Hydra's message."""
    msg = clean_message(str(e))
    if "Cannot find primary config" in msg and config_dir is not None:  # the config's name, no override
        names = sorted(p.stem for p in config_dir.glob("*.yaml"))
        return ConfigError("compose(config_name)", config_name, f"names no config in {config_dir}",
                           f"leave it out for config.yaml, or pass one of: {', '.join(names)}")
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause) and str(cause) not in msg:
        msg += ": " + clean_message(str(cause))
    nulled = next((o for o in overrides if "override must be a string" in msg
                   and re.fullmatch(r"(cluster|model|train|planner)=(?i:null)", o)), None)
    if nulled is not None:  # Hydra's message names no group
        group, value = nulled.split("=")
        names = preset_names(group)
        example = {"cluster": "cpu_hetero4", "model": "llama_tiny"}.get(group, names[0] if names else "default")
        files = f", or a file: {group}=path/to/{group}.yaml" if group in ("cluster", "model") else ""
        return ConfigError(group, value, "a config group takes a preset, and null chooses none (every run needs one)",
                           f"name one, e.g. {group}={example} (presets: {', '.join(names)}){files}")
    for group in ("cluster", "model", "train", "planner"):
        if f"'{group}/" in msg or f"group {group}" in msg or f"{group}=" in msg:
            fix = f"available {group} presets: {', '.join(preset_names(group))}"
            value = next((o.split("=", 1)[1] for o in overrides if o.startswith(group + "=")), group)
            msg = msg.split(" Available options")[0]
            near = difflib.get_close_matches(value, preset_names(group), n=1, cutoff=0.6)
            if near and value not in preset_names(group):  # a misspelled preset: the one it most likely meant
                fix = f"did you mean {group}={near[0]}? ({fix})"
            if group == "cluster" and value == "auto":  # not a preset: the train app and the strategy discover
                fix = ("cluster=auto is for `hexiscale train` and HexiScaleStrategy; here discover first "
                       "(`hexiscale discover --local 4 --model <model> --out my_cluster.yaml`), then pass "
                       f"cluster=my_cluster.yaml, or a preset: {', '.join(preset_names(group))}")
            return ConfigError(group, value, msg, fix)
    # Lightning's checkpoint names (epoch=0-step=2.ckpt) carry '=': Hydra's grammar then needs the value quoted
    unquoted = [o for o in overrides if o.count("=") > 1 and not re.match(r"^[^=]*=\s*['\"]", o)]
    if unquoted and "mismatched input '='" in msg:
        key, value = unquoted[0].split("=", 1)
        return ConfigError(key, value, "a value containing '=' must be quoted in a Hydra override",
                           f"quote it, e.g. {key}='{value}' (in a shell: \"{key}='{value}'\")")
    # '+key=v' appends a key the config lacks; for one it has, Hydra's message names the whole command line
    there = re.search(r"An item is already at '([^']+)'", msg)
    added = next((o[1:] for o in overrides if there and o.startswith(f"+{there.group(1)}=")), None)
    if added is not None:
        return ConfigError(there.group(1), "+" + added, "'+' adds a key the configuration does not have, and this "
                           "one is there already", f"drop the '+': {added}")
    # a top-level key the root lacks (max_steps=3): Hydra names the whole command line and advises '+'
    top = re.search(r"Could not override '(\w+)'.*Key '\1' not in '(\w+)'", msg)
    root = schemas.get(top.group(2)) if top else None
    if top and dataclasses.is_dataclass(root):
        from lightning_hexiscale.config.suggest import top_key_error

        name = top.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == name), "...")
        return top_key_error(name, value, root)
    unreadable = _unparsable_override(overrides)
    if unreadable is not None:  # Hydra named the whole command line and its lexer's state
        key, value, reason = unreadable
        quoted = f"{key}={hydra_quoted(value, always=True)}"
        return ConfigError(key.lstrip("+~"), value, f"Hydra's override grammar cannot read this value ({reason})",
                           f"quote it if it is a literal: {quoted} (in a shell: \"{quoted}\"); the grammar: "
                           "https://hydra.cc/docs/advanced/override_grammar/basic/")
    return ConfigError("overrides", " ".join(overrides), msg, "check key names against conf/ and the schemas in lightning_hexiscale/config/schema.py")


GROUP_EXAMPLES = {"cluster": "cpu_hetero4", "model": "llama_tiny"}
"""The preset a fix names for a group that has these (else the group's first preset)."""

SWEEP_FIX = ("to run each value, sweep with -m where the command takes it (hexiscale plan -m: one plan per value "
             "and one table; hexiscale train -m: one run per value)")
"""What :func:`compose_error` says of a sweep's values given to one run: the commands' own checks, which
know whether they take -m, say it in their words (``cli/main.py``, ``cli/train_job.py``)."""


def sweep_error(override: str, sweep: str) -> ConfigError | None:
    """The ConfigError for ``override`` when it gives a sweep's values (``cluster=cpu_hetero4,cpu2``,
    ``choice(..)``, ``range(..)``, ``glob(..)``) to a command run without ``-m``, which takes one value;
    None for any other override. Hydra's "Ambiguous value ... To use it as a list, use key=[value1,value2]"
    advised a list, which no group takes, and named no sweep. ``sweep``: the fix's first part, how this
    command runs one job per value (or that it does not)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        (ov,) = OverridesParser.create().parse_overrides([override])
    except HydraException:
        return None
    if not ov.is_sweep_override():
        return None
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    try:
        values = [str(v) for v in ov.sweep_string_iterator()]
    except Exception:  # noqa: BLE001 -- glob(..) and interval(..) list no values before a sweeper reads them
        values = []
    group = key in CONFIG_GROUPS
    what = f"preset of {key}" if group else f"value of {key}"
    listed = f" over {len(values)} values ({', '.join(values)})" if values else ""
    fix = f"{sweep}; or one run: {key}={values[0]}" if values else sweep
    if (not group and ov.value_type == ValueType.SIMPLE_CHOICE_SWEEP
            and any(isinstance(v, str) for v in ov.value().list)):  # data.path=a,b.txt: commas of one text
        fix += f"; if the commas belong to one value, quote it: {key}={hydra_quoted(value, always=True)}"
    return ConfigError(key, value, f"one run takes one {what}, and this is a sweep{listed}", fix)


def group_value_error(override: str, preset_names: Callable[[str], list[str]]) -> ConfigError | None:
    """The ConfigError for a config group given a number, a flag, a list or a mapping instead of one
    preset's name (``planner=5``: Hydra's "Config group override must be a string or a list"; a list
    chooses several presets, which Hydra merges or fails to load, and a run takes one); None otherwise."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    key, _, value = override.partition("=")
    group = key.lstrip("+~")
    if group not in CONFIG_GROUPS or key.startswith("~"):
        return None
    try:
        (ov,) = OverridesParser.create().parse_overrides([override])
        parsed = ov.value()
    except HydraException:
        return None
    if parsed is None or isinstance(parsed, str) or ov.is_sweep_override():
        return None  # null: compose_error's own case; a name: Hydra's lookup says whether it is one
    what = ("a list" if isinstance(parsed, list) else "a mapping" if isinstance(parsed, dict)
            else "a flag" if isinstance(parsed, bool) else "a number")
    names = preset_names(group)
    example = GROUP_EXAMPLES.get(group, names[0] if names else "default")
    files = f", or a file: {group}=path/to/{group}.yaml" if group in GROUP_EXAMPLES else ""
    many = "; to run several, sweep with -m where the command takes it" if isinstance(parsed, list) else ""
    return ConfigError(group, value, f"a config group takes one preset's name, not {what}",
                       f"name one, e.g. {group}={example} (presets: {', '.join(names)}){files}{many}")


_UNQUOTED = re.compile(r"[\w\-+./:@%]+")
"""Characters a value may hold unquoted in a Hydra override whatever surrounds them (a subset of its grammar's)."""


def hydra_quoted(value: str, always: bool = False) -> str:
    """``value`` as a Hydra override writes it: as is when it holds only plain characters (letters,
    digits, ``_-+./:@%``), else in single quotes with its own quotes escaped (``~``, ``#``, ``(`` or a
    quote were the lexer's errors: ``trainer.weights=/data/t~x``)."""
    if not always and _UNQUOTED.fullmatch(value):
        return value
    return "'" + value.replace("'", "\\'") + "'"


def _unparsable_override(overrides: list[str]) -> tuple[str, str, str] | None:
    """(key, value, Hydra's reason) of the first override Hydra's parser refuses on its own, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for o in overrides:
        if "=" not in o:
            continue
        try:
            parser.parse_overrides([o])
        except HydraException as e:
            text = f"{e} {e.__cause__ or e.__context__ or ''}"  # a lexer's error: the character is in its context
            reason = re.search(r"(token recognition error at: '.*'|mismatched input '.*?'|extraneous input '.*?'|"
                               r"missing .*? at '.*?'|no viable alternative at input '.*?')", text)
            key, _, value = o.partition("=")
            return key, value, reason.group(1) if reason else clean_message(str(e)).split("\n")[0]
    return None
