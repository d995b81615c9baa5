"""The systems the search is compared with, each choosing its plan the way that system does, all
timed by the same cost model on the whole cluster: Megatron-LM, Galvatron, Metis, random partitions
(the paper's Fig. 6 ablation) and the exhaustive optimum; :class:`BaselineResult`; the homogeneous
belief that heterogeneity-unaware systems rank their candidates on. What each restriction stands
for: the package's docstring (:mod:`lightning_hexiscale.planner.baselines`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload, estimate
from lightning_hexiscale.planner.cost.sources import stage_rule
from lightning_hexiscale.planner.oracle.exact import MAX_DEVICES, oracle
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage
from lightning_hexiscale.planner.search.assemble import (DP_OPTIONS, DraftContext, Evaluator, chain_draft, make_plan,
                                                         micro_batch_candidates, split_batches, split_layers)
from lightning_hexiscale.planner.search.partition import DeviceGraph, partition
from lightning_hexiscale.planner.search.settings import SearchResult, SearchSettings
from lightning_hexiscale.planner.search.two_phase import SearchRun


def best_recompute(fn):
    """``settings.recompute == 'auto'`` (the default): the baseline as the user of that system would
    run it, with recomputation off and on, keeping the faster result that fits (ties: off); a pinned
    True / False runs once. The same rule as the search's (:func:`recompute.auto_recompute`)."""

    @functools.wraps(fn)
    def run(cluster, workload, global_batch, settings=None, *args, **kwargs):
        s = settings if settings is not None else SearchSettings()
        if getattr(s, "recompute", None) != "auto":
            return fn(cluster, workload, global_batch, s, *args, **kwargs)
        out, failed = [], None
        for r in (False, True):
            try:
                out.append(fn(cluster, workload, global_batch, replace(s, recompute=r), *args, **kwargs))
            except InfeasiblePlan as e:
                failed = e
        if not out:
            raise failed

        def cost(res):
            est = getattr(res, "estimate", None)
            return est.cost if est is not None else math.inf

        return min(out, key=cost)  # min keeps the first (off) on ties

    return run


@dataclass(frozen=True)
class BaselineResult:
    name: str
    plan: Plan | None
    estimate: Estimate | None
    note: str = ""
    """Why nothing fits, or which configuration won."""
    ignoring_memory: Estimate | None = None
    """The fastest configuration tried when memory is ignored (the paper's §3.1 case study ignores
    it): for comparisons where every configuration of the baseline runs out of memory."""
    compute_ceiling: float | None = None
    """Sustained FLOP/s of the whole cluster over that of the devices the plan uses (1.0: all of
    them): the most any plan on every device could gain over this one if both ran at the same
    efficiency. None when nothing fits."""
    leaving_out: BaselineResult | None = None
    """symmetric-best: its best plan that leaves at least one machine out (the plan itself may use
    every machine). None for the others."""


class _Best:
    """Keeps the lowest-cost (plan, estimate) seen, and the closest miss for the message."""

    def __init__(self, name: str):
        self.name, self.cost, self.plan, self.est, self.tried, self.note = name, math.inf, None, None, 0, ""
        self.blind = 0
        """Candidates with no layer split that fits in memory (offered only for the ignoring-memory figure)."""
        self.loose: Estimate | None = None
        self.empty = ""
        """Why the space had no candidate at all (set by the caller): said instead of memory."""
        self.unmeasured = 0
        """Candidates with a stage at a TP degree its type's layer table did not measure (not offered)."""

    def offer(self, plan: Plan, cluster: Cluster, workload: Workload, note: str = "", blind: bool = False) -> None:
        """``blind``: a plan built ignoring memory, offered only for the ``ignoring_memory`` figure."""
        if not _measured(plan, cluster, workload, self):
            return
        est = estimate(plan, cluster, workload)
        if not blind:
            self.tried += 1
        self.blind += blind
        if not blind and est.cost < self.cost:
            self.cost, self.plan, self.est, self.note = est.cost, plan, est, note
        if self.loose is None or est.iteration_time_s < self.loose.iteration_time_s:
            self.loose = est

    def result(self) -> BaselineResult:
        if self.plan is None and self.tried == 0 and not self.blind and self.empty:
            return BaselineResult(self.name, None, None, self.empty, self.loose)
        if self.plan is None:
            return BaselineResult(self.name, None, None, f"no configuration fits in memory ({_tried(self)})",
                                  self.loose)
        return BaselineResult(self.name, self.plan, self.est, self.note, self.loose)


