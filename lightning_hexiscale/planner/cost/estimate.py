"""Compose the Appendix B terms into an :class:`Estimate` of one training iteration under a Plan.

Per micro-batch, stage j of pipeline i runs its l_ij layers forward and backward:
    Stage_ij = l_ij * (T_f + T_b) (+ the vocabulary-parallel LM head and loss on the last stage,
               + the vocabulary-parallel embedding's all-reduce on the first; cost.model.vocab_parallel_*)
per iteration the pipeline takes Pipeline-Time(i) (Appendix B eq. 8) plus the data-parallel time
its layers cannot hide behind the last backward, which is
    DP-Overhead-Layer(k) - n_mb * (T_f + T_b)   summed over the stage's layers (eq. 5),
plus the embedding / LM head synchronisation and the TP broadcast of replicated tensors
(:func:`dp_edge_times`), and the iteration takes the slowest pipeline (eq. 9). Messages are priced at
the dtypes the runtime sends them in (planner/cost/wire.py: activations and gathered parameters at
B_type, gradients at ``plan.reduce_dtype``), on the path it takes (scatter/gather between equal TP
degrees), with the transfers that run at once sharing the NICs they cross (:mod:`.nic`: a hop's
flows and the other pipelines' in the same phase, the data-parallel rings of a layer). All
``*_s`` fields of the breakdown are per
iteration (all micro-batches of that pipeline); ``time_per_micro_batch_s`` is per micro-batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.units import format_bytes, format_flops, format_seconds
from lightning_hexiscale.errors import check_argument_types
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import compose
from lightning_hexiscale.planner.cost import compute as C
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost import nic
from lightning_hexiscale.planner.cost import wire as W
from lightning_hexiscale.planner.cost import zero_terms as Z
from lightning_hexiscale.planner.cost.communicators import stage_communicators
from lightning_hexiscale.planner.cost.compose import dp_edge_exposed, dp_t_comm, layer_step  # noqa: F401 (re-exported)
from lightning_hexiscale.planner.cost.dp_comm import dp_comm_all
from lightning_hexiscale.planner.cost.memory import (MemoryTerms, shard_fraction,  # noqa: F401
                                                     stage_memory_at, stage_memory_terms, usable_memory)
from lightning_hexiscale.planner.cost.workload import DTYPE_BYTES, Workload  # noqa: F401 (re-exported)
from lightning_hexiscale.planner.plan import Plan


@dataclass(frozen=True)
class OutOfMemory:
    device: int
    gpu_type: str
    needed_bytes: float
    available_bytes: float

    def __str__(self) -> str:
        return (f"device {self.device} ({self.gpu_type}) needs {format_bytes(self.needed_bytes)} but has "
                f"{format_bytes(self.available_bytes)} (short by {format_bytes(self.needed_bytes - self.available_bytes)})")


@dataclass(frozen=True)
class StageEstimate:
    devices: list[int]
    tp: int
    layers: list[int]
    """[start, end) of the stage's layers."""
    compute_s: float
    """Forward + backward (+ recompute) computation over all micro-batches of the iteration (where
    the cluster's layer table prices a part, its measured time, TP collectives included)."""
    tp_comm_s: float
    """Tensor-parallel all-reduces over all micro-batches."""
    pp_comm_s: float
    """The stage's share of the pipeline hops over all micro-batches (``cost.model.hop_charges``:
    both directions to the next stage under GPipe; under 1F1B half of each adjacent link's)."""
    dp_comm_s: float
    """Data-parallel collectives of this stage's layers (whether overlapped or not)."""
    dp_exposed_s: float
    """Part of the data-parallel time not hidden behind the last backward."""
    time_per_micro_batch_s: float
    """Stage_ij + its hop charge (``cost.model.hop_charges``) for one micro-batch."""
    peak_memory_bytes: float
    """Largest peak memory over the stage's devices."""
    memory_capacity_bytes: float
    """Smallest device memory in the stage."""


