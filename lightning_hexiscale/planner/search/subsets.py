"""Which devices a plan uses: the search over subsets of the cluster, and what each machine is worth.

A slow machine can make every plan that uses it slower than the best plan without it (its links
drag a pipeline hop or the data-parallel sync, or its compute is not worth the bubble it adds).
The plan for a cluster is therefore the best over device subsets; it names the devices it leaves
out in ``Plan.idle_devices`` (used + idle = every device of the cluster) and says in ``meta`` why
(``idle_reason``) and what using them would cost (``all_devices_time_s``).

What is searched (:func:`search_subsets`; a *trial* is the all-device search of §4 on
``cluster.subset(devices)``, its plan mapped back to the cluster's device ids):

- **Every machine subset** when there are at most ``MAX_EXHAUSTIVE`` of them up to symmetry and at
  most 64 devices. Machines that can be swapped without changing the cluster (same devices, same
  links inside, the same links to every other device: :func:`machine_classes`) form a class, and a
  subset is a number of machines per class (the first ones of each class).
- **Greedy** otherwise, as an operator would prune: from the whole cluster, leave out every machine
  of the slowest GPU type, or one machine of that type (the one with the least compute, then the
  weakest links); go on from the better of the two while it beats the best plan so far. Up to 64
  devices each candidate is a trial; beyond, the candidate is priced by taking its devices out of
  the best layout the whole-cluster search found (:func:`shrink`: stages re-formed, leaders and
  layers re-chosen, batches re-split exactly), which keeps the search time of large clusters.
- Both skip a subset that cannot win: its devices cannot hold the training state at all
  (:func:`memory_possible`), or its compute-only lower bound (:func:`compute_bound`) is no less
  than every figure the trial could improve (the best plan so far and, with ``worth``, the best
  plan found without each machine it leaves out).

Inside a trial on up to 16 devices the final improvement may also leave single devices idle (a
device move of :mod:`planner.search.refine`), so devices within a machine can stay out too.

Tolerance: the search's quality target, 0.97 of the throughput. With every machine subset
searched, the plan reaches at least 0.97 of the search's own plan for any machine subset (a trial
runs the same search with ``TRIAL_REFINE`` of the final improvement's budget; a subset skipped is
proven unable to win), and at least 0.97 of the true optimum over every device subset
(:mod:`planner.oracle.exact`; tests/planner/oracle/test_search_vs_oracle.py). The greedy promises only the
subsets it visits.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.planner.cost.estimate import Workload, estimate, layer_times, usable_memory
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage

MAX_EXHAUSTIVE = 16
"""Up to this many machine subsets (up to symmetry, the whole cluster included) every one is searched."""
SEARCHED_DEVICES = 64
"""Up to this many devices a subset is priced by a search of its own; beyond, by :func:`shrink`."""
TRIAL_REFINE = 0.25
"""Share of the final improvement's budget (:func:`refine.budget_for`) a subset trial gets (the whole
cluster gets all of it). A quarter keeps the search on 40 random small clusters at the optimum over
every subset (as with the whole budget: tests/planner/oracle/test_search_vs_oracle.py) for about 0.65x the
time of full trials."""


@dataclass(frozen=True)
class CoreRun:
    """What the all-device search returns to the subset search for one (sub)cluster."""

    plan: Plan
    """Its best plan (ids of the cluster it ran on; may leave single devices idle)."""
    time_s: float
    """That plan's iteration time (``estimate().cost``; inf when it does not fit)."""
    all_devices_s: float
    """The best iteration time it found with every device at work (inf: none)."""
    log: list
    without: Callable[[frozenset[int]], tuple[float, Plan | None]]
    """Prices its best layout with some devices taken out (:meth:`search.SearchRun.without`)."""
    polish: Callable[[Plan], tuple[float, Plan]] | None = None
    """The final improvement's climb from a plan in its cluster's ids (:meth:`two_phase.SearchRun.polish`):
    (time, plan), the plan itself when nothing better is found; None: not offered."""


Core = Callable[..., CoreRun]
"""(cluster, share of the final improvement's budget = 1.0) -> the all-device search's run on it;
raises InfeasiblePlan when nothing fits."""


