"""PipelineEngine: one rank's whole runtime for a Plan (no Lightning here).

Per training step on a global batch of G sequences (G = plan.global_batch), pipeline i takes the
samples [offset_i, offset_i + b_i) (offset_i = b_0 + ... + b_(i-1); every rank of the pipeline takes
the same samples) and runs the phases of :class:`~lightning_hexiscale.runtime.step.Step`
(:attr:`PipelineEngine.step`): open the accumulation window, micro-steps (the schedule's forward and
backward, each micro-batch's loss weighted by micro_batch_size / G), close the window (non-finite
check, then the SUM across pipelines -> global-mean gradients, or discard), clip, update.
:meth:`PipelineEngine.fit_step` is those phases in a row; ``Trainer.fit`` calls the same ones.

The data-parallel flavour (``plan.dp_sharding``: ddp, zero2, zero3) is chosen once, here, as a
:class:`~lightning_hexiscale.runtime.reducers.GradReducer`; ``opt = engine.wrap_optimizer(torch_opt)``
is the optimizer that applies its gradients (the same loop runs all three). Tied embeddings across
stages are kept equal by :mod:`.tied_embeddings`, inside the reducer's phases.
"""

from __future__ import annotations

import torch

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.comm_order import check_exchanges
from lightning_hexiscale.runtime.fast_path import apply_fast_path, fuse_adam
from lightning_hexiscale.runtime.forward_only import eval_loss, eval_loss_and_rows, predict_logits
from lightning_hexiscale.runtime.grad_sync import DEFAULT_BUCKET_CAP_BYTES, GradSynchronizer
from lightning_hexiscale.runtime.parallelize import build_stage, load_full_state_dict, local_shards
from lightning_hexiscale.runtime.reducers import GradReducer, build_reducer, gathers_parameters
from lightning_hexiscale.runtime.schedule import PipelineExecutor, wire_dtype
from lightning_hexiscale.runtime.step import FitStep, Step, check_policy, reduction_device
from lightning_hexiscale.runtime.tied_embeddings import TiedEmbeddingSync, needs_tied_sync
from lightning_hexiscale.runtime.topology import Topology
from lightning_hexiscale.runtime.zero import ShardedOptimizer, ZeroSharder
from lightning_hexiscale.runtime.zero3 import Zero3Gatherer

