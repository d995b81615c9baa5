"""Compose the Appendix B terms into an :class:`Estimate` of one training iteration under a Plan.

Per micro-batch, stage j of pipeline i runs its l_ij layers forward and backward:
    Stage_ij = l_ij * (T_f + T_b) (+ the vocabulary-parallel LM head and loss on the last stage,
               + the vocabulary-parallel embedding's all-reduce on the first; cost_model.vocab_parallel_*)
per iteration the pipeline takes Pipeline-Time(i) (Appendix B eq. 8) plus the data-parallel time
its layers cannot hide behind the last backward, which is
    DP-Overhead-Layer(k) - n_mb * (T_f + T_b)   summed over the stage's layers (eq. 5),
plus the embedding / LM head synchronisation and the TP broadcast of replicated tensors
(:func:`_dp_edges`), and the iteration takes the slowest pipeline (eq. 9). Messages are priced at
the dtypes the runtime sends them in (planner/wire.py: activations and gathered parameters at
B_type, gradients at ``plan.reduce_dtype``), on the path it takes (scatter/gather between equal TP
degrees). All ``*_s`` fields of the breakdown are per
iteration (all micro-batches of that pipeline); ``time_per_micro_batch_s`` is per micro-batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import cost_model as cm
from lightning_hexiscale.planner.plan import Plan, Stage
from lightning_hexiscale.config.units import format_bytes, format_flops

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class Workload:
    """What is trained: the model and the numeric format (the plan says how it is parallelised)."""

    model: LlamaConfig
    dtype: str = "bf16"
    """Parameter/activation precision: bf16, fp16 or fp32."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state K per parameter: Adam with fp32 master weights = 4 + 4 + 4."""
    reserve_bytes: float = 1.0 * 2**30
    """Memory per device not available to the model (runtime context, allocator slack)."""

    @property
    def dtype_bytes(self) -> int:
        """Derived: B_type."""
        return DTYPE_BYTES[self.dtype]

    @property
    def seq_len(self) -> int:
        return self.model.seq_len


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
    """Forward + backward (+ recompute) computation over all micro-batches of the iteration."""
    tp_comm_s: float
    """Tensor-parallel all-reduces over all micro-batches."""
    pp_comm_s: float
    """Sending activations to the next stage and gradients back, over all micro-batches."""
    dp_comm_s: float
    """Data-parallel collectives of this stage's layers (whether overlapped or not)."""
    dp_exposed_s: float
    """Part of the data-parallel time not hidden behind the last backward."""
    time_per_micro_batch_s: float
    """Stage_ij + Hop_ij for one micro-batch."""
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
        """The stable JSON document of ``hexiscale estimate --json`` (fields documented in README)."""
        d = asdict(self)
        d["out_of_memory"] = [dict(asdict(o), message=str(o)) for o in self.out_of_memory]
        return d

    def summary(self) -> str:
        lines = [f"iteration {self.iteration_time_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, "
                 f"{format_flops(self.pflops * 1e15)}, {'fits in memory' if self.feasible else 'OUT OF MEMORY'}"]
        for o in self.out_of_memory[:5]:
            lines.append(f"  OOM: {o}")
        if len(self.out_of_memory) > 5:
            lines.append(f"  ... and {len(self.out_of_memory) - 5} more devices out of memory")
        hdr = ("pipe", "stage", "layers", "TP", "compute", "TP comm", "PP comm", "DP comm", "DP exposed", "peak mem", "capacity")
        rows = [hdr]
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                rows.append((f"{i}" + ("*" if i == self.bottleneck_pipeline and j == 0 else ""), str(j),
                             f"{s.layers[0]}-{s.layers[1] - 1}", str(s.tp), f"{s.compute_s:.3f}s", f"{s.tp_comm_s:.3f}s",
                             f"{s.pp_comm_s:.3f}s", f"{s.dp_comm_s:.3f}s", f"{s.dp_exposed_s:.3f}s",
                             format_bytes(s.peak_memory_bytes), format_bytes(s.memory_capacity_bytes)))
        w = [max(len(r[c]) for r in rows) for c in range(len(hdr))]
        lines += ["  ".join(v.rjust(x) for v, x in zip(r, w)) for r in rows]
        for i, p in enumerate(self.pipelines):
            lines.append(f"pipeline {i}: batch {p.batch} = {p.num_micro_batches} x {p.micro_batch}, "
                         f"time {p.time_s:.3f} s (bubble {p.bubble_s:.3f} s)")
        lines.append("(* bottleneck pipeline; stage times are per iteration, summed over micro-batches)")
        return "\n".join(lines)


