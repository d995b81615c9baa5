"""HexiScaleStrategy's gradient checks: the non-finite step decision and clipping by the global norm.

A mixin of :class:`~lightning_hexiscale.lightning.strategy.HexiScaleStrategy` (kept apart so that each
file holds one concern); it uses the strategy's ``pipeline_model``, ``nonfinite``,
``nonfinite_events`` and ``precision_plugin``.
"""

from __future__ import annotations


import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hexiscale.errors import NonFiniteError
from lightning_hexiscale.lightning.precision import GlobalNormClipping, global_norm_precision


def eps_underflow(optimizers) -> str | None:
    """The cause and fix when an optimizer's ``eps`` is 0 in its parameters' dtype, else None.

    Adam's update is ``m / (sqrt(v) + eps)``. In float16 (``16-true``) the default ``eps=1e-8`` rounds
    to 0 (the smallest float16 is 6.0e-8), and ``v = g^2`` underflows to 0 for every element with
    ``|g| < 2.4e-4``: the update divides by zero and the parameters become inf or NaN in the first
    step, which the non-finite check sees on the next one. bfloat16 has float32's range."""
    from lightning_hexiscale.lightning import internals

    for opt in optimizers:
        inner = internals.unwrap_optimizer(opt)
        for group in inner.param_groups:
            eps = group.get("eps")
            params = [p for p in group["params"] if p.is_floating_point()]
            if not isinstance(eps, float) or eps <= 0 or not params:
                continue
            dtype = params[0].dtype
            if float(torch.tensor(eps, dtype=dtype)) == 0.0:
                name = str(dtype).replace("torch.", "")
                smallest = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
                return (f"Cause: the parameters are {name} and {type(inner).__name__}'s eps={eps:g} rounds to 0 in "
                        f"{name} (its smallest value is {smallest:.1e}), so every element whose squared gradient "
                        "underflows divides by zero in the update m / (sqrt(v) + eps). Fix: train in bf16-mixed or "
                        f"bf16-true (bfloat16 has float32's range), or give the optimizer an eps that {name} holds, "
                        "e.g. eps=1e-4 (LlamaLitModule(eps=1e-4); recipe: trainer.adam_eps=1e-4)")
    return None


class GradientMethods:
    """Non-finite detection (one decision on every rank) and global-norm clipping."""

    def _nonfinite_step(self, bad: dict[int, int]) -> None:
        """A step whose loss or gradients were not finite on the ranks ``bad`` ({global rank: code},
        the engine's :meth:`~lightning_hexiscale.runtime.PipelineEngine.finish_backward` answer, the
        same on every rank, which already dropped the gradients): record it, then stop or skip per
        ``nonfinite``."""
        trainer = self.lightning_module.trainer
        what = " and ".join(w for bit, w in ((1, "loss"), (2, "gradients")) if any(c & bit for c in bad.values()))
        event = {"step": trainer.global_step, "epoch": trainer.current_epoch,
                 "batch": trainer.fit_loop.epoch_loop.batch_idx, "ranks": sorted(bad), "what": what,
                 "action": self.nonfinite}
        self.nonfinite_events.append(event)
        where = (f"non-finite {what} at optimizer step {event['step']} (epoch {event['epoch']}, batch "
                 f"{event['batch']}) on rank(s) {event['ranks']}")
        if self.nonfinite == "stop":
            cause = eps_underflow(self.optimizers)
            if cause:
                raise NonFiniteError(f"{where}; stopping (nonfinite='stop'). {cause}")
            raise NonFiniteError(f"{where}; stopping (nonfinite='stop'). Fix: lower the learning rate, enable "
                                 f"gradient clipping, check the data of that batch, or pass nonfinite='skip' to drop "
                                 f"such steps")
        if self.global_rank == 0:
            rank_zero_warn(f"{where}; the update is skipped (nonfinite='skip')")

    def _install_global_clipping(self) -> None:
        """Clip by the global norm: the Trainer's precision plugin becomes its
        :func:`~lightning_hexiscale.lightning.precision.global_norm_precision` subclass, tied to this
        run's engine (``teardown`` unties it: the plugin then clips as its base class does)."""
        self.precision_plugin = global_norm_precision(self.precision_plugin)
        self.precision_plugin.engine = self.pipeline_model.engine

    def _release_global_clipping(self) -> None:
        if isinstance(self.precision_plugin, GlobalNormClipping):
            self.precision_plugin.engine = None

    def global_grad_norm(self) -> float:
        """L2 norm of the gradient of the whole model, every element counted once (collective;
        :meth:`~lightning_hexiscale.runtime.PipelineEngine.global_grad_norm`)."""
        return self.pipeline_model.engine.global_grad_norm()

    def clip_grad_by_global_norm(self, max_norm: float) -> float:
        """Scale every local gradient by min(1, max_norm / (||g|| + 1e-6)), as
        ``torch.nn.utils.clip_grad_norm_`` does on one device; returns ||g|| (collective;
        :meth:`~lightning_hexiscale.runtime.PipelineEngine.clip_grad_norm`)."""
        return self.pipeline_model.engine.clip_grad_norm(max_norm)
