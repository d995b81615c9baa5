"""Moved import paths fail with an error that names the new path, and CHANGELOG.md lists them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from lightning_hexiscale._moved import MOVED_MODULES

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