class _Believed:
    """How a heterogeneity-unaware system picks: every candidate is ranked by its cost under the
    homogeneous ``belief``; the believed-best plan is then timed on the true cluster. A plan that
    fits the belief but not the real devices would run out of memory and the user would retune
    (Appendix G: "with a higher data parallel degree, the out-of-memory issue persists"), so the
    next plan in believed order is taken; infeasible when no believed-feasible plan fits."""

    def __init__(self, name: str, belief: Cluster):
        self.name, self.belief, self.tried = name, belief, 0
        self.ranked: list[tuple[float, int, Plan, str]] = []
        self.fastest: tuple[float, int, Plan] | None = None
        self.blind = 0
        self.empty = ""
        self.unmeasured = 0

    def offer(self, plan: Plan, cluster: Cluster, workload: Workload, note: str = "", blind: bool = False) -> None:
        if not _measured(plan, cluster, workload, self):
            return
        est = estimate(plan, self.belief, workload)
        if self.fastest is None or est.iteration_time_s < self.fastest[0]:
            self.fastest = (est.iteration_time_s, self.tried, plan)
        if blind:
            self.blind += 1
            return
        if est.feasible:
            self.ranked.append((est.cost, self.tried, plan, note))
        self.tried += 1

    def result(self, cluster: Cluster, workload: Workload) -> BaselineResult:
        # ignoring memory: the plan the system would pick if memory were no constraint, timed truly
        loose = estimate(self.fastest[2], cluster, workload) if self.fastest is not None else None
        self.ranked.sort(key=lambda r: (r[0], r[1]))
        for k, (believed, _, plan, note) in enumerate(self.ranked):
            est = estimate(plan, cluster, workload)
            if est.feasible:
                retuned = f", {k} believed-better plans do not fit the real devices" if k else ""
                return BaselineResult(self.name, plan, est, f"{note}; chosen under a homogeneous belief "
                                      f"(believed {believed:.3f} s{retuned})", loose)
        if self.tried == 0 and not self.blind and self.empty:
            return BaselineResult(self.name, None, None, self.empty, loose)
        return BaselineResult(self.name, None, None, f"no configuration fits in memory ({_tried(self)}, "
                              f"{len(self.ranked)} fit the homogeneous belief)", loose)


def _measured(plan: Plan, cluster: Cluster, workload: Workload, best: _Best | _Believed) -> bool:
    """Whether every stage of ``plan`` is at a TP degree the layer tables price
    (:class:`cost.sources.StageRule`, the search's rule); else counted in ``best.unmeasured``: a
    baseline gets the same space as the search, not a stage priced from FLOP/s beside measured ones."""
    rule = stage_rule(cluster, workload)
    if rule is None or all(rule(st.devices) for p in plan.pipelines for st in p.stages):
        return True
    best.unmeasured += 1
    return False


def _tried(best: _Best | _Believed) -> str:
    """'N tried', and the candidates none of whose layer splits fits (Galvatron's free split): they
    are configurations too, so the space was not empty (it said "no (dp, tp, pp) suits the model");
    and those left out at a TP degree the layer tables did not measure."""
    extra = f", {best.blind} of them with no layer split that fits" if best.blind else ""
    if best.unmeasured:
        extra += f"; {best.unmeasured} left out at a TP degree the layer tables did not measure"
    return f"{best.tried + best.blind} tried{extra}"


