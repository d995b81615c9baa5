"""The package's architecture as tests: no import circles, each folder imports only the layers
below it, and the project's separation rules (the planner never imports torch.distributed, the
model is free of parallelism, only the Lightning layer and the CLI meet Lightning).

Imports are read from the source with ``ast`` (function-level imports included, since a lazy import
is still a dependency), so the test sees circles that Python's import system tolerates.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = "lightning_hexiscale"
ROOT = Path(__file__).resolve().parents[1] / PKG

LAYERS = ["errors", "_lazy", "torch_compat", "progress", "config", "emulate", "models", "data", "planner", "runtime", "profiling", "lightning", "bench", "cli"]
"""Bottom to top. A module may import its own layer and the layers before it, never one after."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports: ``from a.b import c`` counts as ``a.b.c`` when that is
    a module of the package (a submodule import), else as ``a.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports are not used in this package; resolve them anyway
                base = _module_name(path).split(".")
                base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & _MODULES
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return out


_MODULES = {_module_name(p) for p in ROOT.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph[name] = {m for m in _imports(path) if m in mods and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    # The check above must be able to fail.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_is_in_a_layer():
    unknown = sorted(m for m in _graph() if _layer(m) not in LAYERS and m != PKG)
    assert unknown == [], f"modules outside the layers {LAYERS}: {unknown}"


def test_layers_import_only_downwards():
    bad = []
    for mod, deps in _graph().items():
        if mod == PKG:  # the package root re-exports from every layer (lazily)
            continue
        here = LAYERS.index(_layer(mod))
        for dep in deps:
            if dep != PKG and LAYERS.index(_layer(dep)) > here:
                bad.append(f"{mod} -> {dep}")
    assert bad == [], "imports from a higher layer:\n" + "\n".join(sorted(bad))


@pytest.mark.parametrize("layer, forbidden", [
    ("planner", "torch.distributed"),   # the planner runs without a process group
    ("planner", "torch"),               # and without torch: `hexiscale plan` must stay fast
    ("config", "torch"),
    ("models", "torch.distributed"),    # the model is free of parallelism
    ("planner", "lightning"),
    ("runtime", "lightning"),           # the Lightning layer is the only place Lightning meets the runtime
    ("models", "lightning"),
    ("data", "lightning"),
    ("profiling", "lightning"),
    ("emulate", "torch"),               # the emulated cluster is processes, cgroups and namespaces
])
def test_layer_does_not_import(layer, forbidden):
    offenders = []
    for path in (ROOT / layer).rglob("*.py"):
        for m in _imports(path):
            if m == forbidden or m.startswith(forbidden + "."):
                offenders.append(f"{path.relative_to(ROOT.parent)} imports {m}")
    assert offenders == []


def test_runtime_consumes_only_a_plan():
    """The runtime never calls the planner: of the planner it may read only the Plan types and the
    plan's rank layout (derived from the Plan alone)."""
    allowed = (f"{PKG}.planner", f"{PKG}.planner.plan", f"{PKG}.planner.layout")
    bad = sorted(f"{m} -> {d}" for m, deps in _graph().items() if _layer(m) == "runtime"
                 for d in deps if _layer(d) == "planner" and d not in allowed)
    assert bad == []


PLANNER_ORDER = ["plan", "layout", "cost", "search", "oracle", "baselines"]
"""The planner's concerns, bottom to top: the Plan, its rank layout, the cost model, the search, the
true optimum, the baselines (which compare against all of them). Each imports only those before it."""


def _planner_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "planner" else None


def test_every_planner_module_is_in_a_concern():
    unknown = sorted(m for m in _graph() if _planner_part(m) not in (None, *PLANNER_ORDER))
    assert unknown == [], f"planner modules outside {PLANNER_ORDER}: {unknown}"


def planner_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        here = _planner_part(mod)
        for dep in deps:
            there = _planner_part(dep)
            if here and there and PLANNER_ORDER.index(there) > PLANNER_ORDER.index(here):
                bad.append(f"{mod} -> {dep}")
    return sorted(bad)


def test_planner_concerns_import_only_downwards():
    assert planner_upward_imports(_graph()) == []


def test_the_planner_order_check_finds_an_upward_import():
    cost, search = f"{PKG}.planner.cost.estimate", f"{PKG}.planner.search.two_phase"
    assert planner_upward_imports({cost: {search}, search: {cost}}) == [f"{cost} -> {search}"]


SCRIPTS = sorted([*(ROOT.parent / "benchmarks").glob("*.py"), *(ROOT.parent / "recipes").glob("*.py")])
"""The benchmarks and the recipes: scripts that use the package, never one another."""


def sibling_imports(script: Path) -> list[str]:
    """Modules ``script`` imports that are scripts of its own folder (reached through ``sys.path``)."""
    siblings = {p.stem for p in script.parent.glob("*.py")}
    return sorted(m for m in _imports(script) if m.split(".")[0] in siblings)


def test_the_script_check_finds_a_sibling_import(tmp_path):
    (tmp_path / "bench_a.py").write_text("import bench_b\nfrom bench_b import helper\nimport lightning_hexiscale\n")
    (tmp_path / "bench_b.py").write_text("helper = 1\n")
    assert sibling_imports(tmp_path / "bench_a.py") == ["bench_b"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_import_only_the_package(script):
    """A benchmark or recipe imports the package (and third-party libraries), never a sibling script:
    what two of them share is library code, in lightning_hexiscale/bench/ or below."""
    assert SCRIPTS, "no benchmarks/ or recipes/ found"
    assert sibling_imports(script) == []
    assert "sys.path" not in script.read_text(), f"{script.name} edits sys.path"


def private_imports(path: Path) -> list[str]:
    """``from <package module> import _name`` in ``path``: a private name taken from another module
    (dunder names and the package's own lazy-loading helper module ``_lazy`` apart)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PKG):
            out += [f"{node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_the_private_name_check_finds_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(f"from {PKG}.planner.search import _Hidden, search\n")
    assert private_imports(f) == [f"{PKG}.planner.search._Hidden"]


def test_no_private_name_crosses_modules():
    """Issue 31: what one module uses of another is its public API (a private name that another
    module needs is made public under a name that says what it is)."""
    found = {str(p.relative_to(ROOT.parent)): private_imports(p) for p in sorted(ROOT.rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


# ---- the Lightning layer meets the runtime only through its public API (issue 31) ----------------
# Rule 1: lightning/ imports from the runtime only ``lightning_hexiscale.runtime`` itself, and of it
# only the names in its ``__all__`` (never a submodule such as ``runtime.schedule``).
# Rule 2: lightning/ uses the engine only through its façade: no attribute access, on any object,
# whose name is one of the engine's parts (the attributes of PipelineEngine that hold its executor,
# gradient synchroniser, ZeRO sharder, topology, ...). Matching the attribute NAME anywhere, not a
# chain rooted at a variable called ``engine``, sees through aliases (``e = self.engine; e.zero``);
# the price is that lightning/ must not use these names for anything else. Every attribute that
# PipelineEngine sets is classified as façade data or a part, so a new one forces that choice.

ENGINE_FACADE_DATA = {"plan", "config", "device", "role", "stage", "fast_path", "fast_path_settings", "sharding",
                      "wire_dtype", "reduce_dtype", "loss_scale", "loss_device", "step"}
"""Attributes of PipelineEngine a trainer may read (descriptions of the run, the stage it registers, and
``step``, the step's phases that a trainer's hooks call)."""

ENGINE_PARTS = {"topology", "executor", "main_grads", "reducer", "grad_sync", "zero", "zero3", "sharded_optimizer",
                "tied"}
"""Attributes of PipelineEngine that hold the runtime's machinery (the gradient reducer and, as properties,
its parts): only the runtime touches them."""

RUNTIME = f"{PKG}.runtime"


def _class_attributes(path: Path, cls: str) -> set[str]:
    """The ``self.<name>`` attributes that the methods of class ``cls`` in ``path`` assign, and its properties."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    out.add(leaf.attr)
    out |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)}
    return out


