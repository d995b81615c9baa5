"""PipelineEngine: one rank's whole runtime for a Plan (no Lightning here).

Per training step on a global batch of G sequences (G = plan.global_batch):

1. pipeline i takes the samples [offset_i, offset_i + b_i) (offset_i = b_0 + ... + b_(i-1)); every
   rank of the pipeline takes the same samples (the first stage needs the tokens, the last the
   targets; the others need only the shapes);
2. the schedule runs its micro-batches, each loss weighted by micro_batch_size / G, accumulating
   gradients into the local shards;
3. the asymmetric gradient synchroniser SUMs gradients across pipelines -> global-mean gradients;
4. the global-mean loss is all-reduced to every rank.

Step 3 overlaps the last micro-batch's backward (ddp and ZeRO-2): its buckets start at block
boundaries of that backward, in one bucket order shared by every member (``run_pipeline(arm=True)``,
:class:`~lightning_hexiscale.runtime.grad_sync.BoundaryStarts`); :meth:`sync_grads` starts the rest
and waits.

Afterwards ``optimizer.step()`` on :meth:`PipelineEngine.parameters` with any element-wise torch
optimizer (SGD, AdamW) keeps every copy of every parameter element identical across ranks.

``plan.dp_sharding`` = ``zero2`` / ``zero3``: step 3 is a reduce-scatter among each segment's
holders and the optimizer must be wrapped, ``opt = engine.wrap_optimizer(torch_optimizer)``, so
that it steps only this rank's chunks and all-gathers the parameters (:mod:`.zero`); ZeRO-3 also
gathers each block's parameters around its uses (:mod:`.zero3`). ``wrap_optimizer`` returns the
optimizer itself under ``ddp``, so the same loop runs all three.

Tied embeddings (``tie_word_embeddings``) in a pipeline of two or more stages: the last stage's
copy of ``embed.weight`` is kept equal to the first stage's by :mod:`.tied_embeddings`, whose
gradient exchange runs in :meth:`PipelineEngine.sync_grads` before the data-parallel sync. The
embedding's data-parallel buckets start only there, after the exchange (its gradient is complete only
then; its unit is the last of the bucket order, so the others still start during the backward).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.errors import ConfigError, NonFiniteError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime.grad_sync import DEFAULT_BUCKET_CAP_BYTES, GradSynchronizer, finite, squared_norm
from lightning_hexiscale.runtime.parallelize import build_stage, load_full_state_dict, local_shards
from lightning_hexiscale.runtime.comm_order import check_exchanges
from lightning_hexiscale.runtime.fast_path import apply_fast_path, fuse_adam
from lightning_hexiscale.runtime.forward_only import eval_loss, predict_logits
from lightning_hexiscale.runtime.schedule import PipelineExecutor, global_loss, wire_dtype
from lightning_hexiscale.runtime.tied_embeddings import TiedEmbeddingSync, needs_tied_sync
from lightning_hexiscale.runtime.topology import Topology
from lightning_hexiscale.runtime.zero import ShardedOptimizer, ZeroSharder
from lightning_hexiscale.runtime.zero3 import Zero3Gatherer

REDUCE_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""``plan.reduce_dtype`` -> torch dtype."""


@dataclass(frozen=True)
class FitStep:
    """What :meth:`PipelineEngine.fit_step` did."""

    loss: float
    """The global mean loss of the batch (the same on every rank)."""
    grad_norm: float | None
    """||g|| over the whole model before clipping (with ``clip_norm``), else None."""
    nonfinite: dict[int, int]
    """{global rank: code} of a skipped step (:meth:`PipelineEngine.nonfinite_ranks`); empty when applied."""