def homogeneous_belief(cluster: Cluster, memory_bytes: float | None = None) -> Cluster:
    """The cluster as a heterogeneity-unaware planner sees it: same machines and device ids, but
    every device alike and every link of a kind alike.

    - FLOP/s: the mean sustained (and peak) FLOP/s of the devices. Galvatron profiles one device
      type and Megatron's user tunes for one; the mean is the homogeneous cluster of the same total
      compute (the paper compares "given the same theoretical FLOPS"), so the belief's balance of
      compute against communication is neither optimistic nor pessimistic, and there is no tie to
      break on clusters with as many GPUs of each type (hetero2).
    - Memory: the smallest device's. Galvatron's search takes one memory budget for all devices
      and a user who wants the plan to run sets it to the smallest GPU; a plan that fits this
      belief then fits the real devices too (the memory model depends on no other device property).
      ``memory_bytes`` sets another budget (e.g. the largest GPU's: a user who tunes on the big
      machine), where believed plans may not fit and :class:`_Believed` falls back.
    - Links: intra-machine pairs at the median intra-machine bandwidth and latency,
      inter-machine pairs at the median inter-machine value (the one ``inter_machine`` value of
      a preset unless ``machine_links`` overrides some pairs); the NICs as the cluster's (which
      GPUs share an interface is the network's layout, not GPU heterogeneity).
    """
    n = cluster.num_devices
    flops, peak = float(cluster.flops.mean()), float(np.mean([d.peak_flops for d in cluster.devices]))
    memory = float(cluster.memory.min()) if memory_bytes is None else float(memory_bytes)
    label = "uniform"
    devices = [replace(d, gpu_type=label, peak_flops=peak, flops=flops, memory_bytes=memory, hopper=False,
                       **believed_figures(cluster.devices))
               for d in cluster.devices]
    machines = [replace(m, gpu_type=label) for m in cluster.machines]
    mach = np.array([d.machine for d in cluster.devices])
    same = mach[:, None] == mach[None, :]
    intra, inter = same & ~np.eye(n, dtype=bool), ~same
    bw, lat = np.zeros((n, n)), np.zeros((n, n))
    for mask in (intra, inter):
        if mask.any():
            bw[mask] = float(np.median(cluster.bandwidth[mask]))
            lat[mask] = float(np.median(cluster.latency[mask]))
    return Cluster(f"{cluster.name} (homogeneous belief)", devices, machines, bw, lat, cluster.calibration,
                   cluster.description, cluster.nics)


def believed_figures(devices) -> dict:
    """The homogeneous belief's compute figures beyond FLOP/s (``planner.cost.compute`` prices by them):
    the mean of each rate and fraction where every device has one, else none; calibrated when any
    device is (efficiency = mean FLOP/s / mean peak)."""
    def mean(attr: str):
        vals = [getattr(d, attr) for d in devices]
        return float(np.mean(vals)) if all(v is not None for v in vals) else None

    calibrated = any(d.efficiency is not None for d in devices)
    eff = float(np.mean([d.flops for d in devices]) / np.mean([d.peak_flops for d in devices])) if calibrated else None
    return dict(efficiency=eff, fp32_flops=mean("fp32_flops"), tf32_flops=mean("tf32_flops"),
                memory_bandwidth_Bps=mean("memory_bandwidth_Bps"), gemm_efficiency=mean("gemm_efficiency"),
                hbm_efficiency=mean("hbm_efficiency"), datasheet=all(d.datasheet for d in devices))


# Appendix G, "Data-parallel sharding strategies": Megatron and Metis use DDP, Galvatron ZeRO-3.
SYSTEM_SHARDING = {"megatron": ("ddp",), "metis": ("ddp",), "galvatron": ("zero3",)}