@dataclass(frozen=True)
class PipelineEstimate:
    batch: int
    micro_batch: int
    num_micro_batches: int
    time_s: float
    """Pipeline-Time(i) plus exposed data-parallel time."""
    bubble_s: float
    """Pipeline fill and drain: sum_j(Stage_j+Hop_j) - max_j(Stage_j+Hop_j)."""
    stages: list[StageEstimate]


@dataclass(frozen=True)
class Estimate:
    """Cost-model estimate of one iteration. ``cost`` is +inf when any device runs out of memory."""

    iteration_time_s: float
    tokens_per_s: float
    pflops: float
    """Model FLOPs of the iteration (no recomputation counted) / iteration time, in PFLOP/s."""
    feasible: bool
    pipelines: list[PipelineEstimate]
    out_of_memory: list[OutOfMemory] = field(default_factory=list)
    bottleneck_pipeline: int = 0
    breakdown: dict[str, float] = field(default_factory=dict)
    """Bottleneck pipeline, per iteration: compute_s, tp_comm_s, pp_comm_s, dp_exposed_s, bubble_s
    (each summed over its stages, for orientation; stages overlap in time)."""

    @property
    def cost(self) -> float:
        """What the planner minimises: iteration time, or +inf for an out-of-memory plan."""
        return self.iteration_time_s if self.feasible else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON document of ``hexiscale estimate --json`` (fields documented in README);
        byte counts (``*_bytes``) are whole numbers (:func:`whole_bytes`), times stay floats."""
        d = asdict(self)
        d["out_of_memory"] = [dict(asdict(o), message=str(o)) for o in self.out_of_memory]
        return whole_bytes(d)

    def summary(self) -> str:
        lines = [f"iteration {format_seconds(self.iteration_time_s)}, {self.tokens_per_s:,.0f} tokens/s, "
                 f"{format_flops(self.pflops * 1e15)}, {'fits in memory' if self.feasible else 'OUT OF MEMORY'}"]
        for o in self.out_of_memory[:5]:
            lines.append(f"  OOM: {o}")
        if len(self.out_of_memory) > 5:
            lines.append(f"  ... and {len(self.out_of_memory) - 5} more devices out of memory")
        hdr = ("pipe", "stage", "layers", "TP", "compute", "TP comm", "PP comm", "DP comm", "DP exposed", "peak mem", "capacity")
        rows = [hdr]
        times = [t for p in self.pipelines for s in p.stages
                 for t in (s.compute_s, s.tp_comm_s, s.pp_comm_s, s.dp_comm_s, s.dp_exposed_s)]
        longest = max(times, default=0.0)
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                rows.append((f"{i}" + ("*" if i == self.bottleneck_pipeline and j == 0 else ""), str(j),
                             f"{s.layers[0]}-{s.layers[1] - 1}", str(s.tp),
                             *(format_seconds(t, "", like=longest)  # one unit in the whole table
                               for t in (s.compute_s, s.tp_comm_s, s.pp_comm_s, s.dp_comm_s, s.dp_exposed_s)),
                             format_bytes(s.peak_memory_bytes), format_bytes(s.memory_capacity_bytes)))
        w = [max(len(r[c]) for r in rows) for c in range(len(hdr))]
        lines += ["  ".join(v.rjust(x) for v, x in zip(r, w)) for r in rows]
        for i, p in enumerate(self.pipelines):
            lines.append(f"pipeline {i}: batch {p.batch} = {p.num_micro_batches} x {p.micro_batch}, "
                         f"time {format_seconds(p.time_s)} (bubble {format_seconds(p.bubble_s, like=p.time_s)})")
        lines.append("(* bottleneck pipeline; stage times are per iteration, summed over micro-batches)")
        return "\n".join(lines)


def whole_bytes(value: Any, key: str = "") -> Any:
    """``value`` with every finite float under a key with the word ``bytes`` (``peak_memory_bytes``,
    ``peak_bytes_per_rank``) rounded to an int, in dicts and lists at any depth: a byte count is a
    whole number, and JSON wrote the model's float arithmetic as ``1090011264.0`` (a consumer's
    ``isinstance(x, int)`` failed). Infinite and NaN values are left for the writer to refuse or null."""
    if isinstance(value, dict):
        return {k: whole_bytes(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [whole_bytes(v, key) for v in value]
    if "bytes" in key.split("_") and isinstance(value, float) and np.isfinite(value):
        return int(round(value))
    return value


def calibration_theta(cluster: Cluster) -> tuple[float, float, float, float]:
    """(theta_1, theta_2, theta_3f, theta_3b) of the cluster's calibration (Appendix B eq. 5)."""
    cal = cluster.calibration
    return (cal.theta_ddp, cal.theta_zero2, cal.theta_zero3_fwd, cal.theta_zero3_bwd)


