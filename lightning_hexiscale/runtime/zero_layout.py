"""Who owns which element of the gradient and optimizer state under ZeRO-2 / ZeRO-3 (pure data).

Builds on the asymmetric segments of :mod:`lightning_hexiscale.runtime.grad_sync` (paper §3.2): each
segment of a parameter is held by one rank per pipeline, its *holders*. ZeRO shards among exactly
those holders, so it works whatever TP degree each pipeline gives the layer.

Per rank, the segments it holds are grouped by key (holder ranks, unit, kind) and packed, in
canonical parameter order, into flat buckets of at most ``cap`` bytes:

- ``unit``: ``embed``, ``layers.<l>`` or ``head`` (final norm + LM head), so that ZeRO-3 can gather
  one transformer block without touching the others;
- ``kind``: ``"sharded"`` for the TP-sharded matrices of a block (ZeRO-3 shards their parameters),
  ``"whole"`` for the norms and the (vocabulary-parallel) embedding / LM head (ZeRO-3 keeps their
  local tensors whole and treats them as ZeRO-2 does: only gradients and optimizer states are sharded).

Every member of a holder group packs the same segments in the same order, so all members agree on
the layout of each bucket without communicating. A bucket of n elements over k holders is cut into
k chunks of c = ceil(n / k) elements (the flat buffer is zero-padded to k*c); the holder at position
i of the sorted rank tuple owns chunk i, elements [i*c, (i+1)*c). Reduce-scatter gives it the
summed gradient of its chunk; it alone keeps the optimizer state of those c elements, so the
optimizer state per rank is (bytes per element * n / k): the 1/N_dp of Appendix B's ZeRO terms with
N_dp = number of pipelines.

Example (grad_sync's q_proj with 4 KV heads, unit u): pipeline A TP 3, pipeline B TP 2 -> segments
[0,2u) on {a0,b0}, [2u,3u) on {a1,b1}, [3u,4u) on {a2,b1}; b1 has two buckets for this parameter
(groups {a1,b1} and {a2,b1}) and owns the second half of each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_hexiscale.runtime.parallelize import LocalShard
from lightning_hexiscale.runtime.topology import Segment

@dataclass(frozen=True)
class Item:
    """One segment of one local parameter inside a bucket."""

    name: str
    """Global parameter name."""
    dim: int | None
    """Dim of the local tensor the segment is a range of; ``None``: the whole (replicated) tensor."""
    start: int
    """Start of the range in the LOCAL tensor along ``dim`` (0 when ``dim`` is None)."""
    length: int
    """Length of the range along ``dim`` (the full first dim when ``dim`` is None)."""
    numel: int
    """Elements of the segment: length * (product of the other local dims)."""
    global_start: int = 0
    """Start of the segment in the FULL parameter (equal on every holder; orders buckets alike)."""


@dataclass
class Bucket:
    """A flat buffer of segments shared by one holder group; this rank owns chunk ``index``."""

    ranks: tuple[int, ...]
    """Holder ranks, sorted (the process group; position = group rank)."""
    unit: str
    kind: str
    """``"sharded"`` or ``"whole"`` (see the module doc)."""
    items: list[Item]
    index: int
    """This rank's position in ``ranks``: it owns elements [index * chunk, (index + 1) * chunk)."""
    offsets: list[int] = field(default_factory=list)
    """Start of each item in the flat buffer."""

    def __post_init__(self) -> None:
        self.offsets = []
        off = 0
        for it in self.items:
            self.offsets.append(off)
            off += it.numel

    @property
    def numel(self) -> int:
        """n: real elements (without padding)."""
        return sum(it.numel for it in self.items)

    @property
    def k(self) -> int:
        return len(self.ranks)

    @property
    def chunk(self) -> int:
        """c = ceil(n / k) elements per holder."""
        return max(1, math.ceil(self.numel / self.k))

    @property
    def padded(self) -> int:
        """k * c: the flat buffer's length, n plus zero padding."""
        return self.chunk * self.k

    def owned_items(self) -> list[tuple[int, int, int]]:
        """(item index, start, end) in CHUNK coordinates of each item overlapping this rank's chunk."""
        lo, hi = self.index * self.chunk, (self.index + 1) * self.chunk
        out = []
        for i, (it, off) in enumerate(zip(self.items, self.offsets)):
            a, b = max(lo, off), min(hi, off + it.numel)
            if a < b:
                out.append((i, a - lo, b - lo))
        return out


