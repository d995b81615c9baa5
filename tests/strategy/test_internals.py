"""lightning/internals.py: the private Lightning attributes the strategy relies on are present, and
a Lightning release that drops one is reported by name instead of failing inside a training step."""

from __future__ import annotations

import pytest
from lightning.pytorch.loops.fit_loop import _FitLoop

from lightning_hexiscale.lightning import internals


def test_installed_lightning_has_every_attribute():
    internals.check()


def test_missing_attribute_is_named(monkeypatch):
    monkeypatch.delattr(_FitLoop, "_skip_backward")
    with pytest.raises(internals.LightningInternalsChanged, match=r"_FitLoop\._skip_backward is missing in lightning"):
        internals.check()


def test_missing_fabric_helper_is_named(monkeypatch):
    from lightning.fabric.utilities import optimizer

    monkeypatch.delattr(optimizer, "_optimizers_to_device")
    with pytest.raises(internals.LightningInternalsChanged, match="_optimizers_to_device"):
        internals.check()


def test_missing_launcher_method_is_named(monkeypatch):
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    monkeypatch.delattr(_SubprocessScriptLauncher, "_call_children_scripts")
    with pytest.raises(internals.LightningInternalsChanged, match="_call_children_scripts is missing in lightning"):
        internals.check()


def test_changed_worker_signature_is_named(monkeypatch):
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    monkeypatch.setattr(_MultiProcessingLauncher, "_wrapping_function", lambda self, process_idx, fn: None)
    with pytest.raises(internals.LightningInternalsChanged, match="_wrapping_function"):
        internals.check()


def test_missing_precision_closure_is_named(monkeypatch):
    from lightning.pytorch.plugins.precision import Precision

    monkeypatch.delattr(Precision, "_wrap_closure")
    with pytest.raises(internals.LightningInternalsChanged, match="Precision._wrap_closure is missing in lightning"):
        internals.check()


def test_only_internals_touches_lightning_privates():
    """No other module of the Lightning layer reads or writes the private attributes internals.py
    wraps (attribute accesses in the code, docstrings and comments aside)."""
    import ast
    from pathlib import Path

    wrapped = {"_skip_backward", "_accelerator_connector", "_data_source", "_optimizer", "_opt_called",
               "_wrapped_by_lr_sched", "_optimizers_to_device", "_optimizer_to_device", "_launcher", "_start_method",
               "_call_children_scripts", "_wrapping_function", "_SubprocessScriptLauncher", "_MultiProcessingLauncher",
               "_wrap_closure"}
    pkg = Path(internals.__file__).parent
    hits = []
    for path in pkg.glob("*.py"):
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else (
                node.name if isinstance(node, ast.alias) else None)
            if name in wrapped:
                hits.append(f"{path.name}:{node.lineno if hasattr(node, 'lineno') else '?'} {name}")
    assert hits == []
