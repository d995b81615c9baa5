"""Register ``strategy="hexiscale"`` with Lightning when both packages are imported, in either order.

Lightning 2.6 has no entry-point discovery for strategies: its registry is filled from its own
package when ``lightning.pytorch.strategies`` is imported, and the Trainer copies the names when it
is built. A third-party strategy must therefore be registered after that import and before the
first ``Trainer(...)``.

Importing ``lightning.pytorch`` costs 3-4 s, which ``import lightning_hexiscale`` (and so every
``hexiscale estimate`` call) should not pay. So :func:`install` registers at once when Lightning is
already imported, and otherwise adds a one-shot import hook that registers right after
``lightning.pytorch.strategies`` finishes executing. The registered entries are small factories
that import :mod:`lightning_hexiscale.lightning.strategy` only when a Trainer asks for the strategy.

Names: ``hexiscale`` (popen launcher, the default; works under Hydra), ``hexiscale_spawn`` and
``hexiscale_fork``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_TARGET = "lightning.pytorch.strategies"
STRATEGY_NAMES = {"hexiscale": "popen", "hexiscale_spawn": "spawn", "hexiscale_fork": "fork"}


def _factory(**kwargs: Any):
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    return HexiScaleStrategy(**kwargs)


def register_strategies() -> None:
    """Add the hexiscale names to Lightning's StrategyRegistry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, start_method in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name, _factory, start_method=start_method,
                description=f"HexiScale asymmetric pipeline/tensor/data parallelism, launcher '{start_method}'")


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch.strategies`` through the normal machinery, then wraps its loader
    so that :func:`register_strategies` runs once the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            register_strategies()

        loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Register now if Lightning's strategies are imported, else when they are."""
    if _TARGET in sys.modules:
        register_strategies()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