def unit_of(name: str) -> str:
    """``embed``, ``layers.<l>`` or ``head`` for a global parameter name."""
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    return "embed" if name.startswith("embed.") else "head"


def _local_numel(shard: LocalShard, dim: int | None, length: int) -> int:
    shape = list(shard.spec.shape)
    if shard.spec.shard_dim is not None:
        shape[shard.spec.shard_dim] = shard.end - shard.start
    if dim is not None:
        shape[dim] = length
    return math.prod(shape)


def build_buckets(segments: Sequence[Segment], rank: int, shards: dict[str, LocalShard],
                  element_size: int, cap_bytes: int) -> list[Bucket]:
    """This rank's buckets, in ONE global order (equal on every member of each bucket's group).

    ``segments``: the plan's gradient segments (``Topology.segments``, or
    :func:`~lightning_hexiscale.runtime.topology.sync_segments` of the plan and model).

    ``shards``: this rank's local pieces (``StageModule.shards()``). Order: by canonical position of
    the first parameter, descending
    (the order backward finishes gradients), then by holder ranks: every rank's list is then a
    subsequence of one global order, so collectives issued in list order cannot deadlock.
    """
    position: dict[str, int] = {}
    per_key: dict[tuple, list[Item]] = {}
    for seg in segments:
        position.setdefault(seg.name, len(position))  # canonical index: same on every rank
        if rank not in seg.ranks:
            continue
        shard = shards[seg.name]
        if seg.shard_dim is None:
            item = Item(seg.name, None, 0, seg.end - seg.start, _local_numel(shard, None, 0), 0)
        else:
            item = Item(seg.name, seg.shard_dim, seg.start - shard.start, seg.end - seg.start,
                        _local_numel(shard, seg.shard_dim, seg.end - seg.start), seg.start)
        # ZeRO-3 shards (and gathers around each use) only the blocks' matrices; the embedding and
        # LM head stay whole in their local (vocabulary) shape, like the norms.
        kind = "sharded" if seg.shard_dim is not None and seg.name.startswith("layers.") else "whole"
        per_key.setdefault((seg.ranks, unit_of(seg.name), kind), []).append(item)
    buckets: list[Bucket] = []
    for (ranks, unit, kind), items in per_key.items():
        current: list[Item] = []
        size = 0
        for it in items:
            if current and size + it.numel * element_size > cap_bytes:
                buckets.append(Bucket(ranks, unit, kind, current, ranks.index(rank)))
                current, size = [], 0
            current.append(it)
            size += it.numel * element_size
        buckets.append(Bucket(ranks, unit, kind, current, ranks.index(rank)))
    return sorted(buckets, key=lambda b: (-position[b.items[0].name], -b.items[0].global_start, b.kind, b.ranks))


def chunk_runs(bucket: Bucket, group_of: dict[str, int]) -> list[tuple[int, int, int]]:
    """Partition of this rank's chunk [0, c) into runs (start, end, optimizer param group) of
    consecutive elements whose parameters share a param group. Padding joins the run before it
    (or takes the group of the bucket's last item), so every chunk has at least one run: all
    holders then keep optimizer state of the same keys, which the checkpoint gather relies on."""
    runs: list[list[int]] = []
    for i, a, b in bucket.owned_items():
        g = group_of[bucket.items[i].name]
        if runs and runs[-1][2] == g and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b, g])
    if not runs:
        runs.append([0, bucket.chunk, group_of[bucket.items[-1].name]])
    runs[0][0] = 0
    runs[-1][1] = bucket.chunk
    return [tuple(r) for r in runs]
