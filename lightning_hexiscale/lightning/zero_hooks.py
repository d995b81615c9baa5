"""Where ZeRO-2 / ZeRO-3 (``plan.dp_sharding``) meets the Lightning strategy.

Lightning builds the optimizer from ``configure_optimizers`` over the stage's parameters and calls
``optimizer.step(closure=...)`` through its precision plugin (the closure runs clipping). Under
ZeRO the update must touch only this rank's chunks, so :func:`shard_optimizers` routes that
instance's ``step`` to the sharded optimizer the engine's ``wrap_optimizer`` returns (of the same
class and hyper-parameters); the user's optimizer keeps its ``param_groups`` (LR schedulers write
there; the sharded one reads them every step) and holds no state. The gradient norm and gradient
scaling, which under ZeRO live in the owned chunks rather than in ``p.grad``, are the engine's
(``global_grad_norm``, ``scale_grads``, ``clip_grad_norm``). Checkpoints read the owned chunks of
the optimizer state directly from the engine: no gather.
"""

from __future__ import annotations

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning import internals


def shard_optimizers(engine, optimizers: list) -> None:
    """Under zero2/zero3: route each optimizer's ``step`` to its sharded twin (once)."""
    if engine.sharding == "ddp" or not optimizers:
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