@dataclass(frozen=True)
class Trial:
    """One device subset the subset search looked at."""

    devices: tuple[int, ...]
    """Cluster device ids the subset keeps, ascending."""
    left_out: tuple[int, ...]
    """Indices (``Cluster.machines``) of the machines it leaves out."""
    status: str
    """``searched`` (a trial ran), ``shrunk`` (priced by :func:`shrink`), ``bounded`` (its compute
    bound cannot win), ``no memory`` (its devices cannot hold the training state) or
    ``infeasible`` (searched: nothing fits)."""
    time_s: float
    """Iteration time of the plan found on it (inf unless ``searched`` or ``shrunk``)."""
    bound_s: float
    """Compute-only lower bound of any plan on it (:func:`compute_bound`)."""


@dataclass(frozen=True)
class SubsetReport:
    """What the subset search tried, and what each machine is worth."""

    trials: tuple[Trial, ...]
    all_devices_s: float
    """Iteration time of the best plan found that gives every device work (inf: none fits)."""
    best_s: float
    """Iteration time of the chosen plan."""
    mode: str
    """``exhaustive`` (every machine subset), ``greedy`` or ``one machine`` (nothing to leave out
    but single devices)."""
    search_time_s: float = 0.0
    without: dict[int, float] = field(default_factory=dict)
    """Machine index -> the best iteration time found on a subset without it (inf: nothing fits);
    for every machine when the search ran with ``worth``."""
    bound_without: dict[int, float] = field(default_factory=dict)
    """Machine index -> the least compute bound of the subsets without it that were not priced:
    no plan without the machine is faster than min(without, bound_without)."""


# ---- symmetry -----------------------------------------------------------------------------------
def machine_classes(cluster: Cluster) -> list[list[int]]:
    """Classes of machines that can be swapped without changing the cluster, in machine order: the
    same devices (type, FLOP/s, memory) in the same order, the same links among their own devices,
    the same links from each of their devices to every device of every third machine, and a
    symmetric block of links between the two. (A swap of a with b and of a with c makes one of b
    with c, so each machine is compared with its class's first only.)"""
    bw, lat = cluster.bandwidth, cluster.latency
    machines = cluster.machines

    def local(m) -> tuple:
        ds = list(m.devices)
        props = tuple((cluster.devices[d].gpu_type, cluster.devices[d].flops, cluster.devices[d].memory_bytes)
                      for d in ds)
        return props, bw[np.ix_(ds, ds)].tobytes(), lat[np.ix_(ds, ds)].tobytes()

    sig = [local(m) for m in machines]
    classes: list[list[int]] = []
    for a, ma in enumerate(machines):
        for cl in classes:
            if sig[a] == sig[cl[0]] and _swappable(cluster, machines[cl[0]].devices, ma.devices):
                cl.append(a)
                break
        else:
            classes.append([a])
    return classes


