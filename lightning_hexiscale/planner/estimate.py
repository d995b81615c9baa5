"""Compose the Appendix B terms into an :class:`Estimate` of one training iteration under a Plan.

Per micro-batch, stage j of pipeline i runs its l_ij layers forward and backward:
    Stage_ij = l_ij * (T_f + T_b) (+ LM head on the last stage)
per iteration the pipeline takes Pipeline-Time(i) (Appendix B eq. 8) plus the data-parallel time
its layers cannot hide behind the last backward, which is
    DP-Overhead-Layer(k) - n_mb * (T_f + T_b)   summed over the stage's layers (eq. 5),
and the iteration takes the slowest pipeline (eq. 9). All ``*_s`` fields of the breakdown are per
iteration (all micro-batches of that pipeline); ``time_per_micro_batch_s`` is per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import cost_model as cm
from lightning_hexiscale.planner.dp_comm import dp_comm_all
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.config.units import format_bytes

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


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
    memory_headroom: float = 0.0
    """Fraction of every device's memory the plan must leave free (``train.memory_headroom``)."""
    device: str = "cuda"
    """What the runtime runs on: ``cuda`` (NCCL buffers, multi-tensor optimizer step) or ``cpu``."""
    comm_buffer_bytes: float = 64 * 2**20
    """Buffers per communicator on CUDA (NCCL: 4 MiB NCCL_BUFFSIZE per channel, protocol and
    direction; 64 MiB is a few channels' worth). 0 to ignore."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.memory_headroom < 1.0:
            from lightning_hexiscale.errors import ConfigError

            raise ConfigError("train.memory_headroom", self.memory_headroom, "must be a fraction in [0, 1)",
                              "use e.g. 0.05 to keep 5 % of every device free, or 0")
        if self.device not in ("cuda", "cpu"):
            from lightning_hexiscale.errors import ConfigError

            raise ConfigError("workload.device", self.device, "must be cuda or cpu", "use cuda for GPU clusters")

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
                 f"{self.pflops:.3f} PFLOPS, {'fits in memory' if self.feasible else 'OUT OF MEMORY'}"]
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


def calibration_theta(cluster: Cluster) -> tuple[float, float, float, float]:
    """(theta_1, theta_2, theta_3f, theta_3b) of the cluster's calibration (Appendix B eq. 5)."""
    cal = cluster.calibration
    return (cal.theta_ddp, cal.theta_zero2, cal.theta_zero3_fwd, cal.theta_zero3_bwd)


def layer_times(cluster: Cluster, workload: Workload, devices: tuple[int, ...] | list[int], mb: int,
                recompute: bool) -> tuple[float, float, float, float]:
    """(T_f, T_b, Comp-TP-Fwd, Comm-TP-Fwd) of one layer for one micro-batch of ``mb`` sequences on
    the TP group ``devices`` (eq. 1-3): the slowest member sets the compute pace, the largest shard
    the FLOPs per rank; recomputation adds one forward to T_b."""
    model = workload.model
    c_min = min(cluster.devices[d].flops for d in devices)
    comp_f = cm.comp_layer_fwd(model.layer_forward_flops(mb), _shard_fraction(model, len(devices)), c_min)
    tp_f = cm.comm_tp(devices, activation_message_bytes(workload, mb), cluster.bandwidth, cluster.latency)
    return cm.layer_time_fwd(comp_f, tp_f), cm.layer_time_bwd(comp_f, tp_f, recompute), comp_f, tp_f


def activation_message_bytes(workload: Workload, mb: int) -> float:
    """M = B_mb * S * H * B_type: the activation one hop or TP all-reduce moves for one micro-batch."""
    return mb * workload.model.seq_len * workload.model.hidden_size * workload.dtype_bytes


def head_time(cluster: Cluster, workload: Workload, devices: tuple[int, ...] | list[int], mb: int) -> float:
    """LM head forward + backward (3 x 2*B*S*H*V FLOPs) for one micro-batch on the last stage, at the
    pace of the stage's slowest device."""
    return 3.0 * workload.model.head_forward_flops(mb) / min(cluster.devices[d].flops for d in devices)


def hop_time(cluster: Cluster, workload: Workload, src: tuple[int, ...], dst: tuple[int, ...], mb: int) -> float:
    """Comm-PP-Hop (eq. 6) from stage ``src`` to stage ``dst`` for one micro-batch, between the two
    stage leaders (``devices[0]``), which is how the runtime sends."""
    return cm.comm_pp_hop(src, dst, activation_message_bytes(workload, mb), cluster.bandwidth, cluster.latency,
                          leaders=(src[0], dst[0]))


