"""The oracle: the exact optimum of the whole plan space under ``estimate()``, for clusters of up to 8 devices.

The space (what a Plan can express for the cluster, model and global batch G):

- every partition of the devices into pipelines (all devices used, at most ``max_pipelines``, at
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
   enumerated once (canonical devices: the first free devices of each class).
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
   (``estimate.layer_step``: T_f + T_b, or theta*max(T, T_comm); ``cost_model.dp_exposed_layer``),
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

Layer splits are enumerated whole, which suits the small models the oracle is meant for (8-layer
shapes: at most 35 splits per stage count); deep models on many stages run into the time limit.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner import cost_model as cm
from lightning_hexiscale.planner import estimate as E
from lightning_hexiscale.planner.batching import BatchTimer, layout_plan, minimax_split, mask, sumset, with_batches
from lightning_hexiscale.planner.estimate import Estimate, Workload, estimate
from lightning_hexiscale.planner.plan import DP_SHARDINGS, SCHEDULES, Plan

MAX_DEVICES = 8
_CHUNK = 256
_CAP_STEP = 1.25
"""A partition's structures are first taken up to 1.25 x its bound; the rest only if that finds nothing better."""


@dataclass(frozen=True)
class OracleSettings:
    """What the oracle may vary (the same knobs a user pins in ``train.*``)."""

    schedule: str = "1f1b"
    recompute: bool = True
    micro_batch_size: int | None = None
    """None: any micro-batch size per pipeline; else every pipeline uses this one."""
    dp_sharding: str | None = None
    """None: ddp, zero2 and zero3."""
    max_pipelines: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError("train.schedule", self.schedule, f"must be one of {SCHEDULES}", "use 1f1b")
        if self.dp_sharding is not None and self.dp_sharding not in DP_SHARDINGS:
            raise ConfigError("train.dp_sharding", self.dp_sharding, f"must be one of {DP_SHARDINGS}", "use zero2")

    @classmethod
    def of(cls, settings) -> OracleSettings:
        """From a :class:`~lightning_hexiscale.planner.search.SearchSettings` (or None)."""
        if settings is None:
            return cls()
        if isinstance(settings, cls):
            return settings
        return cls(settings.schedule, settings.recompute, settings.micro_batch_size, settings.dp_sharding,
                   settings.max_pipelines)


@dataclass(frozen=True)
class OracleResult:
    plan: Plan | None
    """The optimal plan (the best found when incomplete); None when nothing fits."""
    estimate: Estimate | None
    complete: bool
    """True: the whole space was covered, the plan is optimal (or nothing fits)."""
    status: str
    """``optimal``, ``infeasible`` (complete, nothing fits) or ``incomplete`` (time limit)."""
    lower_bound_s: float
    """Proven lower bound of the optimal iteration time (equals the plan's when complete)."""
    time_s: float
    stats: dict = field(default_factory=dict)
    """Counts: partitions bounded / visited, structures kept, combinations evaluated exactly."""

    @property
    def cost(self) -> float:
        return self.estimate.cost if self.estimate is not None else math.inf


class _Timeout(Exception):
    pass


# ---- pure helpers ------------------------------------------------------------------------------
def device_classes(cluster: Cluster) -> list[list[int]]:
    """Classes of pairwise interchangeable devices, in device order: d joins a class when swapping
    it with every member leaves FLOP/s, memory and all links to third devices unchanged."""
    bw, lat = cluster.bandwidth, cluster.latency
    n = cluster.num_devices
    classes: list[list[int]] = []
    for d in range(n):
        dev = cluster.devices[d]
        for cl in classes:
            ok = True
            for r in cl:
                rv = cluster.devices[r]
                if (rv.flops, rv.memory_bytes, rv.gpu_type) != (dev.flops, dev.memory_bytes, dev.gpu_type):
                    ok = False
                    break
                others = [x for x in range(n) if x not in (d, r)]
                if not (np.array_equal(bw[d, others], bw[r, others]) and np.array_equal(lat[d, others], lat[r, others])):
                    ok = False
                    break
            if ok:
                cl.append(d)
                break
        else:
            classes.append([d])
    return classes


