"""Plan + global rank -> this rank's role, and every process group the runtime needs.

Rank mapping (from the Plan): *plan rank* i runs device ``plan.device_order[i]``. A stage's ranks
are its devices' plan ranks in the stage's device order; the first is the stage leader. Every pure
function here (roles, segments, links, groups) and every rank a runtime module compares or indexes
(``Topology.rank``, ``Role``, bucket holders, checkpoint layouts) is a plan rank, so a plan's
layout does not depend on where it was launched.

Where it was launched is the **rank map** (:func:`rank_map`): plan rank i runs on global rank
``ranks[i]`` of the default process group. With ``plan.world_size`` processes it is the identity.
With one process per device of ``plan.launch_order`` (used and idle devices, sorted: the launch
convention the Lightning strategy and the emulator share), launch rank r runs ``launch_order[r]``,
so ``ranks[i] = launch_order.index(device_order[i])`` and the ranks of idle devices are in no role.
The map is derived from the plan, not passed in, because a rank IS a device: running device d's work
on the process of another device is the mismatch the plan's device ids exist to prevent.
The translation to global ranks happens only where torch.distributed needs them: the ranks of every
new group, and every p2p peer and broadcast root (:meth:`Topology.to_global`).

Process groups, ALL created once, up front, by EVERY rank, in ONE deterministic order (the sorted
list of rank tuples from :func:`group_ranks`). ``torch.distributed.new_group`` is collective over
the default group: a rank that skipped a group, or created them in another order, would make the
first collective on it hang until the timeout, with no error at creation (the PyTorch docs of
``new_group``: all processes of the main group must enter it, "even if they are not going to be
members of the group", and groups "should be created in the same order in all processes"). The
groups are:

- one TP group per stage with TP degree > 1 (its ranks, leader first in the plan but sorted here);
- one data-parallel group per distinct set of "holder" ranks of a gradient segment
  (:func:`sync_segments`): one rank per pipeline, so only
  when the plan has two or more pipelines;
- one two-rank *link* group per point-to-point link between adjacent stages (:func:`link_pairs`):
  the two stage leaders, or TP rank r of both stages on the scatter/gather path. Pipeline p2p runs
  only on these, always as ``batch_isend_irecv`` calls involving both members, so NCCL's rule "the
  first batched call on a group involves every member" holds by construction, and activation
  traffic never shares a FIFO with any other p2p traffic.

The loss reduction and the tied-embedding exchange use the *plan group*, the plan's ranks: the
default group itself when the plan runs on all of it, else one more group created after the others
(:func:`create_groups`). So no engine collective involves a rank outside the plan, and a rank the
plan leaves idle takes part in nothing but the ``new_group`` calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime.parallelize import param_specs, stage_holds


@dataclass(frozen=True)
class Role:
    """What one plan rank does in a plan. Pure data."""

    rank: int
    """Plan rank (the global rank when the plan runs on the whole process group, :func:`rank_map`)."""
    device: int
    """Cluster device id the rank runs (``plan.device_order[rank]``)."""
    pipeline: int
    """Index of its pipeline (data-parallel replica)."""
    stage: int
    """Index of its stage within the pipeline."""
    num_stages: int
    """Stages of its pipeline."""
    tp_rank: int
    """Position within the stage's TP group (0 = leader)."""
    stage_ranks: tuple[int, ...]
    """Plan ranks of its stage, leader first."""
    prev_stage_ranks: tuple[int, ...]
    """Plan ranks of the previous stage (empty on a first stage)."""
    next_stage_ranks: tuple[int, ...]
    """Plan ranks of the next stage (empty on a last stage)."""
    layers: tuple[int, int]
    """[start, end) of the layers the stage runs."""
    batch_offset: int
    """Derived from the plan: first sample of the global batch this pipeline takes
    (sum of the batch sizes of the pipelines before it)."""
    batch_size: int
    """Samples of the global batch this pipeline takes: [batch_offset, batch_offset + batch_size)."""
    micro_batch_size: int
    """Samples per micro-batch."""

    @property
    def tp(self) -> int:
        return len(self.stage_ranks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def leader(self) -> int:
        return self.stage_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def prev_leader(self) -> int | None:
        return self.prev_stage_ranks[0] if self.prev_stage_ranks else None

    @property
    def next_leader(self) -> int | None:
        return self.next_stage_ranks[0] if self.next_stage_ranks else None

    @property
    def num_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def scatter_gather_prev(self) -> bool:
        """Previous stage has the same TP degree t > 1: peer-to-peer 1/t chunks + all-gather."""
        return self.tp > 1 and len(self.prev_stage_ranks) == self.tp

    @property
    def scatter_gather_next(self) -> bool:
        """Next stage has the same TP degree t > 1 (see :attr:`scatter_gather_prev`)."""
        return self.tp > 1 and len(self.next_stage_ranks) == self.tp

    def link_peer(self, side: str) -> int | None:
        """The rank this rank exchanges pipeline p2p with on ``side`` (``prev`` / ``next``): TP rank
        ``tp_rank`` of that stage on the scatter/gather path, its leader on the leader path (leaders
        only); ``None`` when there is no such stage or this rank is a non-leader on the leader path."""
        ranks = self.prev_stage_ranks if side == "prev" else self.next_stage_ranks
        if not ranks:
            return None
        if self.scatter_gather_prev if side == "prev" else self.scatter_gather_next:
            return ranks[self.tp_rank]
        return ranks[0] if self.is_leader else None


def rank_map(plan: Plan, world: int) -> tuple[int, ...]:
    """Global rank of every plan rank (module doc): the identity when ``world == plan.world_size``,
    ``launch_order.index(device_order[i])`` when ``world == len(plan.launch_order)``; else a PlanError.

    >>> from lightning_hexiscale.planner.plan import Pipeline, Stage
    >>> p = Plan((Pipeline(2, 1, (Stage((2,), (0, 4)),)), Pipeline(2, 1, (Stage((3,), (0, 4)),))), 4, idle_devices=(0, 1))
    >>> rank_map(p, 2), rank_map(p, 4)
    ((0, 1), (2, 3))
    """
    if world == plan.world_size:
        return tuple(range(world))
    launch = plan.launch_order
    if plan.idle_devices and world == len(launch):
        return tuple(launch.index(d) for d in plan.device_order)
    rule = f"the plan needs exactly {plan.world_size} processes (devices {list(plan.device_order)})"
    fix = f"launch {plan.world_size} processes or use a plan for {world} devices"
    if plan.idle_devices:
        rule += (f", or {len(launch)}, one per device of its launch order {list(launch)} "
                 f"(devices {list(plan.idle_devices)} idle)")
        fix = f"launch {plan.world_size} or {len(launch)} processes, or use a plan for {world} devices"
    raise PlanError("world_size", world, rule, fix)


def stage_rank_lists(plan: Plan) -> list[list[tuple[int, ...]]]:
    """[pipeline][stage] -> plan ranks of that stage, leader first."""
    order = {d: r for r, d in enumerate(plan.device_order)}
    return [[tuple(order[d] for d in st.devices) for st in p.stages] for p in plan.pipelines]


def role_of(plan: Plan, rank: int) -> Role:
    """The role of plan rank ``rank`` in ``plan`` (the plan must be valid)."""
    if not 0 <= rank < plan.world_size:
        raise PlanError("rank", rank, f"the plan uses {plan.world_size} ranks (0..{plan.world_size - 1})",
                        "launch exactly plan.world_size processes")
    ranks = stage_rank_lists(plan)
    offset = 0
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            if rank in ranks[i][j]:
                return Role(rank=rank, device=plan.device_order[rank], pipeline=i, stage=j,
                            num_stages=len(pipe.stages), tp_rank=ranks[i][j].index(rank),
                            stage_ranks=ranks[i][j], prev_stage_ranks=ranks[i][j - 1] if j > 0 else (),
                            next_stage_ranks=ranks[i][j + 1] if j + 1 < len(pipe.stages) else (),
                            layers=st.layers, batch_offset=offset, batch_size=pipe.batch_size,
                            micro_batch_size=pipe.micro_batch_size)
        offset += pipe.batch_size
    raise AssertionError(f"rank {rank} is in no stage")  # unreachable for a valid plan


# ---- gradient segments: what the data-parallel groups are made of ------------------------------
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

    Pure and identical on every rank; :func:`group_ranks`
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



def link_pairs(plan: Plan) -> list[tuple[int, int]]:
    """The two-rank p2p links between adjacent stages, sorted: (leader, next leader), or (TP rank r,
    TP rank r of the next stage) for every r when both stages have the same TP degree t > 1."""
    pairs = set()
    for pipe in stage_rank_lists(plan):
        for a, b in zip(pipe, pipe[1:]):
            if len(a) == len(b) > 1:
                pairs.update(tuple(sorted(p)) for p in zip(a, b))
            else:
                pairs.add(tuple(sorted((a[0], b[0]))))
    return sorted(pairs)


def group_ranks(plan: Plan, config: LlamaConfig) -> list[tuple[int, ...]]:
    """Every process group the runtime uses, as sorted rank tuples, in creation order (sorted).

    Pure: the same list on every rank. TP groups of stages with TP > 1, the p2p links between
    adjacent stages, plus the holder sets of the gradient segments (one rank per pipeline) when
    there are two or more pipelines. The three kinds never share a rank tuple (a TP group lies in
    one stage, a link across two stages of one pipeline, a holder set across pipelines).
    """
    wanted: set[tuple[int, ...]] = set(link_pairs(plan))
    for pipe in stage_rank_lists(plan):
        for st in pipe:
            if len(st) > 1:
                wanted.add(tuple(sorted(st)))
    if plan.num_pipelines > 1:
        wanted.update(seg.ranks for seg in sync_segments(plan, config))
    return sorted(wanted)


def create_groups(plan: Plan, config: LlamaConfig, ranks: tuple[int, ...], rank: int | None = None
                  ) -> tuple[dict[tuple[int, ...], dist.ProcessGroup], dist.ProcessGroup | None]:
    """Collective over the default group: EVERY rank of it calls this, in the plan or not, at the
    same point (the ``new_group`` rule, module doc). ``ranks``: the :func:`rank_map`; ``rank``: this
    process's global rank (default ``dist.get_rank()``).

    Creates every group of :func:`group_ranks` (plan-rank tuples, created over their global ranks,
    in the same sorted order everywhere), then the plan group when the plan does not cover the
    whole default group. Returns (plan-rank tuple -> group, for the groups this process is in; the
    plan group, ``dist.group.WORLD`` when the plan covers the default group, None on a rank outside
    the plan). A rank outside the plan keeps nothing.
    """
    me = dist.get_rank() if rank is None else rank
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for key in group_ranks(plan, config):
        members = [ranks[i] for i in key]
        pg = dist.new_group(members)  # collective: every rank, same order
        if me in members:
            groups[key] = pg
    if sorted(ranks) == list(range(dist.get_world_size())):
        return groups, dist.group.WORLD
    pg = dist.new_group(sorted(ranks))  # a separate group even if a DP/TP group has the same ranks
    return groups, pg if me in ranks else None


class Topology:
    """The runtime's one derived view of the Plan for this rank, built once per engine: its
    :class:`Role`, the stages' ranks (:attr:`stage_ranks`), the gradient segments
    (:attr:`segments`), the rank map, and handles to the process groups it belongs to. The gradient
    sync, ZeRO, the tied-embedding exchange and checkpoints read the plan's layout from here rather
    than deriving it again.

    Constructing it is collective: every rank of the default group must, at the same point, either
    construct a Topology of the same plan (a rank of the plan) or call :func:`create_groups` with the
    plan's :func:`rank_map` (a rank the plan leaves idle).

    ``rank``: this process's global rank (default ``dist.get_rank()``). :attr:`rank` is its plan
    rank, :attr:`global_rank` the global one, :attr:`ranks` the whole map.
    """

    def __init__(self, plan: Plan, config: LlamaConfig, rank: int | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Topology needs torch.distributed initialised (init_process_group) first")
        self.ranks = rank_map(plan, dist.get_world_size())
        self.global_rank = dist.get_rank() if rank is None else rank
        if self.global_rank not in self.ranks:
            raise PlanError("rank", self.global_rank,
                            f"the plan runs on global ranks {list(self.ranks)}; the others run devices it "
                            f"leaves idle {list(plan.idle_devices)}",
                            "on a rank the plan leaves idle, call runtime.topology.create_groups(plan, config, "
                            "rank_map(plan, world)) instead of building an engine")
        self.plan, self.config = plan, config
        self.rank = self.ranks.index(self.global_rank)
        self.role = role_of(plan, self.rank)
        self.stage_ranks: list[list[tuple[int, ...]]] = stage_rank_lists(plan)
        """[pipeline][stage] -> plan ranks of that stage, leader first (:func:`stage_rank_lists`)."""
        self.segments: tuple[Segment, ...] = sync_segments(plan, config)
        """Every gradient segment, in canonical order (:func:`sync_segments`): what the gradient sync,
        ZeRO's buckets and the ddp checkpoint writers are laid out by."""
        self.all_group_ranks = group_ranks(plan, config)
        self._groups, self.plan_group = create_groups(plan, config, self.ranks, self.global_rank)

    def to_global(self, rank: int) -> int:
        """The global rank of plan rank ``rank`` (for p2p peers and broadcast roots)."""
        return self.ranks[rank]

    def group(self, ranks: tuple[int, ...] | list[int]) -> dist.ProcessGroup:
        """The process group of exactly these plan ranks (this rank must be one of them)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            raise KeyError(f"rank {self.rank} has no process group for ranks {key}")
        return self._groups[key]

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The stage's TP group, or None when the stage has TP degree 1."""
        return self.group(self.role.stage_ranks) if self.role.tp > 1 else None

    def link_group(self, side: str) -> tuple[int, dist.ProcessGroup] | None:
        """(peer's GLOBAL rank, its two-rank link group) for pipeline p2p on ``side``, or None (see
        :meth:`Role.link_peer`)."""
        peer = self.role.link_peer(side)
        return None if peer is None else (self.to_global(peer), self.group((self.rank, peer)))

    @property
    def groups(self) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """Plan-rank tuple -> group, for the groups this rank belongs to."""
        return dict(self._groups)
