"""The rank layout of a Plan: which process runs which device, every rank's role, and the member
lists of every process group. Torch-free and pure, so it is the same on every rank.

One view read by everyone (STYLE 16): the runtime's ``Topology`` is this layout plus the process
groups it creates from :meth:`RankLayout.group_ranks`; the cost model counts a rank's communicators
from the same lists; the Lightning layer's idle-rank switch reads the rank map.

Ranks: *plan rank* i runs ``plan.device_order[i]``; a stage's ranks are its devices' plan ranks in
the stage's device order (the first is the leader). The rank map (:attr:`RankLayout.ranks`) says on
which global rank of the launched job plan rank i runs: the identity with ``plan.world_size``
processes; with one process per device of ``plan.launch_order`` (used and idle, sorted) launch rank r
runs ``launch_order[r]``, so ``ranks[i] = launch_order.index(device_order[i])`` and the ranks of idle
devices have no role. Every list here is in plan ranks except :attr:`RankLayout.ranks`,
:attr:`RankLayout.idle` and :attr:`RankLayout.devices`, which are in global ranks.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan


@dataclass(frozen=True)
class Role:
    """What one plan rank does in a plan. Pure data."""

    rank: int
    """Plan rank (the global rank when the plan runs on the whole process group)."""
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
    """Holder ranks (plan ranks), one per pipeline, sorted ascending (the DP process group)."""


@dataclass(frozen=True)
class RankLayout:
    """Every rank fact of one Plan launched on ``world`` processes. Build with :meth:`of`."""

    plan: Plan
    world: int
    """Processes launched: ``plan.world_size`` (used devices only) or ``len(plan.launch_order)``."""
    ranks: tuple[int, ...]
    """The rank map: global rank of plan rank i (ascending, since both device orders are sorted)."""
    devices: tuple[int, ...]
    """Device each global rank runs: ``device_order`` or ``launch_order``, indexed by global rank."""
    stage_ranks: tuple[tuple[tuple[int, ...], ...], ...]
    """[pipeline][stage] -> plan ranks of that stage, leader first."""
    roles: tuple[Role, ...]
    """Role of every plan rank, indexed by plan rank."""
    batch_offsets: tuple[int, ...]
    """First sample of the global batch pipeline i takes: b_0 + ... + b_(i-1)."""
    link_pairs: tuple[tuple[int, int], ...]
    """The two-rank p2p links between adjacent stages, sorted: (leader, next leader), or (TP rank r,
    TP rank r of the next stage) for every r when both stages have the same TP degree t > 1."""
    tp_groups: tuple[tuple[int, ...], ...]
    """Ranks of every stage with TP degree > 1, each sorted, sorted."""

    @classmethod
    def of(cls, plan: Plan, world: int | None = None) -> RankLayout:
        """The layout of ``plan`` on ``world`` processes (default ``plan.world_size``). A world that
        is neither the used devices' count nor the launch order's is a PlanError."""
        world = plan.world_size if world is None else world
        ranks, devices = _rank_map(plan, world)
        device_order = plan.device_order  # a derived property: sorts every device on each read
        order = {d: r for r, d in enumerate(device_order)}
        stage_ranks = tuple(tuple(tuple(order[d] for d in st.devices) for st in p.stages) for p in plan.pipelines)
        offsets, roles, pairs = [], [None] * plan.world_size, set()
        for i, (pipe, stages) in enumerate(zip(plan.pipelines, stage_ranks)):
            offsets.append(sum(p.batch_size for p in plan.pipelines[:i]))
            for j, (st, here) in enumerate(zip(pipe.stages, stages)):
                prev = stages[j - 1] if j > 0 else ()
                nxt = stages[j + 1] if j + 1 < len(stages) else ()
                for k, r in enumerate(here):
                    roles[r] = Role(rank=r, device=device_order[r], pipeline=i, stage=j,
                                    num_stages=len(stages), tp_rank=k, stage_ranks=here, prev_stage_ranks=prev,
                                    next_stage_ranks=nxt, layers=st.layers, batch_offset=offsets[i],
                                    batch_size=pipe.batch_size, micro_batch_size=pipe.micro_batch_size)
                if nxt and len(here) == len(nxt) > 1:  # scatter/gather: TP rank r to TP rank r
                    pairs.update(tuple(sorted(p)) for p in zip(here, nxt))
                elif nxt:
                    pairs.add(tuple(sorted((here[0], nxt[0]))))
        tp = sorted({tuple(sorted(st)) for stages in stage_ranks for st in stages if len(st) > 1})
        return cls(plan, world, ranks, devices, stage_ranks, tuple(roles), tuple(offsets), tuple(sorted(pairs)),
                   tuple(tp))

    # ---- the rank map -------------------------------------------------------------------------
    @property
    def idle(self) -> tuple[int, ...]:
        """Global ranks that run a device the plan leaves idle (none when launched on used devices)."""
        used = set(self.ranks)
        return tuple(r for r in range(self.world) if r not in used)

    def plan_rank(self, global_rank: int) -> int | None:
        """The plan rank global rank ``global_rank`` runs, or None on an idle rank."""
        return self.ranks.index(global_rank) if global_rank in self.ranks else None

    def role(self, rank: int) -> Role:
        """The role of plan rank ``rank``."""
        if not 0 <= rank < self.plan.world_size:
            raise PlanError("rank", rank, f"the plan uses {self.plan.world_size} ranks (0..{self.plan.world_size - 1})",
                            "launch exactly plan.world_size processes")
        return self.roles[rank]

    # ---- groups and gradient segments (they depend on the model's shapes) ---------------------
    def segments(self, config: LlamaConfig) -> tuple[Segment, ...]:
        """Every gradient segment of the model, in canonical (parameter, start) order (:func:`sync_segments`)."""
        return sync_segments(self.plan, config)

    def dp_groups(self, config: LlamaConfig) -> tuple[tuple[int, ...], ...]:
        """The distinct holder sets of the gradient segments, sorted; empty with one pipeline."""
        return data_parallel_groups(self.plan, config)

    def group_ranks(self, config: LlamaConfig) -> tuple[tuple[int, ...], ...]:
        """Every process group the runtime creates besides the default one, as sorted plan-rank
        tuples, sorted: the creation order on every rank (NCCL: same groups, same order). The TP
        groups, the p2p links, and the data-parallel holder sets (two or more pipelines). The kinds
        never share a tuple (a TP group lies in one stage, a link spans two stages of one pipeline,
        a holder set one stage per pipeline)."""
        return tuple(sorted(set(self.link_pairs) | set(self.tp_groups) | set(self.dp_groups(config))))


def _rank_map(plan: Plan, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global rank of every plan rank, device of every global rank) for ``world`` processes."""
    if world == plan.world_size:
        return tuple(range(world)), plan.device_order
    launch = plan.launch_order
    if plan.idle_devices and world == len(launch):
        return tuple(launch.index(d) for d in plan.device_order), launch
    rule = f"the plan needs exactly {plan.world_size} processes (devices {list(plan.device_order)})"
    fix = f"launch {plan.world_size} processes or use a plan for {world} devices"
    if plan.idle_devices:
        rule += (f", or {len(launch)}, one per device of its launch order {list(launch)} "
                 f"(devices {list(plan.idle_devices)} idle)")
        fix = f"launch {plan.world_size} or {len(launch)} processes, or use a plan for {world} devices"
    raise PlanError("world_size", world, rule, fix)


