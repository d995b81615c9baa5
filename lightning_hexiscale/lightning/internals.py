"""The one module that touches Lightning's (and torch's) private attributes.

The strategy runs forward and backward itself, cuts every global batch into per-pipeline slices
and steps a sharded optimizer; Lightning 2.x has no public switch for any of these, so a handful of
private attributes are set or read. They all live here, behind named functions, so that a
Lightning upgrade that renames one breaks in exactly one place, and :func:`check` (run by the
strategy's ``setup`` and by ``tests/strategy/test_internals.py``) says which attribute moved,
in which Lightning version, instead of failing deep inside a training step.

Tested with lightning 2.6 (pyproject bounds the version to ``>=2.4,<2.7``).
"""

from __future__ import annotations

from typing import Any

from lightning_hexiscale.errors import HexiScaleError

TESTED = "2.4-2.6"
"""Lightning versions the attributes below were read from."""


class LightningInternalsChanged(HexiScaleError, RuntimeError):
    """A private Lightning attribute the strategy relies on is gone (a Lightning upgrade)."""


def _missing(where: str, attr: str) -> LightningInternalsChanged:
    import lightning

    return LightningInternalsChanged(
        f"{where}.{attr} is missing in lightning {lightning.__version__}: the hexiscale strategy relies on it "
        f"(tested with lightning {TESTED}). Fix: pip install 'lightning>=2.4,<2.7', or update "
        f"lightning_hexiscale/lightning/internals.py for this release")


def check() -> None:
    """Raise :class:`LightningInternalsChanged` naming the first private attribute that moved."""
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    if not isinstance(getattr(_FitLoop, "_skip_backward", None), property):
        raise _missing("lightning.pytorch.loops.fit_loop._FitLoop", "_skip_backward")
    if "_skip_backward" not in _AutomaticOptimization.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.loops.optimization.automatic._AutomaticOptimization", "_skip_backward")
    if "use_distributed_sampler" not in _AcceleratorConnector.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector",
                       "use_distributed_sampler")
    if "_data_source" not in _FitLoop.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.loops.fit_loop._FitLoop", "_data_source")
    if "_optimizer" not in LightningOptimizer.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.core.optimizer.LightningOptimizer", "_optimizer")
    from lightning.fabric.utilities import optimizer as fabric_optimizer

    if not callable(getattr(fabric_optimizer, "_optimizers_to_device", None)):
        raise _missing("lightning.fabric.utilities.optimizer", "_optimizers_to_device")


def skip_lightning_backward(trainer) -> None:
    """Lightning's closure would run zero_grad and backward after ``training_step``, wiping the
    gradients the pipeline schedule produced inside it (the NeMo fix; NOTES-torch-lightning.md)."""
    trainer.fit_loop._skip_backward = True


def keep_dataloader_sampler(trainer) -> None:
    """No injected DistributedSampler: the strategy cuts the loader per pipeline itself, and the
    loader's own ``shuffle`` decides, as on one device."""
    connector = getattr(trainer, "_accelerator_connector", None)
    if connector is None:
        raise _missing("lightning.pytorch.Trainer", "_accelerator_connector")
    connector.use_distributed_sampler = False


def train_dataloader(trainer) -> Any:
    """The training DataLoader the fit loop will use, without consuming it; ``None`` when none is
    reachable yet (the caller then asks for an explicit global batch)."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is None:
        return None
    try:
        return source.dataloader() if source.is_defined() else None
    except Exception:  # the user's *_dataloader hook may need setup that has not run: treat as unknown
        return None


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (or the argument itself)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def mark_step_wrapped(raw_optimizer, step) -> None:
    """Install ``step`` as ``raw_optimizer.step`` with the marks torch's LR-scheduler wrapper would
    set, so that ``LRScheduler`` neither warns about an overridden step nor about ``scheduler.step``
    being called before ``optimizer.step``."""
    step._wrapped_by_lr_sched = True
    raw_optimizer.step = step


def record_step_called(raw_optimizer) -> None:
    """What torch's LR-scheduler wrapper records when ``optimizer.step`` ran."""
    raw_optimizer._opt_called = True


def optimizers_to_device(optimizers, device) -> None:
    """Move optimizer state tensors to ``device`` (Lightning's private fabric helper)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)
