"""The gradient reducer: how a step's gradients are summed across pipelines, clipped and applied.

One interface, :class:`GradReducer`, with the three data-parallel flavours of ``plan.dp_sharding``
behind it; :func:`build_reducer` picks one when the engine is built, and the step
(:class:`~lightning_hexiscale.runtime.step.Step`) never asks which:

- :class:`DDPReducer` (``ddp``): every pipeline holds all of its stage's gradients; one all-reduce
  (SUM) per segment bucket among its holders (:class:`~.grad_sync.GradSynchronizer`), the user's
  optimizer steps every local parameter.
- :class:`ZeroReducer` (``zero2`` / ``zero3``): a reduce-scatter per bucket leaves each holder its
  owned chunk of the summed gradient (:class:`~.zero.ZeroSharder`); a sharded optimizer of the user's
  class steps those chunks and all-gathers the parameters (:class:`~.zero.ShardedOptimizer`). ZeRO-3
  also gathers each block's parameters around its uses (:class:`~.zero3.Zero3Gatherer`).

Pipelines weigh their losses by micro_batch / global_batch, so the SUM is the global-mean gradient.
Tied embeddings across stages: the first/last stage exchange runs before the data-parallel sum; ddp
then copies the summed rows back to the last stage, ZeRO copies the updated weights after each step
(:mod:`.tied_embeddings`). Why an interface: the step is written once, and what differs (which
collective, where the reduced gradient lives, what the optimizer steps) stays in one class per flavour.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
import torch

from lightning_hexiscale.runtime.grad_sync import BoundaryStarts, GradSynchronizer, squared_norm
from lightning_hexiscale.runtime.parallelize import StageModule
from lightning_hexiscale.runtime.schedule import PipelineExecutor
from lightning_hexiscale.runtime.tied_embeddings import TiedEmbeddingSync
from lightning_hexiscale.runtime.topology import Topology
from lightning_hexiscale.runtime.zero import ShardedOptimizer, ZeroSharder
from lightning_hexiscale.runtime.zero3 import Zero3Gatherer


class GradReducer(ABC):
    """What a step needs of the data-parallel flavour. Every method marked collective is entered by
    every rank of the plan at the same point of the step, with the same buckets in the same order."""

    sharding: str
    """``plan.dp_sharding`` of this flavour."""

    def __init__(self, stage: StageModule, topology: Topology, tied: TiedEmbeddingSync | None):
        self.stage, self.topology, self.tied = stage, topology, tied

    # ---- the window's last backward --------------------------------------------------------------
    @property
    @abstractmethod
    def starts(self) -> BoundaryStarts:
        """The bucket starts at block boundaries of the window's last backward (overlap)."""

    @abstractmethod
    def arm(self) -> None:
        """Start this window's reductions during the next backward (the window's last)."""

    def after_last_backward(self) -> None:
        """Start every bucket this rank's members start during the backward that has not started yet:
        the early set is the plan's, not the hooks' timing, before anything else communicates."""
        self.starts.finish()

    def training_run(self) -> AbstractContextManager:
        """Context around one schedule run (forward and backward of every micro-batch)."""
        return nullcontext()

    def freed_finite(self) -> list[torch.Tensor]:
        """0-d bool tensors: finiteness of local gradients already freed by reductions started during
        the backward (a non-finite check before :meth:`reduce` must include them)."""
        return []

    # ---- closing the window -----------------------------------------------------------------------
    @abstractmethod
    def reduce(self) -> None:
        """SUM the gradients across pipelines (collective); the tied exchange comes first."""

    def drop_reduced(self) -> None:
        """Forget the reduced gradients that live outside ``p.grad`` (a skipped step)."""

    # ---- clipping and the update ------------------------------------------------------------------
    @abstractmethod
    def grad_norm_sq(self, device: torch.device) -> torch.Tensor:
        """This rank's share of ||g||^2 after :meth:`reduce`, a float64 scalar on ``device``: summed
        over the plan's ranks, every element of the model's gradient counted once."""

    @abstractmethod
    def scale_grads(self, coef: float) -> None:
        """g := coef * g for every reduced gradient element this rank steps."""

    @abstractmethod
    def wrap_optimizer(self, optimizer) -> object:
        """The optimizer whose ``step()`` applies the reduced gradients (``optimizer`` itself, or
        one that steps this rank's chunks in its place)."""

    def full_params(self, gather: bool = True, writeback: bool = False) -> AbstractContextManager:
        """Context with every local parameter whole and exact (collective when it gathers)."""
        return nullcontext()

    # ---- views for the runtime's checkpoints and the tests ---------------------------------------
    sync: GradSynchronizer | None = None
    """ddp's synchroniser (None under ZeRO)."""
    sharder: ZeroSharder | None = None
    """ZeRO's sharder (None under ddp)."""
    gatherer: Zero3Gatherer | None = None
    """ZeRO-3's block gatherer (None otherwise)."""
    optimizer: ShardedOptimizer | None = None
    """ZeRO's sharded optimizer once :meth:`wrap_optimizer` ran (None under ddp)."""


