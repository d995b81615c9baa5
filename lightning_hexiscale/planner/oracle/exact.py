"""The oracle: the exact optimum of the whole plan space under ``estimate()``, for clusters of up to 8 devices.

The space (what a Plan can express for the cluster, model and global batch G):

- every subset of the devices (the rest named in ``Plan.idle_devices``; only the whole cluster with
  ``use_all_devices``) and every partition of it into pipelines (at most ``max_pipelines``, at
  most G pipelines);
- per pipeline, every ordered sequence of stages, every TP group (any subset of the pipeline's
  devices of at most ``num_kv_heads`` devices, across machines too), every stage leader and every
  TP rank order (they decide who exchanges gradients with whom under asymmetric TP, and who sends
  to whom on the scatter/gather path between stages of equal TP degree);
- every layer split (each stage at least one layer);
- every integer batch split b_1 + ... + b_P = G, b_i >= 1, and per pipeline any micro-batch size
  m_i dividing b_i (``train.micro_batch_size`` pins it);
- ddp, zero2 and zero3 (``train.dp_sharding`` pins it); the schedule and recompute are the settings',
  and ``reduce_dtype`` is the run's own (None), as the search leaves it.

Every returned plan is scored by ``estimate()``; the result is the plan of least ``estimate().cost``.

How, exactly and fast enough:

1. **Device symmetry.** Two devices whose swap leaves the cluster unchanged (same FLOP/s and
   memory, equal bandwidth and latency to every third device) are interchangeable, and
   ``estimate()`` is invariant under the swap. Devices are grouped into classes of pairwise
   interchangeable devices (usually: the GPUs of one machine). A pipeline is then a vector of
   device counts per class, a stage a tuple of class labels, and each orbit of plans is
   enumerated once (canonical devices: the first free devices of each class). A subset is a
   count vector at most the class sizes (``space.sub_vectors``): ``estimate()`` prices
   only the devices a plan uses, so which devices of a class stay idle does not matter.
2. **Structure of the time.** With A = sum_j (Stage_j + Hop_j), B = max_j (Stage_j + Hop_j) per
   micro-batch and C = max_j (exposed data-parallel time of stage j), a pipeline with n
   micro-batches takes A + (n - 1) * B + C (Appendix B eq. 8 plus its data-parallel tail) and the
   iteration takes the slowest pipeline. Pipelines interact only through the data-parallel
   T_comm of their layers (eq. 4), which depends on the layouts (devices, layer ranges) of all
   pipelines and on their number P, never on batches or micro-batch sizes.
3. **A lower bound that never exceeds the true time (soundness).** Let device d of a TP-t stage of
   pipeline i and another pipeline k. Every layer d holds is held whole by pipeline k, split over
   the ranks of k's stage, and d exchanges with the ranks whose shard overlaps its own 1/t share:
   at least one partner, and shares summing to 1/t. So its eq. 4 sum over k's partners is at least
   ``min alpha(d, D_k) + (1/t) * layer_bytes / (P * max beta(d, D_k))`` and, summed over the P - 1
   other pipelines and bounded by the links to all devices outside pipeline i,
   ``T_comm(d) >= (P - 1) * (min_{x not in D_i} alpha(d, x) + layer_bytes / (t * P * max_{x not in D_i} beta(d, x)))``.
   The T_comm of a stage is the max over its devices, so the max of these per-device bounds bounds
   it too. Every term of the pipeline time is non-decreasing in T_comm
   (``estimate.layer_step``: T_f + T_b, or theta*max(T, T_comm); ``cost.model.dp_exposed_layer``),
   so plugging the bound in gives a lower bound LB(structure, m, n) of the pipeline's time that
   depends on the pipeline alone. Memory does not depend on T_comm, so the feasibility used with
   the bound is exact. The data-parallel syncs of the embedding, the LM head and the norms
   (``estimate.dp_edge_times``) only add to the tail and are left out (>= 0). On a chain with
   fixed leaders a hop on the leader path is exact; on the scatter/gather path (equal TP > 1) it
   is taken as the least over every pairing of the two stages' ranks, which is what the rank
   orders vary. Two coarser bounds prune earlier: for an unordered set of stages, the hops are at
   least (S - 1) times the cheapest hop between any two of its stages with any leaders and rank
   orders, the LM head at least the cheapest stage's head and the embedding's all-reduce at least
   the cheapest stage's; the memory check uses, per stage, the smallest fixed and per-layer bytes
   over every position the stage could take (a relaxation). Each is a minimum over a superset of
   what the exact term minimises, hence never larger.
4. **Joint batch split, exactly.** For fixed structures, g_i(b) = min over micro-batch sizes m | b
   that fit in memory of pipeline i's time at b / m micro-batches; the best integer split is the
   minimax min_{b_1+...+b_P=G} max_i g_i(b_i), found by a binary search over the candidate values
   with an exact subset-sum (bitset) feasibility test (:func:`batching.minimax_split`).
5. **Branch and bound.** Phase 1 bounds every (partition, sharding) by the minimax of its
   pipelines' coarse bounds; partitions are visited best first and the search stops when the next
   bound reaches the incumbent. Inside a partition the per-pipeline structures whose bound can
   still beat the incumbent are combined depth first (pipelines with the same device counts in
   non-decreasing order: swapping them is a symmetry); a combination survives only if some batch
   split keeps every pipeline's bound below the incumbent (bitset test). Survivors are evaluated
   exactly (their real T_comm, every TP rank order of mixed-class stages where it matters: with
   more than one pipeline or next to a stage of the same TP degree), and an improvement is
   re-scored by ``estimate()`` itself, which must agree to 1e-9 (a disagreement raises: the
   oracle's exact path and ``estimate()`` share their terms, so it would be a bug).
6. **Time limit.** Past ``time_limit_s`` the oracle stops and says so: ``complete=False``,
   ``status="incomplete"``, with the best plan found and a proven lower bound on the optimum.

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
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.cost.estimate import Workload, estimate
from lightning_hexiscale.planner.oracle.space import (OracleResult, OracleSettings, compositions, contexts,
                                                      device_classes, multiset_permutations, sub_vectors,
                                                      vector_partitions)
from lightning_hexiscale.planner.oracle.terms import OracleTerms, OracleTimeout
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search.batching import layout_plan, minimax_split, mask, sumset, with_batches
from lightning_hexiscale.planner.search.subsets import name_idle

__all__ = ["MAX_DEVICES", "OracleResult", "OracleSettings", "compositions", "device_classes", "oracle",
           "vector_partitions"]

MAX_DEVICES = 8
_CAP_STEP = 1.25
"""A partition's structures are first taken up to 1.25 x its bound; the rest only if that finds nothing better."""