def dp_element_bytes(workload: Workload) -> int:
    """Bytes per gradient element on the data-parallel wire."""
    return workload.dtype_bytes


def dp_layer_bytes(workload: Workload) -> float:
    """Bytes of one layer's gradient on the data-parallel wire (eq. 4's 12H^2 * B_type)."""
    return workload.model.layer_params * dp_element_bytes(workload)


def replicated_comm(plan: Plan, cluster: Cluster, workload: Workload) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
    """Per stage holding the embedding (first stages) or the LM head (last stages):
    [(kind, T_comm, TP broadcast)] of its gradient sync between pipelines
    (:func:`cost_model.comm_dp_replicated`, :func:`cost_model.tp_broadcast`); empty with one pipeline."""
    P = plan.num_pipelines
    if P == 1:
        return {}
    model, bt = workload.model, dp_element_bytes(workload)
    bw, lat = cluster.bandwidth, cluster.latency
    out: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
    for kind, pick, params in (("embedding", 0, model.embedding_params), ("head", -1, model.head_params)):
        stages = [p.stages[pick] for p in plan.pipelines]
        leaders = np.array([st.leader for st in stages])
        # eq. 4 between the leaders: every pair at once, a leader does not talk to itself
        terms = lat[np.ix_(leaders, leaders)] + params * bt / (P * bw[np.ix_(leaders, leaders)])
        np.fill_diagonal(terms, 0.0)
        tcs = terms.sum(axis=1)
        for i, st in enumerate(stages):
            j = 0 if pick == 0 else len(plan.pipelines[i].stages) - 1
            out.setdefault((i, j), []).append(
                (kind, float(tcs[i]), cm.tp_broadcast(st.leader, st.devices, params * bt, bw, lat)))
    return out


def replicated_exposed(terms: list[tuple[str, float, float]], head_s: float, sharding: str,
                       theta: tuple[float, float, float, float]) -> float:
    """Exposed time of a stage's embedding / LM-head syncs (:func:`cost_model.dp_exposed_replicated`);
    the LM head's backward (2/3 of ``head_s``, its forward + backward) is what its sync overlaps."""
    return sum(cm.dp_exposed_replicated(2.0 * head_s / 3.0 if kind == "head" else 0.0, tc, bc, sharding, theta)
               for kind, tc, bc in terms)


