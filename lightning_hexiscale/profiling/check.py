"""Run a plan for a few steps with the runtime engine and hold the cost model's estimate against it.

Measured, per rank, in the ranks' own process group (forked CPU ranks or an external launch):

- step time: each step is :meth:`PipelineEngine.fit_step`, the step ``Trainer.fit`` runs (clipping
  at the recipe's default included). Timed: from a barrier's release to its ``before_update`` hook
  (forward, backward, pipeline p2p, TP all-reduces, the loss all-reduce, the non-finite check, the
  asymmetric gradient sync); the rest (clipping's norm all-reduce and the optimizer step) is timed
  apart, because the Appendix B cost model does not price it, except
  under ZeRO-2/3 (``dp_sharding`` not ddp), where the optimizer is the engine's sharded one
  (``PipelineEngine.wrap_optimizer``) and its step all-gathers the updated parameters, which the
  cost model prices as part of the data-parallel term: there the step time includes it.
  Iteration time of a step = the slowest rank's; over steps, the fastest or the median (:data:`STATS`).
- peak memory: growth of the process's peak resident set (Linux VmHWM, reset through
  /proc/self/clear_refs) from just before the engine is built to the end of the steps, with an
  AdamW step so that optimizer states exist. One-time lazy initialisation (dispatch tables, gloo
  buffers) is done by a throw-away step before the baseline. On CUDA: torch.cuda.max_memory_allocated.

Everything runs in the run's precision (``precision``: a Lightning precision string, see
:mod:`lightning_hexiscale.profiling.precision`; default 32-true on CPU ranks, bf16-mixed on CUDA).

Estimated: :func:`~lightning_hexiscale.planner.cost.estimate.estimate` on the given cluster, with the
workload the runtime trains (the precision's dtype, AdamW m and v in the parameter dtype, no reserve).
Deviation = (estimated - measured) / measured.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.config.units import format_bytes
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Estimate, Plan, Workload, estimate
from lightning_hexiscale.planner.cost.sources import PriceSource


def cpu_workload(model: LlamaConfig, precision: str = "32-true") -> Workload:
    """What the CPU runtime trains under ``precision`` (default fp32 weights, AdamW m, v: 8 bytes per
    parameter; :meth:`Workload.from_precision`), nothing reserved."""
    return Workload.from_precision(model, precision, reserve_bytes=0.0)


def make_batch(config: LlamaConfig, global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens (G, S) and their next-token targets."""
    gen = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, config.vocab_size, (global_batch, config.seq_len + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


# ---- memory --------------------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_heap() -> None:
    """glibc: give free heap pages back to the OS (``malloc_trim(0)``) before a CPU window starts.

    malloc serves a request from free heap chunks before it considers mmap, whatever the mmap
    threshold. In a process forked from a long-lived one (a pytest worker), those chunks are
    resident pages shared with the parent: writing them copies each page without growing the
    resident set, so an 80 MB allocation showed as 0.1 MiB of growth. After the trim they are no
    longer resident, and reusing them faults fresh pages that the meter sees."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to release
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def reset_peak_memory(device: torch.device) -> float:
    """Start a peak-memory window; return the baseline in bytes."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return float(torch.cuda.memory_allocated(device))
    _release_free_heap()
    with contextlib.suppress(OSError):  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return float((_status_kib("VmHWM") or 0) * 1024)


def peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float((_status_kib("VmHWM") or 0) * 1024)


def prime(device: torch.device, run=None) -> None:
    """A throw-away tiny forward/backward/AdamW step and all-reduce: lazy one-time initialisation
    (~100 MiB of RSS on the first CPU step) happens here, before the memory baseline; in the
    measured precision ``run`` (a :class:`~lightning_hexiscale.profiling.precision.MeasurePrecision`),
    so that its kernels are the ones initialised."""
    from lightning_hexiscale.models.llama import Llama

    tiny = LlamaConfig(name="prime", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       ffn_hidden_size=16, vocab_size=16, seq_len=4)
    model = Llama(tiny).init_weights(0).to(device, run.param_dtype if run is not None else torch.float32)
    tok = torch.zeros(1, tiny.seq_len, dtype=torch.long, device=device)
    with run.autocast(device) if run is not None else contextlib.nullcontext():
        loss = model.loss(model(tok), tok)
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    if dist.is_initialized():
        dist.all_reduce(torch.zeros(16, device=device))


# ---- one rank ------------------------------------------------------------------------------------
def measure_plan_rank(rank: int, world: int, plan_dict: dict, config: LlamaConfig, steps: int = 3,
                      warmup: int = 1, precision: str | None = None) -> dict:
    """Collective: train ``plan`` for ``warmup + steps`` steps on this rank in ``precision`` (None: the
    device's default); return its measurements (``step_s``, ``optimizer_s`` lists over the timed steps,
    ``peak_bytes``, ``optimizer``: the class name of the optimizer stepped). Under ZeRO ``step_s``
    includes the sharded optimizer step (module docstring)."""
    from lightning_hexiscale.profiling import precision as prec
    from lightning_hexiscale.profiling.measure import current_device
    from lightning_hexiscale.runtime.engine import PipelineEngine

    plan = Plan.from_dict(plan_dict)
    if world != plan.world_size:
        raise ValueError(f"the plan needs {plan.world_size} ranks, the process group has {world}")
    device = current_device()
    run = prec.resolve(precision, device)
    prime(device, run)
    base = reset_peak_memory(device)
    engine = PipelineEngine(plan, config, rank, seed=0, device=device, dtype=run.param_dtype,
                            autocast_dtype=run.autocast_dtype)
    # the engine's optimizer: under ZeRO the sharded one, which updates this rank's shard and gathers
    # the parameters (a plain AdamW would find no gradients on the full parameters and do nothing)
    opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
    gather_in_step = plan.dp_sharding != "ddp"
    step_s, opt_s = [], []
    marks: list[float] = []

    def before_update():  # fit_step's hook after the gradient sync, where Lightning's on_before_optimizer_step runs
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())

    for k in range(warmup + steps):
        tok, tgt = make_batch(config, plan.global_batch, k)
        dist.barrier()
        t0 = time.perf_counter()
        engine.fit_step(tok, tgt, opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL, before_update=before_update)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1, t2 = marks.pop(), time.perf_counter()
        if k >= warmup:
            step_s.append((t2 if gather_in_step else t1) - t0)
            opt_s.append(t2 - t1)
    return {"rank": rank, "step_s": step_s, "optimizer_s": opt_s, "peak_bytes": peak_memory(device) - base,
            "optimizer": type(opt).__name__}


