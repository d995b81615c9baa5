"""Lazy package exports (PEP 562), so that ``import lightning_hexiscale`` stays cheap.

``hexiscale estimate`` imports the package and should not pay for torch or Lightning (2-4 s); the
names that need them are resolved on first attribute access instead of at import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps an exported name to the module
    (absolute) that defines it, or to ``"module:attribute"`` where the package exports it under
    another name, or to the package's own sub-module of that name (``"pkg.name"``), which is then
    the value; the value is cached in the package on first use."""

    def __getattr__(name: str) -> object:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(":")
        if module == f"{package}.{name}" and not attribute:
            # a sub-module exported under its own name: the import system binds it on the package
            # once loaded, but ``pkg.name`` before anything imported it asks here first
            return importlib.import_module(module)
        value = getattr(importlib.import_module(module), attribute or name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals_of(package)) | set(names))

    return __getattr__, __dir__


def globals_of(package: str) -> list[str]:
    return list(vars(importlib.import_module(package)))
