"""The training step of one rank, in phases: what ``Trainer.fit`` and ``PipelineEngine.fit_step`` run.

One optimizer step on a global batch of G sequences, accumulated over k batches (the Trainer's
``accumulate_grad_batches``; ``fit_step``: k = 1):

1. :meth:`Step.open_window`: drop the local gradients (``p.grad = None``).
2. :meth:`Step.micro_step`, k times: the schedule's forward and backward of this pipeline's rows
   (b_i sequences), each micro-batch's mean token loss weighted by m / (G * k) so that the SUM over
   pipelines and batches is the global-mean gradient; the last one (``last=True``) starts the
   gradient reduction at block boundaries of its backward (overlap). Returns the global loss / k.
3. :meth:`Step.close_window`: the non-finite check (one all-reduce: every rank decides alike and
   names the same ranks), then the reducer's sum across pipelines, or, when a loss or gradient is not
   finite anywhere, the same completion of the started reductions followed by dropping everything.
4. :meth:`Step.clip`: ||g|| over every stage, TP shard and pipeline, each element once, and one
   scale min(1, max_norm / (||g|| + 1e-6)), as ``torch.nn.utils.clip_grad_norm_`` on one device.
5. :meth:`Step.update`: ``optimizer.step()`` (the reducer's: under ZeRO it steps the owned chunks).

:meth:`Step.run` is the five in a row. The data-parallel flavour is behind the
:class:`~lightning_hexiscale.runtime.reducers.GradReducer`; nothing here branches on it. Why the
check comes before the sum: the sum would spread one rank's NaN to the other pipelines and hide
where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import ConfigError, NonFiniteError
from lightning_hexiscale.runtime.grad_sync import finite
from lightning_hexiscale.runtime.main_grads import MainGrads
from lightning_hexiscale.runtime.parallelize import StageModule
from lightning_hexiscale.runtime.reducers import GradReducer
from lightning_hexiscale.runtime.schedule import PipelineExecutor, global_loss
from lightning_hexiscale.runtime.topology import Topology

NONFINITE_POLICIES = ("stop", "skip")


def reduction_device(device: torch.device) -> torch.device:
    """Device of tensors reduced with the plan's group: NCCL reduces only CUDA tensors, gloo only CPU ones."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def check_policy(nonfinite: str) -> None:
    """``fit_step(nonfinite=...)`` is 'stop' or 'skip' (a ConfigError otherwise)."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ConfigError("fit_step(nonfinite)", nonfinite, "must be 'stop' or 'skip'",
                          "pass nonfinite='stop' (raise) or nonfinite='skip' (drop the update)")


@dataclass(frozen=True)
class FitStep:
    """What :meth:`Step.run` did."""

    loss: float
    """The global mean loss of the batch (the same on every rank)."""
    grad_norm: float | None
    """||g|| over the whole model before clipping (with ``clip_norm``), else None."""
    nonfinite: dict[int, int]
    """{global rank: code} of a skipped step (:meth:`Step.nonfinite_ranks`); empty when applied."""


class Step:
    """This rank's step phases over its stage, schedule executor and gradient reducer."""

    def __init__(self, stage: StageModule, topology: Topology, executor: PipelineExecutor, reducer: GradReducer,
                 main_grads: MainGrads | None, device: torch.device, loss_scale: float):
        self.stage, self.topology, self.executor, self.reducer = stage, topology, executor, reducer
        self.main_grads = main_grads
        self.device = device
        self.loss_scale = loss_scale
        """Weight of one micro-batch's mean loss: micro_batch_size / global_batch."""

    @property
    def loss_device(self) -> torch.device:
        return reduction_device(self.device)

    # ---- 1. open the window -------------------------------------------------------------------
    def open_window(self) -> None:
        """Drop the local gradients (``p.grad = None`` on every local parameter)."""
        for p in self.stage.parameters():
            p.grad = None

    # ---- 2. micro-steps ---------------------------------------------------------------------------
    def run_pipeline(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float, last: bool = False):
        """One schedule run on this pipeline's rows (forward + backward of all micro-batches); returns
        the pipeline's scaled loss (:meth:`PipelineExecutor.run`). ``last``: the window's last run,
        whose backward starts the reducer's buckets (:meth:`GradReducer.arm`)."""
        # Tied embeddings across stages: the embedding's gradient is final only after the tied
        # exchange in reduce(); its bucket is the last of the order, so it starts only there.
        hook = self.reducer.arm if last else None
        if self.main_grads is not None:  # the compute copies go as their gradients land in the last backward
            hook = _then(hook, self.main_grads.free_after_use)
        with self.reducer.training_run():
            loss = self.executor.run(tokens, targets, loss_scale, hook)
        if last:  # before the loss all-reduce and the non-finite check
            self.reducer.after_last_backward()
        return loss

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, *, accumulate: int = 1,
                   last: bool = False) -> float:
        """Forward + backward of THIS pipeline's rows, each micro-batch's mean loss weighted by
        ``loss_scale / accumulate``; returns the global sum of the weighted losses = the global mean
        loss / ``accumulate`` (collective: one all-reduce, the same float on every rank)."""
        pipeline_loss = self.run_pipeline(tokens, targets, self.loss_scale / accumulate, last=last)
        return self.global_loss(pipeline_loss)

    def global_loss(self, pipeline_loss: torch.Tensor) -> float:
        """The pipelines' weighted losses summed over the plan's ranks (collective)."""
        return global_loss(pipeline_loss, self.topology.role, self.loss_device, self.topology.plan_group)

    # ---- 3. close the window ------------------------------------------------------------------------
    @torch.no_grad()
    def local_grads_finite(self) -> bool:
        """Are this rank's gradients finite: ``p.grad`` of the local parameters and those the reducer
        already freed during the backward? Local."""
        flags = [finite(p.grad) for p in self.stage.parameters() if p.grad is not None]
        flags += self.reducer.freed_finite()
        return not flags or bool(torch.stack(flags).all())

    @torch.no_grad()
    def nonfinite_ranks(self, loss: Any = None) -> dict[int, int]:
        """{global rank: code} of the ranks whose ``loss`` (a tensor; code 1) or gradients (code 2;
        both: 3) are not finite, the same on every rank, empty when all are. Collective: one
        all-reduce(SUM) over the plan's ranks of a float32 vector of one code per rank."""
        local = 0
        if torch.is_tensor(loss) and not bool(torch.isfinite(loss).all()):
            local |= 1
        if not self.local_grads_finite():
            local |= 2
        ranks = self.topology.ranks
        codes = torch.zeros(len(ranks), dtype=torch.float32, device=self.loss_device)
        codes[self.topology.rank] = local
        if len(ranks) > 1:
            dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=self.topology.plan_group)
        return {self.topology.to_global(r): int(c) for r, c in enumerate(codes.tolist()) if c}

    def sync(self) -> None:
        """SUM the gradients across pipelines (collective; :meth:`GradReducer.reduce`)."""
        self.reducer.reduce()

    def discard(self) -> None:
        """Drop this step's gradients everywhere: complete the reductions started during the backward
        (every rank alike, collective), then drop the local and the reduced ones."""
        self.reducer.reduce()
        self.open_window()
        self.reducer.drop_reduced()

    def close_window(self, loss: Any = None) -> dict[int, int]:
        """After the window's last backward: :meth:`nonfinite_ranks`, then :meth:`sync`, or
        :meth:`discard` on every rank alike. Returns the check's answer, empty when the gradients
        are synced and ready for the update (collective)."""
        bad = self.nonfinite_ranks(loss)
        if bad:
            self.discard()
        else:
            self.sync()
        return bad

    # ---- 4. clip --------------------------------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self) -> float:
        """||g|| of the whole model after :meth:`sync`, every element once:
        sqrt(all-reduce_SUM over the plan's ranks of the float64 local shares) (collective)."""
        total = torch.zeros(1, dtype=torch.float64, device=self.loss_device)
        total += self.reducer.grad_norm_sq(total.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.topology.plan_group)
        return float(total.sqrt().item())

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / (||g|| + 1e-6)) (collective); returns ||g||."""
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            self.reducer.scale_grads(coef)
        return norm

    # ---- 5. update ----------------------------------------------------------------------------------
    def update(self, optimizer) -> None:
        """``optimizer.step()``: the reducer's optimizer (:meth:`GradReducer.wrap_optimizer`)."""
        optimizer.step()

    # ---- the phases in a row ------------------------------------------------------------------------
    def run(self, tokens: torch.Tensor, targets: torch.Tensor, optimizer, *, clip_norm: float | None = None,
            nonfinite: str = "stop", before_update: Callable[[], None] | None = None) -> FitStep:
        """One optimizer step on this pipeline's rows (accumulation 1): open, micro-step (last),
        close, ``before_update()`` (Lightning's ``on_before_optimizer_step``), clip, update. A
        non-finite step raises :class:`NonFiniteError` (``nonfinite='stop'``) or skips the update."""
        check_policy(nonfinite)
        self.open_window()
        loss = self.micro_step(tokens, targets, last=True)
        bad = self.close_window(torch.tensor(loss))
        if bad:
            if nonfinite == "stop":
                raise NonFiniteError(f"non-finite loss or gradients on rank(s) {sorted(bad)} (codes {bad}: 1 loss, "
                                     "2 gradients, 3 both); fit_step(nonfinite='stop')")
            return FitStep(loss, None, bad)
        if before_update is not None:
            before_update()
        norm = self.clip(clip_norm) if clip_norm is not None else None
        self.update(optimizer)
        return FitStep(loss, norm, {})


def _then(first, second):
    """``first()`` (if any), then ``second()``."""
    if first is None:
        return second

    def both():
        first()
        second()
    return both