def _shardings(s: SearchSettings, system: str | None = None, like_for_like: bool = True) -> tuple[str, ...]:
    """The user's train.dp_sharding when set; else the system's own (Appendix G) unless
    ``like_for_like``, which gives every baseline the search's three options."""
    if s.dp_sharding:
        return (s.dp_sharding,)
    if system is not None and not like_for_like:
        return SYSTEM_SHARDING[system]
    return DP_OPTIONS


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meta(name: str, cluster: Cluster, workload: Workload) -> dict[str, Any]:
    return {"planner": name, "model": workload.model.name, "cluster": cluster.name}


def _symmetric_layouts(cluster: Cluster, dp: int, tp: int, pp: int) -> list[list[list[tuple[int, ...]]]]:
    """Device layouts [replica][stage] -> TP group for both Megatron rank orders (machine order)."""
    ids = list(range(cluster.num_devices))
    out = []
    # rank r = ((stage * dp) + replica) * tp + t   (Megatron: TP fastest, then DP, then PP)
    out.append([[tuple(ids[((s * dp) + r) * tp:((s * dp) + r + 1) * tp]) for s in range(pp)] for r in range(dp)])
    # rank r = ((replica * pp) + stage) * tp + t   (each replica on consecutive machines)
    out.append([[tuple(ids[((r * pp) + s) * tp:((r * pp) + s + 1) * tp]) for s in range(pp)] for r in range(dp)])
    return out


