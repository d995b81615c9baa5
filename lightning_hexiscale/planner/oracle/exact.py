"""The oracle: the exact optimum of the whole plan space under ``estimate()``, for clusters of up to 8 devices.

Contract: :func:`oracle` returns the plan of least ``estimate().cost`` over every plan a Plan can
express for the cluster, model and global batch (device subsets, pipeline partitions, stage chains,
TP groups, leaders and rank orders, layer and batch splits, micro-batch sizes, ddp/zero2/zero3, and
under ``recompute: auto`` recomputation per pipeline), or, past ``time_limit_s``, ``complete=False``
with the best plan found and a proven lower bound.
Why a branch and bound rather than a brute force: the space grows exponentially with the devices
(partitions x stage chains x layer splits x batch splits); device symmetry and lower bounds proven
sound prune it and keep the result exact. The space, the bounds and their proofs (points 1-6):
``docs/concepts/planner.md``, "How the oracle is exact".

Code: the space and the result in :mod:`.space`, the terms and bounds (points 2-3) in
:mod:`.terms`, the branch and bound (points 4-6) here.

Layer splits are enumerated whole, which suits the small models the oracle is meant for (8-layer
shapes: at most 35 splits per stage count); deep models on many stages run into the time limit.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, check_argument_types
from lightning_hexiscale.planner.cost.estimate import Workload, estimate
from lightning_hexiscale.planner.oracle.space import (OracleResult, OracleSettings, compositions, contexts,
                                                      device_classes, multiset_permutations, sub_vectors,
                                                      vector_partitions)
from lightning_hexiscale.planner.oracle.terms import OracleTerms, OracleTimeout
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search.assemble import micro_batch_candidates
from lightning_hexiscale.planner.search.batching import layout_plan, minimax_split, mask, sumset, with_batches
from lightning_hexiscale.planner.search.settings import SearchSettings, global_batch_setting
from lightning_hexiscale.planner.search.subsets import name_idle

__all__ = ["MAX_BATCH", "MAX_DEVICES", "OracleResult", "OracleSettings", "compositions", "device_classes", "oracle",
           "vector_partitions"]

MAX_DEVICES = 8
MAX_BATCH = 65_536
"""Its tables take every micro-batch size m <= G and count n <= G / m, about G ln G pairs per
pipeline, built before the first check of the time limit: G = 65,536 answers ``incomplete`` in 24 s
at a 10 s limit on cpu_hetero4, G = 4,194,304 (a batch typed in tokens) ran past 3 minutes at 10 s."""
_CAP_STEP = 1.25
"""A partition's structures are first taken up to 1.25 x its bound; the rest only if that finds nothing better."""