def _overlap(r: int, t: int, r2: int, t2: int) -> float:
    """Shared fraction of a layer between TP rank r of t and TP rank r2 of t2 (even splits)."""
    lo, hi = max(r / t, r2 / t2), min((r + 1) / t, (r2 + 1) / t2)
    return max(0.0, hi - lo)


def _dp_comm_per_layer(plan: Plan, i: int, stage: Stage, cluster: Cluster, layer_bytes: float) -> list[tuple[int, float]]:
    """[(layers, T_comm)] over the stage's layer intervals whose holders in other pipelines are fixed.

    Reference form, one stage at a time (kept for tests); :func:`_dp_comm_all` computes the same
    numbers for every stage at once and is what :func:`estimate` uses.
    """
    if plan.num_pipelines == 1:
        return [(stage.num_layers, 0.0)]
    cuts = {stage.layers[0], stage.layers[1]}
    for p in plan.pipelines:
        for s in p.stages:
            for b in s.layers:
                if stage.layers[0] < b < stage.layers[1]:
                    cuts.add(b)
    bounds = sorted(cuts)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        holders = []
        for k, p in enumerate(plan.pipelines):
            if k != i:
                holders.append(next(s for s in p.stages if s.layers[0] <= a < s.layers[1]))
        worst = 0.0
        for r, d in enumerate(stage.devices):
            partners = []
            for h in holders:
                for r2, d2 in enumerate(h.devices):
                    share = _overlap(r, stage.tp, r2, h.tp)
                    if share > 0:
                        partners.append((d, d2, share))
            worst = max(worst, cm.comm_dp(partners, layer_bytes, plan.num_pipelines, cluster.bandwidth, cluster.latency))
        out.append((b - a, worst))
    return out


_DP_CACHE_SIZE = 256


