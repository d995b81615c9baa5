"""Moved import paths fail with an error that names the new path, and CHANGELOG.md lists them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from lightning_hexiscale._moved import DEPRECATED_MODULES, MOVED_MODULES

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_import_path_names_the_new_one(old):
    new = MOVED_MODULES[old]
    with pytest.raises(ImportError, match=f"{old} moved to {new}"):
        importlib.import_module(old)
    importlib.import_module(new)  # the new path exists
    package, _, name = old.rpartition(".")
    with pytest.raises(ImportError, match=f"moved to {new}"):  # the `from package import name` form
        exec(f"from {package} import {name}", {})


def test_the_strategy_path_of_the_issue():
    with pytest.raises(ImportError, match=r"lightning_hexiscale\.lightning\.strategy.*from lightning_hexiscale "
                                          r"import HexiScaleStrategy"):
        from lightning_hexiscale.strategy import HexiScaleStrategy  # noqa: F401
    import lightning_hexiscale

    with pytest.raises(AttributeError, match="moved to lightning_hexiscale.lightning.strategy"):
        lightning_hexiscale.strategy  # noqa: B018


def test_changelog_lists_every_moved_path():
    text = CHANGELOG.read_text()
    assert "## Unreleased" in text
    for old, new in MOVED_MODULES.items():
        assert f"`{old}` | `{new}`" in text, old


@pytest.mark.parametrize("old", sorted(DEPRECATED_MODULES))
def test_deprecated_path_imports_the_new_module_and_warns(old):
    """The planner's flat paths (before its split by concern) still import, as the same module
    object as the new path, with a DeprecationWarning that names it."""
    import sys

    new = DEPRECATED_MODULES[old]
    sys.modules.pop(old, None)
    vars(importlib.import_module(old.rpartition(".")[0])).pop(old.rpartition(".")[2], None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and module.__name__ == new
    assert module.__spec__.name == new  # the real module's spec is not overwritten by the alias
    package, _, name = old.rpartition(".")
    sys.modules.pop(old, None)  # a fresh interpreter's state: the import system has not bound it yet
    vars(importlib.import_module(package)).pop(name, None)
    with pytest.warns(DeprecationWarning, match=f"moved to {new}"):  # the `from package import name` form
        scope: dict = {}
        exec(f"from {package} import {name}", scope)
    assert scope[name] is module


def test_the_planner_packages_export_what_their_modules_did():
    from lightning_hexiscale.planner import oracle as oracle_pkg
    from lightning_hexiscale.planner import search as search_pkg
    from lightning_hexiscale.planner.oracle import exact
    from lightning_hexiscale.planner.search import two_phase

    assert search_pkg.search is two_phase.search and search_pkg.SearchSettings is two_phase.SearchSettings
    assert oracle_pkg.oracle is exact.oracle and oracle_pkg.MAX_DEVICES == exact.MAX_DEVICES
    for pkg in (search_pkg, oracle_pkg):
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None, (pkg.__name__, name)


def test_changelog_lists_every_deprecated_path():
    text = CHANGELOG.read_text()
    for old, new in DEPRECATED_MODULES.items():
        assert f"`{old}` | `{new}`" in text, old
