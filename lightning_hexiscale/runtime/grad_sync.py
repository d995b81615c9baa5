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
``bucket_cap_bytes``; one all-reduce per bucket, issued asynchronously in a global order (sorted
holder tuples) that every rank shares, so the number of collectives depends on the number of holder
sets and bytes, not on the number of parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime.parallelize import StageModule, param_specs, stage_holds
from lightning_hexiscale.runtime.topology import Topology, stage_rank_lists

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
"""25 MiB, DDP's default bucket size."""


@dataclass(frozen=True)
class Segment:
    """A piece of one parameter's gradient that one rank per pipeline holds."""

    name: str
    """Global parameter name."""
    shard_dim: int | None
    """Dim the segment's [start, end) range is along; ``None`` for a replicated parameter (whole)."""
    start: int
    end: int
    ranks: tuple[int, ...]
    """Holder ranks, one per pipeline, sorted ascending (the DP process group)."""


def segment_bounds(ranges: list[list[tuple[int, int]]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Union-of-boundaries segmentation. ``ranges[p]`` = the [start, end) ranges of pipeline p's
    ranks, covering the same [0, n). Returns (start, end, holder index per pipeline) per segment.

    >>> segment_bounds([[(0, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)]])
    [(0, 2, (0, 0)), (2, 3, (1, 1)), (3, 4, (2, 1))]
    """
    cuts = sorted({b for rs in ranges for r in rs for b in r})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        holders = tuple(next(i for i, (s, e) in enumerate(rs) if s <= a < e) for rs in ranges)
        out.append((a, b, holders))
    return out


@functools.lru_cache(maxsize=16)
def sync_segments(plan: Plan, config: LlamaConfig) -> tuple[Segment, ...]:
    """Every gradient segment of the model under ``plan``, in canonical (parameter, start) order.

    Pure and identical on every rank; :func:`lightning_hexiscale.runtime.topology.group_ranks`
    builds the DP process groups from the holder sets.
    """
    stage_ranks = stage_rank_lists(plan)
    segs: list[Segment] = []
    for spec in param_specs(config):
        holders_per_pipe: list[list[int]] = []  # ranks of the stage holding spec, per pipeline
        ranges_per_pipe: list[list[tuple[int, int]]] = []
        for i, pipe in enumerate(plan.pipelines):
            last = len(pipe.stages) - 1
            j = next(j for j, st in enumerate(pipe.stages) if stage_holds(spec, st.layers, j == 0, j == last))
            ranks = stage_ranks[i][j]
            if spec.shard_dim is None:  # replicated: only the leader takes part
                ranks = ranks[:1]
            holders_per_pipe.append(list(ranks))
            ranges_per_pipe.append(spec.ranges(config, len(ranks)) if spec.shard_dim is not None
                                   else [(0, spec.shape[0])])
        for a, b, idx in segment_bounds(ranges_per_pipe):
            ranks = tuple(sorted(holders_per_pipe[p][k] for p, k in enumerate(idx)))
            segs.append(Segment(spec.name, spec.shard_dim, a, b, ranks))
    return tuple(segs)


class GradSynchronizer:
    """Sums gradients across pipelines in place; build once per stage, call :meth:`sync` per step."""

    def __init__(self, stage: StageModule, topology: Topology, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        self.stage, self.topology = stage, topology
        role = topology.role
        self.params = dict(stage.named_parameters())
        shards = stage.shards()
        self.enabled = topology.plan.num_pipelines > 1
        per_group: dict[tuple[int, ...], list[tuple[str, int | None, int, int]]] = {}
        for seg in sync_segments(topology.plan, topology.config):
            if role.rank not in seg.ranks or len(seg.ranks) < 2:
                continue
            local_start = seg.start - shards[seg.name].start if seg.shard_dim is not None else 0
            per_group.setdefault(seg.ranks, []).append((seg.name, seg.shard_dim, local_start, seg.end - seg.start))
        self.dp_buckets = [(ranks, b) for ranks in sorted(per_group)
                           for b in self._pack(per_group[ranks], bucket_cap_bytes)]
        # Replicated params to re-broadcast from the leader within the TP group.
        self.replicated = [n for n, s in shards.items() if s.spec.shard_dim is None] if (
            self.enabled and role.tp > 1) else []
        self.tp_buckets = self._pack([(n, None, 0, 0) for n in self.replicated], bucket_cap_bytes)

    def _pack(self, items: list[tuple[str, int | None, int, int]], cap: int) -> list[list[tuple[str, int | None, int, int]]]:
        """Split items into consecutive buckets of at most ``cap`` bytes (at least one item each)."""
        buckets: list[list] = []
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

    @torch.no_grad()
    def sync(self) -> None:
        """All-reduce(SUM) every segment among its holders, then broadcast replicated grads in TP.

        Collective over the whole world: every rank must call it at the same point of the step.
        """
        if not self.enabled:
            return
        pending = []
        for ranks, items in self.dp_buckets:  # same global order on every rank
            views = [self._view(*it) for it in items]
            flat = torch.cat([v.reshape(-1) for v in views])
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.topology.group(ranks), async_op=True)
            pending.append((work, flat, views))
        self._finish(pending)
        role = self.topology.role
        pending = []
        for items in self.tp_buckets:
            views = [self._view(*it) for it in items]
            flat = torch.cat([v.reshape(-1) for v in views])
            work = dist.broadcast(flat, src=role.leader, group=self.topology.tp_group, async_op=True)
            pending.append((work, flat, views))
        self._finish(pending)

    @staticmethod
    def _finish(pending: list) -> None:
        for work, flat, views in pending:
            work.wait()
            offset = 0
            for v in views:
                n = v.numel()
                v.copy_(flat[offset:offset + n].view(v.shape))
                offset += n
