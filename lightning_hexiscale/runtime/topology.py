"""Topology = the plan's rank layout (:class:`~lightning_hexiscale.planner.layout.RankLayout`) +
the process groups it names, created here.

Every rank a runtime module compares or indexes (``Topology.rank``, ``Role``, bucket holders,
checkpoint layouts) is a plan rank, so a plan's layout does not depend on where it was launched;
where it was launched is the layout's rank map (:func:`rank_map`), used only where
torch.distributed needs global ranks: the members of every new group, and every p2p peer and
broadcast root (:meth:`Topology.to_global`). The map is derived from the plan, not passed in,
because a rank IS a device: running device d's work on the process of another device is the
mismatch the plan's device ids exist to prevent. The pure functions below (:func:`rank_map`,
:func:`role_of`, :func:`group_ranks`, ...) read the layout, in the types the runtime has always used.

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

import torch.distributed as dist

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, RankLayout
from lightning_hexiscale.planner.layout import Role, Segment, segment_bounds, sync_segments

__all__ = ["Role", "Segment", "Topology", "create_groups", "group_ranks", "link_pairs", "rank_map", "role_of",
           "segment_bounds", "stage_rank_lists", "sync_segments"]


# ---- the layout's lists, in the types the runtime has always read (lists, not tuples) -----------
def rank_map(plan: Plan, world: int) -> tuple[int, ...]:
    """Global rank of every plan rank (module doc): the identity when ``world == plan.world_size``,
    ``launch_order.index(device_order[i])`` when ``world == len(plan.launch_order)``; else a PlanError.

    >>> from lightning_hexiscale.planner.plan import Pipeline, Stage
    >>> p = Plan((Pipeline(2, 1, (Stage((2,), (0, 4)),)), Pipeline(2, 1, (Stage((3,), (0, 4)),))), 4, idle_devices=(0, 1))
    >>> rank_map(p, 2), rank_map(p, 4)
    ((0, 1), (2, 3))
    """
    return RankLayout.of(plan, world).ranks


def stage_rank_lists(plan: Plan) -> list[list[tuple[int, ...]]]:
    """[pipeline][stage] -> plan ranks of that stage, leader first."""
    return [list(p) for p in RankLayout.of(plan).stage_ranks]


def role_of(plan: Plan, rank: int) -> Role:
    """The role of plan rank ``rank`` in ``plan`` (the plan must be valid)."""
    return RankLayout.of(plan).role(rank)


def link_pairs(plan: Plan) -> list[tuple[int, int]]:
    """The two-rank p2p links between adjacent stages, sorted (:attr:`RankLayout.link_pairs`)."""
    return list(RankLayout.of(plan).link_pairs)


def group_ranks(plan: Plan, config: LlamaConfig) -> list[tuple[int, ...]]:
    """Every process group the runtime uses, as sorted rank tuples, in creation order (sorted):
    :meth:`RankLayout.group_ranks`. Pure: the same list on every rank."""
    return list(RankLayout.of(plan).group_ranks(config))


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
        self.layout = RankLayout.of(plan, dist.get_world_size())
        """The plan's rank layout on this job (torch-free, the same on every rank)."""
        self.ranks = self.layout.ranks
        self.global_rank = dist.get_rank() if rank is None else rank
        if self.global_rank not in self.ranks:
            raise PlanError("rank", self.global_rank,
                            f"the plan runs on global ranks {list(self.ranks)}; the others run devices it "
                            f"leaves idle {list(plan.idle_devices)}",
                            "on a rank the plan leaves idle, call runtime.topology.create_groups(plan, config, "
                            "rank_map(plan, world)) instead of building an engine")
        self.plan, self.config = plan, config
        self.rank = self.layout.plan_rank(self.global_rank)
        self.role = self.layout.role(self.rank)
        self.stage_ranks: list[list[tuple[int, ...]]] = [list(p) for p in self.layout.stage_ranks]
        """[pipeline][stage] -> plan ranks of that stage, leader first (:attr:`RankLayout.stage_ranks`)."""
        self.segments: tuple[Segment, ...] = self.layout.segments(config)
        """Every gradient segment, in canonical order (:func:`sync_segments`): what the gradient sync,
        ZeRO's buckets and the ddp checkpoint writers are laid out by."""
        self.all_group_ranks = list(self.layout.group_ranks(config))
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
