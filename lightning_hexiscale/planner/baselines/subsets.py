"""Baselines that choose which machines to use, all timed by the same cost model on the whole cluster:

- :func:`symmetric_best`: the best Megatron/Galvatron-style symmetric plan on any machine subset, the
  whole cluster included;
- :func:`leave_out`: what a user does without this project: the best plan of any style, the search's
  included, on a strict machine subset (at least one machine left out);
- :func:`uniform_tp`: the search restricted to one TP degree in every stage (an ablation of per-stage TP).

Their plans are lifted to the cluster's device ids, the devices they leave out named idle. The
systems they build on (``megatron``, ``galvatron``) and ``BaselineResult`` are in
:mod:`planner.baselines.systems`.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.planner.baselines.systems import (BaselineResult, best_recompute, compute_ceiling, galvatron,
                                                           megatron)
from lightning_hexiscale.planner.cost.estimate import Workload, estimate
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search.assemble import micro_batch_candidates
from lightning_hexiscale.planner.search.entry import search
from lightning_hexiscale.planner.search.settings import SearchResult, SearchSettings
from lightning_hexiscale.planner.search.subsets import (compute_bound, device_rates, devices_of, lift, machine_classes,
                                                        machines_of, memory_possible, subset_vectors)


_SYMMETRIC_SUBSETS = 256
"""Beyond this many machine subsets (up to symmetry), symmetric-best tries whole machine classes only."""


@best_recompute
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
              settings: SearchSettings | None = None, style: str | None = None,
              symmetric: BaselineResult | None = None) -> BaselineResult:
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
    whole cluster. A one-machine cluster has no strict subset: no plan, and the note says so.
    ``symmetric``: :func:`symmetric_best`'s result for these same arguments where the caller has it
    (:func:`baselines.run_baselines` runs both; it was searched twice), else it is run here."""
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
        sym = (symmetric or symmetric_best(cluster, workload, global_batch, s)).leaving_out
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
