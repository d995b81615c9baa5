"""Callers import the planner from its root (issue 42, item 5):
``from lightning_hexiscale.planner import Plan, Workload, estimate, search, SearchSettings``.

A deep import (``from lightning_hexiscale.planner.cost.estimate import estimate``) of a name the
root exports fails here, anywhere outside planner/ (which keeps its own module structure). The
root stays cheap: the search's networkx / pymetis and torch load only when used."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_hexiscale.planner as root

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("lightning_hexiscale", "benchmarks", "recipes", "tests")
PLANNER = "lightning_hexiscale.planner"
NOT_YET = {
    # owned by another helper's in-flight change (issue 42, items 1-4) when this test was written;
    # convert their planner imports with the next edit and drop them from here
    "lightning_hexiscale/lightning/strategy.py", "lightning_hexiscale/lightning/launch/elastic.py",
    "tests/runtime/test_sharded_optimizer.py",
}


def _is_root_name(module: str, name: str) -> bool:
    """Whether ``module``'s ``name`` is what the root exports under that name."""
    if name not in root.__all__:
        return False
    if name == "search":  # the root's search is the callable sub-package, entry.search behind it
        return module in (f"{PLANNER}.search", f"{PLANNER}.search.entry")
    try:
        return getattr(importlib.import_module(module), name) is getattr(root, name)
    except (ImportError, AttributeError):
        return False


def deep_imports(source: str, filename: str = "<source>") -> list[str]:
    """``line: from <deep module> import <name>`` for each root-exported name imported deeply."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.ImportFrom) and not node.level and node.module
                and node.module.startswith(PLANNER + ".")):
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if _is_root_name(node.module, a.name)]
    return out


def _files() -> list[Path]:
    files = []
    for top in SCANNED:
        for p in sorted((REPO / top).rglob("*.py")):
            rel = p.relative_to(REPO).as_posix()
            if not rel.startswith("lightning_hexiscale/planner/") and rel not in NOT_YET:
                files.append(p)
    return files


def test_callers_import_root_names_from_the_root():
    offenders = [f"{p.relative_to(REPO)}:{hit}" for p in _files() for hit in deep_imports(p.read_text(), str(p))]
    assert not offenders, ("import these from lightning_hexiscale.planner instead:\n" + "\n".join(offenders))


def test_the_scan_finds_a_deep_import_and_spares_the_rest():
    src = ("from lightning_hexiscale.planner.cost.estimate import estimate, layer_times\n"
           "def f():\n    from lightning_hexiscale.planner.search.entry import search\n"
           "from lightning_hexiscale.planner import Plan\n")
    assert deep_imports(src) == ["1: from lightning_hexiscale.planner.cost.estimate import estimate",
                                 "3: from lightning_hexiscale.planner.search.entry import search"]


def test_every_root_name_resolves():
    for name in root.__all__:
        assert getattr(root, name) is not None, name
    deep = importlib.import_module  # (an import statement of these would be what the scan refuses)
    assert root.estimate is deep(f"{PLANNER}.cost.estimate").estimate
    assert root.SearchSettings is deep(f"{PLANNER}.search.settings").SearchSettings


def test_the_roots_search_runs_the_search_entry(monkeypatch):
    """``search`` at the root is the search sub-package (the import system binds it there), callable
    as entry.search with the same arguments."""
    from lightning_hexiscale.planner import search
    from lightning_hexiscale.planner.search import entry

    seen = []
    monkeypatch.setattr(entry, "search", lambda *a, **k: seen.append((a, k)) or "result")
    assert search(1, 2, 3, settings=4) == "result" and seen == [((1, 2, 3), {"settings": 4})]
    assert root.search is search and search.SearchSettings is root.SearchSettings


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_roots_search_is_an_attribute_before_anything_imported_it():
    """``planner.search`` in a fresh interpreter was "AttributeError: module 'lightning_hexiscale.planner'
    has no attribute 'search'" until something had imported the sub-package (the tests' ``searches``
    fixture failed so when its test ran alone)."""
    code = ("import sys\nimport lightning_hexiscale.planner as planner\n"
            "print(callable(planner.search), planner.search is sys.modules['lightning_hexiscale.planner.search'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=100)
    assert out.stdout.strip() == "True True", out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_root_loads_neither_the_search_nor_torch():
    code = ("import sys\nfrom lightning_hexiscale.planner import Plan, Workload, estimate, Estimate, SearchSettings\n"
            "print(sorted(m for m in ('networkx', 'pymetis', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