class DDPReducer(GradReducer):
    """``ddp``: all-reduce(SUM) of every segment among its holders; ``p.grad`` holds the result."""

    sharding = "ddp"

    def __init__(self, stage, topology, tied, bucket_cap_bytes: int, reduce_dtype: torch.dtype):
        super().__init__(stage, topology, tied)
        self.sync = GradSynchronizer(stage, topology, bucket_cap_bytes, reduce_dtype)

    @property
    def starts(self) -> BoundaryStarts:
        return self.sync.starts

    def arm(self) -> None:
        self.sync.arm()

    def reduce(self) -> None:
        if self.tied is not None:
            self.tied.sum_grads()
        self.sync.sync()
        if self.tied is not None and self.topology.plan.num_pipelines > 1:
            self.tied.after_dp_sync()  # the last stage's rows := the first stage's, now summed

    @torch.no_grad()
    def grad_norm_sq(self, device: torch.device) -> torch.Tensor:
        # After the sync every pipeline holds the same values and pipeline 0 holds each element once
        # across its ranks: count it there; in a TP group replicated tensors count on the leader, a
        # tied embedding on the first stage. Per-tensor float64 scalars: no float64 copy of a gradient.
        role = self.topology.role
        if role.pipeline != 0:
            return torch.zeros((), dtype=torch.float64, device=device)
        shards = self.stage.shards()
        grads = [p.grad.detach() for name, p in self.stage.named_parameters()
                 if p.grad is not None and (shards[name].spec.shard_dim is not None or role.is_leader)
                 and not shards[name].tied_copy]
        return squared_norm(grads, device)

    @torch.no_grad()
    def scale_grads(self, coef: float) -> None:
        for p in self.stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)

    def wrap_optimizer(self, optimizer):
        return optimizer


class ZeroReducer(GradReducer):
    """``zero2`` / ``zero3``: reduce-scatter to owned chunks, a sharded optimizer steps them."""

    def __init__(self, stage, topology, tied, sharding: str, bucket_cap_bytes: int, reduce_dtype: torch.dtype,
                 wire_dtype: torch.dtype, executor: PipelineExecutor):
        super().__init__(stage, topology, tied)
        self.sharding = sharding
        self.sharder = ZeroSharder(stage, topology, sharding, bucket_cap_bytes, reduce_dtype, wire_dtype)
        if sharding == "zero3":
            self.gatherer = Zero3Gatherer(self.sharder)
            executor.before_exchange = self.gatherer.before_exchange  # serve the other pipelines' gathers

    @property
    def starts(self) -> BoundaryStarts:
        return self.sharder.starts

    def arm(self) -> None:
        self.sharder.arm()

    def training_run(self) -> AbstractContextManager:
        return self.gatherer.training_run() if self.gatherer is not None else nullcontext()

    def freed_finite(self) -> list[torch.Tensor]:
        return list(self.sharder.freed_finite)

    def reduce(self) -> None:
        if self.tied is not None:
            self.tied.sum_grads()
        self.sharder.reduce_grads()

    def drop_reduced(self) -> None:
        self.sharder.drop_grads()

    def grad_norm_sq(self, device: torch.device) -> torch.Tensor:
        # every element is owned by exactly one rank: the owned chunks, each element once
        return self.sharder.grad_norm_sq().to(device)

    def scale_grads(self, coef: float) -> None:
        self.sharder.scale_grads(coef)

    def wrap_optimizer(self, optimizer):
        # ZeRO steps only the first stage's copy of a tied embedding: the copy to the last stage
        # follows each step (TiedEmbeddingSync.after_step)
        self.optimizer = self.sharder.attach(optimizer, self.tied.after_step if self.tied is not None else None)
        return self.optimizer

    def full_params(self, gather: bool = True, writeback: bool = False) -> AbstractContextManager:
        if self.gatherer is not None:
            return self.gatherer.full_params(gather, writeback)
        if self.sharder.mixed:
            return self.sharder.full_params(gather, writeback)
        return nullcontext()


def gathers_parameters(sharding: str) -> bool:
    """Does the flavour keep a block's parameters only around their uses (ZeRO-3)? Then nothing may
    hold them between uses (the fast path's main-grad compute copies)."""
    return sharding == "zero3"


def build_reducer(sharding: str, stage: StageModule, topology: Topology, tied: TiedEmbeddingSync | None, *,
                  bucket_cap_bytes: int, reduce_dtype: torch.dtype, wire_dtype: torch.dtype,
                  executor: PipelineExecutor) -> GradReducer:
    """The reducer of ``plan.dp_sharding`` (``ddp``, ``zero2`` or ``zero3``); no communication
    (ZeRO-3 frees the block parameters now: they are gathered around their uses from here on)."""
    if sharding == "ddp":
        return DDPReducer(stage, topology, tied, bucket_cap_bytes, reduce_dtype)
    if sharding in ("zero2", "zero3"):
        return ZeroReducer(stage, topology, tied, sharding, bucket_cap_bytes, reduce_dtype, wire_dtype, executor)
    raise ValueError(f"plan.dp_sharding={sharding!r}: must be 'ddp', 'zero2' or 'zero3'")