def _swappable(cluster: Cluster, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Device k of machine a has the links of device k of machine b to every device outside both,
    and the links between a and b read the same from either side."""
    others = np.setdiff1d(np.arange(cluster.num_devices), np.array(a + b))
    ia, ib = np.array(a), np.array(b)
    for m in (cluster.bandwidth, cluster.latency):
        if not np.array_equal(m[np.ix_(ia, others)], m[np.ix_(ib, others)]):
            return False
        block = m[np.ix_(ia, ib)]
        if not np.array_equal(block, block.T):
            return False
    return True


def subset_vectors(classes: list[list[int]]) -> list[tuple[int, ...]]:
    """Every non-empty choice of a machine count per class, the whole cluster first."""
    return [v for v in itertools.product(*(range(len(c), -1, -1) for c in classes)) if any(v)]


def machines_of(classes: list[list[int]], vector: tuple[int, ...]) -> list[int]:
    """The machines a count vector keeps: the first ``vector[k]`` of class k."""
    return sorted(m for cl, k in zip(classes, vector) for m in cl[:k])


def devices_of(cluster: Cluster, machines: list[int]) -> tuple[int, ...]:
    return tuple(sorted(d for m in machines for d in cluster.machines[m].devices))


# ---- what cannot win ----------------------------------------------------------------------------
def device_rates(cluster: Cluster, workload: Workload, micro_batch_sizes: list[int], recompute: bool) -> np.ndarray:
    """Per device, the most sequence-layers per second it runs alone: the largest, over the
    micro-batch sizes m, of m / (T_f + T_b) of one layer at TP 1 (``estimate.layer_times``)."""
    by_kind: dict[tuple, float] = {}
    out = np.empty(cluster.num_devices)
    for d, dev in enumerate(cluster.devices):
        kind = (dev.gpu_type, dev.flops, dev.peak_flops)
        if kind not in by_kind:
            by_kind[kind] = max(m / sum(layer_times(cluster, workload, (d,), m, recompute)[:2])
                                for m in micro_batch_sizes)
        out[d] = by_kind[kind]
    return out


def compute_bound(rates: np.ndarray, devices, workload: Workload, global_batch: int,
                  theta: tuple[float, float, float, float]) -> float:
    """A lower bound of the iteration time of any plan on ``devices``, from compute alone:

        T >= kappa * G * L / sum_{d in devices} rate_d,     kappa = min(1, theta_3f, theta_3b)

    A TP-t stage runs a layer at most t times as fast as its slowest device alone (each rank
    computes at least 1/t of the FLOPs at the slowest member's pace; TP, hops, head and the
    data-parallel sync only add), so a stage's rate R_j is at most the sum of its devices' rates.
    A pipeline of b sequences spends at least b * l_j / R_j on each stage per iteration, so at
    least b * L / sum_j R_j on the slowest (the mediant), and the slowest pipeline at least
    G * L / (the sum over all devices). ZeRO-3 scales a layer by theta_3 (at least
    min(theta_3f, theta_3b) times T_f + T_b). The rates are the cost model's own layer times, so
    a measured layer-time table keeps the bound while TP t is at most t times faster than TP 1."""
    kappa = min(1.0, theta[2], theta[3])
    total = float(rates[list(devices)].sum())
    return kappa * global_batch * workload.model.num_layers / total if total > 0 else math.inf


def memory_possible(cluster: Cluster, workload: Workload, devices) -> bool:
    """Whether ``devices`` can hold the training state at all: every plan keeps at least
    ``total_params * (2 P + K)`` bytes of weights, gradients and optimizer states over its devices
    (what ZeRO-3 over every pipeline leaves: ``cost.model.runtime_state_bytes_per_param``'s step
    phase), plus ``reserve_bytes`` on each device."""
    w = workload
    need = w.model.total_params * (2 * w.param_bytes + w.optimizer_bytes_per_param)
    have = sum(max(0.0, usable_memory(w, cluster.devices[d].memory_bytes) - w.reserve_bytes) for d in devices)
    return have >= need


# ---- plans on a subset --------------------------------------------------------------------------
def lift(plan: Plan, devices: tuple[int, ...], cluster: Cluster) -> Plan:
    """A plan made on ``cluster.subset(devices)`` (ids 0..k-1) in the cluster's own device ids,
    every other device of the cluster named idle. Each pipeline keeps its own recompute flag (a
    plan of ``recompute: auto`` may differ per pipeline; the plan-wide setting must not override it)."""
    pipes = tuple(Pipeline(p.batch_size, p.micro_batch_size,
                           tuple(Stage(tuple(devices[d] for d in s.devices), s.layers) for s in p.stages), p.recompute)
                  for p in plan.pipelines)
    return name_idle(replace(plan, pipelines=pipes, recompute=None, idle_devices=(),
                             meta={**plan.meta, "cluster": cluster.name}), cluster)


def name_idle(plan: Plan, cluster: Cluster) -> Plan:
    """The plan with every cluster device it gives no work named in ``idle_devices``."""
    used = set(plan.device_order)
    idle = tuple(d for d in range(cluster.num_devices) if d not in used)
    return plan if idle == tuple(plan.idle_devices) else replace(plan, idle_devices=idle)


def idle_meta(plan: Plan, cluster: Cluster, all_devices_s: float, best_s: float) -> Plan:
    """The plan with why it leaves devices idle and what using them would cost in ``meta``:
    ``idle_reason`` (a sentence) and ``all_devices_time_s`` (the best plan found on every device;
    None when none fits). A plan that uses every device is returned unchanged."""
    if not plan.idle_devices:
        return plan
    n, total = len(plan.idle_devices), cluster.num_devices
    if math.isfinite(all_devices_s):
        reason = (f"faster without them: the best plan found on all {total} devices takes {all_devices_s:.4g} s per "
                  f"iteration, {100 * (all_devices_s / best_s - 1):.1f} % more than this plan's {best_s:.4g} s "
                  f"on {total - n}")
        all_s: float | None = float(all_devices_s)
    else:  # a reason the run gave (the cluster has more devices than the model can occupy), else memory
        reason = plan.meta.get("idle_reason") or f"no plan found on all {total} devices fits in memory"
        all_s = None
    return replace(plan, meta={**plan.meta, "idle_reason": reason, "all_devices_time_s": all_s})


def shrink(layouts: list[Plan], drop: frozenset[int], timer: Any, repair: Any, meta: dict,
           stage_ok: Any = None) -> tuple[float, Plan | None]:
    """The best of ``layouts`` with the devices ``drop`` taken out: a stage keeps its other devices
    (one left with none gives its layers to its neighbour), a pipeline left with no stage goes,
    the pipelines that changed get their leaders and layer split afresh (``repair``, the search's
    phase-2 rules) and the batches are re-split exactly (``timer.best``). (inf, None) when nothing
    is left or nothing fits. ``stage_ok`` (:class:`cost.sources.StageRule`): a layout with a stage it
    refuses (a TP group shrunk to a degree its type's layer table lacks) is not scored."""
    from lightning_hexiscale.planner.search.refine import plan_from_layout

    best: tuple[float, Plan | None] = (math.inf, None)
    for like in layouts:
        before = (like.dp_sharding, tuple(tuple((s.devices, s.num_layers) for s in p.stages) for p in like.pipelines))
        pipes = []
        for p in before[1]:
            stages: list[list] = []
            carry = 0
            for devs, n in p:
                keep = tuple(d for d in devs if d not in drop)
                if keep:
                    stages.append([keep, n + carry])
                    carry = 0
                elif stages:
                    stages[-1][1] += n
                else:
                    carry += n
            if stages:
                pipes.append(tuple((tuple(st), n) for st, n in stages))
        if not pipes or len(pipes) > timer.G:
            continue
        if stage_ok is not None and not all(stage_ok(st) for p in pipes for st, _ in p):
            continue
        layout = repair((like.dp_sharding, tuple(pipes)), before)
        cost, plan = timer.best(plan_from_layout(layout, like), meta)
        if plan is not None and cost < best[0]:
            best = (cost, plan)
    return best


# ---- the search over subsets --------------------------------------------------------------------
class _Subsets:
    """State of one subset search: the trials, the best plan, the best per machine left out."""

    def __init__(self, cluster: Cluster, workload: Workload, global_batch: int, core: Core, rates: np.ndarray,
                 worth: bool):
        self.c, self.w, self.G, self.core, self.rates, self.worth = cluster, workload, global_batch, core, rates, worth
        cal = cluster.calibration
        self.theta = (cal.theta_ddp, cal.theta_zero2, cal.theta_zero3_fwd, cal.theta_zero3_bwd)
        self.trials: list[Trial] = []
        self.best: tuple[float, Plan | None] = (math.inf, None)
        self.without: dict[int, float] = {}
        self.all_s = math.inf
        self.full: CoreRun | None = None
        self.error: InfeasiblePlan | None = None
        self.searched = cluster.num_devices <= SEARCHED_DEVICES

    def bound(self, devices) -> float:
        return compute_bound(self.rates, devices, self.w, self.G, self.theta)

    def whole(self) -> None:
        """The whole cluster, first: it sets the figures the others must beat."""
        devices = tuple(range(self.c.num_devices))
        try:
            run = self.core(self.c)
        except InfeasiblePlan as e:
            self.error = e
            self.trials.append(Trial(devices, (), "infeasible", math.inf, self.bound(devices)))
            return
        self.full = run
        self.all_s = run.all_devices_s
        self.trials.append(Trial(devices, (), "searched", run.time_s, self.bound(devices)))
        if math.isfinite(run.time_s):
            self.best = (run.time_s, name_idle(run.plan, self.c))

    def guard(self, out: tuple[int, ...]) -> float:
        """What a subset leaving the machines ``out`` out must beat to matter."""
        if not self.worth:
            return self.best[0]
        return max([self.best[0]] + [self.without.get(m, math.inf) for m in out])

    def price(self, machines: list[int], guard: float | None = None) -> float:
        """Price the subset of these machines unless it cannot win (guard: what it must beat;
        default :meth:`guard`); returns its time (inf when not priced or nothing fits)."""
        keep = set(machines)
        out = tuple(m for m in range(len(self.c.machines)) if m not in keep)
        devices = devices_of(self.c, machines)
        done = next((t for t in self.trials if t.devices == devices and t.status != "bounded"), None)
        if done is not None:  # fill_worth asks again for a subset the exhaustive pass priced (was a second trial)
            for m in out:
                self.without[m] = min(self.without.get(m, math.inf), done.time_s)
            return done.time_s
        bound = self.bound(devices)
        if not memory_possible(self.c, self.w, devices):
            self.trials.append(Trial(devices, out, "no memory", math.inf, bound))
            return math.inf
        if bound >= (self.guard(out) if guard is None else guard):
            self.trials.append(Trial(devices, out, "bounded", math.inf, bound))
            return math.inf
        if self.searched:
            try:
                run = self.core(self.c.subset(list(devices)), TRIAL_REFINE)
                t, plan, status = run.time_s, lift(run.plan, devices, self.c), "searched"
            except InfeasiblePlan:
                t, plan, status = math.inf, None, "infeasible"
        elif self.full is not None:
            drop = frozenset(d for m in out for d in self.c.machines[m].devices)
            t, plan = self.full.without(drop)
            plan, status = (name_idle(plan, self.c) if plan is not None else None), "shrunk"
            if (plan is not None and t < self.best[0] * (1 - 1e-12)
                    and not estimate(plan, self.c, self.w).feasible):
                # beyond 64 devices the batch split checks memory against a lower bound of the NCCL
                # buffers: a shrunk layout short by a few MiB was returned as the plan
                t, plan = math.inf, None
        else:
            return math.inf
        self.trials.append(Trial(devices, out, status, t, bound))
        for m in out:
            self.without[m] = min(self.without.get(m, math.inf), t)
        if plan is not None and t < self.best[0] * (1 - 1e-12):
            self.best = (t, plan)
        return t

    def bring_back(self) -> None:
        """Where a subset's plan won, the whole cluster's climb starts again from it, its left-out
        devices idle (:meth:`two_phase.SearchRun.polish`; up to ``refine.SMALL_CLUSTER`` devices, where
        idle devices may come back): a trial never sees the machines it leaves out, so a plan one
        idle device away (the device joining a TP group) was missed. Tight memory, 7 devices of 3 MiB:
        [V100 V100] | [V100 V100] | [V100 V100] with a T4 machine idle, where the optimum splits the
        middle TP group into two stages and pairs one V100 with the T4 (0.910 of it before)."""
        if self.full is None or self.full.polish is None or self.best[1] is None:
            return
        if not self.best[0] < self.full.time_s * (1 - 1e-12):
            return  # the whole cluster's own plan: its climb has run
        t, plan = self.full.polish(self.best[1])
        if t < self.best[0] * (1 - 1e-12):
            self.best = (t, name_idle(plan, self.c))

    def exhaustive(self, classes: list[list[int]]) -> None:
        # most compute first (the whole cluster, then one machine less, ...): the early trials set
        # the figures the bounds of the later, smaller ones are held against
        vectors = subset_vectors(classes)
        total = [float(self.rates[list(devices_of(self.c, machines_of(classes, v)))].sum()) for v in vectors]
        for k in sorted(range(1, len(vectors)), key=lambda k: (-total[k], k)):
            self.price(machines_of(classes, vectors[k]))

    def greedy(self) -> None:
        current = list(range(len(self.c.machines)))
        while True:
            found = [(self.price(m, self.best[0]), m) for m in self.candidates(current)]
            if not found:
                return
            t, machines = min(found, key=lambda e: e[0])
            if not t <= self.best[0]:
                return
            current = machines

    def candidates(self, current: list[int]) -> list[list[int]]:
        """Leave out every machine of the slowest GPU type among ``current``, or one of them (the
        least compute, then the least bandwidth to the rest, then the last)."""
        if len(current) < 2:
            return []
        c = self.c
        speed = {m: min(c.devices[d].flops for d in c.machines[m].devices) for m in current}
        weak = [m for m in current if speed[m] == min(speed.values())]
        rest = [m for m in current if m not in weak]
        out = [rest] if rest else []
        if len(weak) > 1:
            keep = devices_of(c, current)

            def worth(m: int) -> tuple:
                ds = list(c.machines[m].devices)
                others = [d for d in keep if d not in set(ds)]
                return (float(self.rates[ds].sum()), float(c.bandwidth[np.ix_(ds, others)].sum()), -m)

            drop = min(weak, key=worth)
            out.append([m for m in current if m != drop])
        return out

    def fill_worth(self, classes: list[list[int]], exhaustive: bool) -> None:
        """Per machine, the best plan without it where no trial has priced one yet (one machine of
        a class stands for all of them). After the greedy a subset without it that fits nothing
        says little (a larger one may fit): the cluster without that machine is priced then."""
        for cl in classes:
            # a subset without one machine of a class is, up to symmetry, one without any other
            known = [self.without[m] for m in cl if m in self.without]
            if known and (exhaustive or math.isfinite(min(known))):
                for m in cl:
                    self.without[m] = min(known)
                continue
            keep = [m for m in range(len(self.c.machines)) if m != cl[0]]
            # every subset without the machine is a subset of these: no memory here, none anywhere
            t = self.price(keep, guard=math.inf)
            for m in cl:
                self.without[m] = min(self.without.get(cl[0], math.inf), t)


def search_subsets(cluster: Cluster, workload: Workload, global_batch: int, core: Core,
                   micro_batch_sizes: list[int], recompute: bool, worth: bool = False) -> tuple[Plan, SubsetReport, list]:
    """The best plan over device subsets (module docstring): (plan with its idle devices named and,
    when it leaves some, why in ``meta``; the report; the whole cluster's search log). ``worth``:
    also the best plan without each machine (``SubsetReport.without`` for every machine).
    Raises the whole cluster's InfeasiblePlan when nothing fits on any subset."""
    t0 = time.perf_counter()
    rates = device_rates(cluster, workload, micro_batch_sizes, recompute)
    s = _Subsets(cluster, workload, global_batch, core, rates, worth)
    s.whole()
    # the classes decide the exhaustive mode (searched clusters only) and stand in for their
    # members in the per-machine report; a large cluster without the report needs none
    classes = machine_classes(cluster) if s.searched or worth else []
    if len(cluster.machines) == 1:
        mode = "one machine"
    elif s.searched and math.prod(len(c) + 1 for c in classes) - 1 <= MAX_EXHAUSTIVE:
        mode = "exhaustive"
        s.exhaustive(classes)
    else:
        mode = "greedy"
        s.greedy()
    s.bring_back()
    if worth and len(cluster.machines) > 1:
        s.fill_worth(classes, mode == "exhaustive")
    best_s, plan = s.best
    if plan is None:
        raise s.error or InfeasiblePlan(f"no plan fits on cluster {cluster.name} or any subset of its machines")
    plan = idle_meta(plan, cluster, s.all_s, best_s)
    floor = {m: min((t.bound_s for t in s.trials if m in t.left_out and t.status == "bounded"), default=math.inf)
             for m in range(len(cluster.machines))}
    report = SubsetReport(tuple(s.trials), s.all_s, best_s, mode, time.perf_counter() - t0, dict(s.without),
                          {m: f for m, f in floor.items() if math.isfinite(f)})
    return plan, report, s.full.log if s.full is not None else []
