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

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_hexiscale.errors import ConfigError, HexiScaleError
from lightning_hexiscale.lightning.launch.guard import mark_agreed
from lightning_hexiscale.lightning.step_adapter import StepAdapter

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.runtime import PipelineEngine

_CONTRACT = ("under the hexiscale strategy the logits of self.model(tokens) exist only on the last pipeline "
             "stage; compute the loss with self.model.loss(self.model(tokens), targets) (mean token "
             "cross-entropy, as on one device)")


class PipelineLogits:
    """Placeholder for the logits of ``tokens``; consumed by :meth:`PipelineModel.loss` only.

    Any other use (``F.cross_entropy(logits, ...)``, ``logits.view(...)``) raises
    :class:`HexiScaleError` with the contract, instead of a confusing error deep in torch; every
    rank runs the same step code and raises it alike, so it is marked as raised on ``ranks`` (all
    of the job's: one error, rank 0's, reaches the caller, not one worker traceback per rank).
    """

    def __init__(self, tokens: torch.Tensor, ranks: list[int] | None = None):
        self.tokens = tokens
        self.ranks = ranks or []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        mine = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, PipelineLogits)]
        raise mark_agreed(HexiScaleError(f"{getattr(func, '__name__', func)}(logits): {_CONTRACT}"),
                          mine[0].ranks if mine else [])

    def __getattr__(self, name: str) -> Any:
        raise mark_agreed(HexiScaleError(f"logits.{name}: {_CONTRACT}"), self.__dict__.get("ranks", []))


class PipelineModel(nn.Module):
    """This rank's pipeline stage (TP shards included) behind the Llama's ``forward`` / ``loss`` API.

    ``stage`` is a registered submodule, so ``LightningModule.parameters()`` (and the optimizer the
    module's ``configure_optimizers`` builds from it) are this rank's local shards.
    """

    def __init__(self, engine: PipelineEngine, loss_dtype: torch.dtype,
                 rows_seen: Callable[[int], None] | None = None, built_for: tuple[Any, Any] = (None, None)):
        super().__init__()
        self.built_for = built_for
        """(cluster, workload) the stage's plan was resolved for: a later Trainer call with this module,
        whose new strategy has not planned, takes them with the plan (``plan_resolution.reuse_stage``)."""
        self.rows_seen = rows_seen
        """Told the sequences of the global batch each forward-only loss is the mean of (the strategy
        has Lightning weigh logged values by it: :func:`~lightning_hexiscale.lightning.internals.logged_batch_size`)."""
        self.stage = engine.stage
        self._engine = engine
        self.config = engine.config
        self.loss_dtype = loss_dtype
        self.step_adapter = StepAdapter(engine)
        """Lightning's hooks -> the engine's step phases (the strategy's hooks call it too)."""

    @property
    def engine(self) -> PipelineEngine:
        return self._engine

    def forward(self, tokens: torch.Tensor) -> PipelineLogits:
        try:  # before any communication of the step (train, eval, predict)
            self._engine.check_tokens(tokens)
        except ConfigError as e:
            # Agreed: every rank holds rows of one length wherever the loader's rows have one (the
            # pipelines' rows come from one loader; a pipeline's stages take the same rows), so rank
            # 0 reports it once. Rows padded per pipeline to different lengths would leave some
            # ranks in the step: they stop on the failure watch's RankFailure instead.
            raise mark_agreed(e, list(range(self._engine.plan.world_size))) from None
        return PipelineLogits(tokens, list(range(self._engine.plan.world_size)))

    def loss(self, logits: PipelineLogits, targets: torch.Tensor) -> torch.Tensor:
        """Global mean token cross-entropy of this step's global batch (0-d tensor, same on every rank)."""
        if not isinstance(logits, PipelineLogits):
            raise mark_agreed(HexiScaleError(f"self.model.loss got {type(logits).__name__}: {_CONTRACT}"),
                              list(range(self._engine.plan.world_size)))
        if torch.is_grad_enabled() and self.training:
            value = self._train(logits.tokens, targets)
            out = self.step_adapter.given = torch.tensor(value, dtype=self.loss_dtype, device=logits.tokens.device)
            return out  # the adapter checks that the training step returns it (StepAdapter.end_batch)
        value = self._evaluate(logits.tokens, targets)
        return torch.tensor(value, dtype=self.loss_dtype, device=logits.tokens.device)

    # ---- training ------------------------------------------------------------------------
    def _train(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The window's micro-step on this batch (:meth:`StepAdapter.micro_step`)."""
        return self.step_adapter.micro_step(tokens, targets)

    # ---- forward only --------------------------------------------------------------------
    def _evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The engine's forward-only walk (micro-batches of the plan's size), reduced over the world."""
        loss, rows = self._engine.eval_loss_and_rows(tokens, targets)
        if self.rows_seen is not None:
            self.rows_seen(rows)
        return loss

    # ---- prediction ------------------------------------------------------------------------
    def predict_logits(self, logits: PipelineLogits) -> torch.Tensor | None:
        """The logits of this step's whole batch on global rank 0, None on the other ranks: every
        pipeline walks its slice forward, and rank 0 joins the last stages' outputs in batch order
        (collective: :meth:`~lightning_hexiscale.runtime.PipelineEngine.predict_logits`)."""
        return self._engine.predict_logits(logits.tokens)