def vector_partitions(remaining: tuple[int, ...], upper: tuple[int, ...] | None = None):
    """Multisets of non-zero count vectors summing to ``remaining``, each listed once (vectors in
    non-increasing lexicographic order, the first at most ``upper``)."""
    upper = remaining if upper is None else upper
    if not any(remaining):
        yield []
        return
    for vec in itertools.product(*(range(r, -1, -1) for r in remaining)):
        if not any(vec) or vec > upper:
            continue
        rest = tuple(r - v for r, v in zip(remaining, vec))
        for tail in vector_partitions(rest, vec):
            yield [vec] + tail


def compositions(total: int, parts: int) -> np.ndarray:
    """Every way to write ``total`` as ``parts`` positive integers in order, one row each."""
    rows = [np.diff((0,) + cuts + (total,)) for cuts in itertools.combinations(range(1, total), parts - 1)]
    return np.array(rows, dtype=np.int64).reshape(len(rows), parts)


def multiset_permutations(items: list) -> list[tuple]:
    """Distinct orderings of ``items`` (equal items are not swapped)."""
    out: list[tuple] = []
    counts: dict = {}
    order: list = []
    for x in items:
        if x not in counts:
            order.append(x)
        counts[x] = counts.get(x, 0) + 1

    def rec(prefix: list) -> None:
        if len(prefix) == len(items):
            out.append(tuple(prefix))
            return
        for x in order:
            if counts[x]:
                counts[x] -= 1
                prefix.append(x)
                rec(prefix)
                prefix.pop()
                counts[x] += 1

    rec([])
    return out