STATS = ("min", "median")
"""How step times become one iteration time. ``min``: the fastest timed step; on a host shared with
other jobs, load only ever adds time, so the fastest step is the closest to the machine's own
speed. ``median``: the typical step; the right choice on a dedicated machine (where the two agree)."""


@dataclass(frozen=True)
class PlanMeasurement:
    """Measurements of one plan, gathered from every rank."""

    steps_s: list[float]
    """Per timed step: the slowest rank's step time (s), optimizer step excluded."""
    optimizer_s: float
    """Median over steps of the slowest rank's optimizer step (s), for reference."""
    step_s_per_rank: list[float]
    """Median step time of each rank (s)."""
    peak_bytes_per_rank: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def min_s(self) -> float:
        return min(self.steps_s)

    def iteration_s(self, stat: str = "min") -> float:
        """The iteration time under ``stat`` (see :data:`STATS`)."""
        if stat not in STATS:
            raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
        return self.min_s if stat == "min" else self.median_s

    @property
    def spread(self) -> float:
        """(max - min) / median of the per-step iteration times: run-to-run noise."""
        return (max(self.steps_s) - min(self.steps_s)) / self.median_s

    @classmethod
    def from_ranks(cls, per_rank: list[dict]) -> PlanMeasurement:
        steps = [max(r["step_s"][k] for r in per_rank) for k in range(len(per_rank[0]["step_s"]))]
        opts = [max(r["optimizer_s"][k] for r in per_rank) for k in range(len(per_rank[0]["optimizer_s"]))]
        return cls(steps, statistics.median(opts), [statistics.median(r["step_s"]) for r in per_rank],
                   [r["peak_bytes"] for r in per_rank])