class PipelineEngine:
    """Builds this rank's stage of ``plan`` and trains it step by step.

    Construction is collective (it creates every process group): all ranks construct their engine
    for the same plan at the same time. ``torch.distributed`` must already be initialised with
    ``plan.world_size`` processes, or one per device of ``plan.launch_order``: then the plan runs on
    the ranks of its used devices (:func:`~lightning_hexiscale.runtime.topology.rank_map`), and a
    rank of an idle device calls :func:`~lightning_hexiscale.runtime.topology.create_groups` instead.

    Args:
        plan: the execution plan (validated against ``model_config`` here).
        model_config: the LLaMA shapes.
        rank: global rank (default: ``dist.get_rank()``).
        seed: weight init seed (ignored when ``state_dict`` is given).
        device / dtype: where and in which dtype the local parameters live.
        autocast_dtype: e.g. ``torch.bfloat16`` to run forward under autocast; ``None`` = off.
        state_dict: optional full (global-name) state dict to load instead of initialising.
        bucket_cap_bytes: gradient-sync (and ZeRO) bucket size.
        fast_path: the stage's speed switches (:class:`~lightning_hexiscale.config.fast_path.FastPath`,
            a mapping of its fields, or None = all auto: everything on, compile on CUDA only, main
            grads under mixed precision except ZeRO-3 and recomputation); :attr:`fast_path` says what runs.
    """

    def __init__(self, plan: Plan, model_config: LlamaConfig, rank: int | None = None, *, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 autocast_dtype: torch.dtype | None = None, state_dict: dict[str, torch.Tensor] | None = None,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, fast_path: FastPath | dict | None = None):
        plan.validate(model=model_config)
        check_exchanges(plan)  # every link's batches pair up (else PlanError, before any communication)
        self.plan, self.config = plan, model_config
        self.device = torch.device(device)
        self.topology = Topology(plan, model_config, rank)
        self.role = role = self.topology.role
        with torch.device("meta"):
            model = Llama(model_config)
        self.stage = build_stage(model, role.layers, role.is_first, role.is_last, role.tp, role.tp_rank,
                                 self.topology.tp_group, device=self.device, dtype=dtype,
                                 recompute=plan.recompute, seed=None if state_dict is not None else seed)
        if state_dict is not None:
            load_full_state_dict(self.stage, state_dict)
        mixed = wire_dtype(dtype, autocast_dtype) != dtype
        self.fast_path_settings = FastPath.coerce(fast_path).resolve(self.device.type, mixed, plan.dp_sharding,
                                                                      plan.recompute)
        self.fast_path, self.main_grads = apply_fast_path(
            self.stage, self.fast_path_settings, compute_dtype=autocast_dtype if mixed else dtype,
            zero3=plan.dp_sharding == "zero3", mixed=mixed)
        self.executor = PipelineExecutor(self.stage, self.topology, plan.schedule, autocast_dtype)
        if self.main_grads is not None:
            # the weights' compute copies: cast before the step's first forward, freed after its last backward
            self.executor.before_run, self.executor.after_run = self.main_grads.refresh, self.main_grads.release
        self.sharding = plan.dp_sharding
        # Bytes on the wire = bytes the cost model prices: activations and gathered parameters in the
        # autocast dtype under mixed precision, gradients summed in the plan's reduce_dtype.
        self.wire_dtype = wire_dtype(dtype, autocast_dtype)
        self.reduce_dtype = REDUCE_TORCH_DTYPES[plan.reduce_dtype] if plan.reduce_dtype else self.wire_dtype
        self.grad_sync: GradSynchronizer | None = None
        self.zero: ZeroSharder | None = None
        self.zero3: Zero3Gatherer | None = None
        self.sharded_optimizer: ShardedOptimizer | None = None
        if self.sharding == "ddp":
            self.grad_sync = GradSynchronizer(self.stage, self.topology, bucket_cap_bytes, self.reduce_dtype)
        else:
            self.zero = ZeroSharder(self.stage, self.topology, self.sharding, bucket_cap_bytes, self.reduce_dtype,
                                    self.wire_dtype)
            if self.sharding == "zero3":
                self.zero3 = Zero3Gatherer(self.zero)
                self.executor.before_exchange = self.zero3.before_exchange
        self.tied: TiedEmbeddingSync | None = None
        if needs_tied_sync(plan, model_config):  # collective: every rank constructs it
            self.tied = TiedEmbeddingSync(self.stage, self.topology, self.loss_device)

    def parameters(self):
        """This rank's local parameters (shards), for the optimizer."""
        return self.stage.parameters()

    def wrap_optimizer(self, optimizer):
        """The optimizer to step after :meth:`train_step`: ``optimizer`` itself under ddp, else a
        :class:`ShardedOptimizer` of its class and hyper-parameters over this rank's chunks. With
        the fast path's ``fused_adamw``, a torch Adam / AdamW gets ``fused=True`` first
        (:meth:`prepare_optimizer`)."""
        self.prepare_optimizer(optimizer)
        if self.zero is None:
            return optimizer
        self.sharded_optimizer = self.zero.attach(optimizer)
        if self.tied is not None:
            return _StepThenTie(self.sharded_optimizer, self.tied)
        return self.sharded_optimizer

    def prepare_optimizer(self, optimizer) -> bool:
        """Fused Adam / AdamW where the fast path asks for it and the device has the kernel
        (:func:`~lightning_hexiscale.runtime.fast_path.fuse_adam`); whether it is fused now."""
        fused = self.fast_path_settings.fused_adamw and fuse_adam(optimizer, self.device)
        return fused or bool(optimizer.param_groups and optimizer.param_groups[0].get("fused"))

    def sync_grads(self) -> None:
        """Sum gradients across pipelines (collective): all-reduce (ddp) or reduce-scatter (zero);
        with tied embeddings across stages, the first/last stage exchange comes first."""
        if self.tied is not None:
            self.tied.sum_grads()
        if self.zero is not None:
            self.zero.reduce_grads()
        else:
            self.grad_sync.sync()
            if self.tied is not None and self.plan.num_pipelines > 1:
                self.tied.after_dp_sync()

    def run_pipeline(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float, arm: bool = False):
        """One schedule run on this pipeline's batch (forward + backward of all micro-batches);
        returns the pipeline's scaled loss (see :meth:`PipelineExecutor.run`). ``arm``: this run's
        gradients are the step's last: start the ddp all-reduces / ZeRO-2 reduce-scatters during its
        last backward (:meth:`sync_grads` waits for them)."""
        # Tied embeddings across stages: the embedding's gradient is final only after the tied
        # exchange in sync_grads; the synchroniser starts the embedding's buckets only in sync()
        # (its unit comes last in the backward), so overlapping the others is safe.
        hook = starts = None
        if arm:
            hook = self.grad_sync.arm if self.grad_sync is not None else self.zero.arm
            starts = self.grad_sync.starts if self.grad_sync is not None else self.zero.starts
        if self.main_grads is not None:  # the compute copies go as their gradients land in the last backward
            hook = _then(hook, self.main_grads.free_after_use)
        if self.zero3 is None:
            loss = self.executor.run(tokens, targets, loss_scale, hook)
        else:
            with self.zero3.training_run():
                loss = self.executor.run(tokens, targets, loss_scale, hook)
        if starts is not None:
            # Every member of a bucket starts it before what follows the backward (the loss
            # all-reduce, the strategy's checks): the early set is the plan's, not the hooks' luck.
            starts.finish()
        return loss

    def full_params(self, gather: bool = True, writeback: bool = False):
        """Context with every local parameter whole and exact: ZeRO-3 gathers the blocks, mixed-
        precision ZeRO the float32 masters (a no-op otherwise); see :meth:`Zero3Gatherer.full_params`.
        Collective when it gathers."""
        if self.zero3 is not None:
            return self.zero3.full_params(gather, writeback)
        if self.zero is not None and self.zero.mixed:
            return self.zero.full_params(gather, writeback)
        return nullcontext()

    def freed_grads_finite(self) -> list[torch.Tensor]:
        """0-d bool tensors: finiteness of local gradients that ZeRO-2 already freed because their
        reduce-scatter started during the backward (a check of ``p.grad`` before :meth:`sync_grads`
        must include these); empty under ddp."""
        return [] if self.zero is None else list(self.zero.freed_finite)

    @torch.no_grad()
    def grad_norm_sq_local(self) -> torch.Tensor | None:
        """Under zero2/zero3 after :meth:`sync_grads`: this rank's share of ||g||^2 (each element
        owned once); ``None`` under ddp (the strategy counts pipeline 0's gradients instead)."""
        return None if self.zero is None else self.zero.grad_norm_sq()

    @property
    def loss_scale(self) -> float:
        """Weight of one micro-batch's mean loss: micro_batch_size / global_batch."""
        return self.role.micro_batch_size / self.plan.global_batch

    def local_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This pipeline's rows [offset_i, offset_i + b_i) of a global-batch tensor."""
        if tokens.shape[0] != self.plan.global_batch:
            raise ConfigError("train.global_batch", tokens.shape[0],
                              f"the plan's pipelines take {[p.batch_size for p in self.plan.pipelines]} samples, "
                              f"{self.plan.global_batch} in all",
                              f"pass batches of {self.plan.global_batch} sequences or re-plan")
        return tokens[self.role.batch_offset:self.role.batch_offset + self.role.batch_size]

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, *, zero_grad: bool = True,
                   sync_grads: bool = True, loss_scale_factor: float = 1.0) -> float:
        """Forward + backward of one global batch (G, S) of tokens and targets; returns the global
        mean loss (same value on every rank).

        With ``zero_grad`` the local grads are reset first; with ``sync_grads`` they are summed
        across pipelines at the end (collective). To accumulate k global batches per optimizer
        step, call with ``zero_grad`` only on the first, ``sync_grads`` only on the last and
        ``loss_scale_factor=1/k`` on all: the gradients are then the mean over the k batches, and
        the returned losses (scaled alike) sum to the mean loss.
        """
        tok, tgt = self.local_batch(tokens), self.local_batch(targets)
        if zero_grad:
            for p in self.stage.parameters():
                p.grad = None
        pipeline_loss = self.run_pipeline(tok, tgt, self.loss_scale * loss_scale_factor, arm=sync_grads)
        if sync_grads:
            self.sync_grads()
        return global_loss(pipeline_loss, self.role, self.loss_device, self.topology.plan_group)

    @property
    def loss_device(self) -> torch.device:
        """Device of tensors reduced with the world group: NCCL reduces only CUDA tensors, gloo only CPU ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def local_shards(self) -> dict[str, tuple[torch.Tensor, int | None, int, int]]:
        """Global name -> (local tensor, shard dim, start, end) of this rank's parameters
        (collective under ZeRO-3, which gathers the blocks to copy them)."""
        with self.full_params():
            return {k: (t.clone(), d, s, e) for k, (t, d, s, e) in local_shards(self.stage).items()}

    # ---- the step's façade for a trainer (the Lightning strategy calls only these) -----------
    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, *, accumulate: int = 1,
                         arm: bool = False) -> float:
        """Forward + backward of THIS pipeline's rows (already cut, unlike :meth:`train_step`), each
        micro-batch's mean loss weighted by ``loss_scale / accumulate``; returns the global sum of
        the weighted losses, i.e. the global mean loss / ``accumulate`` (collective, same float on
        every rank). Gradients accumulate into the local shards; ``arm`` as in :meth:`run_pipeline`."""
        pipeline_loss = self.run_pipeline(tokens, targets, self.loss_scale / accumulate, arm=arm)
        return global_loss(pipeline_loss, self.role, self.loss_device, self.topology.plan_group)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Global mean token loss of this pipeline's rows and every other pipeline's, forward only
        (collective; :func:`~lightning_hexiscale.runtime.forward_only.eval_loss`)."""
        return eval_loss(self, tokens, targets)

    def predict_logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The whole batch's logits on plan rank 0, None elsewhere (collective;
        :func:`~lightning_hexiscale.runtime.forward_only.predict_logits`)."""
        return predict_logits(self, tokens)

    def zero_grad(self) -> None:
        """Drop the local gradients (``p.grad = None`` on every local parameter)."""
        for p in self.stage.parameters():
            p.grad = None

    def discard_grads(self) -> None:
        """Drop this step's gradients everywhere (a skipped step): complete the sync started during
        the backward (every rank alike, collective), then drop the local and the ZeRO-reduced ones."""
        self.sync_grads()
        self.zero_grad()
        if self.zero is not None:
            self.zero.grads = [None] * len(self.zero.grads)

    @torch.no_grad()
    def local_grads_finite(self) -> bool:
        """Are this rank's gradients finite: ``p.grad`` of the local parameters and, before
        :meth:`sync_grads`, those that ZeRO-2 already freed (:meth:`freed_grads_finite`)? Local."""
        flags = [finite(p.grad) for p in self.stage.parameters() if p.grad is not None]
        flags += self.freed_grads_finite()
        return not flags or bool(torch.stack(flags).all())

    @torch.no_grad()
    def nonfinite_ranks(self, loss: Any = None) -> dict[int, int]:
        """The step's non-finite check, after the backward and before :meth:`sync_grads` (which would
        spread one rank's NaN to the other pipelines and hide where it came from): {global rank: code}
        of the ranks whose ``loss`` (a tensor; code 1) or gradients (:meth:`local_grads_finite`;
        code 2; both: 3) are not finite, the same on every rank, empty when all are. Collective: one
        all-reduce over the plan's ranks of a float32 vector of one code per rank, so every rank
        takes the same decision and names the same ranks."""
        local = 0
        if torch.is_tensor(loss) and not bool(torch.isfinite(loss).all()):
            local |= 1
        if not self.local_grads_finite():  # ZeRO-2's gradients already freed by the backward included
            local |= 2
        ranks = self.topology.ranks
        codes = torch.zeros(len(ranks), dtype=torch.float32, device=self.loss_device)
        codes[self.topology.rank] = local
        if len(ranks) > 1:
            dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=self.topology.plan_group)
        return {self.topology.to_global(r): int(c) for r, c in enumerate(codes.tolist()) if c}

    def finish_backward(self, loss: Any = None) -> dict[int, int]:
        """After the step's last backward: the non-finite check (:meth:`nonfinite_ranks`, one
        all-reduce), then the gradient sum across pipelines (:meth:`sync_grads`), or, when any rank's
        loss or gradients are not finite, :meth:`discard_grads` on every rank alike. Returns the
        check's answer, empty when the gradients are synced and ready for the update (collective)."""
        bad = self.nonfinite_ranks(loss)
        if bad:
            self.discard_grads()
        else:
            self.sync_grads()
        return bad

    def fit_step(self, tokens: torch.Tensor, targets: torch.Tensor, optimizer, *, clip_norm: float | None = None,
                 nonfinite: str = "stop", before_update=None) -> FitStep:
        """One optimizer step on a global batch (G, S), as ``Trainer.fit`` runs it under the strategy
        with ``accumulate_grad_batches=1``: the same engine calls in the same order, so the same
        collectives (``tests/strategy/test_fit_step_trace.py`` compares the traces; ``tests/runtime/test_fit_step.py``
        checks it against one process):

        zero_grad -> :meth:`forward_backward` of this pipeline's rows (its last backward starts the
        gradient sync) -> :meth:`finish_backward` (non-finite check, then sync) -> ``before_update()``
        (Lightning's ``on_before_optimizer_step``; e.g. a timer) -> :meth:`clip_grad_norm` when
        ``clip_norm`` is set (the Trainer's ``gradient_clip_val``) -> ``optimizer.step()``.

        ``optimizer`` is :meth:`wrap_optimizer`'s (under ZeRO the sharded one). A non-finite step
        raises :class:`~lightning_hexiscale.errors.NonFiniteError` with ``nonfinite='stop'``; with
        ``'skip'`` its gradients are dropped and the update skipped. Calibration and the benchmarks
        time this call, so that they time the step users train with."""
        if nonfinite not in ("stop", "skip"):
            raise ConfigError("fit_step(nonfinite)", nonfinite, "must be 'stop' or 'skip'",
                              "pass nonfinite='stop' (raise) or nonfinite='skip' (drop the update)")
        self.zero_grad()
        loss = self.forward_backward(self.local_batch(tokens), self.local_batch(targets), arm=True)
        bad = self.finish_backward(torch.tensor(loss))
        if bad:
            if nonfinite == "stop":
                raise NonFiniteError(f"non-finite loss or gradients on rank(s) {sorted(bad)} (codes {bad}: 1 loss, "
                                     "2 gradients, 3 both); fit_step(nonfinite='stop')")
            return FitStep(loss, None, bad)
        if before_update is not None:
            before_update()
        norm = self.clip_grad_norm(clip_norm) if clip_norm is not None else None
        optimizer.step()
        return FitStep(loss, norm, {})

    @torch.no_grad()
    def global_grad_norm(self) -> float:
        """L2 norm of the gradient of the whole model after :meth:`sync_grads`: every element once.

        ddp: pipeline 0 holds every parameter exactly once across its ranks (after the sync all
        pipelines hold the same values); within a TP group replicated tensors count on the leader
        only, a tied embedding on the first stage. ZeRO: each rank's owned chunks.
        ||g|| = sqrt(all-reduce_SUM over the plan's ranks of the float64 local sum(g^2)) (collective).
        """
        role = self.role
        shards = self.stage.shards()
        total = torch.zeros(1, dtype=torch.float64, device=self.loss_device)
        owned = self.grad_norm_sq_local()  # ZeRO: the owned chunks, each element once
        if owned is not None:
            total += owned.to(total.device)
        elif role.pipeline == 0:
            # per-tensor norms accumulated as float64 scalars: no float64 copy of any gradient
            grads = [p.grad.detach() for name, p in self.stage.named_parameters()
                     if p.grad is not None and (shards[name].spec.shard_dim is not None or role.is_leader)
                     and not shards[name].tied_copy]
            total += squared_norm(grads, total.device).to(total.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.topology.plan_group)
        return float(total.sqrt().item())

    @torch.no_grad()
    def scale_grads(self, coef: float) -> None:
        """Multiply the step's gradients by ``coef``: ZeRO's owned chunks, else every ``p.grad``."""
        if self.zero is not None:
            self.zero.scale_grads(coef)
            return
        for p in self.stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global norm as ``torch.nn.utils.clip_grad_norm_`` does on one device: scale
        every gradient by min(1, max_norm / (||g|| + 1e-6)) (collective); returns ||g||."""
        norm = self.global_grad_norm()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            self.scale_grads(coef)
        return norm


def _then(first, second):
    """``first()`` (if any), then ``second()``."""
    if first is None:
        return second

    def both():
        first()
        second()
    return both


class _StepThenTie:
    """The sharded optimizer, followed after each step by the tied-embedding weight copy to the last
    stage (ZeRO steps only the first stage's copy, see :meth:`TiedEmbeddingSync.after_step`)."""

    def __init__(self, sharded: ShardedOptimizer, tied: TiedEmbeddingSync):
        self._sharded, self._tied = sharded, tied

    def step(self, closure=None):
        loss = self._sharded.step(closure)
        self._tied.after_step()
        return loss

    def __getattr__(self, name: str):
        return getattr(self._sharded, name)
