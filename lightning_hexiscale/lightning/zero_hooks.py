"""Where ZeRO-2 / ZeRO-3 (``plan.dp_sharding``) meets the Lightning strategy.

Lightning builds the optimizer from ``configure_optimizers`` over the stage's parameters and steps
it through its precision plugin (``Precision.optimizer_step``; the closure runs the training step,
``on_before_optimizer_step`` and clipping). Under ZeRO the update must touch only this rank's
chunks: :func:`shard_optimizers` attaches to that optimizer the sharded one the engine's
``wrap_optimizer`` returns (of the same class and hyper-parameters), and the strategy's precision
plugin steps that one instead (:class:`~lightning_hexiscale.lightning.precision.GlobalNormClipping`);
nothing of the user's optimizer is patched. It keeps its ``param_groups`` (LR schedulers write there;
the sharded one reads them every step) and holds no state. The gradient norm and gradient scaling,
which under ZeRO live in the owned chunks rather than in ``p.grad``, are the engine's
(``global_grad_norm``, ``scale_grads``, ``clip_grad_norm``). Checkpoints read the owned chunks of
the optimizer state directly from the engine: no gather.
"""

from __future__ import annotations

from typing import Any

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning import internals


SHARDED = "_hexiscale_sharded"
"""Attribute of a user's optimizer that holds its sharded twin (under zero2/zero3)."""


def shard_optimizers(engine, optimizers: list) -> None:
    """Under zero2/zero3: attach to the optimizer its sharded twin (once); see :func:`sharded_twin`."""
    if engine.sharding == "ddp" or not optimizers:
        return
    if len(optimizers) > 1:
        raise ConfigError("configure_optimizers", f"{len(optimizers)} optimizers",
                          f"dp_sharding={engine.sharding} shards one optimizer's state over the pipelines",
                          "return one optimizer, or use dp_sharding='ddp'")
    raw = internals.unwrap_optimizer(optimizers[0])
    if getattr(raw, SHARDED, None) is None:
        setattr(raw, SHARDED, engine.wrap_optimizer(raw))


def sharded_twin(optimizer):
    """The sharded optimizer that steps in place of ``optimizer`` (a user's optimizer, or
    Lightning's wrapper of one), or None where there is none (ddp)."""
    return getattr(internals.unwrap_optimizer(optimizer), SHARDED, None)


def sharded_step(plugin, model, optimizer, closure) -> Any:
    """The precision plugin's ``optimizer_step`` under ZeRO: Lightning's closure and hooks, then the
    sharded twin's step; the user's optimizer is marked as stepped for its LR schedulers."""
    result = internals.run_closure_and_hooks(plugin, model, optimizer, closure)
    sharded_twin(optimizer).step()
    internals.record_step_called(internals.unwrap_optimizer(optimizer))
    return result
