"""Calibration: fit the cost model's efficiency per device type, sync latency and theta_ddp to measured steps.

The profile measures hardware (a large square matmul, ping-pong links); training runs smaller,
thinner matmuls plus attention, norms and element-wise work, synchronises ranks that finish their
work at slightly different times, and overlaps (or does not) the data-parallel sync in its own way.
Three constants, fitted in this order to a few measured training steps on the ranks themselves:

1. Efficiency per device type. Every rank trains the whole model alone (no communication; all
   ranks at once, as in training, so shared cores are shared here too) and
       efficiency_new[type] = efficiency_old[type] * median_{ranks of type} (T_est / T_meas)
   where T_est is the cost model's time for that one-device, one-stage plan (pure compute: layers
   x (fwd + 2 fwd for backward [+ fwd when recomputing]) + LM head, at FLOP/s = peak x efficiency).
   Compute time is proportional to 1/efficiency, so one multiplicative step fits it exactly.
2. Sync latency delta (seconds), added to every off-diagonal alpha[d, d']. The ping-pong alpha is
   the link's; a collective also waits for its slowest member and for a blocked rank to be woken
   up (on a virtual machine a sleeping vCPU can take ~2 ms to wake). A plan of TP-2 stages over
   rank pairs (0,1), (2,3), ... is measured, and delta in [0, 20 ms] is the value whose estimate
   matches it (Appendix B eq. 1 charges 4 alpha per layer-forward of a TP-2 stage, so the TP plan
   pins alpha down).
3. theta_ddp (Appendix B eq. 5, DDP: theta_1 * max(T_b, 2 T_comm) for the last backward and the
   gradient all-reduce). A pure data-parallel plan over all ranks is measured, and theta is the
   value whose estimate matches it, on a geometric grid over [0.1, 20] (ties, where the estimate is
   flat, go to the theta nearest 1).
Steps 2 and 3 are refined in turn (three rounds), since each plan's estimate depends a little on
the other constant. Each fit is a 1-D search on a grid: the estimate is monotone in each constant.

Every measurement runs in the run's precision (``precision``, a Lightning precision string: the
parameter dtype and autocast of :mod:`lightning_hexiscale.profiling.precision`; 32-true on CPU
ranks, bf16-mixed on CUDA by default), and the estimates price that dtype, so that the fitted
efficiency is the one of the matmuls training will run.

theta_zero2 / theta_zero3_* stay 1.0: the runtime has ZeRO-2/3 (runtime/zero.py, zero3.py), but no
calibration plan measures them yet; ZeRO plans are estimated with Appendix B's overlap as written.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from lightning_hexiscale.config.cluster import Calibration, Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, estimate
from lightning_hexiscale.profiling.check import cpu_workload, make_batch


# ---- pure fits ---------------------------------------------------------------------------------
def fit_efficiency(types: Sequence[str], predicted_s: Sequence[float], measured_s: Sequence[float],
                   current: dict[str, float]) -> dict[str, float]:
    """Per device type: current efficiency * median(predicted / measured) over its ranks."""
    out: dict[str, float] = {}
    for t in dict.fromkeys(types):
        ratios = [p / m for tt, p, m in zip(types, predicted_s, measured_s) if tt == t]
        if not all(math.isfinite(r) and r > 0 for r in ratios):
            raise ValueError(f"non-positive or non-finite time ratio for device type {t}: {ratios}")
        out[t] = current.get(t, 1.0) * statistics.median(ratios)
    return out


def fit_scalar(predict: Callable[[float], float], measured_s: float, grid: Sequence[float],
               prefer: float) -> float:
    """The grid value whose prediction is nearest ``measured_s`` (relative error); among equally good
    values (a flat part of the estimate) the one nearest ``prefer``."""
    g = np.asarray(list(grid) + [prefer], dtype=float)
    errs = np.array([abs(predict(float(x)) - measured_s) / measured_s for x in g])
    tied = g[errs <= errs.min() + 1e-9]
    return float(tied[np.argmin(np.abs(tied - prefer))])


def fit_theta(predict: Callable[[float], float], measured_s: float, lo: float = 0.1, hi: float = 20.0,
              points: int = 400) -> float:
    """theta in [lo, hi] (geometric grid) matching ``measured_s``; ties go to the theta nearest 1."""
    return fit_scalar(predict, measured_s, np.geomspace(lo, hi, points), 1.0)


def fit_sync_latency(predict: Callable[[float], float], measured_s: float, hi: float = 20e-3,
                     points: int = 801) -> float:
    """delta in [0, hi] seconds (25 us steps by default) matching ``measured_s``; ties go to 0."""
    return fit_scalar(predict, measured_s, np.linspace(0.0, hi, points), 0.0)


def with_calibration(cluster: Cluster, efficiency: dict[str, float] | None = None,
                     calibration: Calibration | None = None, sync_latency_s: float = 0.0,
                     layer_tables: tuple | None = None) -> Cluster:
    """A copy of ``cluster`` whose device FLOP/s are peak x the given efficiency per type (which
    then counts as calibrated: FLOPs / efficiency, not the roofline), whose theta constants are
    ``calibration`` (unchanged where not given), whose off-diagonal latencies are raised by
    ``sync_latency_s`` and whose layer tables are ``layer_tables`` (unchanged when None)."""
    eff = efficiency or {}
    devices = [replace(d, flops=d.peak_flops * eff[d.gpu_type], efficiency=eff[d.gpu_type]) if d.gpu_type in eff else d
               for d in cluster.devices]
    latency = cluster.latency + sync_latency_s * (1.0 - np.eye(cluster.num_devices))
    return Cluster(cluster.name, devices, list(cluster.machines), cluster.bandwidth.copy(), latency,
                   calibration or cluster.calibration, cluster.description, cluster.nics,
                   cluster.layer_tables if layer_tables is None else tuple(layer_tables), cluster.link_guess)


def current_efficiency(cluster: Cluster) -> dict[str, float]:
    """Efficiency per device type implied by the cluster (flops / peak_flops)."""
    return {d.gpu_type: d.flops / d.peak_flops for d in cluster.devices}


def single_device_plan(config: LlamaConfig, micro_batch: int, num_micro_batches: int, recompute: bool) -> Plan:
    """One pipeline, one stage, device 0, all layers: the plan whose estimate is pure compute."""
    return Plan.from_dict({"num_layers": config.num_layers, "schedule": "1f1b", "recompute": recompute,
                           "pipelines": [{"batch_size": micro_batch * num_micro_batches, "micro_batch_size": micro_batch,
                                          "stages": [{"devices": [0], "layers": [0, config.num_layers]}]}]})


def pure_dp_plan(world: int, config: LlamaConfig, micro_batch: int, num_micro_batches: int, recompute: bool) -> Plan:
    """One single-device pipeline per rank over all layers, equal batches."""
    b = micro_batch * num_micro_batches
    return Plan.from_dict({"num_layers": config.num_layers, "schedule": "1f1b", "recompute": recompute,
                           "pipelines": [{"batch_size": b, "micro_batch_size": micro_batch,
                                          "stages": [{"devices": [r], "layers": [0, config.num_layers]}]}
                                         for r in range(world)]})


def tp_pairs_plan(world: int, config: LlamaConfig, micro_batch: int, num_micro_batches: int, recompute: bool) -> Plan:
    """One pipeline per rank pair (0,1), (2,3), ...: a single TP-2 stage over all layers (an odd last
    rank gets a single-device pipeline), equal batches."""
    b = micro_batch * num_micro_batches
    groups = [[r, r + 1] for r in range(0, world - 1, 2)] + ([[world - 1]] if world % 2 else [])
    return Plan.from_dict({"num_layers": config.num_layers, "schedule": "1f1b", "recompute": recompute,
                           "pipelines": [{"batch_size": b, "micro_batch_size": micro_batch,
                                          "stages": [{"devices": g, "layers": [0, config.num_layers]}]}
                                         for g in groups]})


# ---- measurement on the ranks ------------------------------------------------------------------
def measure_compute_rank(rank: int, world: int, config: LlamaConfig, micro_batch: int, num_micro_batches: int,
                         recompute: bool, steps: int = 3, warmup: int = 1, precision: str | None = None) -> list[float]:
    """Collective (barrier per step): seconds per timed step for this rank to run forward + backward of
    ``num_micro_batches`` micro-batches through the whole model, built by the runtime's
    ``build_stage`` (TP 1, one stage, the same recomputation), with no communication, in ``precision``
    (its parameter dtype, the forward under its autocast; None: the device's default)."""
    from lightning_hexiscale.models.llama import Llama, causal_lm_loss
    from lightning_hexiscale.profiling import precision as prec
    from lightning_hexiscale.profiling.measure import current_device
    from lightning_hexiscale.runtime.parallelize import build_stage

    device = current_device()
    run = prec.resolve(precision, device)
    with torch.device("meta"):
        model = Llama(config)
    stage = build_stage(model, (0, config.num_layers), True, True, 1, 0, None, device=device,
                        dtype=run.param_dtype, recompute=recompute, seed=rank)
    times = []
    for k in range(warmup + steps):
        tok, tgt = make_batch(config, micro_batch * num_micro_batches, k)
        for p in stage.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in zip(tok.split(micro_batch), tgt.split(micro_batch)):
            with run.autocast(device):
                loss = causal_lm_loss(stage(x.to(device)), y.to(device)) / num_micro_batches
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class CalibrationResult:
    efficiency: dict[str, float]
    """Fitted efficiency per device type."""
    sync_latency_s: float
    """Fitted delta added to every off-diagonal alpha (s)."""
    theta_ddp: float
    compute_measured_s: list[float]
    """Per rank: measured compute-only time of the calibration batch."""
    compute_predicted_s: list[float]
    """Per rank: its estimate before the fit."""
    tp_measured_s: float
    tp_predicted_s: tuple[float, float]
    """TP-pairs plan estimate (fitted efficiency, delta 0, theta 1) and after the full fit."""
    dp_measured_s: float
    dp_predicted_s: tuple[float, float]
    """Pure-DP estimate (fitted efficiency, delta 0, theta 1) and after the full fit."""
    layer_tables: tuple = ()
    """Layer times measured with ``--layer-times`` (written into the cluster file)."""

    def summary(self) -> str:
        lines = ["efficiency per device type: " + ", ".join(f"{t} {e:.4f}" for t, e in self.efficiency.items())]
        for r, (p, m) in enumerate(zip(self.compute_predicted_s, self.compute_measured_s)):
            lines.append(f"  rank {r}: compute alone measured {m:.3f} s, estimated {p:.3f} s before calibration")
        lines.append(f"sync latency delta = {self.sync_latency_s * 1e6:.0f} us: TP-2 pairs measured {self.tp_measured_s:.3f} s, "
                     f"estimated {self.tp_predicted_s[0]:.3f} s before, {self.tp_predicted_s[1]:.3f} s after")
        lines.append(f"theta_ddp = {self.theta_ddp:.3f}: pure DP measured {self.dp_measured_s:.3f} s, estimated "
                     f"{self.dp_predicted_s[0]:.3f} s before, {self.dp_predicted_s[1]:.3f} s after")
        return "\n".join(lines)


def _calibrate_rank(rank: int, world: int, config: LlamaConfig, micro_batch: int, num_micro_batches: int,
                    recompute: bool, steps: int, warmup: int, precision: str | None = None,
                    layer_opts: dict | None = None):
    from lightning_hexiscale.profiling.check import measure_plan_rank

    compute = measure_compute_rank(rank, world, config, micro_batch, num_micro_batches, recompute, steps, warmup,
                                   precision)
    tp_plan = tp_pairs_plan(world, config, micro_batch, num_micro_batches, recompute)
    tp = measure_plan_rank(rank, world, tp_plan.to_dict(), config, steps, warmup, precision) if world > 1 else None
    dp_plan = pure_dp_plan(world, config, micro_batch, num_micro_batches, recompute)
    dp = measure_plan_rank(rank, world, dp_plan.to_dict(), config, steps, warmup, precision)
    everything: list = [None] * world
    dist.all_gather_object(everything, (compute, tp, dp))
    tables = ()
    if layer_opts is not None:  # the cluster's own device types and machines (device id = rank)
        from lightning_hexiscale.profiling.layer_times import measure_layer_tables

        tables = measure_layer_tables(config, precision=precision, **layer_opts)
    return (everything, tables) if rank == 0 else None


@dataclass(frozen=True)
class CalibrationSteps:
    """Raw step times of the two calibration measurements (seconds)."""

    compute_s: list[list[float]]
    """Per rank: its timed compute-only steps."""
    tp_steps_s: list[float]
    """Per timed step of the TP-pairs plan: the slowest rank's step time (empty for one rank)."""
    dp_steps_s: list[float]
    """Per timed pure-DP step: the slowest rank's step time."""
    layer_tables: tuple = ()
    """Measured layer times (``--layer-times``), one :class:`~lightning_hexiscale.config.layer_table.LayerTable` per type."""

    def merged(self, other: CalibrationSteps) -> CalibrationSteps:
        """Both launches' steps together (so the fastest / median is over all of them)."""
        return CalibrationSteps([a + b for a, b in zip(self.compute_s, other.compute_s)],
                                self.tp_steps_s + other.tp_steps_s, self.dp_steps_s + other.dp_steps_s,
                                other.layer_tables or self.layer_tables)


def measure_calibration(world: int, config: LlamaConfig, micro_batch: int = 2, num_micro_batches: int = 2,
                        recompute: bool = False, steps: int = 5, warmup: int = 1, local: int | None = None,
                        timeout_s: float = 900.0, precision: str = "32-true",
                        layer_opts: dict | None = None) -> CalibrationSteps | None:
    """Run both calibration measurements on ``local`` forked ranks (or the launcher's ranks, when
    ``local`` is None), and with ``layer_opts`` (keyword arguments of
    :func:`~lightning_hexiscale.profiling.layer_times.measure_layer_tables`) the layer times too;
    the steps on rank 0 / local, None on the other ranks."""
    from lightning_hexiscale.profiling.check import PlanMeasurement
    from lightning_hexiscale.profiling.launch import run_from_env, run_local

    args = (config, micro_batch, num_micro_batches, recompute, steps, warmup, precision, layer_opts)
    if local is not None:
        if local != world:
            from lightning_hexiscale.errors import ConfigError

            raise ConfigError("--local", local, f"the cluster has {world} devices, one per rank", f"use --local {world}")
        got = run_local(local, _calibrate_rank, *args, timeout_s=timeout_s)[0]
    else:
        got = run_from_env(_calibrate_rank, *args, timeout_s=timeout_s)
        if got is None:
            return None
    per_rank, tables = got
    tp = PlanMeasurement.from_ranks([t for _, t, _ in per_rank]).steps_s if world > 1 else []
    return CalibrationSteps([c for c, _, _ in per_rank], tp, PlanMeasurement.from_ranks([d for _, _, d in per_rank]).steps_s,
                            tuple(tables or ()))


def fit_calibration(cluster: Cluster, config: LlamaConfig, measured: CalibrationSteps, micro_batch: int = 2,
                    num_micro_batches: int = 2, recompute: bool = False, stat: str = "min",
                    precision: str = "32-true") -> CalibrationResult:
    """Fit efficiency per device type, then theta_ddp, to ``measured`` (see the module docstring).

    ``stat`` reduces step times to one time (``min`` or ``median``, see
    :data:`~lightning_hexiscale.profiling.check.STATS`); use the same when checking estimates.
    ``precision``: the one ``measured`` ran in (the estimates price its dtype).
    """
    reduce = min if stat == "min" else statistics.median
    world = cluster.num_devices
    compute_meas = [reduce(c) for c in measured.compute_s]
    workload = cpu_workload(config, precision)
    one = single_device_plan(config, micro_batch, num_micro_batches, recompute)
    base = Calibration(**{**cluster.calibration.__dict__, "theta_ddp": 1.0})
    # theta 1 for the compute-only plan: the estimate applies theta_ddp to the last backward even
    # of a single pipeline (eq. 5 read literally), but a rank training alone overlaps nothing. The
    # efficiency is a factor of the FLOPs / efficiency path: fitted on it (no layer table, the
    # current efficiency set so that no roofline applies), whatever prices the case afterwards.
    plain = with_calibration(cluster, current_efficiency(cluster), calibration=base, layer_tables=())
    tables = measured.layer_tables or cluster.layer_tables
    pred = [estimate(one, plain.subset([r]), workload).iteration_time_s for r in range(world)]
    types = [d.gpu_type for d in cluster.devices]
    eff = fit_efficiency(types, pred, compute_meas, current_efficiency(cluster))
    dp_plan = pure_dp_plan(world, config, micro_batch, num_micro_batches, recompute)
    tp_plan = tp_pairs_plan(world, config, micro_batch, num_micro_batches, recompute)

    def predict(plan: Plan, delta: float, theta: float) -> float:
        c = with_calibration(cluster, eff, replace(base, theta_ddp=theta), delta, layer_tables=tables)
        return estimate(plan, c, workload).iteration_time_s

    dp_s = reduce(measured.dp_steps_s)
    delta, theta = 0.0, 1.0
    if world > 1:
        tp_s = reduce(measured.tp_steps_s)
        for _ in range(3):
            delta = fit_sync_latency(lambda d: predict(tp_plan, d, theta), tp_s)
            theta = fit_theta(lambda t: predict(dp_plan, delta, t), dp_s)
        tp_pred = (predict(tp_plan, 0.0, 1.0), predict(tp_plan, delta, theta))
    else:
        tp_s, tp_pred = float("nan"), (float("nan"), float("nan"))
    return CalibrationResult(eff, delta, theta, compute_meas, pred, tp_s, tp_pred, dp_s,
                             (predict(dp_plan, 0.0, 1.0), predict(dp_plan, delta, theta)), tuple(measured.layer_tables))


def calibrate(cluster: Cluster, config: LlamaConfig, micro_batch: int = 2, num_micro_batches: int = 2,
              recompute: bool = False, steps: int = 5, warmup: int = 1, local: int | None = None,
              timeout_s: float = 900.0, stat: str = "min", precision: str = "32-true",
              layer_opts: dict | None = None) -> CalibrationResult | None:
    """Measure (:func:`measure_calibration`) and fit (:func:`fit_calibration`) in ``precision``; None on
    ranks > 0. With ``layer_opts`` the layer times are measured on the cluster's device types and
    machines (device id = rank) and the fit prices with them."""
    if layer_opts is not None:
        layer_opts = {"types": [d.gpu_type for d in cluster.devices],
                      "machines": [list(m.devices) for m in cluster.machines], **layer_opts}
    measured = measure_calibration(cluster.num_devices, config, micro_batch, num_micro_batches, recompute, steps,
                                   warmup, local, timeout_s, precision, layer_opts)
    if measured is None:
        return None
    return fit_calibration(cluster, config, measured, micro_batch, num_micro_batches, recompute, stat, precision)
