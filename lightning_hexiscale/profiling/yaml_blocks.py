"""Rewrite some top-level keys of a YAML file the user may have written by hand, keeping the rest as
written: comments, their places, quoting and flow style.

``hexiscale calibrate`` / ``profile --model`` / ``discover --name`` change a cluster file's
``calibration``, ``gpu_types``, ``layer_times``, ``name`` or ``matrix_file``. Loading the file and
dumping it whole (PyYAML keeps no comments) moved every column-0 comment to the top and dropped every
other one: a hand-written cluster file lost its notes to a calibration. Here only the blocks of the
keys that changed are dumped again; comments inside those blocks are the only ones lost.

Why by hand: a round-tripping YAML library (ruamel.yaml) would keep comments inside the changed blocks
too, at the price of a new dependency for four writes of the profiling commands; the block rule below
is simple, and every result is checked by loading it back (:func:`rewrite_keys` falls back to the
whole dump, the former behaviour, for a document it cannot split safely).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_KEY = re.compile(r"""^(?:"([^"]*)"|'([^']*)'|([^\s#'"{}\[\],&*!|>%@`-][^:#]*?))\s*:(?:\s|$)""")
"""A top-level key at column 0: plain, single- or double-quoted, followed by ``:`` and a space or the line's end."""


def dump(value: dict) -> str:
    """``value`` as block YAML in the writers' style (keys in their order, no line folding)."""
    return yaml.safe_dump(value, sort_keys=False, width=1 << 16)


def _top_level_spans(lines: list[str]) -> dict[str, tuple[int, int]] | None:
    """``{key: (first line, line after its block)}`` of a block mapping at column 0, or None when the
    document is not one this module splits safely (a flow mapping, several documents, tabs in the indentation, a key twice); anchors and aliases are
    caught by the load that checks the result.
    A block runs from its ``key:`` line to its last indented line: the column-0 comments and blank
    lines after it stay where they are, with the key they precede."""
    spans: dict[str, tuple[int, int]] = {}
    current, start, last = None, 0, 0
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or line.startswith("#"):
            continue
        if line[0] in " \t":
            if current is None or "\t" in line[: len(line) - len(line.lstrip())]:
                return None
            last = i
            continue
        if line.startswith(("---", "...", "%", "{", "[")):  # several documents, a directive, a flow mapping
            return None
        if line.startswith("-") and (len(line) == 1 or line[1] in " \t") and current is not None:
            last = i  # a list's item at column 0 under its key (PyYAML's own style): still the key's block
            continue
        m = _KEY.match(line)
        if m is None:
            return None
        if current is not None:
            spans[current] = (start, last + 1)
        current = next(g for g in m.groups() if g is not None).strip()
        if current in spans:
            return None
        start = last = i
    if current is not None:
        spans[current] = (start, last + 1)
    return spans


def rewrite_keys(text: str, doc: dict[str, Any], keys: list[str] | tuple[str, ...], stamp: str | None = None) -> str:
    """The file ``text`` with the top-level ``keys`` set to their values in ``doc`` (the whole document
    as it is to be, ``text``'s other keys unchanged in it), each key's block replaced in place (a key
    the text lacks is appended), and ``stamp`` (a ``# ...`` line) after the leading comment lines.
    Loading the result gives ``doc``; where the text cannot be split safely, or the result would not
    load as ``doc``, the result is the former whole dump: the column-0 comments, the stamp, then ``doc``."""
    lines = text.splitlines()
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    fallback = "\n".join([ln for ln in lines if ln.startswith("#")] + ([stamp] if stamp else [])) + "\n" + dump(doc)
    spans = _top_level_spans(lines)
    if spans is None:
        return fallback
    out = list(lines)
    for key in sorted((k for k in keys if k in spans), key=lambda k: -spans[k][0]):  # bottom first: spans stay valid
        a, b = spans[key]
        out[a:b] = dump({key: doc[key]}).splitlines() if key in doc else []
    appended = [ln for k in keys if k not in spans and k in doc for ln in dump({k: doc[k]}).splitlines()]
    if stamp:
        out.insert(head, stamp)
    result = "\n".join(out + appended) + "\n"
    try:
        same = yaml.safe_load(result) == doc
    except yaml.YAMLError:
        same = False
    return result if same else fallback