def run_plan(plan: Plan, config: LlamaConfig, steps: int = 3, warmup: int = 1, local: int | None = None,
             timeout_s: float = 600.0, precision: str = "32-true") -> PlanMeasurement | None:
    """Measure ``plan`` on ``local`` forked CPU ranks, or in the launcher's environment when
    ``local`` is None (then only rank 0 gets the result; the others get None)."""
    from lightning_hexiscale.profiling.launch import run_from_env, run_local

    if local is not None:
        if local != plan.world_size:
            from lightning_hexiscale.errors import ConfigError

            raise ConfigError("--local", local, f"the plan runs on {plan.world_size} ranks",
                              f"use --local {plan.world_size}")
        return PlanMeasurement.from_ranks(run_local(local, measure_plan_rank, plan.to_dict(), config, steps, warmup,
                                                    precision, timeout_s=timeout_s))
    per_rank = run_from_env(_gather_rank, plan.to_dict(), config, steps, warmup, precision, timeout_s=timeout_s)
    return PlanMeasurement.from_ranks(per_rank) if per_rank is not None else None


def _gather_rank(rank: int, world: int, *args) -> list[dict] | None:
    mine = measure_plan_rank(rank, world, *args)
    everything: list[dict] = [{}] * world
    dist.all_gather_object(everything, mine)
    return everything if rank == 0 else None


# ---- comparison ----------------------------------------------------------------------------------
def deviation(estimated: float, measured: float) -> float:
    """(estimated - measured) / measured: +0.10 = the model predicts 10 % too slow/large."""
    return (estimated - measured) / measured


def stage_of_rank(plan: Plan) -> dict[int, tuple[int, int]]:
    """Global rank -> (pipeline, stage) under the plan's rank mapping."""
    out = {}
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            for d in s.devices:
                out[plan.rank_of(d)] = (i, j)
    return out


def comparison_table(plan: Plan, est: Estimate, m: PlanMeasurement) -> str:
    """Per-rank measured step time and peak memory beside the estimate, then the iteration line."""
    where = stage_of_rank(plan)
    rows = [("rank", "pipe/stage", "step (meas.)", "peak mem (meas.)", "peak mem (est.)", "mem dev.")]
    for r in range(plan.world_size):
        i, j = where[r]
        e_mem = est.pipelines[i].stages[j].peak_memory_bytes
        rows.append((str(r), f"{i}/{j}", f"{m.step_s_per_rank[r]:.3f} s", format_bytes(m.peak_bytes_per_rank[r]),
                     format_bytes(e_mem), f"{deviation(e_mem, m.peak_bytes_per_rank[r]) * 100:+.1f} %"))
    w = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(x) for v, x in zip(row, w)) for row in rows]
    e = est.iteration_time_s
    lines.append(f"iteration time: estimated {e:.3f} s; measured fastest step {m.min_s:.3f} s "
                 f"(deviation {deviation(e, m.min_s) * 100:+.1f} %), median step {m.median_s:.3f} s "
                 f"(deviation {deviation(e, m.median_s) * 100:+.1f} %); step-to-step spread {m.spread * 100:.0f} %; "
                 f"optimizer step {m.optimizer_s:.3f} s (not priced by the cost model)")
    return "\n".join(lines)


def check(plan: Plan, cluster: Cluster, config: LlamaConfig, steps: int = 3, warmup: int = 1,
          local: int | None = None, timeout_s: float = 600.0,
          precision: str = "32-true") -> tuple[Estimate, PlanMeasurement] | None:
    """Estimate and measure ``plan`` in ``precision``; (estimate, measurement) on rank 0 / local, None elsewhere."""
    plan.validate(cluster, config)
    est = estimate(plan, cluster, cpu_workload(config, precision))
    m = run_plan(plan, config, steps, warmup, local, timeout_s, precision)
    return None if m is None else (est, m)


