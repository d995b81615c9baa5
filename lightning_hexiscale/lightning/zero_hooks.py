"""Where ZeRO-2 / ZeRO-3 (``plan.dp_sharding``) meets the Lightning strategy.

Lightning builds the optimizer from ``configure_optimizers`` over the stage's parameters and calls
``optimizer.step(closure=...)`` through its precision plugin (the closure runs clipping). Under
ZeRO the update must touch only this rank's chunks, so :func:`shard_optimizers` routes that
instance's ``step`` to a :class:`~lightning_hexiscale.runtime.zero.ShardedOptimizer` of the same
class and hyper-parameters; the user's optimizer keeps its ``param_groups`` (LR schedulers write
there; the sharded one reads them every step) and holds no state. The rest of the strategy asks
the helpers below for the gradient norm and gradient scaling, which under ZeRO live in the owned
chunks rather than in ``p.grad``. Checkpoints read the owned chunks of the optimizer state
directly from the engine (:mod:`lightning_hexiscale.runtime.checkpoint_layout`): no gather.
"""

from __future__ import annotations

import torch

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning import internals


def shard_optimizers(engine, optimizers: list) -> None:
    """Under zero2/zero3: route each optimizer's ``step`` to its sharded twin (once)."""
    if engine.zero is None or not optimizers:
        return
    if len(optimizers) > 1:
        raise ConfigError("configure_optimizers", f"{len(optimizers)} optimizers",
                          f"dp_sharding={engine.sharding} shards one optimizer's state over the pipelines",
                          "return one optimizer, or use dp_sharding='ddp'")
    raw = internals.unwrap_optimizer(optimizers[0])
    if getattr(raw, "_hexiscale_sharded", None) is not None:
        return
    sharded = engine.wrap_optimizer(raw)

    def step(closure=None):
        loss = closure() if closure is not None else None
        sharded.step()
        internals.record_step_called(raw)
        return loss

    internals.mark_step_wrapped(raw, step)
    raw._hexiscale_sharded = sharded


def grad_norm_sq_local(engine) -> torch.Tensor | None:
    """This rank's share of ||g||^2 under ZeRO (each element owned once), else ``None``."""
    return engine.grad_norm_sq_local()


def scale_grads(engine, coef: float) -> bool:
    """Scale the owned gradient chunks under ZeRO; ``False`` under ddp (caller scales p.grad)."""
    if engine.zero is None:
        return False
    engine.zero.scale_grads(coef)
    return True