class Oracle(OracleTerms):
    """The branch and bound over the terms and bounds of :class:`OracleTerms`."""

    def offer(self, plan: Plan) -> None:
        if self.s.use_all_devices and plan.world_size < self.cluster.num_devices:
            return  # outside the space asked for: an incumbent that leaves devices idle
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
        for chain, _ in combo:
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
            for chain, _ in combo:
                devs = []
                for _ in chain:
                    devs.append(tuple(pools[lab].pop(0) for lab in variant[k]))
                    k += 1
                stages_dev.append(devs)
            layout = layout_plan(stages_dev, [split for _, split in combo], sh, self.s.schedule, self.s.recompute,
                                 self.L)
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
    pipelines). ``incumbent``: a known plan to start from (it only speeds up the pruning)."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError("train.global_batch", global_batch, "must be a positive integer", "use e.g. 16")
    if cluster.num_devices > max_devices:
        raise ConfigError("cluster", cluster.name, f"the oracle enumerates every plan; {cluster.num_devices} devices "
                          f"is more than max_devices={max_devices}", "use a small cluster (cluster.subset) or the search")
    if time_limit_s <= 0:
        raise ConfigError("time_limit_s", time_limit_s, "must be positive", "give the oracle e.g. 60 seconds")
    if getattr(settings, "recompute", None) == "auto":  # the optimum over both settings (search.auto_recompute)
        return _best_of_recompute(cluster, workload, global_batch, settings, time_limit_s, incumbent)
    return Oracle(cluster, workload, global_batch, OracleSettings.of(settings), time_limit_s).run(incumbent)


def _best_of_recompute(cluster: Cluster, workload: Workload, global_batch: int, settings, time_limit_s: float,
                       incumbent: Plan | None) -> OracleResult:
    """``recompute: auto``: the optimum without and with recomputation (half the time limit each),
    the better one (ties: without); complete when both are, its bound the smaller of the two. One
    flag for every pipeline: the search's per-pipeline decision (:mod:`planner.search.recompute`)
    can beat it where one pipeline fits without recomputation and another does not."""
    import dataclasses

    runs = []
    for r in (False, True):
        start = incumbent if incumbent is not None and incumbent.recompute == r else None
        runs.append(Oracle(cluster, workload, global_batch, OracleSettings.of(dataclasses.replace(settings, recompute=r)),
                           time_limit_s / 2).run(start))
    best = min(runs, key=lambda x: x.cost)
    complete = all(x.complete for x in runs)
    status = best.status if complete else "incomplete"
    return dataclasses.replace(best, complete=complete, status=status,
                               lower_bound_s=min(x.lower_bound_s for x in runs), time_s=sum(x.time_s for x in runs))