class Oracle(OracleTerms):
    """The branch and bound over the terms and bounds of :class:`OracleTerms`."""

    def offer(self, plan: Plan) -> None:
        if self.s.use_all_devices and plan.world_size < self.cluster.num_devices:
            return  # outside the space asked for: an incumbent that leaves devices idle
        if not set(plan.recomputes) <= set(self.flags):
            return  # outside the space asked for: a recompute setting the settings exclude
        est = estimate(plan, self.cluster, self.w)
        if est.cost < self.best[0]:
            self.best = (est.cost, plan, est)

    def run(self, incumbent: Plan | None) -> OracleResult:
        if incumbent is not None:
            self.offer(incumbent)
        bound = 0.0
        try:
            heap = []
            parts = (vecs for sub in sub_vectors(self.counts, self.s.use_all_devices) for vecs in vector_partitions(sub))
            for vecs in parts:
                if len(vecs) > self.max_p:
                    continue
                for sh in self.shardings:
                    lb, _ = minimax_split([self.level0(v, len(vecs), sh) for v in vecs], self.G)
                    if math.isfinite(lb):
                        heap.append((lb, len(heap), 0, sh, tuple(vecs)))
            heapq.heapify(heap)
            self.stats["partitions"] = len(heap)
            bound = math.inf
            while heap:
                bound, _, stage, sh, vecs = heapq.heappop(heap)
                if bound >= self.best[0]:
                    break
                P = len(vecs)
                if stage == 0:  # refine the rate bound by the stage-set bound
                    self.stats["partitions_visited"] += 1
                    lb1, _ = minimax_split([self.level1(ctx, P, sh)[1] for ctx in contexts(vecs)], self.G)
                    if lb1 < self.best[0]:
                        heapq.heappush(heap, (max(lb1, bound), len(heap) + self.stats["partitions"], 1, sh, vecs))
                    continue
                # every plan of this partition costs at least `bound`: evaluate those that may cost
                # less than `cap`; the rest cost at least `cap` and come back with that bound
                cap = min(self.best[0], bound * _CAP_STEP)
                tables = [self.level2(ctx, P, sh, cap) for ctx in contexts(vecs)]
                if all(len(t[0]) for t in tables):
                    lb2, _ = minimax_split([t[1].min(axis=0) for t in tables], self.G)
                    if lb2 < min(cap, self.best[0]):
                        self.combine(vecs, P, sh, tables, cap)
                if cap < self.best[0]:
                    heapq.heappush(heap, (cap, len(heap) + self.stats["partitions"], 2, sh, vecs))
            bound = math.inf
            complete = True
        except OracleTimeout:
            complete = False
        cost, plan, est = self.best
        if complete:
            status, lower = ("optimal", cost) if plan is not None else ("infeasible", math.inf)
        else:
            status, lower = "incomplete", min(cost, bound)
        return OracleResult(plan, est, complete, status, lower, time.perf_counter() - self.t0, dict(self.stats))

    def combine(self, vecs: tuple, P: int, sh: str, tables: list, cap: float) -> None:
        """Depth-first over one structure per pipeline; a partial choice survives while some batch
        split keeps every chosen pipeline's bound, and every other pipeline's best bound, below the
        incumbent (bitset subset-sum over batches)."""
        G = self.G
        state = {"bar": None}
        masks: list[dict[int, int]] = [{} for _ in range(P)]
        suffix: list[int] = []

        def bar_now() -> float:
            return min(cap, self.best[0])

        def refresh() -> None:
            bar = bar_now()
            if state["bar"] == bar:
                return
            state["bar"] = bar
            for m in masks:
                m.clear()
            suffix[:] = [1] * (P + 1)
            for i in range(P - 1, -1, -1):
                suffix[i] = sumset(suffix[i + 1], mask(tables[i][1].min(axis=0), bar) & ~1, G)

        def rowmask(i: int, r: int) -> int:
            if r not in masks[i]:
                masks[i][r] = mask(tables[i][1][r], bar_now()) & ~1
            return masks[i][r]

        def rec(i: int, reach: int, chosen: list[int]) -> None:
            refresh()
            if i == P:
                if (reach >> G) & 1:
                    self.exact(vecs, P, sh, [tables[k][0][r] for k, r in enumerate(chosen)],
                               [tables[k][1][r] for k, r in enumerate(chosen)])
                return
            self.tick()
            structs, garr = tables[i]
            start = chosen[-1] if i and vecs[i] == vecs[i - 1] else 0
            for r in range(start, len(structs)):
                refresh()
                if garr[r].min() >= bar_now():
                    break  # rows are sorted by their least bound
                mk = rowmask(i, r)
                if not mk:
                    continue
                nr = sumset(reach, mk, G)
                if not (sumset(nr, suffix[i + 1], G) >> G) & 1:
                    continue
                rec(i + 1, nr, chosen + [r])

        suffix.extend([1] * (P + 1))
        rec(0, 1, [])

    def exact(self, vecs: tuple, P: int, sh: str, combo: list, bounds: list[np.ndarray]) -> None:
        """Exact times of one combination (every TP rank order of its mixed-class stages when the
        pipelines exchange gradients), the best batch split, and, when it beats the incumbent,
        ``estimate()`` of the plan. ``bounds``: the pipelines' bounds g[b]; batches whose bound
        cannot beat the incumbent are not evaluated."""
        self.stats["combinations"] += 1
        orders_per_stage = []
        for chain, _, _ in combo:
            for j, st in enumerate(chain):
                rest = list(st[1:])
                # the rank order beyond the leader matters for the gradient exchange (P > 1) and on
                # the scatter/gather path to an adjacent stage of the same TP degree
                scatter = any(0 <= k < len(chain) and len(chain[k]) == len(st) > 1 for k in (j - 1, j + 1))
                perms = multiset_permutations(rest) if (P > 1 or scatter) and len(set(rest)) > 1 else [tuple(rest)]
                orders_per_stage.append([(st[0],) + tuple(p) for p in perms])
        for variant in itertools.product(*orders_per_stage):
            self.tick()
            self.stats["exact"] += 1
            pools = [list(c) for c in self.classes]
            stages_dev, k = [], 0
            for chain, _, _ in combo:
                devs = []
                for _ in chain:
                    devs.append(tuple(pools[lab].pop(0) for lab in variant[k]))
                    k += 1
                stages_dev.append(devs)
            flags = [r for _, _, r in combo]
            layout = layout_plan(stages_dev, [split for _, split, _ in combo], sh, self.s.schedule, flags[0], self.L)
            if len(set(flags)) > 1:
                layout = layout.with_recompute(flags)
            dp = self.timer.dp(layout)
            bar = self.best[0]
            suffix = [1] * (P + 1)
            for i in range(P - 1, -1, -1):
                suffix[i] = sumset(suffix[i + 1], mask(bounds[i], bar) & ~1, self.G)
            g_all, pick, reach = [], [], 1
            for i in range(P):
                g, m_of = self.timer.pipeline(layout, i, dp, bounds[i] < bar)
                reach = sumset(reach, mask(g, bar) & ~1, self.G)
                if not (sumset(reach, suffix[i + 1], self.G) >> self.G) & 1:
                    break  # no batch split lets this variant beat the incumbent
                g_all.append(g)
                pick.append(m_of)
            else:
                cost, batches = minimax_split(g_all, self.G)
                if cost < self.best[0]:
                    plan = name_idle(with_batches(layout, batches, [pick[i][b] for i, b in enumerate(batches)],
                                                  self.meta()), self.cluster)
                    est = estimate(plan, self.cluster, self.w)
                    if not math.isclose(est.cost, cost, rel_tol=1e-9):
                        raise RuntimeError(f"oracle: exact time {cost} of {plan.to_dict()} disagrees with "
                                           f"estimate() {est.cost}: the oracle's terms and estimate() diverged")
                    if est.cost < self.best[0]:
                        self.best = (est.cost, plan, est)

    def meta(self) -> dict:
        return {"planner": "oracle", "model": self.w.model.name, "cluster": self.cluster.name}


