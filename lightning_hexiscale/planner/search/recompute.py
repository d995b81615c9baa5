"""``recompute: auto`` decided per pipeline: a roomy pipeline runs without activation recomputation
while a tight one beside it recomputes.

Recomputation re-runs each layer's forward inside its backward (T_b grows by T_f, about a third of
a layer's compute: :func:`cost.model.layer_time_bwd`) and in exchange keeps only each layer's input
per micro-batch in flight (:mod:`planner.cost.memory`). At equal micro-batches it is never faster;
it pays only where memory keeps a pipeline (or its larger micro-batches) out. So for one layout,
pipeline i's time at batch b is

    g_i(b) = min over flags r in {off, on} and micro-batch sizes m | b that fit with r of T_i(m, b/m, r)

(ties: off), and the batch split is :func:`batching.minimax_split`'s over these g_i, exact up to
``batching._EXACT_DEVICES`` devices (:func:`recompute_each`). Beyond, every pipeline keeps its batch
and micro-batch size and turns recomputation off where it then still fits (:func:`turn_off_where_fits`).
The search (:func:`auto_recompute`) applies this to the layouts of its runs without and
with recomputation and keeps the fastest plan that fits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload, estimate
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search.assemble import batch_micro_sizes
from lightning_hexiscale.planner.search.batching import BatchTimer, minimax_split, with_batches
from lightning_hexiscale.planner.search.settings import SearchResult, SearchSettings


def recompute_each(timer: BatchTimer, layout: Plan) -> tuple[float, Plan | None]:
    """The layout's least iteration time when each pipeline chooses its own flag with its
    micro-batch size (module docstring), and that plan; (inf, None) when nothing fits or the
    cluster is past the exact split (``timer.exact`` False)."""
    if not timer.exact:
        return math.inf, None
    off, on = layout.with_recompute(False), layout.with_recompute(True)
    dp = timer.dp(layout)  # the data-parallel terms read the stages only, not the flags
    gs, picks = [], []
    for i in range(layout.num_pipelines):
        g_off, m_off = timer.pipeline(off, i, dp)
        g_on, m_on = timer.pipeline(on, i, dp)
        use_on = g_on < g_off  # strictly faster (or the only one that fits): ties run without
        g = np.where(use_on, g_on, g_off)
        if not np.isfinite(g).any():
            return math.inf, None
        gs.append(g)
        picks.append((m_off, m_on, use_on))
    cost, batches = minimax_split(gs, timer.G)
    if not batches:
        return math.inf, None
    flags = [bool(use_on[b]) for (_, _, use_on), b in zip(picks, batches)]
    mbs = [(m_on if f else m_off)[b] for (m_off, m_on, _), b, f in zip(picks, batches, flags)]
    return cost, with_batches(layout, batches, mbs, layout.meta, flags)


def turn_off_where_fits(plan: Plan, cluster: Cluster, workload: Workload) -> Plan | None:
    """``plan`` with recomputation off in every pipeline that fits without it at its batch and
    micro-batch size (its time only drops: one forward per layer less); None when none changes.
    Turning one pipeline's flag changes no other pipeline's memory, so one estimate of the plan
    with every flag off says which pipelines fit."""
    if not any(plan.recomputes):
        return None
    short = {o.device for o in estimate(plan.with_recompute(False), cluster, workload).out_of_memory}
    flags = [r and any(d in short for d in p.devices) for r, p in zip(plan.recomputes, plan.pipelines)]
    return plan.with_recompute(flags) if tuple(flags) != plan.recomputes else None


def per_pipeline(cluster: Cluster, workload: Workload, global_batch: int, user_mb: int | None,
                 plan: Plan) -> tuple[Plan, Estimate] | None:
    """``plan``'s layout with recomputation decided per pipeline (:func:`recompute_each` up to
    the exact split's size, else :func:`turn_off_where_fits`), and its estimate; None where that
    gives nothing new (one pipeline: the searches without and with already priced both flags)."""
    if plan.num_pipelines < 2:
        return None
    timer = BatchTimer(cluster, workload, global_batch, batch_micro_sizes(global_batch, user_mb, cluster.num_devices))
    if timer.exact:
        _, best = recompute_each(timer, plan)
        # the layout's own idle devices, sharding, reduce dtype and provenance stay
        mixed = dataclasses.replace(plan, recompute=None, pipelines=best.pipelines) if best is not None else None
    else:
        mixed = turn_off_where_fits(plan, cluster, workload)
    if mixed is None or mixed == plan:
        return None
    return mixed, estimate(mixed, cluster, workload)


def auto_recompute(cluster: Cluster, workload: Workload, global_batch: int, s: SearchSettings,
                   worth: bool, search_one: Callable[..., SearchResult]) -> SearchResult:
    """``recompute: auto``: the whole search once without and once with activation recomputation,
    then each winner's layout with the flag decided per pipeline (:mod:`planner.search.recompute`:
    a pipeline recomputes only where that is faster, i.e. where memory keeps it, or its larger
    micro-batches, out), and the fastest plan that fits (ties: fewer recomputing pipelines).
    Recomputation re-runs each layer's forward in its backward (~1/3 more compute) and keeps only
    each layer's input per micro-batch in flight. The plan's ``meta['recompute']`` records the
    times (inf: nothing fits). Raises the InfeasiblePlan of the run with recomputation (the least
    memory) when neither fits. ``search_one(cluster, workload, global_batch, settings, worth)`` is
    the search with one setting (``entry._search_one``)."""
    results: dict[bool, SearchResult] = {}
    failed: InfeasiblePlan | None = None
    for r in (False, True):
        try:
            results[r] = search_one(cluster, workload, global_batch, dataclasses.replace(s, recompute=r), worth)
        except InfeasiblePlan as e:
            failed = e
    if not results:
        assert failed is not None
        raise failed
    times = {r: (res.estimate.cost if res is not None else math.inf) for r, res in
             ((r, results.get(r)) for r in (False, True))}
    options = list(results.values())
    for res in results.values():
        mixed = per_pipeline(cluster, workload, global_batch, s.micro_batch_size, res.plan)
        if mixed is not None:
            options.append(dataclasses.replace(res, plan=mixed[0], estimate=mixed[1]))
    best = min(options, key=lambda res: (res.estimate.cost, sum(res.plan.recomputes)))
    flags = best.plan.recomputes
    pick = "on" if all(flags) else "off" if not any(flags) else "per pipeline " + ",".join(
        "on" if f else "off" for f in flags)
    per = [o.estimate.cost for o in options[len(results):]]
    note = (f"auto: {pick} (without {times[False]:.6g} s, with {times[True]:.6g} s"
            + (f", per pipeline {min(per):.6g} s" if per else "") + " per iteration)")
    plan = dataclasses.replace(best.plan, meta={**best.plan.meta, "recompute": note})
    return dataclasses.replace(best, plan=plan, search_time_s=sum(r.search_time_s for r in results.values()))
