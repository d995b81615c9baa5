"""Compute time of a layer, the LM head and the embedding on a TP group: measured, roofline or FLOPs.

Three sources, in this order of preference (each a named function below; all times are seconds of
one micro-batch on the slowest rank of the group, which the group waits for):

1. **Measured** (:func:`measured_times`): the cluster file's layer table
   (:mod:`lightning_hexiscale.config.layer_table`) for the group's device type, the model's shape
   and the run's precision, at the group's TP degree, interpolated in the micro-batch size. Its
   times include the TP collectives, which are then not priced again. Used for TP groups inside
   one machine (the table was measured over the machine's own links).
2. **Roofline** (:func:`layer_compute_s`, :func:`head_compute_s`, :func:`embedding_compute_s` with
   :mod:`.roofline`): CUDA devices whose type is not calibrated (no ``efficiency``) and has a memory
   bandwidth: GEMM FLOPs at ``gemm_efficiency`` (default
   :data:`~lightning_hexiscale.planner.cost.roofline.DEFAULT_GEMM_EFFICIENCY`) of the matmul peak,
   memory-bound bytes at ``hbm_efficiency`` of the bandwidth.
3. **FLOPs / efficiency** (Appendix B eq. 2): FLOPs / (matmul peak x efficiency), efficiency 1.0
   when not calibrated. CPU workloads (``Workload.device == "cpu"``) always take this path, at the
   device's declared FLOP/s, as before.

The matmul peak is the dtype's (:func:`matmul_peak`): the dense 16-bit tensor peak for bf16 / fp16,
the FP32 (or, with ``Workload.allow_tf32``, TF32) peak for ``32-true`` on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence

from lightning_hexiscale.config.cluster import DEFAULT_INTER_MACHINE, Cluster, Device
from lightning_hexiscale.config.layer_table import LayerTable, ModelShape, mismatch_rule, refuse_or_warn
from lightning_hexiscale.config.recipe import PRECISION_DTYPES
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost import roofline as rf
from lightning_hexiscale.planner.cost.memory import shard_fraction
from lightning_hexiscale.planner.cost.workload import Workload


# ---- rates -----------------------------------------------------------------------------------------
def matmul_peak(device: Device, workload: Workload) -> float:
    """Peak FLOP/s of the run's matmuls on ``device``: ``peak_flops`` (dense 16-bit tensor) for bf16 /
    fp16 and on CPU workloads; for fp32 on CUDA the type's TF32 peak with ``allow_tf32``, else its
    FP32 peak (``fp32_flops``), falling back to ``peak_flops`` where the type has no such figure (a
    profiled type measured in the run's own dtype)."""
    if workload.device == "cuda" and workload.dtype == "fp32":
        rate = device.tf32_flops if workload.allow_tf32 else device.fp32_flops
        if rate is not None:
            return rate
    return device.peak_flops


def flops_rate(device: Device, workload: Workload) -> float:
    """Sustained FLOP/s of the FLOPs / efficiency path: matmul_peak * efficiency (1.0 when not
    calibrated). For bf16 and CPU workloads this is ``device.flops``."""
    if workload.device != "cuda" or matmul_peak(device, workload) == device.peak_flops:
        return device.flops
    return matmul_peak(device, workload) * (1.0 if device.efficiency is None else device.efficiency)


def uses_roofline(device: Device, workload: Workload) -> bool:
    """The roofline prices this device: a CUDA workload, an uncalibrated type (no ``efficiency``)
    with a memory bandwidth figure."""
    return workload.device == "cuda" and device.efficiency is None and device.memory_bandwidth_Bps is not None


def _roofline(device: Device, workload: Workload, flops: float, nbytes: float) -> float:
    return rf.roofline_s(flops, nbytes, matmul_peak(device, workload), device.memory_bandwidth_Bps,
                         device.gemm_efficiency or rf.DEFAULT_GEMM_EFFICIENCY,
                         device.hbm_efficiency or rf.DEFAULT_HBM_EFFICIENCY)


# ---- computed: roofline or FLOPs ---------------------------------------------------------------------
def layer_compute_s(cluster: Cluster, workload: Workload, devices: Sequence[int], mb: int) -> tuple[float, float]:
    """(Comp-Fwd, Comp-Bwd) of one layer for one micro-batch of ``mb`` sequences on the TP group
    ``devices``, the slowest member's:

        FLOPs path:  fwd = F_layer * f / c,  bwd = 2 * fwd                  (Appendix B eq. 2)
        roofline:    fwd = roofline(F_layer * f, layer_forward_bytes)
                     bwd = roofline(2 * F_layer * f, layer_backward_bytes)

    with F_layer = ``model.layer_forward_flops(mb)``, f the largest share of the layer's matmul
    weights on one rank (1/t for even splits), c = :func:`flops_rate`."""
    fwd = bwd = 0.0
    for d in _kinds(cluster, devices):
        f, b = _layer_compute_one(d, workload, len(devices), mb)
        fwd, bwd = max(fwd, f), max(bwd, b)
    return fwd, bwd


@functools.lru_cache(maxsize=65536)
def _layer_compute_one(d: Device, workload: Workload, t: int, mb: int) -> tuple[float, float]:
    """:func:`layer_compute_s` on one device of a TP-``t`` group (memoised: the search asks for the
    same type, degree and size for many groups)."""
    model = workload.model
    frac = shard_fraction(model, t)
    flops = model.layer_forward_flops(mb)
    if uses_roofline(d, workload):
        args = (model, mb * model.seq_len, t, workload.dtype_bytes, workload.param_bytes, workload.mixed)
        return (_roofline(d, workload, flops * frac, rf.layer_forward_bytes(*args)),
                _roofline(d, workload, 2.0 * flops * frac, rf.layer_backward_bytes(*args, frac)))
    f = cm.comp_layer_fwd(flops, frac, flops_rate(d, workload))
    return f, cm.comp_layer_bwd(f)


def layer_backward_s(comp_fwd_s: float, comp_bwd_s: float, comm_tp_s: float, recompute: bool) -> float:
    """T_b = Comp-Bwd + Comm-TP-Bwd (Appendix B eq. 3), plus the re-run forward when recomputing:
    Comp-Fwd + RECOMPUTE_TP_SHARE * Comm-TP-Fwd (:func:`cost.model.layer_time_bwd` with Comp-Bwd
    given, which the roofline prices apart from 2 x Comp-Fwd)."""
    t_b = comp_bwd_s + comm_tp_s
    if recompute:
        t_b += comp_fwd_s + cm.RECOMPUTE_TP_SHARE * comm_tp_s
    return t_b


def head_compute_s(cluster: Cluster, workload: Workload, devices: Sequence[int], mb: int) -> float:
    """Forward + backward of the LM head and loss for one micro-batch, the slowest member's:

        FLOPs path:  3 * (2 B_mb S H V) * f_V / c            (cost.model.vocab_parallel_head)
        roofline:    roofline(3 * (2 B_mb S H V) * f_V, head_bytes)

    f_V = ceil(V/t)/V, the largest vocabulary share."""
    return max(_head_compute_one(d, workload, len(devices), mb) for d in _kinds(cluster, devices))


@functools.lru_cache(maxsize=65536)
def _head_compute_one(d: Device, workload: Workload, t: int, mb: int) -> float:
    model = workload.model
    vfrac = model.max_vocab_fraction(t)
    flops = model.head_forward_flops(mb)
    if uses_roofline(d, workload):
        nbytes = rf.head_bytes(model, mb * model.seq_len, t, workload.dtype_bytes, workload.param_bytes, workload.mixed)
        return _roofline(d, workload, 3.0 * flops * vfrac, nbytes)
    return 3.0 * flops * vfrac / flops_rate(d, workload)


def embedding_compute_s(cluster: Cluster, workload: Workload, devices: Sequence[int], mb: int) -> float:
    """Forward + backward of the first stage's embedding for one micro-batch: its memory-bound
    bytes (:func:`roofline.embedding_bytes`) at the bandwidth under the roofline; 0 on the FLOPs
    path (a lookup has no FLOPs: Appendix B prices none)."""
    model = workload.model
    worst = 0.0
    for d in _kinds(cluster, devices):
        if uses_roofline(d, workload):
            nbytes = rf.embedding_bytes(model, mb * model.seq_len, len(devices), workload.param_bytes)
            worst = max(worst, _roofline(d, workload, 0.0, nbytes))
    return worst


def _kinds(cluster: Cluster, devices: Sequence[int]) -> list[Device]:
    """The group's devices with their id and machine cleared, one per distinct set of figures
    (members of one type price alike; hashable keys for the memoised per-device terms)."""
    out: dict[Device, None] = {}
    for i in devices:
        out.setdefault(without_place(cluster.devices[i]), None)
    return list(out)


@functools.lru_cache(maxsize=65536)
def without_place(d: Device) -> Device:
    """``d`` with its id and machine cleared: what prices it (devices of one type on any machine give
    equal ones; a hashable memo key)."""
    return dataclasses.replace(d, id=0, machine=0)


def effective_flops(device: Device, workload: Workload) -> float:
    """The FLOP/s ``device`` sustains on one of the workload's layers under the roofline:
    F_layer(1) / (Comp-Fwd + Comp-Bwd) * 3 at TP 1 and micro-batch 1, i.e. the rate that makes
    FLOPs / rate equal the roofline's time; ``device.flops`` where the roofline does not apply."""
    if not uses_roofline(device, workload):
        return device.flops
    fwd, bwd = _layer_compute_one(without_place(device), workload, 1, 1)
    return 3.0 * workload.model.layer_forward_flops(1) / (fwd + bwd)


def effective_cluster(cluster: Cluster, workload: Workload) -> Cluster:
    """``cluster`` with each roofline-priced device's ``flops`` set to :func:`effective_flops`: the
    search ranks, partitions and balances devices by ``flops`` (its heuristics), which should then
    follow the speeds the cost model prices (an H20 is 4.9x slower than an H800 per layer, not
    6.7x). Pricing is unchanged (the roofline does not read ``flops``). The same cluster when no
    device is priced by the roofline."""
    if not any(uses_roofline(d, workload) for d in cluster.devices):
        return cluster
    devices = [dataclasses.replace(d, flops=effective_flops(d, workload)) for d in cluster.devices]
    return Cluster(cluster.name, devices, list(cluster.machines), cluster.bandwidth.copy(), cluster.latency.copy(),
                   cluster.calibration, cluster.description, cluster.nics, cluster.layer_tables,
                   cluster.link_guess)


# ---- measured ----------------------------------------------------------------------------------------
def table_for(cluster: Cluster, workload: Workload, gpu_type: str) -> LayerTable | None:
    """The cluster's layer table for ``gpu_type``, the workload's model shape and precision (the
    parameter and compute dtypes of the table's precision equal the workload's), or None when the
    cluster has no table for the type. Tables for the type that all differ in shape or precision
    are a ConfigError naming the difference (with ``workload.allow_table_mismatch``: a warning,
    then None, i.e. the computed path): :mod:`planner.cost.sources`, rule 1."""
    if not cluster.layer_tables:
        return None
    found = _find(cluster.layer_tables, gpu_type, workload.dtype, workload.param_dtype or workload.dtype,
                  ModelShape.of(workload.model))
    if found is None:
        theirs = [t for t in cluster.layer_tables if t.gpu == gpu_type]
        if theirs:
            refuse_or_warn(
                "cluster.layer_times", gpu_type, mismatch_rule(theirs, workload),
                f"measure this model and precision on {gpu_type} (hexiscale discover --model {workload.model.name} "
                f"--rediscover, or hexiscale profile --model {workload.model.name}), or remove the {gpu_type} "
                f"entries from layer_times", workload.allow_table_mismatch, "FLOP/s (the computed path)")
    return found


@functools.lru_cache(maxsize=1024)
def _find(tables: tuple[LayerTable, ...], gpu_type: str, dtype: str, param_dtype: str,
          shape: ModelShape) -> LayerTable | None:
    for t in tables:
        t_dtype = PRECISION_DTYPES[t.precision]
        t_param = "fp32" if t.precision.endswith("-mixed") else t_dtype
        if t.gpu == gpu_type and (t_dtype, t_param) == (dtype, param_dtype) and t.shape == shape:
            return t
    return None


def measured_times(cluster: Cluster, workload: Workload, part: str, devices: Sequence[int], mb: int,
                   recompute: bool = False) -> tuple[float, float] | None:
    """(forward, backward) seconds of ``part`` (``layer``, ``embedding``, ``head``) for one
    micro-batch on the TP group ``devices`` from the cluster's layer table, TP collectives included
    (:meth:`LayerTable.times`: linear in the micro-batch size between measured sizes, the nearest
    size's per-sequence time outside them; a layer's backward with recomputation is its measured
    ``backward_recompute``, else backward + forward). None (the caller computes it) when the group
    spans machines, mixes device types, or the table has no row of that part at its TP degree."""
    if not cluster.layer_tables:
        return None
    first = cluster.devices[devices[0]]
    if any(cluster.devices[d].machine != first.machine or cluster.devices[d].gpu_type != first.gpu_type
           for d in devices):
        return None
    table = table_for(cluster, workload, first.gpu_type)
    return table.times(part, len(devices), mb, recompute) if table is not None else None


# ---- the datasheet notice ----------------------------------------------------------------------------
class DatasheetPricingWarning(UserWarning):
    """A plan for CUDA devices is priced from datasheet figures (no measured table, no calibration)."""

    cli_notice = True
    """``hexiscale`` prints it as one line (``cli/main.py``)."""


_WARNED: set[str] = set()
"""Device types the notice has named in this process."""


def datasheet_types(cluster: Cluster, workload: Workload) -> list[str]:
    """Device types of a CUDA workload priced from the catalog's datasheet figures alone: no
    ``efficiency`` (calibration), no measured GEMM fraction (probe) and no layer table for the
    model and precision. Empty for CPU workloads and for user-declared or profiled types."""
    if workload.device != "cuda":
        return []
    out = []
    for d in cluster.devices:
        if (d.datasheet and d.efficiency is None and d.gemm_efficiency is None
                and table_for(cluster, workload, d.gpu_type) is None and d.gpu_type not in out):
            out.append(d.gpu_type)
    return out


def warn_datasheet_pricing(cluster: Cluster, workload: Workload) -> str | None:
    """Warn once per process and device type that the plan is priced from datasheet figures;
    returns the message, or None when nothing is priced so (or every type was named already).
    Per type, not per set: ``hexiscale plan --baselines`` searches subsets of the machines, and each
    subset's set of types gave its own notice (four for case_study, where the docs promise one)."""
    types = [t for t in datasheet_types(cluster, workload) if t not in _WARNED]
    if not types:
        return None
    _WARNED.update(types)
    msg = (f"{', '.join(types)}: priced from datasheet figures (no measured layer times, no calibration): "
           f"GEMMs at {rf.DEFAULT_GEMM_EFFICIENCY:.0%} of the dense peak, memory-bound work at "
           f"{rf.DEFAULT_HBM_EFFICIENCY:.0%} of the memory bandwidth. For measured times run `hexiscale profile "
           f"--model {workload.model.name}` on the cluster (or `hexiscale calibrate`), or set "
           f"gpu_types.<type>.gemm_efficiency from recipes/mfu_probe.py")
    warnings.warn(msg, DatasheetPricingWarning, stacklevel=3)
    return msg


class DefaultLinkWarning(UserWarning):
    """Links between machines are priced at the default bandwidth: the cluster file gave none."""

    cli_notice = True
    """``hexiscale`` prints it as one line (``cli/main.py``)."""


_LINKS_WARNED: set[tuple[str, tuple, int]] = set()
"""(cluster name, first pairs, count) the notice has named in this process."""


def warn_default_links(cluster: Cluster, devices: Sequence[int] | None = None) -> str | None:
    """Warn once per process and cluster that machine pairs are priced at
    :data:`~lightning_hexiscale.config.cluster.DEFAULT_INTER_MACHINE` because the cluster file gave no
    link for them (:meth:`Cluster.default_links`); returns the message, or None when no pair is
    (``devices``: only pairs of machines that hold some of them, e.g. a plan's). A user's cluster
    file without ``inter_machine`` was priced at 1 GB/s without a word, and a plan that crosses a
    25 GB/s link or a 1 GbE one is another plan."""
    used = None if devices is None else {cluster.machines[cluster.devices[d].machine].name for d in devices}
    first, count = cluster.default_links(used)
    if not count or (cluster.name, first, count) in _LINKS_WARNED:
        return None
    _LINKS_WARNED.add((cluster.name, first, count))
    named = ", ".join(f"{a}-{b}" for a, b in first) + (f" and {count - len(first)} more" if count > len(first) else "")
    msg = (f"cluster {cluster.name}: the links between machines ({named}) are priced at "
           f"{DEFAULT_INTER_MACHINE / 1e9:g} GB/s, a guess: the cluster file gives no inter_machine.bandwidth. "
           f"Measure them (`hexiscale discover` or `hexiscale profile` on the cluster) or set "
           f"cluster.inter_machine.bandwidth (e.g. \"10 Gbps\")")
    warnings.warn(msg, DefaultLinkWarning, stacklevel=3)
    return msg