def layer_times(cluster: Cluster, workload: Workload, devices: tuple[int, ...] | list[int], mb: int,
                recompute: bool) -> tuple[float, float, float, float]:
    """(T_f, T_b, Comp-TP-Fwd, Comm-TP-Fwd) of one layer for one micro-batch of ``mb`` sequences on
    the TP group ``devices`` (eq. 1-3): the slowest member sets the compute pace, the largest shard
    the FLOPs per rank; recomputation adds one forward to T_b. Where the cluster's layer table
    covers the case (:func:`compute.measured_times`) T_f and T_b are its measured times, TP
    collectives included, and Comm-TP-Fwd is 0; otherwise compute is
    :func:`compute.layer_compute_s` (roofline or FLOPs / efficiency) plus eq. 1's TP term."""
    measured = C.measured_times(cluster, workload, "layer", devices, mb, recompute)
    if measured is not None:
        return measured[0], measured[1], measured[0], 0.0
    comp_f, comp_b = C.layer_compute_s(cluster, workload, devices, mb)
    tp_f = cm.comm_tp(devices, activation_message_bytes(workload, mb), cluster.bandwidth, cluster.latency)
    return cm.layer_time_fwd(comp_f, tp_f), C.layer_backward_s(comp_f, comp_b, tp_f, recompute), comp_f, tp_f


def activation_message_bytes(workload: Workload, mb: int) -> float:
    """M = B_mb * S * H * B_type: the activation one hop or TP all-reduce moves for one micro-batch."""
    return mb * workload.model.seq_len * workload.model.hidden_size * workload.dtype_bytes


def stage_extra_times(cluster: Cluster, workload: Workload, devices: tuple[int, ...] | list[int], mb: int,
                      first: bool, last: bool) -> tuple[float, float]:
    """(compute, communication) per micro-batch a stage adds to its layers: on the last stage the
    vocabulary-parallel LM head and loss (:func:`cost.model.vocab_parallel_head`'s communication,
    :func:`compute.head_compute_s`), on the first the vocabulary-parallel embedding's all-reduce
    (:func:`cost.model.vocab_parallel_embedding`; its lookup priced by the roofline only). A part
    the cluster's layer table covers (:func:`compute.measured_times`) is its measured forward +
    backward, counted as compute (its TP collectives inside)."""
    model = workload.model
    comp = comm = 0.0
    if last:
        measured = C.measured_times(cluster, workload, "head", devices, mb)
        if measured is not None:
            comp = measured[0] + measured[1]
        else:
            comp = C.head_compute_s(cluster, workload, devices, mb)
            comm = cm.vocab_parallel_head(model.head_forward_flops(mb), model.max_vocab_fraction(len(devices)),
                                          1.0, devices, mb * model.seq_len, model.hidden_size,
                                          workload.dtype_bytes, cluster.bandwidth, cluster.latency)[1]
    if first:
        measured = C.measured_times(cluster, workload, "embedding", devices, mb)
        if measured is not None:
            comp += measured[0] + measured[1]
        else:
            comp += C.embedding_compute_s(cluster, workload, devices, mb)
            comm += cm.vocab_parallel_embedding(devices, activation_message_bytes(workload, mb), cluster.bandwidth,
                                                cluster.latency)
    return comp, comm


