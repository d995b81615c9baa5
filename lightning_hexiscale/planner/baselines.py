"""Baselines: the plan spaces of other systems, each chosen the way that system chooses, all timed
by the SAME cost model as §4 on the real cluster.

Every baseline returns a :class:`BaselineResult` whose plan (when one fits) is scored by
``estimate()`` on the true cluster, with the same micro-batch candidates as the search. Which
restriction stands for which system:

- :func:`megatron` (Megatron-LM): symmetric (dp, tp, pp) over all devices, dp * tp * pp = N,
  pp dividing the layers (equal layers per stage), equal batches per replica; ranks laid out in
  machine order with TP fastest, then DP then PP (Megatron's order) or TP, PP, DP; best over
  degrees, micro-batch sizes and both layouts.
- :func:`galvatron` (Galvatron): the same symmetric degrees and layouts, but the layer split per
  stage is free (chosen by the speed of the slowest replica at each stage, memory-capped).
- :func:`metis` (Metis, ATC'24): data-parallel first: D_dp replicas made by dealing every machine's
  GPUs over the replicas, TP raised (1, 2, 4, 8) only when a replica does not fit in memory,
  stages ordered by GPU type (fastest first), layers in proportion to speed, batches in
  proportion to replica speed.
- :func:`random_search` (the paper's Fig. 6 ablation): the §4 search with phase 1 replaced by
  random compute-agnostic partitions (a seeded random permutation cut into D_dp equal sizes).
- :func:`symmetric_best`: the best Megatron-style and Galvatron-style symmetric plans over every
  machine subset, the whole cluster included (so on a cluster where the slow machines help, it is
  a heterogeneity-aware symmetric plan on every device).
- :func:`leave_out` (what a user does without this project): the best plan of any style, the
  search's included, on a STRICT subset of the machines: at least one machine left out (the fast
  machines alone, typically).
- :func:`uniform_tp` (an ablation of per-stage TP): the search restricted to one TP degree in every
  stage, the best over the degrees.
- :func:`exhaustive`: the true optimum of the whole plan space on clusters of up to 8 devices
  (:mod:`planner.oracle.exact`).

Two readings of Megatron and Galvatron (``aware``):

- faithful (default, ``aware=False``): the real systems are heterogeneity-unaware. Megatron's user
  and Galvatron's profiler-driven search see one GPU type and uniform links, so the candidates of
  the space are ranked by ``estimate()`` on :func:`homogeneous_belief` of the cluster, and the
  believed-best plan is then timed on the true cluster. That is what the paper measured: a plan
  picked blind to heterogeneity, run on heterogeneous GPUs.
- aware (``aware=True``, ``hexiscale plan --aware-baselines``): the candidates are ranked with the
  true cluster, giving the best plan of the restricted space; a speedup then measures the plan
  space alone. A stronger opponent than the real systems.

Metis is heterogeneity-aware (it profiles every GPU type and the links), so it has one reading.
Data-parallel sharding, independently: the system's own as the paper ran it (Appendix G: Megatron
and Metis DDP, Galvatron ZeRO-3) unless ``like_for_like=True``, which gives each the search's ddp /
zero2 / zero3 choice; a user's ``train.dp_sharding`` binds everyone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload, estimate
from lightning_hexiscale.planner.oracle.exact import MAX_DEVICES, oracle
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage
from lightning_hexiscale.planner.search.assemble import (DP_OPTIONS, DraftContext, Evaluator, chain_draft, make_plan,
                                                         micro_batch_candidates, split_batches, split_layers)
from lightning_hexiscale.planner.search.partition import DeviceGraph, partition
from lightning_hexiscale.planner.search.subsets import (compute_bound, device_rates, devices_of, lift, machine_classes,
                                                        machines_of, memory_possible, subset_vectors)
from lightning_hexiscale.planner.search.entry import search
from lightning_hexiscale.planner.search.settings import SearchResult, SearchSettings
from lightning_hexiscale.planner.search.two_phase import SearchRun


def _best_recompute(fn):
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
        self.loose: Estimate | None = None
        self.empty = ""
        """Why the space had no candidate at all (set by the caller): said instead of memory."""

    def offer(self, plan: Plan, cluster: Cluster, workload: Workload, note: str = "", blind: bool = False) -> None:
        """``blind``: a plan built ignoring memory, offered only for the ``ignoring_memory`` figure."""
        est = estimate(plan, cluster, workload)
        if not blind:
            self.tried += 1
        if not blind and est.cost < self.cost:
            self.cost, self.plan, self.est, self.note = est.cost, plan, est, note
        if self.loose is None or est.iteration_time_s < self.loose.iteration_time_s:
            self.loose = est

    def result(self) -> BaselineResult:
        if self.plan is None and self.tried == 0 and self.empty:
            return BaselineResult(self.name, None, None, self.empty, self.loose)
        if self.plan is None:
            return BaselineResult(self.name, None, None, f"no configuration fits in memory ({self.tried} tried)",
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
        self.empty = ""

    def offer(self, plan: Plan, cluster: Cluster, workload: Workload, note: str = "", blind: bool = False) -> None:
        est = estimate(plan, self.belief, workload)
        if self.fastest is None or est.iteration_time_s < self.fastest[0]:
            self.fastest = (est.iteration_time_s, self.tried, plan)
        if blind:
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
        if self.tried == 0 and self.empty:
            return BaselineResult(self.name, None, None, self.empty, loose)
        return BaselineResult(self.name, None, None, f"no configuration fits in memory ({self.tried} tried, "
                              f"{len(self.ranked)} fit the homogeneous belief)", loose)


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


@_best_recompute
def megatron(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
             like_for_like: bool = False, aware: bool = False, belief: Cluster | None = None) -> BaselineResult:
    """Megatron-LM: symmetric (dp, tp, pp) with TP dividing the heads, equal layers, equal batches, chosen under ``belief``
    (default :func:`homogeneous_belief`) unless ``aware`` (see the module docstring)."""
    return _symmetric("megatron", cluster, workload, global_batch, settings or SearchSettings(), False,
                      like_for_like, aware, belief)


@_best_recompute
def galvatron(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
              like_for_like: bool = False, aware: bool = False, belief: Cluster | None = None) -> BaselineResult:
    """Galvatron: symmetric (dp, tp, pp) with a free per-stage layer split, chosen under ``belief``
    (default :func:`homogeneous_belief`) unless ``aware`` (see the module docstring)."""
    return _symmetric("galvatron", cluster, workload, global_batch, settings or SearchSettings(), True,
                      like_for_like, aware, belief)


@_best_recompute
def metis(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
          like_for_like: bool = False) -> BaselineResult:
    """Metis: data parallelism first, TP only when memory forces it, stages by GPU type."""
    s = settings or SearchSettings()
    ev = Evaluator(cluster, workload, s.schedule, s.recompute)
    graph = DeviceGraph.from_cluster(cluster)
    best = _Best("metis")
    mbs = micro_batch_candidates(global_batch, s.micro_batch_size, cluster.num_devices)
    for dp in range(1, min(cluster.num_devices, global_batch) + 1):
        replicas = partition(graph, dp, "max")
        for tp in (1, 2, 4, 8):
            if tp > workload.model.num_kv_heads:
                break
            chains = [_by_type_chain(cluster, rep, tp) for rep in replicas]
            fitted = False
            for mb in mbs:
                total = global_batch // mb
                if total < dp:
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


@_best_recompute
def random_search(cluster: Cluster, workload: Workload, global_batch: int,
                  settings: SearchSettings | None = None) -> SearchResult:
    """The search with random phase-1 partitions; same iterations, seed and everything else."""
    s = settings or SearchSettings()
    return _RandomSearch(cluster, workload, global_batch, s).run()


@_best_recompute
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


_SYMMETRIC_SUBSETS = 256
"""Beyond this many machine subsets (up to symmetry), symmetric-best tries whole machine classes only."""


@_best_recompute
def symmetric_best(cluster: Cluster, workload: Workload, global_batch: int,
                   settings: SearchSettings | None = None, style: str | None = None) -> BaselineResult:
    """The best symmetric plan on any machine subset, the whole cluster included (its name says it
    may use every machine: on a cluster where the slow machines help it is the heterogeneity-aware
    symmetric plan on all devices), the other machines idle. ``style``: ``megatron`` or ``galvatron`` alone (None: the better of
    the two, the default). The best plan of :func:`megatron` and :func:`galvatron`, each in its
    strongest reading (ranked with the true cluster, every dp sharding), over every machine subset
    up to symmetry (:func:`subsets.machine_classes`; beyond ``_SYMMETRIC_SUBSETS`` subsets, every
    choice of whole classes), most compute first; ``leaving_out`` is the best of those on a subset
    that leaves at least one machine out. A subset whose devices cannot hold the training state, or
    whose compute-only bound (:func:`subsets.compute_bound`) is no better than the best such plan so
    far, is skipped: no plan on it can win. Timed on the whole cluster, the other devices idle."""
    styles = {"megatron": (megatron,), "galvatron": (galvatron,), None: (megatron, galvatron)}
    if style not in styles:
        raise ConfigError("symmetric_best(style)", style, "must be megatron, galvatron or None (the better of both)",
                          "pass style='megatron' or style='galvatron', or leave it out")
    s = replace(settings or SearchSettings(), progress=False)
    classes = machine_classes(cluster)
    vectors = subset_vectors(classes)
    if len(vectors) > _SYMMETRIC_SUBSETS:
        vectors = [v for v in vectors if all(k in (0, len(c)) for k, c in zip(v, classes))]
    cal = cluster.calibration
    theta = (cal.theta_ddp, cal.theta_zero2, cal.theta_zero3_fwd, cal.theta_zero3_bwd)
    rates = device_rates(cluster, workload, micro_batch_candidates(global_batch, s.micro_batch_size,
                                                                   cluster.num_devices), s.recompute)
    subsets = [devices_of(cluster, machines_of(classes, v)) for v in vectors]
    subsets.sort(key=lambda ds: (-float(rates[list(ds)].sum()), ds))
    # [every subset, the subsets that leave a machine out]: (cost, plan, note)
    best: list[tuple[float, Plan | None, str]] = [(math.inf, None, ""), (math.inf, None, "")]
    tried = 0
    for devices in subsets:
        whole = len(devices) == cluster.num_devices
        if not memory_possible(cluster, workload, devices):
            continue
        if compute_bound(rates, devices, workload, global_batch, theta) >= best[0 if whole else 1][0]:
            continue
        sub = cluster if whole else cluster.subset(list(devices))
        for fn in styles[style]:
            tried += 1
            r = fn(sub, workload, global_batch, s, like_for_like=True, aware=True)
            if r.plan is None:
                continue
            kinds = ", ".join(f"{n}x{t}" for t, n in _kinds(cluster, devices).items())
            found = (r.estimate.cost, lift(r.plan, devices, cluster), f"{fn.__name__} on {kinds}: {r.note}")
            for k in (0,) if whole else (0, 1):
                if found[0] < best[k][0] * (1 - 1e-12):
                    best[k] = found
    results = []
    for cost, plan, note in best:
        if plan is None:
            results.append(BaselineResult("symmetric-best", None, None,
                                          f"no symmetric plan fits any machine subset ({tried} tried)"))
            continue
        plan = replace(plan, meta={**plan.meta, "planner": "symmetric-best"})
        results.append(BaselineResult("symmetric-best", plan, estimate(plan, cluster, workload), note,
                                      compute_ceiling=compute_ceiling(plan, cluster)))
    return replace(results[0], leaving_out=results[1] if results[1].plan is not None else None)


LEAVE_OUT_STYLES = ("search", "symmetric")
"""What :func:`leave_out` may run on the machines it keeps: the §4 search, or the symmetric plans of
:func:`symmetric_best` (Megatron- and Galvatron-style)."""


def leave_out(cluster: Cluster, workload: Workload, global_batch: int,
              settings: SearchSettings | None = None, style: str | None = None) -> BaselineResult:
    """What a user does without this project: train on some machines (the fast ones, usually) and
    leave at least one machine out. The best plan on a STRICT machine subset, of ``style``:

    - ``search``: the §4 search on the cluster less one machine, for each machine class
      (:func:`subsets.machine_classes`: which machine of a class is left out does not matter), the
      best of them. Every strict subset lies inside one of these, and the search on it may leave
      more devices idle itself (:mod:`planner.search.subsets`), so this covers every strict subset
      as far as the search explores subsets; ``use_all_devices`` in ``settings`` is ignored here.
    - ``symmetric``: :func:`symmetric_best`'s best plan that leaves a machine out.
    - None (default): the better of the two.

    The plan is in the cluster's own device ids, the machines left out named idle, timed on the
    whole cluster. A one-machine cluster has no strict subset: no plan, and the note says so."""
    if style not in LEAVE_OUT_STYLES + (None,):
        raise ConfigError("leave_out(style)", style, "must be search, symmetric or None (the better of both)",
                          "pass style='search' or style='symmetric', or leave it out")
    if len(cluster.machines) < 2:
        return BaselineResult("leave-out", None, None, "one machine: nothing can be left out")
    s = replace(settings or SearchSettings(), progress=False)
    found: list[tuple[float, Plan, str]] = []
    if style in ("search", None):
        for cls in machine_classes(cluster):
            gone = cls[0]
            devices = devices_of(cluster, [m for m in range(len(cluster.machines)) if m != gone])
            if not memory_possible(cluster, workload, devices):
                continue
            try:
                r = search(cluster.subset(list(devices)), workload, global_batch, replace(s, use_all_devices=False))
            except InfeasiblePlan:
                continue
            if r.estimate.feasible:
                plan = lift(r.plan, devices, cluster)
                est = estimate(plan, cluster, workload)
                n = r.plan.num_pipelines
                found.append((est.cost, plan, f"search without {cluster.machines[gone].name}: "
                                              f"{n} pipeline{'s' if n != 1 else ''}, {r.plan.dp_sharding}"))
    if style in ("symmetric", None):
        sym = symmetric_best(cluster, workload, global_batch, s).leaving_out
        if sym is not None and sym.plan is not None:
            found.append((sym.estimate.cost, sym.plan, sym.note))
    if not found:
        return BaselineResult("leave-out", None, None, f"no {style or 'search or symmetric'} plan fits any strict "
                                                       "machine subset")
    cost, plan, note = min(found, key=lambda f: f[0])  # min keeps the first (the search's) on ties
    left = sorted({cluster.machines[cluster.devices[d].machine].name for d in plan.idle_devices})
    plan = replace(plan, meta={**plan.meta, "planner": "leave-out"})
    return BaselineResult("leave-out", plan, estimate(plan, cluster, workload), f"{note}; idle: {', '.join(left)}",
                          compute_ceiling=compute_ceiling(plan, cluster))


def _kinds(cluster: Cluster, devices) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in devices:
        out[cluster.devices[d].gpu_type] = out.get(cluster.devices[d].gpu_type, 0) + 1
    return out


def uniform_tp(cluster: Cluster, workload: Workload, global_batch: int,
               settings: SearchSettings | None = None) -> BaselineResult:
    """The search (subsets included, as the user's settings say) restricted to one TP degree t in
    every stage (``SearchSettings.tp_degrees``; the devices of a machine no TP-t group covers stay
    idle), the best over t in 1, 2, 4, 8, 16 up to the widest machine and the KV heads: whether
    per-stage TP degrees pay off."""
    from lightning_hexiscale.errors import InfeasiblePlan

    s = replace(settings or SearchSettings(), progress=False)
    widest = max(len(m.devices) for m in cluster.machines)
    degrees = [t for t in (1, 2, 4, 8, 16) if t <= min(widest, workload.model.num_kv_heads)]
    best: SearchResult | None = None
    for t in degrees:
        try:
            r = search(cluster, workload, global_batch, replace(s, tp_degrees=(t,)))
        except InfeasiblePlan:
            continue
        if r.estimate.feasible and (best is None or r.estimate.cost < best.estimate.cost * (1 - 1e-12)):
            best = r
    if best is None:
        return BaselineResult("uniform-tp", None, None, f"no plan with one TP degree ({degrees}) fits")
    plan = replace(best.plan, meta={**best.plan.meta, "planner": "uniform-tp"})
    t = plan.pipelines[0].stages[0].tp
    k = len(plan.idle_devices)
    idle = f", {k} device{'s' if k != 1 else ''} idle" if k else ""
    return BaselineResult("uniform-tp", plan, best.estimate, f"TP {t} in every stage, {plan.num_pipelines} "
                          f"pipeline{'s' if plan.num_pipelines != 1 else ''}{idle} (best of TP {degrees})", compute_ceiling=compute_ceiling(plan, cluster))


BASELINES = ("megatron", "galvatron", "metis", "random", "symmetric-best", "leave-out", "uniform-tp")
"""What ``--baselines`` runs (``exhaustive`` only when asked: it is exponential)."""


def run_baselines(cluster: Cluster, workload: Workload, global_batch: int, settings: SearchSettings | None = None,
                  names: tuple[str, ...] = BASELINES,
                  like_for_like: bool = False, aware: bool = False) -> dict[str, BaselineResult]:
    """Run the named baselines; ``exhaustive`` only when asked (it is exponential).
    ``like_for_like`` gives megatron, galvatron and metis every dp sharding the search may use
    instead of their own (Appendix G: DDP, ZeRO-3, DDP); ``aware`` ranks megatron's and
    galvatron's candidates with the true cluster instead of the homogeneous belief."""
    s = replace(settings or SearchSettings(), progress=False)
    out = {}
    for n in names:
        if n in ("megatron", "galvatron"):
            fn = megatron if n == "megatron" else galvatron
            out[n] = fn(cluster, workload, global_batch, s, like_for_like=like_for_like, aware=aware)
        elif n == "metis":
            out[n] = metis(cluster, workload, global_batch, s, like_for_like=like_for_like)
        elif n == "random":
            out[n] = random_baseline(cluster, workload, global_batch, s)
        elif n == "exhaustive":
            out[n] = exhaustive(cluster, workload, global_batch, s)
        elif n == "symmetric-best":
            out[n] = symmetric_best(cluster, workload, global_batch, s)
        elif n == "leave-out":
            out[n] = leave_out(cluster, workload, global_batch, s)
        elif n == "fast-only":  # renamed in issue 43: it ranged over the whole cluster too
            raise ConfigError("baselines", n, "fast-only was split: it also ranged over the whole cluster",
                              "use symmetric-best (the best symmetric plan on any machine subset, all machines "
                              "included) or leave-out (the best plan of any style that leaves a machine out)")
        elif n == "uniform-tp":
            out[n] = uniform_tp(cluster, workload, global_batch, s)
        else:
            raise ConfigError("baselines", n, "unknown baseline",
                              f"use one of {', '.join(BASELINES + ('exhaustive',))}")
        if out[n].plan is not None and out[n].compute_ceiling is None:
            out[n] = replace(out[n], compute_ceiling=compute_ceiling(out[n].plan, cluster))
    return out


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
