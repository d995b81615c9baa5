"""Import paths that moved: importing an old one raises an error that names the new one.

Every moved or removed public name is listed in ``CHANGELOG.md`` (section ``Unreleased`` until a
release). A module path that no longer exists is kept here, mapped to where its contents went, and
:class:`MovedFinder` (installed first in ``sys.meta_path`` by ``import lightning_hexiscale``, which
every ``import lightning_hexiscale.x`` runs first) turns ``import lightning_hexiscale.strategy`` into
``ImportError: lightning_hexiscale.strategy moved to lightning_hexiscale.lightning.strategy ...``
instead of Python's bare "No module named". Nothing is aliased: the old path does not work.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

MOVED_MODULES: dict[str, str] = {
    # the one-folder-per-layer move (8bfca30): top-level modules went into config/, data/, lightning/, cli/
    "lightning_hexiscale.catalog": "lightning_hexiscale.config.catalog",
    "lightning_hexiscale.cluster": "lightning_hexiscale.config.cluster",
    "lightning_hexiscale.recipe_config": "lightning_hexiscale.config.recipe",
    "lightning_hexiscale.units": "lightning_hexiscale.config.units",
    "lightning_hexiscale.weights": "lightning_hexiscale.data.weights",
    "lightning_hexiscale.example": "lightning_hexiscale.lightning.example",
    "lightning_hexiscale.pipeline_model": "lightning_hexiscale.lightning.pipeline_model",
    "lightning_hexiscale.registration": "lightning_hexiscale.lightning.registration",
    "lightning_hexiscale.strategy": "lightning_hexiscale.lightning.strategy",
    "lightning_hexiscale.strategy_plan": "lightning_hexiscale.lightning.plan_resolution",
    "lightning_hexiscale.strategy_zero": "lightning_hexiscale.lightning.zero_hooks",
    "lightning_hexiscale.profiler": "lightning_hexiscale.cli.profile",
    "lightning_hexiscale.profiling.commands": "lightning_hexiscale.cli.calibrate",
    "lightning_hexiscale.planner.cli_plan": "lightning_hexiscale.cli.plan",
}
"""Old module path -> the module that holds its contents now."""

TOP_LEVEL = {"lightning_hexiscale.lightning.strategy": "HexiScaleStrategy",
             "lightning_hexiscale.lightning.example": "LlamaLitModule",
             "lightning_hexiscale.config.cluster": "Cluster"}
"""Moved modules whose main name the package itself exports (``from lightning_hexiscale import ...``)."""


def moved_message(old: str) -> str:
    new = MOVED_MODULES[old]
    also = f" (or `from lightning_hexiscale import {TOP_LEVEL[new]}`)" if new in TOP_LEVEL else ""
    return (f"{old} moved to {new}: import from {new}{also}. Moved and removed names are listed in "
            f"CHANGELOG.md")


class MovedFinder(MetaPathFinder):
    """Raises ``ImportError`` naming the new path for an import of a moved module (an ImportError,
    not a ModuleNotFoundError, which ``from lightning_hexiscale import strategy`` would swallow into
    "cannot import name")."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            raise ImportError(moved_message(fullname), name=fullname)
        return None


def moved_getattr(package: str, getattr_):
    """The package's ``__getattr__``: ``lightning_hexiscale.strategy`` as an attribute names the new
    path too; every other name is ``getattr_``'s (the lazy exports)."""

    def __getattr__(name: str) -> object:
        if f"{package}.{name}" in MOVED_MODULES:
            raise AttributeError(moved_message(f"{package}.{name}"))
        return getattr_(name)

    return __getattr__


def install() -> None:
    """Put :class:`MovedFinder` first in ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
