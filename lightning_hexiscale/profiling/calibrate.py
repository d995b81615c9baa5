"""Calibration: fit the cost model's efficiency per device type and theta_ddp to measured steps.

The profile measures hardware (a large square matmul, ping-pong links); training runs smaller,
thinner matmuls plus attention, norms and element-wise work, so the model's compute rate is a
fraction of the matmul rate, and the data-parallel sync overlaps (or does not) in its own way.
Two steps, each a few measured training steps on the ranks themselves:

1. Efficiency per device type. Every rank trains the whole model alone (no communication; all
   ranks at once, as in training, so shared cores are shared here too) and
       efficiency_new[type] = efficiency_old[type] * median_{ranks of type} (T_est / T_meas)
   where T_est is the cost model's time for that one-device, one-stage plan (pure compute: layers
   x (fwd + 2 fwd for backward [+ fwd when recomputing]) + LM head, at FLOP/s = peak x efficiency).
   Compute time is proportional to 1/efficiency, so one multiplicative step fits it exactly.
2. theta_ddp (Appendix B eq. 5, DDP: theta_1 * max(T_b, 2 T_comm) for the last backward and the
   gradient all-reduce). A pure data-parallel plan over all ranks is measured, and theta is the
   value whose estimate matches it, found on a geometric grid over [0.1, 20] (the estimate is
   monotone non-decreasing in theta; ties, where the estimate is flat, go to the theta nearest 1).

theta_zero2 / theta_zero3_* stay 1.0: the runtime has no ZeRO-2/3 sharding to measure them on.
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

from lightning_hexiscale.cluster import Calibration, Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.estimate import estimate
from lightning_hexiscale.planner.plan import Plan
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


def fit_theta(predict: Callable[[float], float], measured_s: float, lo: float = 0.1, hi: float = 20.0,
              points: int = 400) -> float:
    """The theta in [lo, hi] whose prediction is nearest ``measured_s`` (relative error); among equally
    good values (a flat part of the estimate) the one nearest 1 in log scale."""
    grid = np.geomspace(lo, hi, points)
    grid = np.append(grid, 1.0)
    errs = np.array([abs(predict(float(th)) - measured_s) / measured_s for th in grid])
    best = errs.min()
    tied = grid[errs <= best + 1e-9]
    return float(tied[np.argmin(np.abs(np.log(tied)))])


def with_calibration(cluster: Cluster, efficiency: dict[str, float] | None = None,
                     calibration: Calibration | None = None) -> Cluster:
    """A copy of ``cluster`` whose device FLOP/s are peak x the given efficiency per type and whose
    theta constants are ``calibration`` (unchanged where not given)."""
    eff = efficiency or {}
    devices = [replace(d, flops=d.peak_flops * eff[d.gpu_type]) if d.gpu_type in eff else d for d in cluster.devices]
    return Cluster(cluster.name, devices, list(cluster.machines), cluster.bandwidth.copy(), cluster.latency.copy(),
                   calibration or cluster.calibration, cluster.description)


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


# ---- measurement on the ranks ------------------------------------------------------------------
def measure_compute_rank(rank: int, world: int, config: LlamaConfig, micro_batch: int, num_micro_batches: int,
                         recompute: bool, steps: int = 3, warmup: int = 1) -> list[float]:
    """Collective (barrier per step): seconds per timed step for this rank to run forward + backward of
    ``num_micro_batches`` micro-batches through the whole model, built by the runtime's
    ``build_stage`` (TP 1, one stage, the same recomputation), with no communication."""
    from lightning_hexiscale.models.llama import Llama, causal_lm_loss
    from lightning_hexiscale.profiling.measure import current_device
    from lightning_hexiscale.runtime.parallelize import build_stage

    device = current_device()
    with torch.device("meta"):
        model = Llama(config)
    stage = build_stage(model, (0, config.num_layers), True, True, 1, 0, None, device=device,
                        dtype=torch.float32, recompute=recompute, seed=rank)
    times = []
    for k in range(warmup + steps):
        tok, tgt = make_batch(config, micro_batch * num_micro_batches, k)
        for p in stage.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in zip(tok.split(micro_batch), tgt.split(micro_batch)):
            (causal_lm_loss(stage(x.to(device)), y.to(device)) / num_micro_batches).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class CalibrationResult:
    efficiency: dict[str, float]
    """Fitted efficiency per device type."""
    theta_ddp: float
    compute_measured_s: list[float]
    """Per rank: measured compute-only time of the calibration batch."""
    compute_predicted_s: list[float]
    """Per rank: its estimate before the fit."""
    dp_measured_s: float
    dp_predicted_before_s: float
    """Pure-DP estimate with the fitted efficiency and theta_ddp = 1."""
    dp_predicted_after_s: float

    def summary(self) -> str:
        lines = ["efficiency per device type: " + ", ".join(f"{t} {e:.4f}" for t, e in self.efficiency.items())]
        for r, (p, m) in enumerate(zip(self.compute_predicted_s, self.compute_measured_s)):
            lines.append(f"  rank {r}: compute alone measured {m:.3f} s, estimated {p:.3f} s before calibration")
        lines.append(f"theta_ddp = {self.theta_ddp:.3f}: pure DP measured {self.dp_measured_s:.3f} s, estimated "
                     f"{self.dp_predicted_before_s:.3f} s with theta 1, {self.dp_predicted_after_s:.3f} s after")
        return "\n".join(lines)


def _calibrate_rank(rank: int, world: int, config: LlamaConfig, micro_batch: int, num_micro_batches: int,
                    recompute: bool, steps: int, warmup: int):
    from lightning_hexiscale.profiling.check import measure_plan_rank

    compute = measure_compute_rank(rank, world, config, micro_batch, num_micro_batches, recompute, steps, warmup)
    plan = pure_dp_plan(world, config, micro_batch, num_micro_batches, recompute)
    dp = measure_plan_rank(rank, world, plan.to_dict(), config, steps, warmup)
    everything: list = [None] * world
    dist.all_gather_object(everything, (compute, dp))
    return everything if rank == 0 else None


def calibrate(cluster: Cluster, config: LlamaConfig, micro_batch: int = 2, num_micro_batches: int = 2,
              recompute: bool = False, steps: int = 5, warmup: int = 1, local: int | None = None,
              timeout_s: float = 900.0, stat: str = "min") -> CalibrationResult | None:
    """Measure on ``local`` forked ranks (or the launcher's ranks) and fit; None on ranks > 0.

    ``stat`` reduces the timed steps to one time (``min`` or ``median``, see
    :data:`~lightning_hexiscale.profiling.check.STATS`); use the same when checking estimates.
    """
    from lightning_hexiscale.profiling.check import PlanMeasurement
    from lightning_hexiscale.profiling.launch import run_from_env, run_local

    world = cluster.num_devices
    args = (config, micro_batch, num_micro_batches, recompute, steps, warmup)
    if local is not None:
        if local != world:
            from lightning_hexiscale.errors import ConfigError

            raise ConfigError("--local", local, f"the cluster {cluster.name} has {world} devices, one per rank",
                              f"use --local {world}")
        per_rank = run_local(local, _calibrate_rank, *args, timeout_s=timeout_s)[0]
    else:
        per_rank = run_from_env(_calibrate_rank, *args, timeout_s=timeout_s)
        if per_rank is None:
            return None
    reduce = min if stat == "min" else statistics.median
    compute_meas = [reduce(c) for c, _ in per_rank]
    dp = PlanMeasurement.from_ranks([d for _, d in per_rank])
    dp_s = dp.iteration_s(stat)
    workload = cpu_workload(config)
    one = single_device_plan(config, micro_batch, num_micro_batches, recompute)
    pred = [estimate(one, cluster.subset([r]), workload).iteration_time_s for r in range(world)]
    types = [d.gpu_type for d in cluster.devices]
    eff = fit_efficiency(types, pred, compute_meas, current_efficiency(cluster))
    fitted = with_calibration(cluster, eff)
    plan = pure_dp_plan(world, config, micro_batch, num_micro_batches, recompute)

    def predict(theta: float) -> float:
        c = with_calibration(fitted, calibration=replace(cluster.calibration, theta_ddp=theta))
        return estimate(plan, c, workload).iteration_time_s

    theta = fit_theta(predict, dp_s) if world > 1 else cluster.calibration.theta_ddp
    return CalibrationResult(eff, theta, compute_meas, pred, dp_s, predict(1.0), predict(theta))
