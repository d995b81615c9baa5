"""Where ZeRO-2 / ZeRO-3 (``plan.dp_sharding``) meets the Lightning strategy.

Lightning builds the optimizer from ``configure_optimizers`` over the stage's parameters and calls
``optimizer.step(closure=...)`` through its precision plugin (the closure runs clipping). Under
ZeRO the update must touch only this rank's chunks, so :func:`shard_optimizers` routes that
instance's ``step`` to a :class:`~lightning_hexiscale.runtime.zero.ShardedOptimizer` of the same
class and hyper-parameters; the user's optimizer keeps its ``param_groups`` (LR schedulers write
there; the sharded one reads them every step) and holds no state. The rest of the strategy asks
the helpers below for the gradient norm, gradient scaling and checkpoint state, which under ZeRO
live in the owned chunks rather than in ``p.grad`` / ``optimizer.state``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch.optim import Optimizer

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


def checkpoint_optimizer(engine, optimizer: Optimizer | None) -> Any:
    """What the checkpoint writer reads as the optimizer: under ZeRO a view with the full local
    state gathered from the holders (collective: every rank calls it), else ``optimizer``."""
    if optimizer is None or engine.sharded_optimizer is None:
        return optimizer
    return engine.sharded_optimizer.checkpoint_view()


def load_target(engine, optimizer: Optimizer) -> Any:
    """What the checkpoint reader loads into: under ZeRO the sharded optimizer (it slices its own
    chunks out of the full state), with the user's ``param_groups`` for names and hyper-parameters."""
    if engine.sharded_optimizer is None:
        return optimizer
    return SimpleNamespace(param_groups=optimizer.param_groups, load_state_dict=engine.sharded_optimizer.load_state_dict)
