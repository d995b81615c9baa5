"""lightning/internals.py: the private Lightning names the strategy relies on are present, a Lightning
release that drops one is reported by name instead of failing inside a training step, no other module
of the package uses a private Lightning name, and internals.py's documented list holds every one it uses."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import lightning_hexiscale
from lightning_hexiscale.lightning import internals

PACKAGE = Path(lightning_hexiscale.__file__).parent
KNOWN_OUTSIDE: set[tuple[str, str]] = {("config/suggest.py", "_metadata")}
"""Private Lightning names still used outside internals.py: none of Lightning's (the idle-rank switch
read DDPStrategy's ``_timeout`` until it read ``strategy.settings.timeout``, as the strategy does).
``_metadata`` in config/suggest.py is OmegaConf's (a DictConfig's ``element_type``, which OmegaConf
offers no public reader of); the scan matches by name and Lightning has one of that name too."""


def test_installed_lightning_has_every_attribute():
    internals.check()


def _plain_init(self, *args, **kwargs):
    pass


@pytest.mark.parametrize("entry", internals.CHECKS, ids=lambda e: e[2])
def test_each_private_name_is_checked(monkeypatch, entry):
    """Take each name of internals.CHECKS away from the installed Lightning: check() names it."""
    _touch, path, name, kind = entry
    owner = internals._resolve(path)
    if kind in ("init", "local"):  # an __init__ (of the owner or a base) that no longer mentions it
        for cls in owner.__mro__:
            init = cls.__dict__.get("__init__")
            code = getattr(inspect.unwrap(init), "__code__", None) if init else None
            if code is not None and (name in code.co_names or name in code.co_varnames):
                monkeypatch.setattr(cls, "__init__", _plain_init)
    elif kind == "worker":
        monkeypatch.setattr(owner, name, lambda self, process_idx, fn: None)
    else:
        monkeypatch.setattr(owner, name, None)
    with pytest.raises(internals.LightningInternalsChanged, match=re.escape(f"{path}.{name}")):
        internals.check()


# ---- the source scan --------------------------------------------------------------------------------
_DEFINED = re.compile(r"(?:def|class)\s+(_[A-Za-z]\w*)|self\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)"
                      r"|^\s*(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)", re.M)


@pytest.fixture(scope="module")
def lightning_privates() -> frozenset[str]:
    """Every private name Lightning (pytorch, fabric) defines: functions, classes, module-level names,
    ``self._x`` attributes and private modules. A text scan (parsing 260 files takes seconds)."""
    root = Path(importlib.util.find_spec("lightning").submodule_search_locations[0])
    names = set()
    for sub in ("pytorch", "fabric"):
        for path in (root / sub).rglob("*.py"):
            names.update(next(g for g in m.groups() if g) for m in _DEFINED.finditer(path.read_text()))
            if path.stem.startswith("_") and not path.stem.startswith("__"):
                names.add(path.stem)
    return frozenset(names)


def _lightning_bases(tree: ast.AST) -> dict[str, list[type]]:
    """Class name -> its bases that are imported from Lightning (``from lightning... import X``)."""
    imported = {a.asname or a.name: n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module and n.module.split(".")[0] == "lightning" for a in n.names}
    out = {}
    for c in ast.walk(tree):
        if isinstance(c, ast.ClassDef):
            names = [b.id for b in c.bases if isinstance(b, ast.Name) and b.id in imported]
            out[c.name] = [getattr(importlib.import_module(imported[b]), b) for b in names]
    return out


def _overrides(tree: ast.AST) -> dict[str, int]:
    """Private methods defined in a class that a Lightning base of it defines too: an override of a
    private Lightning method is a use of it."""
    bases = _lightning_bases(tree)
    return {f.name: f.lineno for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.startswith("__")
            and any(hasattr(b, f.name) for b in bases.get(c.name, []))}


def _own_names(tree: ast.AST, module_level_only: bool = False) -> set[str]:
    """Private names a module of this package defines itself (they shadow a Lightning name of the same
    spelling: ``ChildWatch._run`` is not ``Trainer._run``); overrides of Lightning methods excepted."""
    nodes = ast.iter_child_nodes(tree) if module_level_only else ast.walk(tree)
    out = set()
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign | ast.AnnAssign):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                out.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
                if not module_level_only:
                    out.update(x.attr for x in ast.walk(t) if isinstance(x, ast.Attribute))
    return out - set(_overrides(tree))


def used_privates(source: str) -> dict[str, int]:
    """Private names a module uses, with a line: attributes, imported names and modules, strings
    that are exactly an identifier (``getattr(x, "_name")``), overrides of Lightning methods."""
    out: dict[str, int] = {}
    tree = ast.parse(source)
    for n in ast.walk(tree):
        names: list[str] = []
        if isinstance(n, ast.Attribute):
            names = [n.attr]
        elif isinstance(n, ast.alias):
            names = n.name.split(".")
        elif isinstance(n, ast.ImportFrom) and n.module:
            names = n.module.split(".")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"_[A-Za-z]\w*", n.value):
            names = [n.value]
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                out.setdefault(name, getattr(n, "lineno", 0))
    return {**out, **_overrides(tree)}


def lightning_uses(source: str, privates: frozenset[str], own: set[str]) -> dict[str, int]:
    """The private Lightning names ``source`` uses: overrides of Lightning's private methods, and
    other uses of names that Lightning defines and this package does not."""
    overrides = _overrides(ast.parse(source))
    return {k: v for k, v in used_privates(source).items() if k in overrides or (k in privates and k not in own)}


@pytest.fixture(scope="module")
def own_outside() -> set[str]:
    """Private names the package defines outside internals.py (module names included)."""
    own = set()
    for path in PACKAGE.rglob("*.py"):
        own.add(path.stem)
        if path.name != "internals.py":
            own |= _own_names(ast.parse(path.read_text()))
    return own


def test_scan_finds_a_private_lightning_name(lightning_privates, own_outside):
    """The scan this file relies on can fail: each form of use is found."""
    for source in ("trainer.fit_loop._skip_backward = True", "from lightning.fabric.utilities.optimizer import "
                   "_optimizers_to_device", "x = getattr(s, '_start_method', 'popen')",
                   "from lightning.pytorch.strategies import DDPStrategy\nclass S(DDPStrategy):\n"
                   "    def _configure_launcher(self): pass"):
        assert lightning_uses(source, lightning_privates, own_outside), source
    assert not lightning_uses("self._checkpointer = None\nos._exit(1)", lightning_privates, own_outside)


def test_no_private_lightning_name_outside_internals(lightning_privates, own_outside):
    hits = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "lightning/internals.py":
            hits |= {(rel, name) for name in lightning_uses(path.read_text(), lightning_privates, own_outside)}
    assert hits - KNOWN_OUTSIDE == set(), "use them through a named function of lightning/internals.py"
    assert KNOWN_OUTSIDE <= hits, "a known use is gone: drop it from KNOWN_OUTSIDE"


def test_internals_uses_only_the_documented_names(lightning_privates):
    """Every private Lightning name internals.py uses is one of CHECKS (or a class that owns one);
    the docstring's numbered list has as many touches as it says and CHECKS covers each."""
    source = Path(internals.__file__).read_text()
    tree = ast.parse(source)
    documented = {name for _t, _p, name, _k in internals.CHECKS}
    documented |= {part for _t, path, _n, _k in internals.CHECKS for part in path.split(".") if part.startswith("_")}
    used = lightning_uses(source, lightning_privates, _own_names(tree, module_level_only=True) - {
        "_SubprocessScriptLauncher", "_MultiProcessingLauncher"})  # imported as a fallback there
    undocumented = {k: v for k, v in used.items() if k not in documented}
    assert undocumented == {}, "add each to CHECKS and to the module docstring's list"
    doc = internals.__doc__
    count = int(re.search(r"The touches: (\d+)", doc).group(1))
    numbered = [int(m) for m in re.findall(r"^\s*(\d+)\. ", doc, re.M)]
    assert numbered == list(range(1, count + 1))
    assert {t for t, *_ in internals.CHECKS} == set(numbered)
    for _t, _p, name, _k in internals.CHECKS:
        assert name in doc, name