def _symmetric(name: str, cluster: Cluster, workload: Workload, global_batch: int, s: SearchSettings,
               free_layers: bool, like_for_like: bool, aware: bool, belief: Cluster | None) -> BaselineResult:
    L, N = workload.model.num_layers, cluster.num_devices
    # unaware: the free layer split too is computed from the belief (Galvatron's own cost model);
    # device ids are shared, so a believed plan runs on the real devices in the same machine order
    belief = cluster if aware else (belief or homogeneous_belief(cluster))
    ev = Evaluator(belief, workload, s.schedule, s.recompute)
    best: _Best | _Believed = _Best(name) if aware else _Believed(name, belief)
    m = workload.model
    for tp in _divisors(N):
        # Megatron's TP layers (which Galvatron also uses) need TP to divide the attention heads
        # and the KV groups; the project's uneven head split is not available to these systems.
        if m.num_heads % tp or m.num_kv_heads % tp:
            continue
        for pp in _divisors(N // tp):
            dp = N // tp // pp
            if pp > L or global_batch % dp or (not free_layers and L % pp):
                continue
            if s.micro_batch_size is not None and (global_batch // dp) % s.micro_batch_size:
                # replicas of global_batch / dp sequences cannot be cut into the user's micro-batches:
                # not a candidate (the user's size itself is checked against the global batch below)
                if global_batch % s.micro_batch_size == 0:
                    continue
            for layout in _symmetric_layouts(cluster, dp, tp, pp):
                for mb in micro_batch_candidates(global_batch // dp, s.micro_batch_size, N):
                    if (global_batch // dp) % mb:  # a replica of 3 in micro-batches of 2 ran (and was priced as) 2
                        continue
                    for sh in _shardings(s, name, like_for_like):
                        layers = _symmetric_layers(ev, layout, mb, sh, dp, global_batch // dp // mb) if free_layers \
                            else [L // pp] * pp
                        # no capped split fits: still priced with an uncapped one for the figure that
                        # ignores memory (as the paper's §3.1 case study does), never as a candidate
                        blind = layers is None
                        if blind:
                            layers = _symmetric_layers(ev, layout, mb, sh, dp, global_batch // dp // mb, capped=False)
                        bounds = np.concatenate([[0], np.cumsum(layers)]).tolist()
                        pipes = tuple(Pipeline(global_batch // dp, mb, tuple(
                            Stage(st, (bounds[j], bounds[j + 1])) for j, st in enumerate(rep))) for rep in layout)
                        plan = Plan(pipes, L, s.schedule, s.recompute, sh, _meta(name, cluster, workload))
                        best.offer(plan, cluster, workload, f"(dp, tp, pp) = ({dp}, {tp}, {pp}), micro-batch {mb}, {sh}",
                                   blind)
    best.empty = (f"no (dp, tp, pp) with dp x tp x pp = {N} devices suits the model and batch: tp must divide the "
                  f"{m.num_heads} heads and {m.num_kv_heads} KV heads, pp be at most {L} layers"
                  + ("" if free_layers else " and divide them") + f", dp divide the global batch {global_batch}"
                  + (f" into replicas the micro-batch {s.micro_batch_size} divides" if s.micro_batch_size else ""))
    return best.result() if isinstance(best, _Best) else best.result(cluster, workload)


def _symmetric_layers(ev: Evaluator, layout, mb: int, sharding: str, dp: int, n_mb: int,
                      capped: bool = True) -> list[int] | None:
    """Galvatron's free split: one layer count per stage index, shared by all replicas, from the
    slowest replica's stage speed and the tightest replica's memory (ignored when not ``capped``)."""
    pp = len(layout[0])
    layer_s = [max(ev.layer_s(rep[j], mb, sharding) for rep in layout) for j in range(pp)]
    fixed = [0.0] * pp
    fixed[0] = max(ev.embed_s(rep[0], mb) for rep in layout)
    fixed[-1] += max(ev.head_s(rep[-1], mb) for rep in layout)
    L = ev.model.num_layers
    caps = [min(ev.max_layers(rep[j], j, pp, mb, pp if ev.schedule == "1f1b" else n_mb, sharding, dp)
                for rep in layout) if capped else L for j in range(pp)]
    return split_layers(layer_s, fixed, caps, L)


@best_recompute
def megatron(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
             like_for_like: bool = False, aware: bool = False, belief: Cluster | None = None) -> BaselineResult:
    """Megatron-LM: symmetric (dp, tp, pp) with TP dividing the heads, equal layers, equal batches, chosen under ``belief``
    (default :func:`homogeneous_belief`) unless ``aware`` (see the module docstring)."""
    return _symmetric("megatron", cluster, workload, global_batch, settings or SearchSettings(), False,
                      like_for_like, aware, belief)


@best_recompute
def galvatron(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
              like_for_like: bool = False, aware: bool = False, belief: Cluster | None = None) -> BaselineResult:
    """Galvatron: symmetric (dp, tp, pp) with a free per-stage layer split, chosen under ``belief``
    (default :func:`homogeneous_belief`) unless ``aware`` (see the module docstring)."""
    return _symmetric("galvatron", cluster, workload, global_batch, settings or SearchSettings(), True,
                      like_for_like, aware, belief)


@best_recompute
def metis(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
          like_for_like: bool = False) -> BaselineResult:
    """Metis: data parallelism first, TP only when memory forces it, stages by GPU type."""
    s = settings or SearchSettings()
    ev = Evaluator(cluster, workload, s.schedule, s.recompute)
    graph = DeviceGraph.from_cluster(cluster)
    best = _Best("metis")
    mbs = micro_batch_candidates(global_batch, s.micro_batch_size, cluster.num_devices)
    rule = stage_rule(cluster, workload)
    for dp in range(1, min(cluster.num_devices, global_batch) + 1):
        replicas = partition(graph, dp, "max")
        for tp in (1, 2, 4, 8):
            if tp > workload.model.num_kv_heads:
                break
            chains = [_by_type_chain(cluster, rep, tp) for rep in replicas]
            if rule is not None and not all(rule(st) for ch in chains for st in ch):
                best.unmeasured += 1
                continue  # a degree the layer tables did not measure: the next one, as for memory
            fitted = False
            for mb in mbs:
                total = global_batch // mb
                if total < dp or global_batch % mb:  # the plan would run total * mb < global_batch sequences
                    continue
                for sh in _shardings(s, "metis", like_for_like):
                    drafts = [chain_draft(ev, ch, DraftContext(mb, sh, dp, max(1, total // dp))) for ch in chains]
                    if any(d is None for d in drafts):
                        continue
                    fitted = True
                    counts = split_batches([d.sum_s for d in drafts], [d.max_s for d in drafts], [0.0] * dp, total,
                                           [d.max_micro for d in drafts])
                    plan = make_plan(drafts, counts, mb, sh, s.schedule, s.recompute, workload.model.num_layers,
                                     _meta("metis", cluster, workload))
                    best.offer(plan, cluster, workload, f"{dp} replicas, TP {tp}, micro-batch {mb}, {sh}")
            if fitted:
                break  # TP only as far as memory forces it
    return best.result()


def _by_type_chain(cluster: Cluster, devices: np.ndarray, tp: int) -> list[tuple[int, ...]]:
    """Stages of TP ``tp`` inside machines, ordered fastest GPU type first (then machine, id)."""
    by_machine: dict[int, list[int]] = {}
    for d in sorted(devices.tolist()):
        by_machine.setdefault(cluster.devices[d].machine, []).append(d)
    stages = [tuple(ds[i:i + tp]) for ds in by_machine.values() for i in range(0, len(ds), tp)]
    return sorted(stages, key=lambda st: (-cluster.devices[st[0]].flops, cluster.devices[st[0]].machine, st[0]))


class _RandomSearch(SearchRun):
    """The §4 search with phase 1 replaced by random equal-size partitions (Fig. 6)."""

    def phase1(self, step) -> list[np.ndarray]:
        perm = self.rng.permutation(self.cluster.num_devices)
        return sorted((np.sort(part) for part in np.array_split(perm, step.dp)), key=lambda a: int(a.min()))


@best_recompute
def random_search(cluster: Cluster, workload: Workload, global_batch: int,
                  settings: SearchSettings | None = None) -> SearchResult:
    """The search with random phase-1 partitions; same iterations, seed and everything else."""
    s = settings or SearchSettings()
    return _RandomSearch(cluster, workload, global_batch, s).run()


@best_recompute
def random_baseline(cluster: Cluster, workload: Workload, global_batch: int,
                    settings: SearchSettings | None = None) -> BaselineResult:
    from lightning_hexiscale.errors import InfeasiblePlan

    try:
        r = random_search(cluster, workload, global_batch, replace(settings or SearchSettings(), progress=False))
    except InfeasiblePlan as e:
        return BaselineResult("random", None, None, str(e))
    return BaselineResult("random", replace(r.plan, meta={**r.plan.meta, "planner": "random"}), r.estimate,
                          f"{r.plan.num_pipelines} pipelines")


def compute_ceiling(plan: Plan, cluster: Cluster) -> float:
    """Sustained FLOP/s of every device of the cluster over that of the devices ``plan`` uses."""
    return float(cluster.flops.sum() / cluster.flops[list(plan.device_order)].sum())


# ---- exhaustive ----------------------------------------------------------------------------------
def exhaustive(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
               max_devices: int = MAX_DEVICES, time_limit_s: float = 300.0) -> BaselineResult:
    """The true optimum of the whole plan space under the cost model (:mod:`planner.oracle.exact`), for
    clusters of up to ``max_devices``; the note says whether the oracle completed within
    ``time_limit_s`` (when it did not, the plan is only the best found)."""
    r = oracle(cluster, workload, global_batch, settings, time_limit_s=time_limit_s, max_devices=max_devices)
    if r.plan is None:
        note = "no plan fits in memory (complete)" if r.complete else f"nothing found in {time_limit_s:g} s (incomplete)"
        return BaselineResult("exhaustive", None, None, note)
    plan = replace(r.plan, meta={**r.plan.meta, "planner": "exhaustive"})
    note = (f"optimal ({r.plan.num_pipelines} pipelines, {plan.dp_sharding}; {r.time_s:.1f} s)" if r.complete else
            f"INCOMPLETE after {r.time_s:.1f} s: best found, optimum >= {r.lower_bound_s:.4g} s")
    return BaselineResult("exhaustive", plan, r.estimate, note)
