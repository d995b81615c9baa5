"""Import paths that moved: importing an old one raises an error that names the new one.

Every moved or removed public name is listed in ``CHANGELOG.md`` (section ``Unreleased`` until a
release). A module path that no longer exists is kept here, mapped to where its contents went, and
:class:`MovedFinder` (installed first in ``sys.meta_path`` by ``import lightning_hexiscale``, which
every ``import lightning_hexiscale.x`` runs first) turns ``import lightning_hexiscale.strategy`` into
``ImportError: lightning_hexiscale.strategy moved to lightning_hexiscale.lightning.strategy ...``
instead of Python's bare "No module named". Nothing is aliased: the old path does not work.

The planner's split by concern (issue 31: ``planner/cost``, ``planner/search``, ``planner/oracle``) is
the one exception, in :data:`DEPRECATED_MODULES`: those module paths were named in the project's own
specifications (``planner/cost_model.py`` holds the Appendix B terms) and users' scripts import the
cost terms from them, so for one release the old path still imports, as the *same* module object as
the new one (a monkeypatch through either path patches both), with a ``DeprecationWarning`` that
names the new path. After that release they move to :data:`MOVED_MODULES` and raise.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec

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
    "lightning_hexiscale.strategy_zero": "lightning_hexiscale.lightning.step_adapter",
    "lightning_hexiscale.profiler": "lightning_hexiscale.cli.profile",
    "lightning_hexiscale.profiling.commands": "lightning_hexiscale.cli.calibrate",
    "lightning_hexiscale.planner.cli_plan": "lightning_hexiscale.cli.plan",
}
"""Old module path -> the module that holds its contents now."""

_P = "lightning_hexiscale.planner"
DEPRECATED_MODULES: dict[str, str] = {
    f"{_P}.{old}": f"{_P}.{new}" for old, new in {
        # the planner split by concern (issue 31): the cost model, the search, the true optimum
        "cost_model": "cost.model", "compute": "cost.compute", "memory": "cost.memory",
        "communicators": "cost.communicators", "dp_comm": "cost.dp_comm", "wire": "cost.wire",
        "nic": "cost.nic", "roofline": "cost.roofline", "zero_terms": "cost.zero_terms",
        "workload": "cost.workload", "estimate": "cost.estimate",
        "search_settings": "search.settings", "partition": "search.partition", "assemble": "search.assemble",
        "dp_split": "search.dp_split", "batching": "search.batching", "floors": "search.floors",
        "refine": "search.refine", "subsets": "search.subsets", "infeasible": "search.infeasible",
        "oracle_space": "oracle.space", "oracle_terms": "oracle.terms", "cases": "oracle.cases",
    }.items()}
"""Old module path -> its new path, still importable (same module object) with a DeprecationWarning.
``planner.search`` and ``planner.oracle`` are not here: they are packages now, and export the public
names their modules had (``from lightning_hexiscale.planner.search import search`` is unchanged)."""

TOP_LEVEL = {"lightning_hexiscale.lightning.strategy": "HexiScaleStrategy",
             "lightning_hexiscale.lightning.example": "LlamaLitModule",
             "lightning_hexiscale.config.cluster": "Cluster"}
"""Moved modules whose main name the package itself exports (``from lightning_hexiscale import ...``)."""


def moved_message(old: str) -> str:
    new = MOVED_MODULES[old]
    also = f" (or `from lightning_hexiscale import {TOP_LEVEL[new]}`)" if new in TOP_LEVEL else ""
    return (f"{old} moved to {new}: import from {new}{also}. Moved and removed names are listed in "
            f"CHANGELOG.md")


def deprecated_message(old: str) -> str:
    new = DEPRECATED_MODULES[old]
    return (f"{old} moved to {new}: import from {new}; the old path stops working in the next release "
            f"(CHANGELOG.md)")


class _AliasLoader(Loader):
    """Loads a deprecated path as its new module: ``exec_module`` puts the new module object in
    ``sys.modules`` under the old name, which the import system then returns (the placeholder module
    it created is dropped; the new module's own ``__spec__`` is left alone)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        warnings.warn(deprecated_message(module.__name__), DeprecationWarning, stacklevel=2)
        # (warnings skips the import system's frames: level 2 is the line that imports)
        sys.modules[module.__name__] = importlib.import_module(self.new)


class MovedFinder(MetaPathFinder):
    """Raises ``ImportError`` naming the new path for an import of a moved module (an ImportError,
    not a ModuleNotFoundError, which ``from lightning_hexiscale import strategy`` would swallow into
    "cannot import name"); imports a deprecated path as its new module, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            raise ImportError(moved_message(fullname), name=fullname)
        if fullname in DEPRECATED_MODULES:
            return ModuleSpec(fullname, _AliasLoader(DEPRECATED_MODULES[fullname]))
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