def _dp_comm_all(plan: Plan, cluster: Cluster, layer_bytes: float) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """:func:`_dp_comm_per_layer` for every stage (i, j) at once, vectorised with numpy.

    Sweep the global layer intervals (between any two stage boundaries of any pipeline). For each
    device slot keep F[slot, k] = sum over the TP ranks r2 of pipeline k's current holder of
    alpha + share * layer_bytes / (N_dp * beta) (eq. 4 per partner); at a boundary only the
    columns of the pipelines whose holder changed, and the rows of the devices that start a
    stage, are recomputed, so a plan costs O(N^2) pair terms in a few dozen array operations
    instead of a Python loop over every (stage, interval, rank, partner). T_comm of a stage on an
    interval is the max over its devices of the row sum. Same terms as the reference, summed in
    a different order (differences at the level of float rounding). Results are memoised per
    cluster for the last few plan layouts (they do not depend on batch, micro-batch or sharding).
    """
    P = plan.num_pipelines
    if P == 1:
        return {(0, j): [(st.num_layers, 0.0)] for j, st in enumerate(plan.pipelines[0].stages)}
    key = (layer_bytes, tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines))
    cache = cluster.__dict__.setdefault("_dp_comm_cache", {})
    if key in cache:
        return cache[key]
    bw, lat = cluster.bandwidth, cluster.latency
    scale = layer_bytes / P
    # device slots, stage by stage
    dev, lo, hi, pipe_of = [], [], [], []
    first_slot: dict[tuple[int, int], int] = {}
    for k, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            first_slot[(k, j)] = len(dev)
            t = st.tp
            for r, d in enumerate(st.devices):
                dev.append(d)
                lo.append(r / t)
                hi.append((r + 1) / t)
                pipe_of.append(k)
    dev_a, lo_a, hi_a, pipe_a = np.array(dev), np.array(lo), np.array(hi), np.array(pipe_of)
    bounds = sorted({b for p in plan.pipelines for s in p.stages for b in s.layers})
    starts = np.array(bounds[:-1])
    holder = np.empty((P, len(starts)), dtype=np.int64)
    for k, p in enumerate(plan.pipelines):
        holder[k] = np.searchsorted(np.array([s.layers[1] for s in p.stages]), starts, side="right")

    def slots(k: int, j: int) -> np.ndarray:
        a = first_slot[(k, j)]
        return np.arange(a, a + plan.pipelines[k].stages[j].tp)

    def terms(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        share = np.minimum(hi_a[rows][:, None], hi_a[cols][None, :]) - np.maximum(lo_a[rows][:, None], lo_a[cols][None, :])
        ix = np.ix_(dev_a[rows], dev_a[cols])
        return np.where(share > 0, lat[ix] + share * layer_bytes / (P * bw[ix]), 0.0)

    def by_pipeline(t: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Column sums per pipeline (cols are grouped by pipeline, in pipeline order)."""
        ks, first = np.unique(pipe_a[cols], return_index=True)
        return ks, np.add.reduceat(t, first, axis=1)

    F = np.zeros((len(dev), P))
    worst: dict[tuple[int, int], list[float]] = {}
    prev = np.full(P, -1)
    for g in range(len(starts)):
        changed = np.flatnonzero(holder[:, g] != prev)
        prev = holder[:, g].copy()
        active = np.concatenate([slots(k, int(holder[k, g])) for k in range(P)])
        fresh = np.concatenate([slots(int(k), int(holder[k, g])) for k in changed])
        staying = np.setdiff1d(active, fresh, assume_unique=True)
        if len(fresh):  # new stages: whole rows against every current holder
            ks, sums = by_pipeline(terms(fresh, active), active)
            F[fresh] = 0.0
            F[np.ix_(fresh, ks)] = sums
        if len(staying):  # unchanged stages: only the columns of pipelines whose holder changed
            ks, sums = by_pipeline(terms(staying, fresh), fresh)
            F[np.ix_(staying, ks)] = sums
        F[active, pipe_a[active]] = 0.0  # a pipeline does not synchronise with itself
        cost = F[active].sum(axis=1)
        pos = 0
        for k in range(P):
            j = int(holder[k, g])
            t = plan.pipelines[k].stages[j].tp
            worst.setdefault((k, j), []).append(float(cost[pos:pos + t].max()))
            pos += t
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for k, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            a, b = bounds.index(st.layers[0]), bounds.index(st.layers[1])
            out[(k, j)] = [(bounds[q + 1] - bounds[q], w) for q, w in zip(range(a, b), worst[(k, j)])]
    if len(cache) >= _DP_CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = out
    return out


def estimate(plan: Plan, cluster: Cluster, workload: Workload) -> Estimate:
    """Estimate iteration time, throughput and memory of ``plan`` on ``cluster`` (Appendix B)."""
    model = workload.model
    bt = workload.dtype_bytes
    S, H = model.seq_len, model.hidden_size
    cal = cluster.calibration
    theta = (cal.theta_ddp, cal.theta_zero2, cal.theta_zero3_fwd, cal.theta_zero3_bwd)
    # Wire dtypes (as the runtime sends them, planner/wire.py): activations and gathered parameters
    # at B_type, gradients summed at the plan's reduce_dtype (default B_type).
    red_bt = DTYPE_BYTES[plan.reduce_dtype] if plan.reduce_dtype else bt
    n_dp = plan.num_pipelines
    dp_red = _dp_comm_all(plan, cluster, model.layer_params * red_bt)
    dp_par = dp_red if red_bt == bt else _dp_comm_all(plan, cluster, model.layer_params * bt)
    pipes: list[PipelineEstimate] = []
    ooms: list[OutOfMemory] = []
    for i, pipe in enumerate(plan.pipelines):
        mb, n_mb = pipe.micro_batch_size, pipe.num_micro_batches
        act_msg = mb * S * H * bt
        n_st = len(pipe.stages)
        per_mb, hops, tails, rows = [], [], [], []
        for j, st in enumerate(pipe.stages):
            l = st.num_layers
            c_min = min(cluster.devices[d].flops for d in st.devices)
            frac = _shard_fraction(model, st.tp)
            comp_f = cm.comp_layer_fwd(model.layer_forward_flops(mb), frac, c_min)
            tp_f = cm.comm_tp(st.devices, act_msg, cluster.bandwidth, cluster.latency)
            t_f = cm.layer_time_fwd(comp_f, tp_f)
            t_b = cm.layer_time_bwd(comp_f, tp_f, plan.recompute)
            head_comp = head_comm = 0.0
            if j == n_st - 1:  # LM head + loss split over the stage's TP ranks along the vocabulary
                head_comp, head_comm = cm.vocab_parallel_head(
                    model.head_forward_flops(mb), model.max_vocab_fraction(st.tp), c_min, st.devices, mb * S, H, bt,
                    cluster.bandwidth, cluster.latency)
            if j == 0:
                head_comm += cm.vocab_parallel_embedding(st.devices, act_msg, cluster.bandwidth, cluster.latency)
            head_s = head_comp + head_comm
            hop = _hop(st, pipe.stages[j + 1], act_msg, cluster) if j + 1 < n_st else 0.0
            stage_mb = 0.0
            dp_comm, tail = _dp_edges(plan, i, j, cluster, model, red_bt, bt, l * t_b)
            for (n_layers, t_red), (_, t_par) in zip(dp_red[(i, j)], dp_par[(i, j)]):
                t_comm = _dp_t_comm(plan.dp_sharding, t_red, t_par)
                if plan.dp_sharding == "zero3":
                    f_eff, b_eff = theta[2] * max(t_f, t_comm), theta[3] * max(t_b, t_comm)
                    dp_comm += n_layers * (2 * n_mb + 1) * t_comm
                else:
                    f_eff, b_eff = t_f, t_b
                    dp_comm += n_layers * 2 * t_comm
                over = cm.dp_overhead_layer(n_mb, t_f, t_b, t_comm, plan.dp_sharding, theta)
                tail += n_layers * max(0.0, over - n_mb * (f_eff + b_eff))
                stage_mb += n_layers * (f_eff + b_eff)
            stage_mb += head_s
            per_mb.append(stage_mb)
            hops.append(hop)
            tails.append(tail)
            n_comp = 4.0 if plan.recompute else 3.0
            n_tp = 2.0 + (cm.RECOMPUTE_TP_SHARE if plan.recompute else 0.0)
            peak, cap = _stage_memory(plan, pipe, j, st, cluster, workload, ooms)
            rows.append(dict(devices=list(st.devices), tp=st.tp, layers=list(st.layers),
                             compute_s=n_mb * (l * n_comp * comp_f + head_comp),
                             tp_comm_s=n_mb * (l * n_tp * tp_f + head_comm),
                             pp_comm_s=n_mb * hop, dp_comm_s=dp_comm, dp_exposed_s=tail,
                             time_per_micro_batch_s=stage_mb + hop, peak_memory_bytes=peak, memory_capacity_bytes=cap))
        t_pipe = cm.pipeline_time(per_mb, hops, n_mb) + max(tails)
        steps = [s + h for s, h in zip(per_mb, hops)]
        pipes.append(PipelineEstimate(pipe.batch_size, mb, n_mb, t_pipe, sum(steps) - max(steps),
                                      [StageEstimate(**r) for r in rows]))
    it = cm.total_time([p.time_s for p in pipes])
    # the first of the slowest pipelines, ties judged to 1e-12 so that float rounding in the
    # data-parallel sums cannot move the bottleneck between equally fast pipelines
    worst = next(k for k, p in enumerate(pipes) if p.time_s >= it * (1 - 1e-12))
    gb = plan.global_batch
    bp = pipes[worst]
    breakdown = {k: sum(getattr(s, k) for s in bp.stages) for k in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_exposed_s")}
    breakdown["bubble_s"] = bp.bubble_s
    return Estimate(iteration_time_s=it, tokens_per_s=gb * S / it, pflops=model.model_flops_per_iteration(gb) / it / 1e15,
                    feasible=not ooms, pipelines=pipes, out_of_memory=ooms, bottleneck_pipeline=worst, breakdown=breakdown)


def _hop(st: Stage, nxt: Stage, act_msg: float, cluster: Cluster) -> float:
    """Comm-PP-Hop of one boundary on the path the runtime takes: scatter/gather between equal TP
    degrees above 1, else leader to leader plus the receiving TP broadcast."""
    if st.tp == nxt.tp > 1:
        return cm.comm_pp_hop_scatter(st.devices, nxt.devices, act_msg, cluster.bandwidth, cluster.latency)
    return cm.comm_pp_hop(st.devices, nxt.devices, act_msg, cluster.bandwidth, cluster.latency,
                          leaders=(st.leader, nxt.leader))


def _dp_t_comm(sharding: str, t_red: float, t_par: float) -> float:
    """T_comm entering DP-Overhead-Layer (whose collectives cost 2*T_comm): ddp all-reduces gradients
    (reduce-scatter + all-gather, both at reduce_dtype); zero2 reduce-scatters gradients
    (reduce_dtype) and all-gathers parameters (B_type); zero3 is dominated by its per-use parameter
    gathers (B_type)."""
    if sharding == "ddp":
        return t_red
    if sharding == "zero2":
        return 0.5 * (t_red + t_par)
    return t_par


def _dp_edges(plan: Plan, i: int, j: int, cluster: Cluster, model: LlamaConfig, red_bt: int, bt: int,
              backward_s: float) -> tuple[float, float]:
    """(total, exposed) data-parallel time of the tensors outside the layers, per iteration: each TP
    rank's vocabulary rows of the embedding (first stage) and of the untied LM head (last stage),
    summed with the ranks of the other pipelines that hold the same rows (all-reduce, or
    reduce-scatter + all-gather; the slowest rank of the stage counts), and the leader's TP broadcast
    of the stage's replicated norms after the sync. The embedding's gradient is final only at the
    end of the backward (fully exposed); the head's sync overlaps the stage's last backward
    ``backward_s``."""
    pipes = plan.pipelines
    if len(pipes) == 1:
        return 0.0, 0.0
    st = pipes[i].stages[j]
    first, last = j == 0, j == len(pipes[i].stages) - 1
    bw, lat = cluster.bandwidth, cluster.latency

    def sync(params: float, holder) -> float:
        worst = 0.0
        for r, d in enumerate(st.devices):
            partners = [(d, d2, share) for k, p in enumerate(pipes) if k != i
                        for r2, d2 in enumerate(holder(p).devices)
                        if (share := _overlap(r, st.tp, r2, holder(p).tp)) > 0]
            t_red = cm.comm_dp(partners, params * red_bt, len(pipes), bw, lat)
            t_par = cm.comm_dp(partners, params * bt, len(pipes), bw, lat)
            worst = max(worst, 2.0 * _dp_t_comm(plan.dp_sharding, t_red, t_par))
        return worst

    total = exposed = 0.0
    if first:
        t = sync(model.embedding_params, lambda p: p.stages[0])
        total, exposed = total + t, exposed + t
    if last and not model.tie_word_embeddings:
        t = sync(model.head_params, lambda p: p.stages[-1])  # LM head rows (+ the final norm, on leaders)
        total, exposed = total + t, exposed + max(0.0, t - backward_s)
    if st.tp > 1:  # leader -> TP group: the replicated norms' gradients (ddp) or parameters (zero)
        norms = (2 * st.num_layers + (1 if last else 0)) * model.hidden_size
        nbytes = norms * (red_bt if plan.dp_sharding == "ddp" else bt)
        t = sum(lat[st.leader, d] + nbytes / (st.tp * bw[st.leader, d]) for d in st.devices[1:])
        total, exposed = total + t, exposed + t
    return float(total), float(exposed)  # plain floats: the estimate is serialised (JSON, logger YAML)


def _shard_fraction(model: LlamaConfig, tp: int) -> float:
    """model.max_shard_fraction(tp), memoised per model shape (the planner calls estimate() often)."""
    key = (model, tp)
    if key not in _FRAC:
        _FRAC[key] = model.max_shard_fraction(tp)
    return _FRAC[key]


_FRAC: dict[tuple[LlamaConfig, int], float] = {}


def _stage_memory(plan: Plan, pipe, j: int, st: Stage, cluster: Cluster, workload: Workload,
                  ooms: list[OutOfMemory]) -> tuple[float, float]:
    """Peak bytes on each device of the stage; appends out-of-memory devices to ``ooms``.

    params_local = l * layer_params * shard (+ the embedding's V/t rows on the first stage, the norm
    and the LM head's V/t rows on the last: vocabulary-parallel; a tied head is the embedding on a
    one-stage pipeline and a copy of its rows on a separate last stage); states = params_local *
    bytes/param (ddp/zero2/zero3); activations = in-flight micro-batches * stored activations (layer
    inputs only when recomputing) + one layer's full activations as working memory + this rank's
    V/t columns of the fp32 logits and their softmax on the last stage; + ``reserve_bytes``.
    """
    model = workload.model
    bt = workload.dtype_bytes
    S, H = model.seq_len, model.hidden_size
    n_st = len(pipe.stages)
    mb, n_mb = pipe.micro_batch_size, pipe.num_micro_batches
    frac = _shard_fraction(model, st.tp)
    vfrac = model.max_vocab_fraction(st.tp)
    params = st.num_layers * model.layer_params * frac
    if j == 0:
        params += model.embedding_params * vfrac
    if j == n_st - 1:
        head = model.stage_head_params(is_first=j == 0)
        params += model.hidden_size + (head - model.hidden_size) * vfrac
    states = params * cm.state_bytes_per_param(plan.dp_sharding, plan.num_pipelines, bt, workload.optimizer_bytes_per_param)
    if plan.dp_sharding == "zero3":
        states += 2 * model.layer_params * frac * bt  # current + prefetched gathered layer
    inflight = cm.inflight_micro_batches(plan.schedule, n_st, j, n_mb)
    full = cm.activation_bytes_layer(mb, S, H, st.tp, bt)
    if plan.recompute:
        acts = inflight * st.num_layers * mb * S * H * bt + full
    else:
        acts = inflight * st.num_layers * full
    if j == n_st - 1:
        acts += 2 * mb * S * model.vocab_size * vfrac * 4
    peak = states + acts + workload.reserve_bytes
    cap = min(cluster.devices[d].memory_bytes for d in st.devices)
    for d in st.devices:
        if peak > cluster.devices[d].memory_bytes:
            ooms.append(OutOfMemory(d, cluster.devices[d].gpu_type, peak, cluster.devices[d].memory_bytes))
    return peak, cap


def workload_from_config(cfg) -> Workload:
    """Workload from a composed root config: ``cfg.model``, and the dtype of ``trainer.precision``
    (null: chosen by the cluster's devices, :func:`~lightning_hexiscale.config.recipe.effective_precision`)."""
    from lightning_hexiscale.config.recipe import effective_precision, precision_dtype

    types = [m.gpu for m in cfg.cluster.machines]
    dtype = precision_dtype(effective_precision(cfg.trainer.precision, types))
    # Adam's m and v in the dtype of the weights; bf16/fp16 training adds an fp32 master copy (4 + 4 + 4).
    optimizer_bytes = {"fp64": 16.0, "fp32": 8.0}.get(dtype, 12.0)
    return Workload(LlamaConfig.from_config(cfg.model), dtype=dtype, optimizer_bytes_per_param=optimizer_bytes)