# ---- how the model's parameters are laid out over a TP group ----------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """How one global parameter is laid out over a TP group (the same table as
    ``runtime.parallelize.ParamSpec``, without torch; a test keeps the two equal)."""

    name: str
    """Global name, as in ``Llama.named_parameters()``."""
    shape: tuple[int, ...]
    """Full shape."""
    shard_dim: int | None
    """Dimension split over TP ranks; ``None`` when replicated."""
    split: str | None
    """``"kv"`` (whole KV-head groups), ``"ffn"`` (FFN columns), ``"vocab"`` (vocabulary rows) or ``None``."""
    unit: int
    """Elements along ``shard_dim`` per split unit: g*d for q/o, d for k/v, 1 for the FFN and vocabulary."""
    layer: int | None
    """Layer index, or ``None`` for the embedding / final norm / LM head."""
    place: str
    """``"first"`` (embedding), ``"layer"``, ``"last"`` (final norm, LM head) or ``"tied"`` (the
    embedding when the head is tied to it: held by first AND last stages)."""

    def ranges(self, config: LlamaConfig, tp: int) -> list[tuple[int, int]]:
        """[start, end) along ``shard_dim`` held by each of ``tp`` ranks ([0, full) when replicated)."""
        if self.shard_dim is None:
            return [(0, self.shape[0])] * tp
        split = {"kv": config.kv_head_split, "ffn": config.ffn_split, "vocab": config.vocab_split}[self.split]
        return [(s * self.unit, e * self.unit) for s, e in split(tp)]


def param_specs(config: LlamaConfig, layers: range | list[int] | None = None) -> list[ParamSpec]:
    """Every parameter of the model in one canonical order: embed, layers 0..L-1, norm, lm_head
    (no lm_head when tied: the head is ``embed.weight``). ``layers``: only these layers' parameters."""
    h, f, v = config.hidden_size, config.ffn_hidden_size, config.vocab_size
    gd, d = config.heads_per_kv * config.head_dim, config.head_dim
    q_out = config.num_heads * d
    tied = config.tie_word_embeddings
    specs = [ParamSpec("embed.weight", (v, h), 0, "vocab", 1, None, "tied" if tied else "first")]
    for layer in range(config.num_layers) if layers is None else layers:
        p = f"layers.{layer}."
        specs += [
            ParamSpec(p + "attn_norm.weight", (h,), None, None, 1, layer, "layer"),
            ParamSpec(p + "attn.q_proj.weight", (q_out, h), 0, "kv", gd, layer, "layer"),
            ParamSpec(p + "attn.k_proj.weight", (config.kv_dim, h), 0, "kv", d, layer, "layer"),
            ParamSpec(p + "attn.v_proj.weight", (config.kv_dim, h), 0, "kv", d, layer, "layer"),
            ParamSpec(p + "attn.o_proj.weight", (h, q_out), 1, "kv", gd, layer, "layer"),
            ParamSpec(p + "mlp_norm.weight", (h,), None, None, 1, layer, "layer"),
            ParamSpec(p + "mlp.gate_proj.weight", (f, h), 0, "ffn", 1, layer, "layer"),
            ParamSpec(p + "mlp.up_proj.weight", (f, h), 0, "ffn", 1, layer, "layer"),
            ParamSpec(p + "mlp.down_proj.weight", (h, f), 1, "ffn", 1, layer, "layer"),
        ]
    specs.append(ParamSpec("norm.weight", (h,), None, None, 1, None, "last"))
    if not tied:
        specs.append(ParamSpec("lm_head.weight", (v, h), 0, "vocab", 1, None, "last"))
    return specs