# ---- while training: the plan's price against its measured step (lightning/plan_check.py) -------------
PLAN_CHECK_TOLERANCE = 0.25
"""A run whose measured step is more than this fraction off its estimate (|measured / estimated - 1|)
gets a warning naming the stage furthest from its price and what to do."""


@dataclass(frozen=True)
class StageCheck:
    """One stage's busy time per step, priced and measured."""

    pipeline: int
    stage: int
    devices: list[int]
    tp: int
    estimated_s: float
    """The stage's priced compute per iteration: ``StageEstimate.compute_s + tp_comm_s`` (forward and
    backward of its layers, head / embedding, TP collectives, over all micro-batches)."""
    measured_s: float
    """The slowest of its ranks: per step, the time inside the pipeline schedule minus the time in
    its point-to-point exchanges (waiting for and moving activations), median over the measured steps."""

    @property
    def ratio(self) -> float:
        """measured / estimated (1.0: priced right; 1.4: 40 % slower than priced)."""
        return self.measured_s / self.estimated_s if self.estimated_s > 0 else float("inf")


@dataclass(frozen=True)
class RunCheck:
    """The plan's estimate against a training run's measured steps."""

    estimated_step_s: float
    """``Estimate.iteration_time_s``."""
    measured_step_s: float
    """Per step the slowest rank's wall time from its first training batch of the step to the end of
    its optimizer step; the median over the measured steps."""
    stages: list[StageCheck]
    warmup_steps: int
    measured_steps: int
    tolerance: float = PLAN_CHECK_TOLERANCE

    @property
    def ratio(self) -> float:
        """measured / estimated step time."""
        return self.measured_step_s / self.estimated_step_s

    @property
    def worst(self) -> StageCheck:
        """The stage whose measured time is furthest from its price (largest |log ratio|: 2x and 0.5x are as far)."""
        import math

        return max(self.stages, key=lambda s: abs(math.log(s.ratio)) if 0 < s.ratio < float("inf") else float("inf"))

    @property
    def off(self) -> bool:
        return abs(self.ratio - 1.0) > self.tolerance

    def line(self) -> str:
        """The one line rank 0 prints."""
        w = self.worst
        return (f"hexiscale plan check ({self.measured_steps} steps after {self.warmup_steps} warm-up): step "
                f"estimated {self.estimated_step_s:.4g} s, measured {self.measured_step_s:.4g} s "
                f"({self.ratio:.2f}x); furthest from its price: pipeline {w.pipeline} stage {w.stage} "
                f"(devices {w.devices}, TP {w.tp}) estimated {w.estimated_s:.4g} s, measured {w.measured_s:.4g} s "
                f"({w.ratio:.2f}x)")

    def warning(self, model_name: str = "<model>", sources: Mapping[int, PriceSource] | None = None) -> str | None:
        """None within tolerance; else what is off, where, and what to do. ``sources`` (device id ->
        what priced its type, :func:`~lightning_hexiscale.planner.cost.sources.price_sources`) tailors
        the fix to the furthest stage: measured layer tables are measured again (they may be stale, or
        taken on a busy machine); declared, datasheet or calibrated figures are replaced by measuring
        the machine, which a hand-written cluster file never did."""
        if not self.off:
            return None
        w = self.worst
        way = "slower" if self.ratio > 1 else "faster"
        head = (f"the plan runs {abs(self.ratio - 1) * 100:.0f} % {way} than priced (step measured "
                f"{self.measured_step_s:.4g} s, estimated {self.estimated_step_s:.4g} s; more than "
                f"{self.tolerance:.0%} off): the stage furthest from its price is pipeline {w.pipeline} stage {w.stage} "
                f"on devices {w.devices} ({w.ratio:.2f}x its price), so the plan may not be the best one for this "
                f"cluster. ")
        profile = f"`hexiscale profile --model {model_name}`"
        unmeasured = sorted({sources[d] for d in w.devices if d in (sources or {})
                             and sources[d].kind != "layer table"}, key=lambda s: s.gpu_type)
        if unmeasured:
            what = ", ".join(f"{s.gpu_type} ({s.kind})" for s in unmeasured)
            return (head + f"Those devices are priced from figures, not measured layer times: {what}. Fix: plan from "
                    f"the machine: cluster=auto (the default when no cluster is given) discovers it, or "
                    f"`hexiscale discover --model {model_name} --out cluster.yaml` writes the measured cluster file; "
                    f"or profile those devices ({profile}); then plan again")
        return (head + f"Fix: re-discover the cluster (`hexiscale discover --rediscover`) so that the planner prices "
                f"freshly measured layer times and links, or profile those devices ({profile}), then plan again")

    def to_dict(self) -> dict:
        return {"estimated_step_s": self.estimated_step_s, "measured_step_s": self.measured_step_s,
                "ratio": self.ratio, "warmup_steps": self.warmup_steps, "measured_steps": self.measured_steps,
                "tolerance": self.tolerance, "off": self.off,
                "worst_stage": {"pipeline": self.worst.pipeline, "stage": self.worst.stage},
                "stages": [{"pipeline": s.pipeline, "stage": s.stage, "devices": s.devices, "tp": s.tp,
                            "estimated_s": s.estimated_s, "measured_s": s.measured_s, "ratio": s.ratio}
                           for s in self.stages]}