REDUCE_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""``plan.reduce_dtype`` -> torch dtype."""


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
        # recomputation is per pipeline (a roomy pipeline runs without it beside a tight one that
        # recomputes); it changes no collective, only when this rank's forwards run
        recompute = plan.pipelines[role.pipeline].recompute
        self.stage = build_stage(model, role.layers, role.is_first, role.is_last, role.tp, role.tp_rank,
                                 self.topology.tp_group, device=self.device, dtype=dtype,
                                 recompute=recompute, seed=None if state_dict is not None else seed)
        if state_dict is not None:
            load_full_state_dict(self.stage, state_dict)
        mixed = wire_dtype(dtype, autocast_dtype) != dtype
        self.fast_path_settings = FastPath.coerce(fast_path).resolve(self.device.type, mixed, plan.dp_sharding,
                                                                      recompute)
        self.fast_path, self.main_grads = apply_fast_path(
            self.stage, self.fast_path_settings, compute_dtype=autocast_dtype if mixed else dtype,
            zero3=gathers_parameters(plan.dp_sharding), mixed=mixed)
        executor = PipelineExecutor(self.stage, self.topology, plan.schedule, autocast_dtype)
        if self.main_grads is not None:
            # the weights' compute copies: cast before the step's first forward, freed after its last backward
            executor.before_run, executor.after_run = self.main_grads.refresh, self.main_grads.release
        self.sharding = plan.dp_sharding
        # Bytes on the wire = bytes the cost model prices: activations and gathered parameters in the
        # autocast dtype under mixed precision, gradients summed in the plan's reduce_dtype.
        self.wire_dtype = wire_dtype(dtype, autocast_dtype)
        self.reduce_dtype = REDUCE_TORCH_DTYPES[plan.reduce_dtype] if plan.reduce_dtype else self.wire_dtype
        self.tied: TiedEmbeddingSync | None = None
        if needs_tied_sync(plan, model_config):  # collective: every rank constructs it
            self.tied = TiedEmbeddingSync(self.stage, self.topology, self.loss_device)
        # The flavour is chosen once, here; nothing after this line asks which it is.
        self.reducer: GradReducer = build_reducer(
            plan.dp_sharding, self.stage, self.topology, self.tied, bucket_cap_bytes=bucket_cap_bytes,
            reduce_dtype=self.reduce_dtype, wire_dtype=self.wire_dtype, executor=executor)
        self.step = Step(self.stage, self.topology, executor, self.reducer, self.main_grads, self.device,
                         role.micro_batch_size / plan.global_batch)
        """The step's phases (:class:`~lightning_hexiscale.runtime.step.Step`): what a trainer calls."""

    def parameters(self):
        """This rank's local parameters (shards), for the optimizer. Under ZeRO-3 a block's are empty
        tensors between uses: choose param groups by shape inside :meth:`full_params` (as the
        Lightning strategy runs ``configure_optimizers``)."""
        return self.stage.parameters()

    def wrap_optimizer(self, optimizer):
        """The optimizer to step after the window closes (:meth:`GradReducer.wrap_optimizer`):
        ``optimizer`` itself under ddp, else a :class:`ShardedOptimizer` of its class and
        hyper-parameters over this rank's chunks. With the fast path's ``fused_adamw``, a torch Adam /
        AdamW gets ``fused=True`` first (:meth:`prepare_optimizer`)."""
        self.prepare_optimizer(optimizer)
        return self.reducer.wrap_optimizer(optimizer)

    def prepare_optimizer(self, optimizer) -> bool:
        """Fused Adam / AdamW where the fast path asks for it and the device has the kernel
        (:func:`~lightning_hexiscale.runtime.fast_path.fuse_adam`); whether it is fused now."""
        fused = self.fast_path_settings.fused_adamw and fuse_adam(optimizer, self.device)
        return fused or bool(optimizer.param_groups and optimizer.param_groups[0].get("fused"))

    def full_params(self, gather: bool = True, writeback: bool = False):
        """Context with every local parameter whole and exact: ZeRO-3 gathers the blocks, mixed-
        precision ZeRO the float32 masters (a no-op otherwise); see :meth:`Zero3Gatherer.full_params`.
        Collective when it gathers."""
        return self.reducer.full_params(gather, writeback)

    @property
    def loss_scale(self) -> float:
        """Weight of one micro-batch's mean loss: micro_batch_size / global_batch."""
        return self.step.loss_scale

    @property
    def loss_device(self) -> torch.device:
        """Device of tensors reduced with the world group: NCCL reduces only CUDA tensors, gloo only CPU ones."""
        return reduction_device(self.device)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Refuse input sequences longer than the model's ``seq_len`` S, before any communication:
        the stage was built and the plan priced for S positions (activation memory grows with the
        sequence, attention's time with its square), so rows of 4 S trained "fine" on a CPU and would
        run out of memory on a GPU the plan said they fit. Shorter sequences cost less than priced: they pass."""
        s = self.config.seq_len
        if tokens.dim() >= 2 and tokens.shape[1] > s:
            n = int(tokens.shape[1])
            raise ConfigError("model.seq_len", s, f"the batch holds sequences of {n} input tokens (rows of {n + 1} with "
                              f"the shifted targets), longer than the model and its plan were built for: memory and "
                              f"step time are priced for {s}",
                              f"give rows of at most {s + 1} tokens (seq_len + 1), or build the model for {n}: "
                              f"model.seq_len={n} in the recipe, LlamaConfig(..., seq_len={n}) in Python, then plan again")

    def local_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This pipeline's rows [offset_i, offset_i + b_i) of a global-batch tensor."""
        self.check_tokens(tokens)
        if tokens.shape[0] != self.plan.global_batch:
            raise ConfigError("train.global_batch", tokens.shape[0],
                              f"the plan's pipelines take {[p.batch_size for p in self.plan.pipelines]} samples, "
                              f"{self.plan.global_batch} in all",
                              f"pass batches of {self.plan.global_batch} sequences or re-plan")
        return tokens[self.role.batch_offset:self.role.batch_offset + self.role.batch_size]

    def fit_step(self, tokens: torch.Tensor, targets: torch.Tensor, optimizer, *, clip_norm: float | None = None,
                 nonfinite: str = "stop", before_update=None) -> FitStep:
        """One optimizer step on a global batch (G, S), as ``Trainer.fit`` runs it under the strategy
        with ``accumulate_grad_batches=1``: :meth:`Step.run` on this pipeline's rows, the phases the
        strategy's hooks call (``tests/lightning/test_fit_step_trace.py`` compares the traces;
        ``tests/runtime/test_fit_step.py`` checks it against one process).

        ``optimizer`` is :meth:`wrap_optimizer`'s; ``clip_norm`` the Trainer's ``gradient_clip_val``;
        ``before_update()`` runs where Lightning's ``on_before_optimizer_step`` does (e.g. a timer). A
        non-finite step raises :class:`~lightning_hexiscale.errors.NonFiniteError` with
        ``nonfinite='stop'``; with ``'skip'`` its gradients are dropped and the update skipped.
        Calibration and the benchmarks time this call, so that they time the step users train with."""
        check_policy(nonfinite)  # before anything is cut or communicated
        return self.step.run(self.local_batch(tokens), self.local_batch(targets), optimizer, clip_norm=clip_norm,
                             nonfinite=nonfinite, before_update=before_update)

    def local_shards(self) -> dict[str, tuple[torch.Tensor, int | None, int, int]]:
        """Global name -> (local tensor, shard dim, start, end) of this rank's parameters
        (collective under ZeRO-3, which gathers the blocks to copy them)."""
        with self.full_params():
            return {k: (t.clone(), d, s, e) for k, (t, d, s, e) in local_shards(self.stage).items()}

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Global mean token loss of this pipeline's rows and every other pipeline's, forward only
        (collective; :func:`~lightning_hexiscale.runtime.forward_only.eval_loss`)."""
        self.check_tokens(tokens)
        return eval_loss(self, tokens, targets)

    def eval_loss_and_rows(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """:meth:`eval_loss` and the sequences of the world's batch it is the mean of (the same
        all-reduce; a trainer weighs the loss by them when it averages over batches)."""
        self.check_tokens(tokens)
        return eval_loss_and_rows(self, tokens, targets)

    def predict_logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The whole batch's logits on plan rank 0, None elsewhere (collective;
        :func:`~lightning_hexiscale.runtime.forward_only.predict_logits`)."""
        self.check_tokens(tokens)
        return predict_logits(self, tokens)

    @property
    def executor(self) -> PipelineExecutor:
        """The schedule's executor, the step's (forward-only walks use it too)."""
        return self.step.executor

    @executor.setter
    def executor(self, executor: PipelineExecutor) -> None:
        self.step.executor = executor  # one executor: the step runs what the engine holds

    # ---- the reducer's parts, for the runtime's checkpoints and the tests (None where absent) ----
    @property
    def grad_sync(self) -> GradSynchronizer | None:
        return self.reducer.sync

    @property
    def zero(self) -> ZeroSharder | None:
        return self.reducer.sharder

    @property
    def zero3(self) -> Zero3Gatherer | None:
        return self.reducer.gatherer

    @property
    def sharded_optimizer(self) -> ShardedOptimizer | None:
        return self.reducer.optimizer