def hop_time(cluster: Cluster, workload: Workload, src: tuple[int, ...], dst: tuple[int, ...], mb: int,
             caps: tuple[float, ...] | None = None, schedule: str = "1f1b") -> float:
    """Comm-PP-Hop (eq. 6) from stage ``src`` to stage ``dst`` for one micro-batch, on the path the
    runtime takes: scatter/gather between equal TP degrees above 1
    (:func:`cost.model.comm_pp_hop_scatter`), else between the stage leaders (``devices[0]``) plus
    the receiving TP broadcast. ``caps``: the NIC fair share of each send flow in its phase
    (:func:`nic.hop_caps`; () = none binding); None: the hop alone under ``schedule``
    (:func:`nic.hop_alone_caps`, its own flows still share their NICs)."""
    act_msg = activation_message_bytes(workload, mb)
    if caps is None:
        caps = nic.hop_alone_caps(cluster, src, dst, schedule)
    if len(src) == len(dst) > 1:
        return cm.comm_pp_hop_scatter(src, dst, act_msg, cluster.bandwidth, cluster.latency, caps)
    return cm.comm_pp_hop(src, dst, act_msg, cluster.bandwidth, cluster.latency, leaders=(src[0], dst[0]),
                          send_cap=caps[0] if caps else np.inf)


def wire_element_bytes(plan: Plan, workload: Workload) -> tuple[int, int]:
    """(reduce, parameter) bytes per element on the data-parallel wire (planner/cost/wire.py): gradients
    are summed at ``plan.reduce_dtype`` (default B_type), parameters gathered at B_type."""
    bt = workload.dtype_bytes
    return (DTYPE_BYTES[plan.reduce_dtype] if plan.reduce_dtype else bt), bt


def dp_layer_bytes(workload: Workload, element_bytes: int | None = None) -> float:
    """Bytes of one layer's gradient (or parameters) on the data-parallel wire (eq. 4's 12H^2 * B_type)."""
    return workload.model.layer_params * (workload.dtype_bytes if element_bytes is None else element_bytes)


def dp_terms(plan: Plan, cluster: Cluster, workload: Workload) -> tuple[dict, dict]:
    """Per stage, [(layers, T_comm)] at the reduce and at the parameter bytes (:func:`dp_comm.dp_comm_all`)."""
    red_bt, bt = wire_element_bytes(plan, workload)
    dp_red = dp_comm_all(plan, cluster, dp_layer_bytes(workload, red_bt), workload.model)
    dp_par = dp_red if red_bt == bt else dp_comm_all(plan, cluster, dp_layer_bytes(workload, bt), workload.model)
    return dp_red, dp_par


def _overlap(r: int, t: int, r2: int, t2: int) -> float:
    """Shared fraction of a tensor between TP rank r of t and TP rank r2 of t2 (even splits)."""
    lo, hi = max(r / t, r2 / t2), min((r + 1) / t, (r2 + 1) / t2)
    return max(0.0, hi - lo)


