"""PipelineEngine: one rank's whole runtime for a Plan (no Lightning here).

Per training step on a global batch of G sequences (G = plan.global_batch):

1. pipeline i takes the samples [offset_i, offset_i + b_i) (offset_i = b_0 + ... + b_(i-1)); every
   rank of the pipeline takes the same samples (the first stage needs the tokens, the last the
   targets; the others need only the shapes);
2. the schedule runs its micro-batches, each loss weighted by micro_batch_size / G, accumulating
   gradients into the local shards;
3. the asymmetric gradient synchroniser SUMs gradients across pipelines -> global-mean gradients;
4. the global-mean loss is all-reduced to every rank.

Afterwards ``optimizer.step()`` on :meth:`PipelineEngine.parameters` with any element-wise torch
optimizer (SGD, AdamW) keeps every copy of every parameter element identical across ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime.grad_sync import DEFAULT_BUCKET_CAP_BYTES, GradSynchronizer
from lightning_hexiscale.runtime.parallelize import build_stage, load_full_state_dict, local_shards
from lightning_hexiscale.runtime.schedule import PipelineExecutor, global_loss
from lightning_hexiscale.runtime.topology import Topology


class PipelineEngine:
    """Builds this rank's stage of ``plan`` and trains it step by step.

    Construction is collective (it creates every process group): all ranks construct their engine
    for the same plan at the same time. ``torch.distributed`` must already be initialised with
    ``plan.world_size`` processes.

    Args:
        plan: the execution plan (validated against ``model_config`` here).
        model_config: the LLaMA shapes.
        rank: global rank (default: ``dist.get_rank()``).
        seed: weight init seed (ignored when ``state_dict`` is given).
        device / dtype: where and in which dtype the local parameters live.
        autocast_dtype: e.g. ``torch.bfloat16`` to run forward under autocast; ``None`` = off.
        state_dict: optional full (global-name) state dict to load instead of initialising.
        bucket_cap_bytes: gradient-sync bucket size.
    """

    def __init__(self, plan: Plan, model_config: LlamaConfig, rank: int | None = None, *, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 autocast_dtype: torch.dtype | None = None, state_dict: dict[str, torch.Tensor] | None = None,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        plan.validate(model=model_config)
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
        self.executor = PipelineExecutor(self.stage, self.topology, plan.schedule, autocast_dtype)
        self.grad_sync = GradSynchronizer(self.stage, self.topology, bucket_cap_bytes)

    def parameters(self):
        """This rank's local parameters (shards), for the optimizer."""
        return self.stage.parameters()

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
        pipeline_loss = self.executor.run(tok, tgt, self.loss_scale * loss_scale_factor,
                                          self.grad_sync.arm if sync_grads else None)
        if sync_grads:
            self.grad_sync.sync()
        return global_loss(pipeline_loss, self.role, self._loss_device())

    def _loss_device(self) -> torch.device:
        # NCCL reduces only CUDA tensors; gloo only CPU ones.
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def local_shards(self) -> dict[str, tuple[torch.Tensor, int | None, int, int]]:
        """Global name -> (local tensor, shard dim, start, end) of this rank's parameters."""
        return local_shards(self.stage)