def runtime_public_names() -> set[str]:
    """``lightning_hexiscale.runtime.__all__``, read from the source (importing it would not be a test of it)."""
    tree = ast.parse((ROOT / "runtime" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def runtime_api_violations(path: Path, public: set[str], parts: set[str]) -> list[str]:
    """What ``path`` uses of the runtime beyond its public API: submodule imports, imported names
    not in ``public``, and attribute accesses named after an engine part (``parts``)."""
    out = sorted(f"imports {m}" for m in _imports(path) if m.startswith(RUNTIME + "."))
    reach = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == RUNTIME and not node.level:
            out += [f"imports {RUNTIME}.{a.name} (not in its __all__)" for a in node.names
                    if a.name not in public and f"{RUNTIME}.{a.name}" not in _MODULES]
        elif isinstance(node, ast.Attribute) and node.attr in parts:
            reach.append((node.lineno, f"line {node.lineno}: .{node.attr} (an engine part)"))
    return out + [text for _, text in sorted(reach)]


def test_the_runtime_api_check_finds_violations(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(f"from {RUNTIME}.schedule import global_loss\n"
                 f"from {RUNTIME} import checkpoint as ckpt\n"
                 f"from {RUNTIME} import PipelineEngine, Hidden\n"
                 f"import {RUNTIME}.engine\n"
                 "def f(self):\n"
                 "    e = self.pipeline_model.engine\n"
                 "    e.executor.forward_only(1, 2)\n"
                 "    self.pipeline_model.engine.zero.grads = []\n"
                 "    e.sync_grads(); e.zero_grad(); e.role.pipeline\n")
    assert runtime_api_violations(f, {"PipelineEngine"}, ENGINE_PARTS) == [
        f"imports {RUNTIME}.checkpoint", f"imports {RUNTIME}.engine", f"imports {RUNTIME}.schedule",
        f"imports {RUNTIME}.Hidden (not in its __all__)",
        "line 7: .executor (an engine part)", "line 8: .zero (an engine part)"]


def test_every_engine_attribute_is_classified():
    found = _class_attributes(ROOT / "runtime" / "engine.py", "PipelineEngine")
    public = {a for a in found if not a.startswith("_")}
    assert not ENGINE_FACADE_DATA & ENGINE_PARTS
    assert public == ENGINE_FACADE_DATA | ENGINE_PARTS, (
        "PipelineEngine's attributes changed: put each new one in ENGINE_FACADE_DATA (a trainer may read it) "
        f"or ENGINE_PARTS (only the runtime may); new: {sorted(public - ENGINE_FACADE_DATA - ENGINE_PARTS)}, "
        f"gone: {sorted((ENGINE_FACADE_DATA | ENGINE_PARTS) - public)}")


def test_runtime_api_names_exist():
    """Every name of the runtime's ``__all__`` resolves (the lazy table and ``__all__`` agree)."""
    import importlib

    runtime = importlib.import_module(RUNTIME)
    assert runtime_public_names() == set(runtime.__all__)
    missing = [n for n in runtime.__all__ if getattr(runtime, n, None) is None]
    assert missing == []


def test_lightning_layer_uses_only_the_runtime_api():
    """Issue 31: the Lightning layer crosses into the runtime only through ``lightning_hexiscale.runtime``'s
    public names and the engine's façade (its methods and ENGINE_FACADE_DATA)."""
    public = runtime_public_names()
    assert "PipelineEngine" in public
    found = {str(p.relative_to(ROOT.parent)): runtime_api_violations(p, public, ENGINE_PARTS)
             for p in sorted((ROOT / "lightning").rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}