def tied_exchange_s(plan: Plan, i: int, cluster: Cluster, workload: Workload) -> float:
    """Time per iteration of pipeline i's tied-embedding exchange between its first and last stage
    (``wire.tied_pairs``: every rank pair whose vocabulary rows overlap; runtime/tied_embeddings.py),
    rows at the stored parameter dtype (``Workload.param_bytes``): one two-way exchange of the
    gradients (both directions at once) and, under ddp with 2+ pipelines or under ZeRO, one one-way
    copy first -> last (``wire.tied_phases``), each taking

        max( max_x sum_{pairs p of x} (alpha_p + bytes_p / beta_p),  max_n sum_{p crossing NIC n} bytes_p / B_n )

    (a rank sends its pairs' rows over its own links; the pairs that leave a machine share its NIC).
    Zero for an untied model or a one-stage pipeline. It follows the backward and precedes the
    first stage's embedding sync, so it is fully exposed."""
    model = workload.model
    stages = plan.pipelines[i].stages
    pairs = W.tied_pairs(model, stages[0], stages[-1])
    if not pairs:
        return 0.0
    two_way, one_way = W.tied_phases(plan.dp_sharding, plan.num_pipelines)
    per_rank: dict[int, float] = {}
    per_nic = np.zeros(len(cluster.nic_bandwidth))
    for a, b, rows in pairs:
        nbytes = rows * model.hidden_size * workload.param_bytes
        t = float(cluster.latency[a, b] + nbytes / cluster.bandwidth[a, b])
        for x in (a, b):
            per_rank[x] = per_rank.get(x, 0.0) + t
        if cluster.machine_of[a] != cluster.machine_of[b]:
            per_nic[cluster.nic_of[a]] += nbytes
            per_nic[cluster.nic_of[b]] += nbytes
    phase = max(max(per_rank.values()), float((per_nic / cluster.nic_bandwidth).max()))
    return (two_way + one_way) * phase


def dp_edge_times(plan: Plan, i: int, j: int, cluster: Cluster, workload: Workload) -> tuple[float, float, float]:
    """Data-parallel times of the tensors outside the layers of stage (i, j), per iteration:
    (embedding sync, LM head sync, TP broadcast of the replicated norms). Each TP rank's vocabulary
    rows of the embedding (first stage) and of the untied LM head (last stage) are summed with the
    ranks of the other pipelines that hold the same rows (all-reduce, or reduce-scatter +
    all-gather; the slowest rank of the stage counts), and the leader broadcasts the stage's
    replicated norms in its TP group after the sync. A tied embedding's first/last-stage exchange
    (:func:`tied_exchange_s`) counts with the embedding sync of the first stage. With one pipeline
    only that exchange and, under ZeRO, the norms' broadcast (:func:`norms_broadcast_s`) remain."""
    pipes = plan.pipelines
    tied = tied_exchange_s(plan, i, cluster, workload) if j == 0 else 0.0
    st = pipes[i].stages[j]
    first, last = j == 0, j == len(pipes[i].stages) - 1
    if len(pipes) == 1:
        return tied, 0.0, norms_broadcast_s(plan, st, last, cluster, workload)
    model = workload.model
    red_bt, bt = wire_element_bytes(plan, workload)
    bw, lat = cluster.bandwidth, cluster.latency

    def sync(params: float, holder) -> float:
        worst = 0.0
        rates = nic.holder_rates(cluster, [holder(p).devices for p in pipes])[i]  # shared NICs
        for r, d in enumerate(st.devices):
            partners = [(d, d2, share) for k, p in enumerate(pipes) if k != i
                        for r2, d2 in enumerate(holder(p).devices)
                        if (share := _overlap(r, st.tp, r2, holder(p).tp)) > 0]
            t_red = cm.comm_dp(partners, params * red_bt, len(pipes), bw, lat, rates[r])
            t_par = cm.comm_dp(partners, params * bt, len(pipes), bw, lat, rates[r])
            worst = max(worst, 2.0 * dp_t_comm(plan.dp_sharding, t_red, t_par))
        return worst

    t_emb = tied + (sync(model.embedding_params, lambda p: p.stages[0]) if first else 0.0)
    t_head = (sync(model.head_params, lambda p: p.stages[-1])  # LM head rows (+ the final norm, on leaders)
              if last and not model.tie_word_embeddings else 0.0)
    return float(t_emb), float(t_head), norms_broadcast_s(plan, st, last, cluster, workload)