# ---- the search --------------------------------------------------------------------------------
class _Oracle:
    def __init__(self, cluster: Cluster, workload: Workload, global_batch: int, s: OracleSettings,
                 time_limit_s: float):
        self.cluster, self.w, self.G, self.s = cluster, workload, global_batch, s
        model = workload.model
        self.L, self.max_tp = model.num_layers, model.num_kv_heads
        self.classes = device_classes(cluster)
        self.counts = tuple(len(c) for c in self.classes)
        self.K = len(self.classes)
        self.theta = E.calibration_theta(cluster)
        self.layer_bytes = E.dp_layer_bytes(workload)
        self.shardings = (s.dp_sharding,) if s.dp_sharding else DP_SHARDINGS
        self.max_p = min(cluster.num_devices, global_batch, s.max_pipelines or cluster.num_devices)
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + time_limit_s
        self.best: tuple[float, Plan | None, Estimate | None] = (math.inf, None, None)
        self.stats = dict(partitions=0, partitions_visited=0, structures=0, combinations=0, exact=0)
        rep = [c[0] for c in self.classes]
        bw, lat = cluster.bandwidth, cluster.latency
        self.link_bw = np.zeros((self.K, self.K))
        self.link_lat = np.zeros((self.K, self.K))
        for a in range(self.K):
            for b in range(self.K):
                other = self.classes[b][1] if a == b and len(self.classes[b]) > 1 else self.classes[b][0]
                if a == b and len(self.classes[b]) == 1:
                    self.link_bw[a, b], self.link_lat[a, b] = np.nan, np.nan
                else:
                    self.link_bw[a, b], self.link_lat[a, b] = bw[rep[a], other], lat[rep[a], other]
        self._comp: dict[int, np.ndarray] = {}
        self._q: dict[int, tuple] = {}
        self._lt: dict[tuple, tuple[float, float]] = {}
        self._extra: dict[tuple, float] = {}
        self._hop: dict[tuple, float] = {}
        self._mem: dict[tuple, E.MemoryTerms] = {}
        self._cap: dict[tuple, float] = {}
        self._arr: dict[tuple, object] = {}
        self.timer = BatchTimer(cluster, workload, global_batch, [s.micro_batch_size] if s.micro_batch_size else None)
        self.ms = [s.micro_batch_size] if s.micro_batch_size else list(range(1, global_batch + 1))
        self._l1: dict[tuple, tuple] = {}
        self._l2: dict[tuple, tuple] = {}

    def tick(self) -> None:
        if time.perf_counter() > self.deadline:
            raise _Timeout

    # ---- cached terms (all through estimate's own functions) --------------------------------
    def devices_of(self, labels: tuple[int, ...], taken: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Canonical devices for class labels: the first devices of each class not in ``taken``."""
        used = {k: 0 for k in range(self.K)}
        out = []
        for lab in labels:
            pool = [d for d in self.classes[lab] if d not in taken]
            out.append(pool[used[lab]])
            used[lab] += 1
        return tuple(out)

    def comps(self, S: int) -> np.ndarray:
        if S not in self._comp:
            self._comp[S] = compositions(self.L, S)
        return self._comp[S]

    def qpairs(self, P: int) -> tuple:
        """(m, n, b, index of m in ``self.ms``, b group starts, b values) of the (micro-batch size,
        micro-batches) pairs a pipeline of a P-pipeline plan may take, grouped by batch b = m * n."""
        if P not in self._q:
            hi = self.G - (P - 1)
            pairs = sorted(((m * n, m, n) for m in self.ms if m <= hi for n in range(1, hi // m + 1)
                            if P > 1 or m * n == self.G))
            qb = np.array([p[0] for p in pairs], dtype=np.int64)
            qm = np.array([p[1] for p in pairs], dtype=np.int64)
            qn = np.array([p[2] for p in pairs], dtype=np.int64)
            qmi = np.searchsorted(np.array(self.ms), qm)
            bvals, starts = np.unique(qb, return_index=True)
            self._q[P] = (qm, qn, qb, qmi, starts, bvals)
        return self._q[P]

    def layer_tb(self, st: tuple[int, ...], m: int) -> tuple[float, float]:
        key = (tuple(sorted(st)), m)
        if key not in self._lt:
            t_f, t_b, _, _ = E.layer_times(self.cluster, self.w, self.devices_of(key[0]), m, self.s.recompute)
            self._lt[key] = (t_f, t_b)
        return self._lt[key]

    def extra(self, st: tuple[int, ...], m: int, first: bool, last: bool) -> float:
        """:func:`estimate.stage_extra_times` (head on the last stage, embedding on the first), summed;
        they depend on the stage's set of devices only."""
        key = (tuple(sorted(st)), m, first, last)
        if key not in self._extra:
            self._extra[key] = sum(E.stage_extra_times(self.cluster, self.w, self.devices_of(key[0]), m, first, last))
        return self._extra[key]

    def head_arr(self, st: tuple[int, ...]) -> np.ndarray:
        """The LM head and loss per micro-batch on a last stage, per micro-batch size of ``self.ms``."""
        key = ("head", tuple(sorted(st)))
        if key not in self._arr:
            self._arr[key] = np.array([self.extra(st, m, False, True) for m in self.ms])
        return self._arr[key]

    def embed_arr(self, st: tuple[int, ...]) -> np.ndarray:
        """The vocabulary-parallel embedding's all-reduce per micro-batch on a first stage."""
        key = ("embed", tuple(sorted(st)))
        if key not in self._arr:
            self._arr[key] = np.array([self.extra(st, m, True, False) for m in self.ms])
        return self._arr[key]

    def hop(self, src: tuple[int, ...], dst: tuple[int, ...], m: int) -> float:
        """:func:`estimate.hop_time` from stage ``src`` to stage ``dst`` (class labels in rank order,
        leader first). Between equal TP degrees above 1 (the scatter/gather path) the whole rank
        orders matter (rank r sends to rank r); otherwise only the source leader, the destination
        leader and the destination's devices."""
        scatter = len(src) == len(dst) > 1
        key = (src, dst, m) if scatter else (src[:1], dst, m)
        if key not in self._hop:
            s_dev = self.devices_of(key[0])
            self._hop[key] = E.hop_time(self.cluster, self.w, s_dev, self.devices_of(dst, taken=s_dev), m)
        return self._hop[key]

    def hop_arr(self, src: tuple[int, ...], dst: tuple[int, ...]) -> np.ndarray:
        key = ("hop", src if len(src) == len(dst) > 1 else src[:1], dst)
        if key not in self._arr:
            self._arr[key] = np.array([self.hop(src, dst, m) for m in self.ms])
        return self._arr[key]

    def hop_bound(self, src: tuple[int, ...], dst: tuple[int, ...]) -> np.ndarray:
        """A lower bound of the hop from stage ``src`` to stage ``dst`` (labels, leader first) over every
        rank order consistent with their leaders: exact on the leader path (it depends on the leaders
        only); on the scatter/gather path the least over every pairing of their ranks (the pairing is
        the only thing the rank orders change there), per micro-batch size."""
        if not len(src) == len(dst) > 1:
            return self.hop_arr(src, dst)
        key = ("hopscatter", tuple(sorted(src)), tuple(sorted(dst)))
        if key not in self._arr:
            a = key[1]
            self._arr[key] = np.min([self.hop_arr(a, p) for p in multiset_permutations(list(key[2]))], axis=0)
        return self._arr[key]

    def hop_min(self, a: tuple[int, ...], b: tuple[int, ...]) -> np.ndarray:
        """Cheapest hop from stage a to stage b (sorted labels) over every choice of their leaders and rank orders."""
        key = ("hopmin", a, b)
        if key not in self._arr:
            self._arr[key] = np.min([self.hop_bound((la,) + _rest(a, la), (lb,) + _rest(b, lb))
                                     for la in set(a) for lb in set(b)], axis=0)
        return self._arr[key]

    def cap(self, st: tuple[int, ...]) -> float:
        key = tuple(sorted(set(st)))
        if key not in self._cap:
            self._cap[key] = E.usable_memory(self.w, min(self.cluster.devices[self.classes[k][0]].memory_bytes
                                                        for k in key))
        return self._cap[key]

    def room_pos(self, sh: str, P: int, S: int, tp: int, cap: float) -> np.ndarray:
        """(Q, S): the most layers a TP-tp stage with ``cap`` usable bytes holds at position j of an
        S-stage pipeline, per (m, n) pair, in every memory phase (:func:`estimate.stage_memory_at`),
        rounded generously: a bound may admit a split the exact check (``BatchTimer.fits``, the
        arithmetic of ``estimate()``) then rejects, never the reverse."""
        key = ("room", sh, P, S, tp, cap)
        if key not in self._arr:
            qm, qn = self.qpairs(P)[:2]
            room = np.empty((len(qm), S))
            for q, (m, n) in enumerate(zip(qm.tolist(), qn.tolist())):
                for j in range(S):
                    inflight = cm.inflight_micro_batches(self.s.schedule, S, j, n)
                    k = (sh, P, j == 0, j == S - 1, inflight, tp, m)
                    if k not in self._mem:
                        self._mem[k] = E.stage_memory_at(self.w, sh, P, self.s.recompute, *k[2:])
                    room[q, j] = _generous_room(self._mem[k], cap)
            self._arr[key] = room
        return self._arr[key]

    def room_any(self, sh: str, P: int, S: int, tp: int, cap: float) -> np.ndarray:
        """(Q,): the most layers at the stage's most favourable position (a relaxation)."""
        key = ("roomany", sh, P, S, tp, cap)
        if key not in self._arr:
            self._arr[key] = self.room_pos(sh, P, S, tp, cap).max(axis=1)
        return self._arr[key]

    def tc_lb(self, st: tuple[int, ...], ctx: tuple, P: int) -> float:
        """Lower bound of the stage's T_comm (module docstring, point 3): for each of its devices,
        per other pipeline k, the lowest latency plus its 1/t share over the fastest link to k."""
        if P == 1:
            return 0.0
        t = len(st)
        worst = 0.0
        for a in set(st):
            total = 0.0
            for other in ctx[1]:
                present = [k for k in range(self.K) if other[k]]
                total += (min(self.link_lat[a, k] for k in present)
                          + self.layer_bytes / (t * P * max(self.link_bw[a, k] for k in present)))
            worst = max(worst, total)
        return worst

    def uw(self, st: tuple[int, ...], ctx: tuple, P: int, sh: str) -> tuple[np.ndarray, np.ndarray]:
        """Per micro-batch size of ``self.ms``: (time per layer per micro-batch, exposed DP time per
        layer), with the T_comm lower bound."""
        key = ("uw", tuple(sorted(st)), ctx, sh)
        if key not in self._arr:
            tc = self.tc_lb(st, ctx, P)
            u, w = np.empty(len(self.ms)), np.empty(len(self.ms))
            for i, m in enumerate(self.ms):
                t_f, t_b = self.layer_tb(st, m)
                u[i], w[i] = E.layer_step(t_f, t_b, tc, sh, self.theta)
            self._arr[key] = (u, w)
        return self._arr[key]

    # ---- level 0: a partition bound from device rates -------------------------------------
    def level0(self, v: tuple[int, ...], P: int, sh: str) -> np.ndarray:
        """f0[b]: a bound of any pipeline with device counts ``v`` at batch b, from rates alone.

        With u(s) a stage's time per layer per micro-batch (T_comm taken as 0), any stage set of the
        pipeline has sum_j 1/u_j <= R = sum_d max_{s containing d's class} 1/(u(s) |s|), so the
        slowest stage takes at least L / R per micro-batch and sum_j l_j u_j >= L * min_s u(s); the
        head adds at least the least head of any stage (a TP group's vocabulary-parallel head may
        be cheaper than any single device's). Hence T >= max(n L / R, L min u + head + (n-1) L / R)
        (hops, tails >= 0; memory ignored)."""
        key = ("l0", v, P, sh)
        if key in self._arr:
            return self._arr[key]
        qm, qn, qb, qmi, starts, bvals = self.qpairs(P)
        present = [k for k in range(self.K) if v[k]]
        rho = np.zeros((self.K, len(self.ms)))
        umin = np.full(len(self.ms), math.inf)
        head = np.full(len(self.ms), math.inf)
        for sub in itertools.product(*(range(c + 1) for c in v)):
            size = sum(sub)
            if not 1 <= size <= self.max_tp:
                continue
            st = tuple(k for k in range(self.K) for _ in range(sub[k]))
            u = self.u0(st, sh)
            umin = np.minimum(umin, u)
            head = np.minimum(head, self.head_arr(st))
            for k in set(st):
                rho[k] = np.maximum(rho[k], 1.0 / (u * size))
        R = sum(v[k] * rho[k] for k in present)
        L = self.L
        T = np.maximum(qn * L / R[qmi], L * umin[qmi] + head[qmi] + (qn - 1) * L / R[qmi])
        f0 = np.full(self.G + 1, math.inf)
        f0[bvals] = np.minimum.reduceat(T, starts)
        self._arr[key] = f0
        return f0

    def u0(self, st: tuple[int, ...], sh: str) -> np.ndarray:
        key = ("u0", tuple(sorted(st)), sh)
        if key not in self._arr:
            self._arr[key] = np.array([E.layer_step(*self.layer_tb(st, m), 0.0, sh, self.theta)[0] for m in self.ms])
        return self._arr[key]

    # ---- level 1: unordered stage sets -------------------------------------------------------
    def stage_sets(self, v: tuple[int, ...]) -> tuple[list, dict]:
        """Every unordered set of stages of a pipeline with device counts ``v`` (at most L stages of
        at most num_kv_heads devices), grouped by stage count S: (catalog of distinct stages,
        {S: (sets, catalog index (n, S), head + hop floor (n, M), TP degrees (n, S), memory caps (n, S))})."""
        key = ("sets", v)
        if key in self._arr:
            return self._arr[key]
        catalog: dict[tuple[int, ...], int] = {}
        grouped: dict[int, list] = {}
        for parts in vector_partitions(v):
            S = len(parts)
            if S > self.L or any(sum(p) > self.max_tp for p in parts):
                continue
            self.tick()
            stages = [tuple(k for k in range(self.K) for _ in range(p[k])) for p in parts]
            for st in stages:
                catalog.setdefault(st, len(catalog))
            grouped.setdefault(S, []).append(stages)
        by_s = {}
        for S, sets in grouped.items():
            idx = np.array([[catalog[st] for st in stages] for stages in sets], dtype=np.int64)
            floor = np.empty((len(sets), len(self.ms)))
            for r, stages in enumerate(sets):
                f = (np.min([self.head_arr(st) for st in stages], axis=0)
                     + np.min([self.embed_arr(st) for st in stages], axis=0))
                if S > 1:
                    f = f + (S - 1) * np.min([self.hop_min(x, y) for i, x in enumerate(stages)
                                              for j, y in enumerate(stages) if i != j], axis=0)
                floor[r] = f
            tps = np.array([[len(st) for st in stages] for stages in sets], dtype=np.int64)
            caps = np.array([[self.cap(st) for st in stages] for stages in sets])
            by_s[S] = (sets, idx, floor, tps, caps)
        self._arr[key] = (list(catalog), by_s)
        return self._arr[key]

    def set_fits(self, v: tuple[int, ...], P: int, sh: str, S: int) -> np.ndarray:
        """(n, Q, K) whether each stage set of S stages can hold each layer split at each (m, n), with
        each stage at its most favourable position (:meth:`room_any`)."""
        key = ("fits", v, P, sh, S)
        if key not in self._arr:
            sets, idx, floor, tps, caps = self.stage_sets(v)[1][S]
            room = np.stack([np.stack([self.room_any(sh, P, S, int(t), float(c)) for t, c in zip(tr, cr)], axis=1)
                             for tr, cr in zip(tps, caps)])  # (n, Q, S)
            Lc = self.comps(S)
            self._arr[key] = (Lc[None, None, :, :] <= room[:, :, None, :]).all(axis=3)
        return self._arr[key]

    # ---- level 1: unordered stage sets -------------------------------------------------------
    def level1(self, ctx: tuple, P: int, sh: str) -> tuple[list, np.ndarray]:
        """Every unordered set of stages of the pipeline ``ctx`` = (device counts, others') with its
        coarse bound per (m, n) pair (hops >= (S-1) x the cheapest hop between two of its stages,
        head >= its cheapest head, memory relaxed over positions), and f1[b], the least bound at
        batch b. Evaluated for all sets of a stage count at once; cached."""
        key = (ctx, sh)
        if key in self._l1:
            return self._l1[key]
        v = ctx[0]
        qm, qn, qb, qmi, starts, bvals = self.qpairs(P)
        catalog, by_s = self.stage_sets(v)
        Ucat = np.stack([self.uw(st, ctx, P, sh)[0] for st in catalog]) if catalog else np.zeros((0, len(self.ms)))
        Wcat = np.stack([self.uw(st, ctx, P, sh)[1] for st in catalog]) if catalog else np.zeros((0, len(self.ms)))
        f1 = np.full(self.G + 1, math.inf)
        out = []
        for S, (sets, idx, floor, tps, caps) in by_s.items():
            self.tick()
            Lc = self.comps(S)
            fits = self.set_fits(v, P, sh, S)
            U = Ucat[idx].transpose(0, 2, 1)  # (n, M, S)
            W = Wcat[idx].transpose(0, 2, 1)
            LU = Lc[None, None, :, :] * U[:, :, None, :]  # (n, M, K, S)
            A = LU.sum(axis=3) + floor[:, :, None]
            B = A if S == 1 else LU.max(axis=3)
            C = (Lc[None, None, :, :] * W[:, :, None, :]).max(axis=3)
            T = A[:, qmi] + (qn - 1)[None, :, None] * B[:, qmi] + C[:, qmi]  # (n, Q, K)
            lb = np.where(fits, T, math.inf).min(axis=2)  # (n, Q)
            out.extend(zip(sets, lb))
            f1[bvals] = np.minimum(f1[bvals], np.minimum.reduceat(lb.min(axis=0), starts))
        self._l1[key] = (out, f1)
        return self._l1[key]

    # ---- level 2: ordered chains with leaders ------------------------------------------------
    def level2(self, ctx: tuple, P: int, sh: str, cap: float) -> tuple[list, np.ndarray]:
        """Structures (chain, layer split) of the pipeline whose bound is below ``cap`` at some batch,
        with their bound g[b] (rows, sorted by their least bound). Cached with the cap they were
        cut at: a smaller cap filters the cache, a larger one rebuilds it."""
        bar = cap
        key = (ctx, sh)
        if key in self._l2:
            structs, garr, cut = self._l2[key]
            if cut >= bar:
                if cut > bar and len(structs):
                    keep = np.flatnonzero(garr.min(axis=1) < bar)
                    structs, garr = [structs[i] for i in keep], garr[keep]
                    self._l2[key] = (structs, garr, bar)
                return structs, garr
        qm, qn, qb, qmi, starts, bvals = self.qpairs(P)
        sets, _ = self.level1(ctx, P, sh)
        structs, rows = [], []
        for stages, lb in sets:
            if not lb.min() < bar:
                continue
            self.tick()
            S = len(stages)
            Lc = self.comps(S)
            chains = [tuple((ld,) + _rest(stages[i], ld) for i, ld in zip(order, leaders))
                      for order in multiset_permutations([stages.index(st) for st in stages])
                      for leaders in itertools.product(*(sorted(set(stages[i])) for i in order))]
            for lo in range(0, len(chains), _CHUNK):
                part = chains[lo:lo + _CHUNK]
                T = self.chains_table(part, ctx, P, sh)  # (n, Q, K)
                g = np.full((len(part), T.shape[2], self.G + 1), math.inf)
                g[:, :, bvals] = np.minimum.reduceat(T, starts, axis=1).transpose(0, 2, 1)
                for c, k in zip(*np.nonzero(g.min(axis=2) < bar)):
                    structs.append((part[c], tuple(Lc[k].tolist())))
                    rows.append(g[c, k])
        garr = np.array(rows).reshape(len(rows), self.G + 1)
        order = np.argsort(garr.min(axis=1), kind="stable") if len(rows) else np.array([], dtype=np.int64)
        structs, garr = [structs[i] for i in order.tolist()], garr[order]
        self.stats["structures"] += len(structs)
        self._l2[key] = (structs, garr, bar)
        return structs, garr

    def chains_table(self, chains: list[tuple], ctx: tuple, P: int, sh: str) -> np.ndarray:
        """Bound (chains, Q, layer splits) of stage chains of one length (class labels, leader first):
        exact hops, head and memory, T_comm at its lower bound; inf where a stage does not fit."""
        qmi, qn = self.qpairs(P)[3], self.qpairs(P)[1]
        S = len(chains[0])
        Lc = self.comps(S)
        U = np.array([[self.uw(st, ctx, P, sh)[0] for st in ch] for ch in chains]).transpose(0, 2, 1)  # (n, M, S)
        W = np.array([[self.uw(st, ctx, P, sh)[1] for st in ch] for ch in chains]).transpose(0, 2, 1)
        H = np.array([[self.hop_bound(ch[j], ch[j + 1]) for j in range(S - 1)] + [self.head_arr(ch[-1])]
                      for ch in chains]).transpose(0, 2, 1)
        H[:, :, 0] += np.array([self.embed_arr(ch[0]) for ch in chains])
        room = np.array([[self.room_pos(sh, P, S, len(st), self.cap(st))[:, j] for j, st in enumerate(ch)]
                         for ch in chains]).transpose(0, 2, 1)  # (n, Q, S)
        X = Lc[None, None, :, :] * U[:, :, None, :] + H[:, :, None, :]  # (n, M, K, S)
        A = X.sum(axis=3)
        B = X.max(axis=3)
        C = (Lc[None, None, :, :] * W[:, :, None, :]).max(axis=3)
        T = A[:, qmi] + (qn - 1)[None, :, None] * B[:, qmi] + C[:, qmi]  # (n, Q, K)
        fits = (Lc[None, None, :, :] <= room[:, :, None, :]).all(axis=3)
        return np.where(fits, T, math.inf)

    def pipeline_bounds(self, plan: Plan, i: int) -> tuple[float, float, float]:
        """(rate bound, stage-set bound, chain bound) of pipeline i of ``plan`` at its own batch and
        micro-batch size; each never exceeds the next nor the pipeline's time in ``estimate()`` (tests)."""
        cls = {d: k for k, c in enumerate(self.classes) for d in c}
        pipe, P, sh = plan.pipelines[i], plan.num_pipelines, plan.dp_sharding
        v = tuple(sum(cls[d] == k for d in pipe.devices) for k in range(self.K))
        chain = tuple((cls[st.devices[0]],) + tuple(sorted(cls[d] for d in st.devices[1:])) for st in pipe.stages)
        split = tuple(st.num_layers for st in pipe.stages)
        qm, qn = self.qpairs(P)[:2]
        q = int(np.flatnonzero((qm == pipe.micro_batch_size) & (qn == pipe.num_micro_batches))[0])
        k = int(np.flatnonzero((self.comps(len(chain)) == np.array(split)).all(axis=1))[0])
        stage_set = sorted(tuple(sorted(st)) for st in chain)
        others = tuple(sorted(tuple(sum(cls[d] == k for d in p.devices) for k in range(self.K))
                              for x, p in enumerate(plan.pipelines) if x != i))
        ctx = (v, others)
        lb1 = next(lb[q] for stages, lb in self.level1(ctx, P, sh)[0] if sorted(stages) == stage_set)
        return float(self.level0(v, P, sh)[pipe.batch_size]), float(lb1), float(self.chains_table([chain], ctx, P, sh)[0, q, k])

    # ---- the branch and bound ----------------------------------------------------------------
    def offer(self, plan: Plan) -> None:
        est = estimate(plan, self.cluster, self.w)
        if est.cost < self.best[0]:
            self.best = (est.cost, plan, est)

    def run(self, incumbent: Plan | None) -> OracleResult:
        if incumbent is not None:
            self.offer(incumbent)
        bound = 0.0
        try:
            heap = []
            for vecs in vector_partitions(self.counts):
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
                    lb1, _ = minimax_split([self.level1(ctx, P, sh)[1] for ctx in _contexts(vecs)], self.G)
                    if lb1 < self.best[0]:
                        heapq.heappush(heap, (max(lb1, bound), len(heap) + self.stats["partitions"], 1, sh, vecs))
                    continue
                # every plan of this partition costs at least `bound`: evaluate those that may cost
                # less than `cap`; the rest cost at least `cap` and come back with that bound
                cap = min(self.best[0], bound * _CAP_STEP)
                tables = [self.level2(ctx, P, sh, cap) for ctx in _contexts(vecs)]
                if all(len(t[0]) for t in tables):
                    lb2, _ = minimax_split([t[1].min(axis=0) for t in tables], self.G)
                    if lb2 < min(cap, self.best[0]):
                        self.combine(vecs, P, sh, tables, cap)
                if cap < self.best[0]:
                    heapq.heappush(heap, (cap, len(heap) + self.stats["partitions"], 2, sh, vecs))
            bound = math.inf
            complete = True
        except _Timeout:
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
                    plan = with_batches(layout, batches, [pick[i][b] for i, b in enumerate(batches)], self.meta())
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
    return _Oracle(cluster, workload, global_batch, OracleSettings.of(settings), time_limit_s).run(incumbent)


def _generous_room(terms: E.MemoryTerms, cap: float) -> float:
    """The most layers fitting ``cap`` in every phase, rounded up by a hair (see :meth:`_Oracle.room_pos`)."""
    most = math.inf
    for f, p in terms.phases:
        if f > cap * (1 + 1e-12):
            return -1.0
        if p > 0:
            most = min(most, math.floor((cap - f) / p * (1 + 1e-9) + 1e-9))
    return float(min(most, 1 << 30))


def _contexts(vecs: tuple) -> list[tuple]:
    """Per pipeline of a partition: (its device counts, the sorted device counts of the others)."""
    return [(v, tuple(sorted(vecs[:i] + vecs[i + 1:]))) for i, v in enumerate(vecs)]


def _rest(stage: tuple[int, ...], leader: int) -> tuple[int, ...]:
    """The stage's class labels without one ``leader``, sorted (the canonical rank order)."""
    rest = list(stage)
    rest.remove(leader)
    return tuple(sorted(rest))
