"""What a LightningModule's ``self.model`` becomes under the hexiscale strategy.

A module written for one device computes its loss as ``self.model.loss(self.model(tokens), targets)``
with the plain :class:`~lightning_hexiscale.models.llama.Llama`. Under the strategy ``self.model`` is a
:class:`PipelineModel` with the same two calls, but the logits of a pipeline exist only on its last
stage and only one micro-batch at a time, so:

- ``self.model(tokens)`` returns a :class:`PipelineLogits` placeholder that only remembers the tokens;
- ``self.model.loss(logits, targets)`` runs the whole pipeline step on this pipeline's batch and
  returns the GLOBAL mean loss (all pipelines, all micro-batches; the same value on every rank):
  in training (grad enabled, module in train mode) the schedule's forward and backward, leaving the
  gradients in the stage parameters; otherwise forward only (validation, ``trainer.validate``);
- ``trainer.predict``: a ``predict_step`` that returns ``self.model(tokens)`` (as on one device, the
  logits) gets them from :meth:`PipelineModel.predict_logits`: every pipeline runs the forward of its
  slice of the batch, and the last stages' outputs are gathered, in batch order, to global rank 0
  (the caller's process), which returns the one-device logits of the whole batch; other ranks
  return None.

Loss weights, so that SUM-reducing gradients over pipelines gives one-device gradients: a
micro-batch of m sequences weighs its mean token loss by m / (G * k), G the global batch, k the
Trainer's ``accumulate_grad_batches`` (Lightning divides the one-device loss by k before backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hexiscale.errors import HexiScaleError
from lightning_hexiscale.runtime.schedule import global_loss

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.runtime.engine import PipelineEngine

_CONTRACT = ("under the hexiscale strategy the logits of self.model(tokens) exist only on the last pipeline "
             "stage; compute the loss with self.model.loss(self.model(tokens), targets) (mean token "
             "cross-entropy, as on one device)")


class PipelineLogits:
    """Placeholder for the logits of ``tokens``; consumed by :meth:`PipelineModel.loss` only.

    Any other use (``F.cross_entropy(logits, ...)``, ``logits.view(...)``) raises
    :class:`HexiScaleError` with the contract, instead of a confusing error deep in torch.
    """

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise HexiScaleError(f"{getattr(func, '__name__', func)}(logits): {_CONTRACT}")

    def __getattr__(self, name: str) -> Any:
        raise HexiScaleError(f"logits.{name}: {_CONTRACT}")


class PipelineModel(nn.Module):
    """This rank's pipeline stage (TP shards included) behind the Llama's ``forward`` / ``loss`` API.

    ``stage`` is a registered submodule, so ``LightningModule.parameters()`` (and the optimizer the
    module's ``configure_optimizers`` builds from it) are this rank's local shards.
    """

    def __init__(self, engine: PipelineEngine, loss_dtype: torch.dtype, accumulate: int = 1):
        super().__init__()
        self.stage = engine.stage
        self._engine = engine
        self.config = engine.config
        self.loss_dtype = loss_dtype
        self.accumulate = accumulate
        """k = accumulate_grad_batches; set by the strategy before each fit."""
        self.last_of_window = False
        """Set by the strategy before each training step: this batch ends the accumulation window
        (an optimizer step follows), so its last backward starts the gradient sync (overlap)."""

    @property
    def engine(self) -> PipelineEngine:
        return self._engine

    def forward(self, tokens: torch.Tensor) -> PipelineLogits:
        return PipelineLogits(tokens)

    def loss(self, logits: PipelineLogits, targets: torch.Tensor) -> torch.Tensor:
        """Global mean token cross-entropy of this step's global batch (0-d tensor, same on every rank)."""
        if not isinstance(logits, PipelineLogits):
            raise HexiScaleError(f"self.model.loss got {type(logits).__name__}: {_CONTRACT}")
        if torch.is_grad_enabled() and self.training:
            value = self._train(logits.tokens, targets)
        else:
            value = self._evaluate(logits.tokens, targets)
        return torch.tensor(value, dtype=self.loss_dtype, device=logits.tokens.device)

    def zero_grad_local(self) -> None:
        """Start of an accumulation window: drop the stage's gradients (Lightning's zero_grad is skipped)."""
        for p in self.stage.parameters():
            p.grad = None

    # ---- training ------------------------------------------------------------------------
    def _train(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        e = self._engine
        scale = e.loss_scale / self.accumulate
        arm, self.last_of_window = self.last_of_window, False
        pipeline_loss = e.run_pipeline(tokens, targets, scale, arm=arm)
        # The reduced value is the scaled sum; undo the 1/k so the shown loss is this batch's mean.
        return global_loss(pipeline_loss, e.role, e.loss_device) * self.accumulate

    # ---- forward only --------------------------------------------------------------------
    @torch.no_grad()
    def _evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward through the pipeline (the executor's forward-only walk, micro-batches of the
        plan's size). The last-stage leader of each pipeline contributes (sum over chunks of
        chunk_mean * chunk_size, n) to one world all-reduce; loss = sum / sum n.
        """
        e = self._engine
        role = e.role
        # ZeRO-3: gather every block once for the whole batch (pipelines cut different numbers of
        # chunks, so per-use gathers could not be paired across pipelines here).
        with e.full_params():
            weighted = e.executor.forward_only(tokens, targets)
        buf = torch.zeros(2, dtype=torch.float64, device=e.loss_device)
        if role.is_last and role.is_leader:
            buf[0], buf[1] = weighted.item(), float(tokens.shape[0])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return float(buf[0] / buf[1])

    # ---- prediction ------------------------------------------------------------------------
    @torch.no_grad()
    def predict_logits(self, logits: PipelineLogits) -> torch.Tensor | None:
        """The logits of this step's whole batch on global rank 0, None on the other ranks.

        Each pipeline runs the executor's forward-only walk over its slice (micro-batches of the
        plan's size); a forward hook on the stage keeps the last stage's outputs. Then ONE
        ``gather_object`` to rank 0 over the default group, entered by every rank in the same order
        (the same on every backend): last-stage leaders send (pipeline, logits); the other ranks of
        a last stage send their part only when the head is split over the vocabulary, else nothing.
        Rank 0 joins vocabulary parts in TP order and pipelines in batch order.
        """
        e = self._engine
        role = e.role
        outs: list[torch.Tensor] = []
        hook = self.stage.register_forward_hook(lambda _m, _args, out: outs.append(out.detach()))
        try:
            with e.full_params():  # ZeRO-3: every block whole for the walk, as in _evaluate
                e.executor.forward_only(logits.tokens, torch.zeros_like(logits.tokens))
        finally:
            hook.remove()
        mine = None
        if role.is_last and outs:
            full = torch.cat(outs)
            if role.tp_rank == 0 or full.shape[-1] < self.config.vocab_size:
                mine = (role.pipeline, role.tp_rank, full.cpu())
        world, rank = dist.get_world_size(), dist.get_rank()
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank != 0:
            return None
        parts: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for item in gathered:
            if item is not None:
                parts.setdefault(item[0], []).append((item[1], item[2]))
        pipes = []
        for i in sorted(parts):
            shards = [t for _, t in sorted(parts[i], key=lambda x: x[0])]
            whole = shards[0] if shards[0].shape[-1] == self.config.vocab_size else torch.cat(shards, dim=-1)
            if whole.shape[-1] != self.config.vocab_size:
                raise HexiScaleError(f"pipeline {i}'s last stage gave logits of width {whole.shape[-1]}, "
                                     f"not the vocabulary's {self.config.vocab_size}")
            pipes.append(whole)
        return torch.cat(pipes).to(logits.tokens.device)