def compare_run(plan: Plan, est: Estimate, step_s: list[list[float]], busy_s: list[list[float]],
                warmup_steps: int, tolerance: float = PLAN_CHECK_TOLERANCE) -> RunCheck:
    """Hold ``est`` against what every rank measured: ``step_s[r]`` / ``busy_s[r]`` are rank r's wall
    and busy seconds per measured step (ranks in the plan's rank order). Step: per step the slowest
    rank, then the median over steps; a stage: the median of each of its ranks, then the slowest."""
    if not step_s or any(len(s) != len(step_s[0]) or not s for s in step_s) or len(busy_s) != len(step_s):
        raise ValueError("every rank must report the same, non-zero number of measured steps")
    per_step = [max(s[k] for s in step_s) for k in range(len(step_s[0]))]
    where = stage_of_rank(plan)
    stages = []
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            ranks = [r for r, ij in where.items() if ij == (i, j)]
            e = est.pipelines[i].stages[j]
            stages.append(StageCheck(i, j, list(st.devices), st.tp, e.compute_s + e.tp_comm_s,
                                     max(statistics.median(busy_s[r]) for r in ranks)))
    return RunCheck(est.iteration_time_s, statistics.median(per_step), stages, warmup_steps, len(per_step), tolerance)


class StageTimer:
    """This rank's busy time inside the engine's pipeline schedule, while installed: each call of
    ``executor.run`` minus the calls of ``executor.exchange`` inside it (waiting for a neighbour
    stage and moving activations), i.e. the stage's forward and backward with their TP collectives.
    Installed as instance attributes that shadow the executor's two methods (removed by
    :meth:`remove`); on CUDA with a device synchronisation at each edge, so that queued kernels
    count where they run. ``busy_s`` accumulates until reset."""

    def __init__(self, engine):
        self.engine = engine
        self.busy_s = 0.0
        self.installed = False
        self.cuda = torch.device(engine.device).type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.engine.device)

    def install(self) -> None:
        if self.installed:
            return
        ex = self.engine.executor
        run, exchange = ex.run, ex.exchange
        comm = [0.0]

        def timed_exchange(*args, **kwargs):
            self.sync()
            t = time.perf_counter()
            try:
                return exchange(*args, **kwargs)
            finally:
                self.sync()
                comm[0] += time.perf_counter() - t

        def timed_run(*args, **kwargs):
            comm[0] = 0.0
            self.sync()
            t = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.sync()
                self.busy_s += time.perf_counter() - t - comm[0]

        ex.run, ex.exchange = timed_run, timed_exchange
        self.installed = True

    def remove(self) -> None:
        if self.installed:
            ex = self.engine.executor
            del ex.run, ex.exchange
            self.installed = False