def oracle(cluster: Cluster, workload: Workload, global_batch: int, settings=None, time_limit_s: float = 60.0,
           max_devices: int = MAX_DEVICES, incumbent: Plan | None = None) -> OracleResult:
    """The plan of least ``estimate().cost`` over the whole plan space (module docstring), or, past
    ``time_limit_s``, the best found with ``complete=False``. ``settings``: a SearchSettings or
    :class:`OracleSettings` (schedule, recompute, pinned micro-batch size / dp sharding, max
    pipelines; ``recompute="auto"``: each pipeline recomputes or not, as the search decides it).
    ``incumbent``: a known plan to start from (it only speeds up the pruning)."""
    check_argument_types("oracle", (
        ("cluster", cluster, Cluster, "pass a Cluster: Cluster.load(name_or_path)"),
        ("workload", workload, Workload, "pass a Workload: Workload(LlamaConfig.load(name))")))
    check_argument_types("oracle", (("settings", settings, (OracleSettings, SearchSettings, type(None)),
                                     "pass OracleSettings(recompute='auto', ...)"),))
    global_batch = global_batch_setting(global_batch, example=16)
    s = OracleSettings.of(settings)
    if s.micro_batch_size is not None:  # one that does not divide the batch: 'infeasible', complete, no plan
        micro_batch_candidates(global_batch, s.micro_batch_size, cluster.num_devices)
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)):
        raise ConfigError("time_limit_s", time_limit_s, "must be a number of seconds", "give the oracle e.g. 60 seconds")
    if cluster.num_devices > max_devices:
        raise ConfigError("cluster", cluster.name, f"the oracle enumerates every plan; {cluster.num_devices} devices "
                          f"is more than max_devices={max_devices}", "use a small cluster (cluster.subset) or the search")
    if time_limit_s <= 0:
        raise ConfigError("time_limit_s", time_limit_s, "must be positive", "give the oracle e.g. 60 seconds")
    if global_batch > MAX_BATCH:
        raise ConfigError("train.global_batch", global_batch, f"the oracle enumerates every micro-batch size and batch "
                          f"split; it covers global batches of at most {MAX_BATCH:,} sequences",
                          "drop --optimum (the search plans it), or give the global batch in sequences, not tokens")
    return Oracle(cluster, workload, global_batch, s, time_limit_s).run(incumbent)