def layer_step(t_f: float, t_b: float, t_comm: float, sharding: str,
               theta: tuple[float, float, float, float]) -> tuple[float, float]:
    """(time per micro-batch, exposed data-parallel time per iteration) of one layer (eq. 5):
    ZeRO-3 overlaps every forward and backward with its gathers (theta_3f*max(T_f, T_comm) +
    theta_3b*max(T_b, T_comm)); DDP and ZeRO-2 run T_f + T_b; the exposed part is
    :func:`cost_model.dp_exposed_layer`. Both are non-decreasing in ``t_comm``."""
    if sharding == "zero3":
        step = theta[2] * max(t_f, t_comm) + theta[3] * max(t_b, t_comm)
    else:
        step = t_f + t_b
    return step, cm.dp_exposed_layer(t_b, t_comm, sharding, theta)


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on each device of a stage, phase by phase, each affine in the stage's layer count l:
    the peak is max over phases of ``fixed + l * per_layer``. Phases: the backward (states,
    stored activations, autograd working set, logits), the gradient sync (states, communication
    buckets) and the optimizer step (states, its temporaries)."""

    phases: tuple[tuple[float, float], ...]
    """((fixed, per_layer), ...) in bytes."""

    def peak(self, layers: int) -> float:
        return max(f + layers * p for f, p in self.phases)

    def max_layers(self, usable_bytes: float) -> int:
        """The most layers that fit in ``usable_bytes`` in every phase (0 if none)."""
        most = math.inf
        for f, p in self.phases:
            if f > usable_bytes:
                return 0
            if p > 0:
                most = min(most, math.floor((usable_bytes - f) / p * (1 - 1e-12)))
        return int(min(most, 1 << 30))


def stage_memory_terms(workload: Workload, sharding: str, num_pipelines: int, schedule: str, recompute: bool,
                       num_stages: int, j: int, tp: int, mb: int, n_mb: int) -> MemoryTerms:
    """Memory of stage j of a pipeline of ``num_stages`` stages; see :func:`stage_memory_at` (the
    position matters only through first / last stage and the in-flight micro-batches)."""
    return stage_memory_at(workload, sharding, num_pipelines, recompute, j == 0, j == num_stages - 1,
                           cm.inflight_micro_batches(schedule, num_stages, j, n_mb), tp, mb)


def stage_memory_at(workload: Workload, sharding: str, num_pipelines: int, recompute: bool, first: bool,
                    last: bool, inflight: int, tp: int, mb: int) -> MemoryTerms:
    """Bytes on each device of a stage of TP ``tp`` holding ``inflight`` micro-batches of ``mb``
    sequences at its peak, as the runtime allocates them (each term a named function of
    :mod:`cost_model`):

    - in every phase: the parameters' states (weights, gradients, optimizer;
      :func:`cost_model.runtime_state_bytes_per_param`) of the stage's layers, of the embedding
      (first stage) and of the final norm and LM head (last stage; replicated over TP), ZeRO-3's
      gathered current and prefetched layer, ``reserve_bytes``, and on CUDA the collective
      library's buffers for each communicator the device joins (world, TP group, pipeline
      neighbours, one data-parallel group; :func:`cost_model.comm_buffer_bytes`);
    - backward: the stored activations of the in-flight micro-batches (each layer's input when
      recomputing, else :func:`cost_model.stored_activation_bytes`), the working set of the layer
      being back-propagated (its recomputed activations when recomputing, plus
      :func:`cost_model.backward_working_bytes`), and the loss's float32 logits on the last stage
      (:func:`cost_model.logits_bytes`);
    - gradient sync: DDP's bucket copies of every synchronised gradient, ZeRO's two buckets in
      flight (:func:`cost_model.ddp_bucket_bytes`, :func:`cost_model.zero_window_bytes`);
    - optimizer step: Adam's temporaries (:func:`cost_model.optimizer_temp_bytes`): one float32
      state per parameter stepped at once (all of them with the multi-tensor step on CUDA, one
      bucket under ZeRO, the largest parameter with the CPU's single-tensor step).
    """
    model = workload.model
    bt = workload.dtype_bytes
    S, H, F = model.seq_len, model.hidden_size, model.ffn_hidden_size
    tokens = mb * S
    P = max(num_pipelines, 1)
    K = workload.optimizer_bytes_per_param
    layer_local = model.layer_params * _shard_fraction(model, tp)
    extra_params = (model.embedding_params if first else 0) + (model.head_params if last else 0)
    comms = 1 + (tp > 1) + (not first) + (not last) + (P > 1)
    common = workload.reserve_bytes + (cm.comm_buffer_bytes(comms, workload.comm_buffer_bytes)
                                       if workload.device == "cuda" else 0.0)
    if sharding == "zero3":
        common += 2 * layer_local * bt  # the gathered current and next layer

    def states(phase: str) -> tuple[float, float]:
        spp = cm.runtime_state_bytes_per_param(sharding, P, bt, K, phase, recompute)
        return common + extra_params * spp, layer_local * spp

    phases = []
    # backward: stored activations, the working set of the layer in its backward, the logits
    full = cm.stored_activation_bytes(tokens, H, model.kv_dim, F, tp, bt)
    fixed, per = states("backward")
    work = (full if recompute else 0.0) + cm.backward_working_bytes(tokens, H, F, tp, bt)
    if last:
        work += cm.logits_bytes(tokens, model.vocab_size)
    phases.append((fixed + work, per + inflight * (tokens * H * bt if recompute else full)))
    # gradient sync between pipelines: DDP's bucket copies, ZeRO's buckets in flight
    if P > 1:
        fixed, per = states("sync")
        if sharding == "ddp":
            phases.append((fixed + cm.ddp_bucket_bytes(extra_params, bt), per + cm.ddp_bucket_bytes(layer_local, bt)))
        else:
            phases.append((fixed + cm.zero_window_bytes(_BUCKET_CAP_BYTES), per))
    # optimizer step: Adam's temporaries (one float32 state per parameter stepped at once)
    fixed, per = states("step")
    state_b = max(4, bt) if K > 2 * bt else bt
    if sharding != "ddp":
        phases.append((fixed + cm.zero_window_bytes(_BUCKET_CAP_BYTES)
                       + cm.optimizer_temp_bytes(_BUCKET_CAP_BYTES / bt, state_b), per))
    elif workload.device == "cuda":
        phases.append((fixed + cm.optimizer_temp_bytes(extra_params, state_b),
                       per + cm.optimizer_temp_bytes(layer_local, state_b)))
    else:
        largest = max(H * F / tp, model.vocab_size * H if (first or last) else 0)
        phases.append((fixed + cm.optimizer_temp_bytes(largest, state_b), per))
    return MemoryTerms(tuple(phases))


_BUCKET_CAP_BYTES = 4 * 2**20
"""The runtime's gradient-sync and ZeRO bucket size (``runtime.grad_sync.DEFAULT_BUCKET_CAP_BYTES``)."""


def usable_memory(workload: Workload, capacity_bytes: float) -> float:
    """Bytes of a device the plan may use: its capacity less the ``memory_headroom`` fraction."""
    return capacity_bytes * (1.0 - workload.memory_headroom)


def estimate(plan: Plan, cluster: Cluster, workload: Workload) -> Estimate:
    """Estimate iteration time, throughput and memory of ``plan`` on ``cluster`` (Appendix B)."""
    model = workload.model
    S = model.seq_len
    theta = calibration_theta(cluster)
    dp_terms = dp_comm_all(plan, cluster, dp_layer_bytes(workload))
    rep_terms = replicated_comm(plan, cluster, workload)
    pipes: list[PipelineEstimate] = []
    ooms: list[OutOfMemory] = []
    n_comp = 4.0 if plan.recompute else 3.0
    n_tp = 3.0 if plan.recompute else 2.0
    for i, pipe in enumerate(plan.pipelines):
        mb, n_mb = pipe.micro_batch_size, pipe.num_micro_batches
        n_st = len(pipe.stages)
        per_mb, hops, tails, rows = [], [], [], []
        for j, st in enumerate(pipe.stages):
            l = st.num_layers
            t_f, t_b, comp_f, tp_f = layer_times(cluster, workload, st.devices, mb, plan.recompute)
            head_s = head_time(cluster, workload, st.devices, mb) if j == n_st - 1 else 0.0
            hop = hop_time(cluster, workload, st.devices, pipe.stages[j + 1].devices, mb) if j + 1 < n_st else 0.0
            stage_mb, tail, dp_comm = head_s, 0.0, 0.0
            for n_layers, t_comm in dp_terms[(i, j)]:
                step, exposed = layer_step(t_f, t_b, t_comm, plan.dp_sharding, theta)
                stage_mb += n_layers * step
                tail += n_layers * exposed
                dp_comm += n_layers * (2 * n_mb + 1 if plan.dp_sharding == "zero3" else 2) * t_comm
            rep = rep_terms.get((i, j), [])
            if rep:
                tail += replicated_exposed(rep, head_time(cluster, workload, st.devices, mb), plan.dp_sharding, theta)
                dp_comm += sum(2 * tc + bc for _, tc, bc in rep)
            per_mb.append(stage_mb)
            hops.append(hop)
            tails.append(tail)
            peak = stage_memory_terms(workload, plan.dp_sharding, plan.num_pipelines, plan.schedule,
                                      plan.recompute, n_st, j, st.tp, mb, n_mb).peak(l)
            cap = min(cluster.devices[d].memory_bytes for d in st.devices)
            for d in st.devices:
                usable = usable_memory(workload, cluster.devices[d].memory_bytes)
                if peak > usable:
                    ooms.append(OutOfMemory(d, cluster.devices[d].gpu_type, peak, usable))
            rows.append(dict(devices=list(st.devices), tp=st.tp, layers=list(st.layers),
                             compute_s=n_mb * (l * n_comp * comp_f + head_s), tp_comm_s=n_mb * l * n_tp * tp_f,
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


def _shard_fraction(model: LlamaConfig, tp: int) -> float:
    """model.max_shard_fraction(tp), memoised per model shape (the planner calls estimate() often)."""
    key = (model, tp)
    if key not in _FRAC:
        _FRAC[key] = model.max_shard_fraction(tp)
    return _FRAC[key]


_FRAC: dict[tuple[LlamaConfig, int], float] = {}


def workload_from_config(cfg) -> Workload:
    """Workload from a composed root config (``cfg.model`` and ``cfg.train``)."""
    dtype = cfg.train.dtype
    if dtype not in DTYPE_BYTES:
        from lightning_hexiscale.errors import ConfigError

        raise ConfigError("train.dtype", dtype, f"must be one of {sorted(DTYPE_BYTES)}", "use bf16")
    # fp32 training keeps no separate master copy: Adam's m and v only (4 + 4 bytes).
    return Workload(LlamaConfig.from_config(cfg.model), dtype=dtype,
                    optimizer_bytes_per_param=8.0 if dtype == "fp32" else 12.0,
                    memory_headroom=float(cfg.train.get("memory_headroom", 0.0) or 0.0),
                    device="cpu" if _cpu_cluster(cfg) else "cuda")


def _cpu_cluster(cfg) -> bool:
    """Whether every machine of ``cfg.cluster`` is a CPU device type (``CPU``, ``CPU-FAST``, ...: the
    emulated presets and profiled CPU hosts), i.e. the runtime runs on gloo without NCCL buffers."""
    try:
        machines = cfg.cluster.machines
        return bool(machines) and all(str(m["gpu"]).upper().startswith("CPU") for m in machines)
    except (AttributeError, KeyError, TypeError):
        return False
