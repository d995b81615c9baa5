"""Reading a user's YAML file names the entry at fault: paths that may not be files (a name longer
than the OS allows), a preset-or-file argument of the wrong type, and where in the file an
OmegaConf error points (it names a field, not its place in a list). Used by
:mod:`~lightning_hexiscale.config.schema` and :mod:`~lightning_hexiscale.config.suggest`, which it
imports neither of."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_hexiscale.errors import ConfigError, shown


def _asks(p: str | os.PathLike, question) -> bool:
    """``question(Path(p))``, False for a name the OS refuses (longer than NAME_MAX: pathlib raises
    OSError 'File name too long' there instead of answering; an embedded NUL byte: ValueError)."""
    try:
        return question(Path(p))
    except (OSError, ValueError):
        return False


def is_file(p: str | os.PathLike) -> bool:
    """``Path(p).is_file()``, False for a name the OS refuses (:func:`_asks`)."""
    return _asks(p, Path.is_file)


def is_dir(p: str | os.PathLike) -> bool:
    """``Path(p).is_dir()``, False for a name the OS refuses (:func:`_asks`)."""
    return _asks(p, Path.is_dir)


def expand_user(p: str | os.PathLike) -> Path:
    """``Path(p).expanduser()``, or ``Path(p)`` as given when its ``~name`` names no user (pathlib
    raises RuntimeError 'Could not determine home directory' there; a shell, too, leaves the word as
    it is). The check that follows then says the path does not exist, naming it as the user wrote it."""
    try:
        return Path(p).expanduser()
    except RuntimeError:
        return Path(p)


FROM_MAPPING = {"cluster": "Cluster.from_config(mapping)", "model": "LlamaConfig.from_config(mapping)"}
"""What reads a mapping of a preset file's keys, per preset group (the default ``from_mapping``)."""


def check_name_or_path(value: Any, key: str, example: str, from_mapping: str | None = None) -> None:
    """``value`` names a preset or a file: a str or a path. None, a number or a mapping was a
    TypeError from pathlib ('expected str, bytes or os.PathLike object'). ``from_mapping``: what reads
    a mapping of the file's keys instead, named in a mapping's fix (default: ``FROM_MAPPING[key]``)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        fix = f"pass e.g. {example!r}"
        from_mapping = from_mapping or FROM_MAPPING.get(key)
        if from_mapping and isinstance(value, Mapping):
            fix += f", or {from_mapping} for a mapping of the file's keys"
        raise ConfigError(key, shown(value),
                          "must be a preset name or the path of a file", fix)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face hub id, ``owner/name`` (``meta-llama/Llama-3.2-1B``): one slash, no path prefix."""


def check_hub_id(key: str, value: str, then: str, also: str = "") -> None:
    """``value`` (of a model or a tokenizer), shaped as a hub id (:data:`HUB_ID`), that names nothing
    here (nor does its first part: else it is a path with a typo) is a ConfigError saying so: nothing
    is downloaded. The fix downloads it once and goes on with ``then`` (the key's way to the folder,
    ``model=hf:DIR``, ``--tokenizer DIR``), then ``also``. It was "no such file", or "no tokenizer.json
    in this directory" of a directory that does not exist."""
    if not HUB_ID.fullmatch(value) or value.endswith((".yaml", ".yml", ".json")) or Path(value.split("/")[0]).exists():
        return
    raise ConfigError(key, value, "names nothing here; it looks like a Hugging Face model id, and nothing is "
                      "downloaded", f"download it once (huggingface-cli download {value} --local-dir DIR), then "
                      f"{then}{also}")


def check_not_directory(value: str | os.PathLike, key: str, group: str) -> None:
    """``value``, which names no preset or file of ``group``, is no directory either: a ConfigError saying
    it is one (it was 'no such preset or file' for a directory that exists), with ``hf:DIR`` as the fix
    for a Hugging Face model directory (one with a config.json)."""
    if not is_dir(expand_user(value)):
        return
    fix = f"give the path of a {group} YAML file (or a preset name)"
    if group == "model" and is_file(expand_user(value) / "config.json"):
        fix = f"it holds a config.json: for a Hugging Face model directory write 'hf:{value}'"
    raise ConfigError(key, str(value), f"is a directory, not a {group} file", fix)


DOC_PAGES = {"cluster": "Clusters (docs/guide/clusters.md)", "model": "Models (docs/guide/models.md)"}
"""The documentation page of each file kind, for the fixes: a wheel user has the docs, not ``conf/``."""


ENTRY_EXAMPLES = {
    "MachineConfig": '{{name: {name}, gpu: A800, count: 8, intra_bandwidth: "200 GB/s"}}',
    "MachineLinkConfig": '{{machines: [a, b], bandwidth: "100 Gbps"}}',
}
"""An example entry per schema that a list holds, for the fix when an entry is not a mapping or
the list is not a list."""


def doc_page(key: str) -> str:
    return "the docs' " + DOC_PAGES.get(key, "Configuration reference (docs/reference/configuration.md)") + " page"


def locate_entry(data: Any, full_key: str | int, message: str = "") -> tuple[str, Any] | None:
    """(path with list indices, value) of the entry of ``data`` that OmegaConf's error is about: it
    reports ``count`` for ``machines[1].count``, so every entry whose path ends with ``full_key`` is
    a candidate, and the one whose value the message quotes wins. An entry of a nested list
    (``nics.gpus: [[0], 1]``) is reported by its index alone (``1``, an int): the entry at that index
    whose type the message names (``int is not a ListConfig``)."""
    if isinstance(full_key, int):  # was AttributeError: 'int' object has no attribute 'split'
        hits: list[tuple[str, Any]] = []

        def entries(node: Any, path: str) -> None:
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for k, v in items:
                here = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else str(k))
                if isinstance(node, list) and k == full_key and f"{type(v).__name__} is not" in message:
                    hits.append((here, v))
                entries(v, here)

        entries(data, "")
        return hits[0] if hits else None
    if not full_key:
        return None
    tail = full_key.split(".")
    found: list[tuple[str, Any]] = []
    exact: list[tuple[str, Any]] = []  # full_key names an entry itself (machines[0]): that entry

    def walk(node: Any, path: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            here = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else str(k))
            if here == full_key and "[" in full_key:
                exact.append((here, v))
            if re.sub(r"\[\d+\]", "", here).split(".")[-len(tail):] == tail:
                found.append((here, v))
            walk(v, here)

    walk(data, "")
    if exact:
        return exact[0]
    quoted = [c for c in found if f"'{c[1]}'" in message]
    return (quoted or found or [None])[0]


def clean_message(msg: str) -> str:
    """First meaningful lines of an OmegaConf/Hydra message, without the full_key/object_type footer."""
    keep = [ln.strip() for ln in msg.splitlines() if ln.strip() and not ln.strip().startswith(("full_key", "object_type", "reference_type"))]
    return " ".join(keep[:3])
