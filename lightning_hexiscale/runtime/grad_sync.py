"""Asymmetric data-parallel gradient synchronisation across pipelines with different TP degrees.

Every pipeline holds every parameter once: a layer's parameter lives on the TP group of the stage
that runs the layer, each rank holding a [start, end) range along the sharded dim (or the whole
tensor when replicated). Pipelines split the same parameter at different boundaries (TP 2 vs TP 3,
uneven head splits), so plain DDP, which all-reduces equal tensors, cannot be used.

Rule (the paper's §3.2 "chunks of the smallest gradient size", generalised to uneven splits):
for each parameter, take the union of all pipelines' shard boundaries; between two consecutive
boundaries lies a *segment* that every pipeline holds on exactly one rank. Each segment is
SUM-all-reduced among those holder ranks (one per pipeline). Pipelines weighted their losses by
micro_batch / global_batch, so the SUM is the global-mean gradient.

Example: q_proj with 4 KV heads (unit u = g*d rows per KV head), pipeline A TP 3 -> rows
[0,2u) [2u,3u) [3u,4u) on ranks a0 a1 a2, pipeline B TP 2 -> [0,2u) [2u,4u) on b0 b1. Boundaries
{0, 2u, 3u, 4u}: segments [0,2u) on {a0,b0}, [2u,3u) on {a1,b1}, [3u,4u) on {a2,b1}.

Replicated parameters (norm weights, embedding, LM head): only the stage leader (TP rank 0) takes
part in the all-reduce, then broadcasts the sum within its TP group. This is exact because the
Megatron f/g placement makes their gradients identical on all ranks of a TP group before the sync.

Communication volume: segments with the same holder set are packed into flat buckets of at most
``bucket_cap_bytes``; one asynchronous all-reduce per bucket, so the number of collectives depends
on the number of holder sets and bytes, not on the number of parameters. Buckets start during the
last micro-batch's backward as their gradients become final (see :class:`GradSynchronizer`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime.parallelize import StageModule, param_specs, stage_holds
from lightning_hexiscale.runtime.topology import Topology, sync_segments

DEFAULT_BUCKET_CAP_BYTES = 4 * 2**20
"""4 MiB. Smaller than DDP's 25 MiB so that several buckets overlap with the last backward even for
small stages; a gloo all-reduce costs ~0.14 ms of latency against ~18 ms per 4 MB on 8 ranks
(NOTES), so the extra collectives cost little."""


Item = tuple[str, int | None, int, int]
"""(parameter name, shard dim or None, start in the LOCAL tensor along that dim, length)."""


class GradSynchronizer:
    """Sums gradients across pipelines in place; build once per stage, call :meth:`sync` per step.

    Overlap with backward: :meth:`arm` (called right before the last micro-batch's backward)
    registers post-accumulate-grad hooks; a bucket's all-reduce starts as soon as all its
    gradients are final AND all buckets before it in :attr:`dp_buckets` have started. That list is
    in one global order (reverse parameter order, the order backward produces gradients), so every
    rank issues its collectives consistently with it whatever its stage layout. :meth:`sync` starts
    what is left, waits, and writes the sums back; it works with or without :meth:`arm`.
    """

    def __init__(self, stage: StageModule, topology: Topology, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        self.stage, self.topology = stage, topology
        role = topology.role
        self.params = dict(stage.named_parameters())
        self._shards = shards = stage.shards()
        self.enabled = topology.plan.num_pipelines > 1
        per_group: dict[tuple[int, ...], list[Item]] = {}
        for seg in sync_segments(topology.plan, topology.config):
            if role.rank not in seg.ranks or len(seg.ranks) < 2:
                continue
            local_start = seg.start - shards[seg.name].start if seg.shard_dim is not None else 0
            per_group.setdefault(seg.ranks, []).append((seg.name, seg.shard_dim, local_start, seg.end - seg.start))
        # Pack each group's items in reverse canonical order (the order backward finishes them), then
        # order ALL buckets by a key every member computes alike: (canonical position of the bucket's
        # first item, descending; holder ranks). Each rank starts its buckets as a prefix of that
        # order, so all ranks issue their collectives consistently with one global order: safe for
        # communicators that must not interleave (NCCL) and deadlock-free.
        self._position = {spec.name: i for i, spec in enumerate(param_specs(topology.config))}
        buckets = [(ranks, b) for ranks in per_group for b in self._pack(per_group[ranks][::-1], bucket_cap_bytes)]
        self.dp_buckets: list[tuple[tuple[int, ...], list[Item]]] = sorted(buckets, key=self._order_key)
        self._param_buckets: dict[str, list[int]] = {}
        for i, (_, items) in enumerate(self.dp_buckets):
            for name in {it[0] for it in items}:
                self._param_buckets.setdefault(name, []).append(i)
        # Replicated params to re-broadcast from the leader within the TP group.
        self.replicated = [n for n, s in shards.items() if s.spec.shard_dim is None] if (
            self.enabled and role.tp > 1) else []
        self.tp_buckets = self._pack([(n, None, 0, 0) for n in self.replicated], bucket_cap_bytes)
        self._hooks: list = []
        self.overlapped_buckets = 0
        """Diagnostics: buckets of the last :meth:`sync` that started during backward."""
        self._reset()

    def _order_key(self, bucket: tuple[tuple[int, ...], list[Item]]) -> tuple:
        """(-canonical index of the first item's parameter, -its GLOBAL start, holder ranks): equal on
        every member of the bucket's group, because the members pack the same items alike."""
        ranks, items = bucket
        name, dim, local_start, _ = items[0]
        global_start = local_start + (self._shards[name].start if dim is not None else 0)
        return (-self._position[name], -global_start, ranks)

    def _reset(self) -> None:
        self._missing = [len({it[0] for it in items}) for _, items in self.dp_buckets]
        self._started: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self._ready: set[int] = set()

    def _pack(self, items: list[Item], cap: int) -> list[list[Item]]:
        """Split items into consecutive buckets of at most ``cap`` bytes (at least one item each)."""
        buckets: list[list[Item]] = []
        size = cap
        for item in items:
            p = self.params[item[0]]
            n = (p.numel() if item[1] is None else p.numel() // p.shape[item[1]] * item[3]) * p.element_size()
            if size + n > cap or not buckets:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += n
        return buckets

    def _view(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad if dim is None else p.grad.narrow(dim, start, length)

    def _flat(self, items: list[Item]) -> torch.Tensor:
        return torch.cat([self._view(*it).reshape(-1) for it in items])

    # ---- overlap with the last backward ----------------------------------------------------
    def arm(self) -> None:
        """Start bucket all-reduces from gradient hooks during the next backward (the step's last)."""
        if not self.enabled or self._hooks:
            return
        self._reset()
        for name in self._param_buckets:
            self._hooks.append(self.params[name].register_post_accumulate_grad_hook(
                lambda _p, name=name: self._on_grad_ready(name)))

    @torch.no_grad()
    def _on_grad_ready(self, name: str) -> None:
        for b in self._param_buckets[name]:
            self._missing[b] -= 1
            if self._missing[b] == 0:
                self._ready.add(b)
        self._start_in_order(only_ready=True)

    def _start_in_order(self, only_ready: bool) -> None:
        """Start buckets in list order; with ``only_ready`` stop at the first bucket whose
        gradients are not all final yet (later ones wait, to keep the global order)."""
        for i, (ranks, items) in enumerate(self.dp_buckets):
            if i in self._started:
                continue
            if only_ready and i not in self._ready:
                return
            flat = self._flat(items)
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.topology.group(ranks), async_op=True)
            self._started[i] = (work, flat)

    # ---- the synchronisation -----------------------------------------------------------------
    @torch.no_grad()
    def sync(self) -> None:
        """All-reduce(SUM) every segment among its holders, then broadcast replicated grads in TP.

        Collective over the whole world: every rank must call it at the same point of the step.
        """
        if not self.enabled:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.overlapped_buckets = len(self._started)
        self._start_in_order(only_ready=False)
        for i, (work, flat) in sorted(self._started.items()):
            work.wait()
            self._unflatten(flat, self.dp_buckets[i][1])
        self._reset()
        role = self.topology.role
        pending = []
        for items in self.tp_buckets:
            flat = self._flat(items)
            pending.append((dist.broadcast(flat, src=role.leader, group=self.topology.tp_group, async_op=True),
                            flat, items))
        for work, flat, items in pending:
            work.wait()
            self._unflatten(flat, items)

    def _unflatten(self, flat: torch.Tensor, items: list[Item]) -> None:
        offset = 0
        for it in items:
            v = self._view(*it)
            v.copy_(flat[offset:offset + v.numel()].view(v.shape))
            offset += v.numel()
