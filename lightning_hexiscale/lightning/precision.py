"""Gradient clipping by the whole model's norm, through Lightning's precision plugin.

Lightning clips in its precision plugin: ``Precision.clip_gradients`` calls ``clip_grad_by_norm``,
which runs ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters. Under the strategy
those are this rank's shards, so that norm would be a local one. The strategy gives the plugin the
Trainer chose (``32-true``: ``Precision``, ``64-true``: ``DoublePrecision``, ``bf16-true``:
``HalfPrecision``, ``bf16-mixed``: ``MixedPrecision``, or one the user passed) as an instance of a
subclass of that plugin's class (:func:`global_norm_precision`), with the same state, whose
``clip_grad_by_norm`` asks the engine: ||g|| over every stage, TP shard and pipeline, each element
once, and one scale min(1, max_norm / (||g|| + 1e-6)) for every gradient, as on one device
(:meth:`~lightning_hexiscale.runtime.PipelineEngine.clip_grad_norm`). Clipping by value is
element-wise, so the plugin's own is already the one-device one.

Under ZeRO the same subclass steps the optimizer's sharded twin in place of the optimizer Lightning
holds, after the same closure and hooks (:func:`~lightning_hexiscale.lightning.zero_hooks.sharded_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.runtime import PipelineEngine


class GlobalNormClipping:
    """Mixin placed before a Lightning ``Precision`` class: ``clip_grad_by_norm`` by the global norm
    while :attr:`engine` is set (the strategy's ``setup`` sets it, ``teardown`` clears it), and under
    ZeRO ``optimizer_step`` steps the sharded twin; the base class's local clipping and step otherwise."""

    engine: PipelineEngine | None = None
    base: type = Precision
    """The Lightning plugin class this one extends (set on each subclass)."""

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        """Under ZeRO the optimizer's sharded twin steps (:mod:`~lightning_hexiscale.lightning.zero_hooks`),
        after the same closure and hooks; as the base class otherwise."""
        from lightning_hexiscale.lightning.zero_hooks import sharded_step, sharded_twin

        if self.engine is None or sharded_twin(optimizer) is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        if kwargs:
            raise TypeError(f"optimizer.step() got arguments {sorted(kwargs)}: under ZeRO the sharded optimizer "
                            f"steps, and it takes none")
        return sharded_step(self, model, optimizer, closure)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self.engine is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        self.engine.clip_grad_norm(clip_val)

    def __reduce__(self):
        # The class is made at run time (one per plugin class): pickle the plugin's own class and
        # state, and rebuild this subclass around them (spawn pickles the Trainer's strategy).
        state = {k: v for k, v in vars(self).items() if k != "engine"}
        return _rebuild, (self.base, state)


_SUBCLASSES: dict[type, type] = {}


def global_norm_precision(plugin: Precision) -> Precision:
    """``plugin`` as an instance of ``GlobalNorm<its class>`` (its class with :class:`GlobalNormClipping`
    first), holding the same attributes; ``plugin`` itself when it already is one."""
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    base = type(plugin)
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = _SUBCLASSES[base] = type(f"GlobalNorm{base.__name__}", (GlobalNormClipping, base),
                                       {"__module__": __name__, "base": base,
                                        "__doc__": f"{base.__qualname__}, clipping by the global norm "
                                                   "(lightning_hexiscale.lightning.precision)."})
    new = cls.__new__(cls)
    new.__dict__.update(vars(plugin))
    return new


def _rebuild(base: type, state: dict[str, Any]) -> Precision:
    plugin = base.__new__(base)
    plugin.__dict__.update(state)
    return global_norm_precision(plugin)
