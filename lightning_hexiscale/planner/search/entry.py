"""``search(cluster, workload, global_batch, settings)``: the search as callers run it.

It checks the batch, warns once where CUDA types are priced from datasheets, runs the search on the
cluster whose device speeds follow the roofline (:func:`cost.compute.effective_cluster`), resolves
``recompute: auto`` per pipeline (:mod:`.recompute`), searches device subsets unless
``settings.use_all_devices`` (:mod:`.subsets`; each (sub)cluster by one :class:`.two_phase.SearchRun`)
and names what priced each device type (:func:`cost.sources.price_sources`). The two-phase search
itself is :mod:`.two_phase`; why the result may leave devices idle is :mod:`.subsets`'.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan, check_argument_types
from lightning_hexiscale.planner.cost.compute import effective_cluster, warn_datasheet_pricing, warn_default_links
from lightning_hexiscale.planner.cost.estimate import Workload, estimate
from lightning_hexiscale.planner.cost.sources import check_measured_tp, price_sources
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search.assemble import micro_batch_candidates
from lightning_hexiscale.planner.search.infeasible import most_busy
from lightning_hexiscale.planner.search.recompute import auto_recompute
from lightning_hexiscale.planner.search.settings import SearchResult, SearchSettings, global_batch_setting
from lightning_hexiscale.planner.search.subsets import CoreRun, lift, search_subsets
from lightning_hexiscale.planner.search.two_phase import HEARTBEAT, SearchRun


def search(cluster: Cluster, workload: Workload, global_batch: int,
           settings: SearchSettings | None = None, worth: bool = False) -> SearchResult:
    """Find a low-cost plan for ``workload`` on ``cluster`` with ``global_batch`` sequences per step.

    Unless ``settings.use_all_devices``, the plan may leave devices idle where that is faster
    (:mod:`planner.search.subsets`: device subsets are searched too; ``result.subsets`` says which).
    ``worth``: also find, per machine, the best plan without it (``hexiscale plan``'s report).
    Raises :class:`InfeasiblePlan` when no plan tried fits in memory, saying what is missing.
    """
    check_argument_types("search", (
        ("cluster", cluster, Cluster, "pass a Cluster: Cluster.load(name_or_path)"),
        ("workload", workload, Workload, "pass a Workload: Workload(LlamaConfig.load(name)) or workload_from_config(cfg)"),
        ("settings", settings, (SearchSettings, type(None)), "pass SearchSettings(iterations=..., ...) or None"),
        # a truthy string or number would run the per-machine searches (minutes on a large cluster)
        ("worth", worth, bool, "pass worth=True (also price the best plan without each machine) or False")))
    s = settings or SearchSettings()
    global_batch = global_batch_setting(global_batch)
    most_tp = min(workload.model.num_kv_heads, cluster.num_devices)
    if s.tp_degrees is not None and min(s.tp_degrees) > most_tp:
        # no stage can be formed: this was "no plan fits in memory ... the activations do not fit"
        raise ConfigError("tp_degrees", s.tp_degrees,
                          f"a stage's TP degree is at most the KV heads ({workload.model.name}: "
                          f"{workload.model.num_kv_heads}) and the devices (cluster {cluster.name}: "
                          f"{cluster.num_devices}), so no TP group can be formed",
                          f"allow a degree from 1 to {most_tp}, or None for any")
    # a type its layer table prices at no TP degree its machines can form: refused here, not by an
    # empty search (the search proposes only measured degrees: cost.sources.StageRule)
    measured = check_measured_tp(cluster, workload, s.tp_degrees)  # read once: every SearchRun's StageRule
    priced = cluster
    warn_datasheet_pricing(cluster, workload)  # once per process: CUDA types priced from datasheets
    warn_default_links(cluster)  # once per process: machine pairs at the default bandwidth
    cluster = effective_cluster(cluster, workload)  # the heuristics' device speeds follow the roofline
    # the search allocates millions of small tuples that live as long as its caches: a rarer
    # young-generation collection saves ~5% of the time on large clusters (restored afterwards)
    threshold = gc.get_threshold()
    HEARTBEAT.restart()  # into a pipe: the first line 10 s after this search starts (two_phase.progress_kind)
    gc.set_threshold(max(threshold[0], 100_000), *threshold[1:])
    try:
        one = functools.partial(_search_one, measured=measured)
        if s.recompute == "auto":
            result = auto_recompute(cluster, workload, global_batch, s, worth, one)
        else:
            result = one(cluster, workload, global_batch, s, worth)
    finally:
        gc.set_threshold(*threshold)
    # what priced each device type; would refuse a stage at a TP degree its type's layer table lacks
    # (the search proposes none: cost.sources.StageRule)
    return dataclasses.replace(result, sources=price_sources(priced, workload, result.plan))


def _search_one(cluster: Cluster, workload: Workload, global_batch: int, s: SearchSettings,
                worth: bool, measured: dict[str, frozenset[int]] | None = None) -> SearchResult:
    """One recompute setting's search. ``measured``: :func:`cost.sources.measured_tp_degrees` of
    ``cluster`` (None: each run reads the tables)."""
    if s.use_all_devices:
        return SearchRun(cluster, workload, global_batch, s, measured=measured).run()
    return subset_search(cluster, workload, global_batch, s, worth, measured)


def _core(workload: Workload, global_batch: int, s: SearchSettings, results: list[tuple[Cluster, SearchResult]],
          measured: dict[str, frozenset[int]] | None = None):
    """The all-device search as :mod:`planner.search.subsets` runs it on a (sub)cluster: a
    :class:`subsets.CoreRun` (its best plan, the best plan giving every device work, the log and
    a way to try the best layouts without some devices). Each run's (cluster, result) is appended
    to ``results``; every run shares ``measured`` (the tables' TP degrees do not depend on the subset)."""

    def run(cluster: Cluster, share: float = 1.0) -> CoreRun:
        if cluster.num_devices > most_busy(workload, global_batch):
            return busy_only(cluster, share)
        sr = SearchRun(cluster, workload, global_batch, s, share, measured)
        result = sr.run()
        results.append((cluster, result))
        return CoreRun(result.plan, result.estimate.cost, sr.best_all[0], result.log, sr.without,
                       sr.polish if sr.small and not s.use_all_devices else None)

    def busy_only(cluster: Cluster, share: float) -> CoreRun:
        """More devices than any plan can give work to (G x L x K, :func:`infeasible.capacity_message`):
        the all-device search refuses such a cluster, but plans may leave devices idle, so it runs
        on the ``most`` fastest devices (then, as a second try, the ``most`` largest: memory may be
        what binds), the others idle. Without this a one-machine cluster had no subset to fall back on."""
        most = most_busy(workload, global_batch)
        devs = cluster.devices
        keeps = []
        for key in (lambda d: (-devs[d].flops, -devs[d].memory_bytes, d),
                    lambda d: (-devs[d].memory_bytes, -devs[d].flops, d)):
            keep = tuple(sorted(sorted(range(cluster.num_devices), key=key)[:most]))
            if keep not in keeps:
                keeps.append(keep)
        best, error = None, None
        for keep in keeps:
            sr = SearchRun(cluster.subset(list(keep)), workload, global_batch, s, share, measured)
            try:
                result = sr.run()
            except InfeasiblePlan as e:
                error = error or e
                continue
            m = workload.model
            reason = (f"no plan gives all {cluster.num_devices} devices work: {m.name} at global batch {global_batch} "
                      f"has work for at most {most} ({global_batch} sequences x {m.num_layers} layers x "
                      f"{m.num_kv_heads} KV heads)")
            plan = lift(result.plan, keep, cluster)
            plan = dataclasses.replace(plan, meta={**plan.meta, "idle_reason": reason})
            est = estimate(plan, cluster, workload)
            if best is None or est.cost < best[1].cost:
                best = (plan, est, result, sr, keep)
        if best is None:
            raise error
        plan, est, result, sr, keep = best
        results.append((cluster, SearchResult(plan, est, result.log, result.search_time_s)))

        def without(drop: frozenset[int]) -> tuple[float, Plan | None]:
            t, p = sr.without(frozenset(keep.index(d) for d in drop if d in keep))
            return t, (lift(p, keep, cluster) if p is not None else None)

        return CoreRun(plan, est.cost, math.inf, result.log, without)

    return run


def subset_search(cluster: Cluster, workload: Workload, global_batch: int, s: SearchSettings,
                  worth: bool = False, measured: dict[str, frozenset[int]] | None = None) -> SearchResult:
    """The best plan over device subsets (:func:`subsets.search_subsets`), as a SearchResult.
    ``measured``: as :func:`_search_one`'s."""
    t0 = time.perf_counter()
    mbs = micro_batch_candidates(global_batch, s.micro_batch_size, cluster.num_devices)
    runs: list[tuple[Cluster, SearchResult]] = []
    core = _core(workload, global_batch, s, runs, measured)
    plan, report, log = search_subsets(cluster, workload, global_batch, core, mbs, s.recompute, worth)
    # the whole cluster's plan was priced at the end of its run, on this cluster: not again (a
    # quarter of a second at 1,024 GPUs); a subset's plan is priced here on the whole cluster
    same = [r.estimate for c, r in runs if c is cluster and r.plan.pipelines == plan.pipelines]
    return SearchResult(plan, same[0] if same else estimate(plan, cluster, workload), log,
                        time.perf_counter() - t0, report)