def norms_broadcast_s(plan: Plan, st, last: bool, cluster: Cluster, workload: Workload) -> float:
    """Stage leader -> its TP group (t > 1), after the sync: the replicated norms' gradients (ddp,
    only when there are pipelines to sum with) or parameters (ZeRO, whatever the pipelines: the
    leader alone steps them); sum over the other members d of lat + bytes / (t * bw) in seconds."""
    if st.tp == 1 or (plan.dp_sharding == "ddp" and plan.num_pipelines == 1):
        return 0.0
    red_bt, bt = wire_element_bytes(plan, workload)
    norms = (2 * st.num_layers + (1 if last else 0)) * workload.model.hidden_size
    nbytes = norms * (red_bt if plan.dp_sharding == "ddp" else bt)
    bw, lat = cluster.bandwidth, cluster.latency
    return float(sum(lat[st.leader, d] + nbytes / (st.tp * bw[st.leader, d]) for d in st.devices[1:]))


def dp_edge_all(plan: Plan, cluster: Cluster, workload: Workload) -> dict[tuple[int, int], tuple[float, float, float]]:
    """:func:`dp_edge_times` of every stage (i, j) that has any ((i, j) -> (embedding, head, norms);
    absent: all zero), vectorised: each of the two syncs is one pass over the (rank, rank) pairs of
    all first (last) stages, in row blocks, instead of a Python loop over partners per rank. The
    same terms as :func:`dp_edge_times`, summed in a different order (float rounding apart). This is
    what :func:`estimate` and the batch timer use."""
    pipes = plan.pipelines
    P = len(pipes)
    tied = {i: t for i in range(P) if (t := tied_exchange_s(plan, i, cluster, workload)) > 0.0}
    if P == 1:  # the tied exchange and, under ZeRO, the norms' broadcast (as dp_edge_times)
        stages = pipes[0].stages
        one = {(0, j): (tied.get(0, 0.0) if j == 0 else 0.0, 0.0,
                        norms_broadcast_s(plan, st, j == len(stages) - 1, cluster, workload))
               for j, st in enumerate(stages)}
        return {key: v for key, v in one.items() if v != (0.0, 0.0, 0.0)}
    model = workload.model
    red_bt, bt = wire_element_bytes(plan, workload)
    bw, lat = cluster.bandwidth, cluster.latency
    sh = plan.dp_sharding

    def sync(params: float, stage_of) -> np.ndarray:
        stages = [stage_of(p) for p in pipes]
        dev = np.array([d for st in stages for d in st.devices])
        tps = np.array([st.tp for st in stages])
        pipe = np.repeat(np.arange(P), tps)
        rank = np.concatenate([np.arange(t) for t in tps])
        tp = np.repeat(tps, tps)
        lo, hi = rank / tp, (rank + 1) / tp
        n = len(dev)
        rates = nic.dp_ring_rates(cluster, dev, lo, hi)  # the NICs the rings share
        t_red, t_par = np.empty(n), np.empty(n)
        block = max(1, 2_000_000 // n)
        for a in range(0, n, block):
            b = min(n, a + block)
            share = np.minimum(hi[a:b, None], hi[None, :]) - np.maximum(lo[a:b, None], lo[None, :])
            ok = (share > 0) & (pipe[a:b, None] != pipe[None, :])
            ix = np.ix_(dev[a:b], dev)
            base = np.where(ok, lat[ix], 0.0).sum(axis=1)
            # bytes paced by the slowest partner link (cost.model.comm_dp); no partner: q = 0
            q = np.where(ok, share, 0.0).sum(axis=1) / np.minimum(np.where(ok, bw[ix], np.inf).min(axis=1), rates[a:b])
            t_red[a:b] = base + q * (params * red_bt / P)
            t_par[a:b] = base + q * (params * bt / P)
        row = 2.0 * (t_red if sh == "ddp" else 0.5 * (t_red + t_par) if sh == "zero2" else t_par)
        return np.maximum.reduceat(row, np.concatenate([[0], np.cumsum(tps)[:-1]]))

    out: dict[tuple[int, int], list[float]] = {}
    for i, t in enumerate(sync(model.embedding_params, lambda p: p.stages[0]).tolist()):
        out[(i, 0)] = [tied.get(i, 0.0) + t, 0.0, 0.0]
    if not model.tie_word_embeddings:
        for i, t in enumerate(sync(model.head_params, lambda p: p.stages[-1]).tolist()):
            out.setdefault((i, len(pipes[i].stages) - 1), [0.0, 0.0, 0.0])[1] = t
    for i, p in enumerate(pipes):
        for j, st in enumerate(p.stages):
            if st.tp > 1:  # leader -> TP group: the replicated norms (as dp_edge_times)
                out.setdefault((i, j), [0.0, 0.0, 0.0])[2] = norms_broadcast_s(plan, st, j == len(p.stages) - 1,
                                                                               cluster, workload)
    return {k: (float(v[0]), float(v[1]), float(v[2])) for k, v in out.items()}


def _check_arguments(plan: Any, cluster: Any, workload: Any) -> None:
    """``estimate``'s arguments: a Plan, a Cluster and a Workload, the plan valid on both."""
    check_argument_types("estimate", (
        ("plan", plan, Plan, "pass a Plan: Plan.load(path) or Plan.from_dict(d)"),
        ("cluster", cluster, Cluster, "pass a Cluster: Cluster.load(name_or_path)"),
        ("workload", workload, Workload, "pass a Workload: Workload(LlamaConfig.load(name)) or workload_from_config(cfg)")))
    plan.validate(cluster, workload.model)
    plan.check_model(workload.model)


def estimate(plan: Plan, cluster: Cluster, workload: Workload) -> Estimate:
    """Estimate iteration time, throughput and memory of ``plan`` on ``cluster`` (Appendix B).

    The plan is validated against ``cluster`` and ``workload.model`` first (:meth:`Plan.validate`,
    :meth:`Plan.check_model`): a plan made for another cluster or model (one whose recorded shape
    differs, even with the same layer count) is a :class:`PlanError` naming the key, not a price."""
    _check_arguments(plan, cluster, workload)
    model = workload.model
    S = model.seq_len
    theta = calibration_theta(cluster)
    dp = compose.dp_intervals(*dp_terms(plan, cluster, workload), plan.dp_sharding)
    edges = dp_edge_all(plan, cluster, workload)
    pipes: list[PipelineEstimate] = []
    ooms: list[OutOfMemory] = []
    # the communicators each stage's ranks join (only priced on CUDA)
    comms = stage_communicators(plan, model) if workload.device == "cuda" and workload.comm_buffer_bytes else {}
    caps = nic.hop_caps(cluster, [[st.devices for st in p.stages] for p in plan.pipelines], plan.schedule)
    micro_batches = [p.num_micro_batches for p in plan.pipelines]
    for i, pipe in enumerate(plan.pipelines):
        mb, n_mb = pipe.micro_batch_size, pipe.num_micro_batches
        n_st = len(pipe.stages)
        recompute = pipe.recompute  # each pipeline's own: its time and memory (Plan.recomputes)
        n_tp = 2.0 + (cm.RECOMPUTE_TP_SHARE if recompute else 0.0)
        per_mb, hops, tails, rows = [], [], [], []
        for j, st in enumerate(pipe.stages):
            l = st.num_layers
            t_f, t_b, comp_f, tp_f = layer_times(cluster, workload, st.devices, mb, recompute)
            head_comp, head_comm = stage_extra_times(cluster, workload, st.devices, mb, j == 0, j == n_st - 1)
            hop = (hop_time(cluster, workload, st.devices, pipe.stages[j + 1].devices, mb, caps.get((i, j), ()))
                   if j + 1 < n_st else 0.0)
            edge = edges.get((i, j))
            stage_mb, tail = compose.stage_time(t_f, t_b, dp[(i, j)], head_comp + head_comm, edge, l,
                                                plan.dp_sharding, theta)
            # ZeRO-3: a gather per use (2 n_mb), the partners' uses served (2 n_mb of THEIR pipelines,
            # zero_terms.zero3_served_per_layer), the reduce-scatter
            per_comm = (2 * n_mb + Z.zero3_served_per_layer(micro_batches, i) + 1 if plan.dp_sharding == "zero3"
                        else 2)
            dp_comm = dp_edge_exposed(edge or compose.NO_EDGES, l * t_b, plan.dp_sharding)[0]
            for n_layers, t_comm in dp[(i, j)]:
                dp_comm += n_layers * per_comm * t_comm
            per_mb.append(stage_mb)
            hops.append(hop)
            tails.append(tail)
            peak = stage_memory_terms(workload, plan.dp_sharding, plan.num_pipelines, plan.schedule,
                                      recompute, n_st, j, st.tp, mb, n_mb, comms.get((i, j))).peak(l)
            cap = min(cluster.devices[d].memory_bytes for d in st.devices)
            for d in st.devices:
                usable = usable_memory(workload, cluster.devices[d].memory_bytes)
                if peak > usable:
                    ooms.append(OutOfMemory(d, cluster.devices[d].gpu_type, peak, usable))
            rows.append(dict(devices=list(st.devices), tp=st.tp, layers=list(st.layers),
                             compute_s=n_mb * (l * (t_f + t_b - n_tp * tp_f) + head_comp),
                             tp_comm_s=n_mb * (l * n_tp * tp_f + head_comm),
                             pp_comm_s=0.0, dp_comm_s=float(dp_comm), dp_exposed_s=float(tail),
                             time_per_micro_batch_s=stage_mb, peak_memory_bytes=peak, memory_capacity_bytes=cap))
        # each stage's share of the hops under the plan's schedule (sum unchanged: cost.model.hop_charges)
        t = compose.pipeline_time(per_mb, hops, tails, plan.schedule)
        for r, h, step in zip(rows, t.charges, t.steps):
            r.update(pp_comm_s=n_mb * h, time_per_micro_batch_s=step)
        pipes.append(PipelineEstimate(pipe.batch_size, mb, n_mb, t.time_s(n_mb), t.bubble_s,
                                      [StageEstimate(**r) for r in rows]))
    it = compose.iteration_time([p.time_s for p in pipes])
    # the first of the slowest pipelines, ties judged to 1e-12 so that float rounding in the
    # data-parallel sums cannot move the bottleneck between equally fast pipelines
    worst = next(k for k, p in enumerate(pipes) if p.time_s >= it * (1 - 1e-12))
    gb = plan.global_batch
    bp = pipes[worst]
    breakdown = {k: sum(getattr(s, k) for s in bp.stages) for k in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_exposed_s")}
    breakdown["bubble_s"] = bp.bubble_s
    return Estimate(iteration_time_s=it, tokens_per_s=gb * S / it, pflops=model.model_flops_per_iteration(gb) / it / 1e15,
                    feasible=not ooms, pipelines=pipes, out_of_memory=ooms, bottleneck_pipeline=worst, breakdown=breakdown)


def workload_from_config(cfg) -> Workload:
    """Workload from a composed root config: ``cfg.model``, ``trainer.precision`` (null: chosen by the
    cluster's devices), ``train.memory_headroom``, ``planner.allow_table_mismatch``, ``trainer.fast_path``, and the kind of the
    cluster's devices (:meth:`Workload.for_devices`, which every entry point uses)."""
    from lightning_hexiscale.config.fast_path import FastPath

    return Workload.for_devices(LlamaConfig.from_config(cfg.model), [m.gpu for m in cfg.cluster.machines],
                                cfg.trainer.precision,
                                memory_headroom=float(cfg.train.get("memory_headroom", 0.0) or 0.0),
                                allow_table_mismatch=bool((cfg.get("planner") or {}).get("allow_table_mismatch", False)),
                                fast_path=FastPath.coerce(cfg.trainer.get("fast_path"), key="trainer.fast_path"))