def stage_holds(spec: ParamSpec, layers: tuple[int, int], is_first: bool, is_last: bool) -> bool:
    """Whether a stage running ``layers`` (first/last flags given) holds ``spec``. A tied embedding
    is held by first and last stages; the ONE holder per pipeline that the gradient sync and the
    checkpoints use is the first stage holding it, i.e. the first stage."""
    if spec.place == "first":
        return is_first
    if spec.place == "last":
        return is_last
    if spec.place == "tied":
        return is_first or is_last
    return layers[0] <= spec.layer < layers[1]


# ---- gradient segments: what the data-parallel groups are made of ------------------------------
def segment_bounds(ranges: list[list[tuple[int, int]]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Union-of-boundaries segmentation. ``ranges[p]`` = the [start, end) ranges of pipeline p's
    ranks in ascending order, covering the same [0, n). Returns (start, end, holder index per
    pipeline) per segment; the holder of a segment is the last range starting at or before it.

    >>> segment_bounds([[(0, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)]])
    [(0, 2, (0, 0)), (2, 3, (1, 1)), (3, 4, (2, 1))]
    """
    cuts = sorted({b for rs in ranges for r in rs for b in r})
    starts = [[s for s, _ in rs] for rs in ranges]
    return [(a, b, tuple(bisect.bisect_right(st, a) - 1 for st in starts)) for a, b in zip(cuts, cuts[1:])]


def _segments_of(plan: Plan, config: LlamaConfig, specs: list[ParamSpec]
                 ) -> list[tuple[str, int | None, int, int, tuple[int, ...]]]:
    """The segments of ``specs`` under ``plan`` as :class:`Segment` fields: per parameter, the union
    of the pipelines' shard boundaries; the holders are the first stage of each pipeline holding it
    (leaders only when replicated)."""
    order = {d: r for r, d in enumerate(plan.device_order)}
    stage_ranks = [[tuple(order[d] for d in st.devices) for st in p.stages] for p in plan.pipelines]
    segs = []
    for spec in specs:
        holders_per_pipe: list[tuple[int, ...]] = []  # ranks of the stage holding spec, per pipeline
        ranges_per_pipe: list[list[tuple[int, int]]] = []
        for i, pipe in enumerate(plan.pipelines):
            last = len(pipe.stages) - 1
            j = next(j for j, st in enumerate(pipe.stages) if stage_holds(spec, st.layers, j == 0, j == last))
            ranks = stage_ranks[i][j]
            if spec.shard_dim is None:  # replicated: only the leader takes part
                ranks = ranks[:1]
            holders_per_pipe.append(ranks)
            ranges_per_pipe.append(spec.ranges(config, len(ranks)) if spec.shard_dim is not None
                                   else [(0, spec.shape[0])])
        for a, b, idx in segment_bounds(ranges_per_pipe):
            ranks = tuple(sorted(holders_per_pipe[p][k] for p, k in enumerate(idx)))
            segs.append((spec.name, spec.shard_dim, a, b, ranks))
    return segs


@functools.lru_cache(maxsize=16)
def sync_segments(plan: Plan, config: LlamaConfig) -> tuple[Segment, ...]:
    """Every gradient segment of the model under ``plan``, in canonical (parameter, start) order:
    what the gradient sync, ZeRO's buckets and the ddp checkpoint writers are laid out by."""
    return tuple(Segment(*fields) for fields in _segments_of(plan, config, param_specs(config)))


@functools.lru_cache(maxsize=64)
def data_parallel_groups(plan: Plan, config: LlamaConfig) -> tuple[tuple[int, ...], ...]:
    """The distinct holder sets of :func:`sync_segments`, sorted (empty with one pipeline).

    The search prices this for thousands of plans, so only the parameters whose holder sets can
    differ are segmented: a layer's holders change only where some pipeline has a stage boundary
    (one layer per interval between consecutive boundaries stands for all of them), and parameters
    of one layer with the same split have the same holder sets (the split's unit scales every
    boundary alike: q, k, v and o share the KV-head split). That is 3 parameters per interval (a
    norm, q, gate) plus the embedding, the final norm and the head: 30 of Llama-30B's 543 on
    Tab. 7's plan."""
    if plan.num_pipelines < 2:
        return ()
    cuts = sorted({b for p in plan.pipelines for s in p.stages for b in s.layers})
    one_per_split = {(s.place, s.layer, s.split): s for s in reversed(param_specs(config, cuts[:-1]))}
    segs = _segments_of(plan, config, list(one_per_split.values()))
    return tuple(sorted({ranks for *_, ranks in segs}))
