"""The oracle's terms and bounds: every time and memory term of a stage, a hop and a pipeline,
cached per device-class structure and computed through ``estimate``'s own functions, and the three
levels of lower bounds the branch and bound prunes with (per device-count vector, per unordered
set of stages, per ordered chain with layer splits). Why each bound is sound: the module docstring
of :mod:`lightning_hexiscale.planner.oracle.exact`, point 3."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload
from lightning_hexiscale.planner.cost.sources import stage_rule
from lightning_hexiscale.planner.oracle.space import (OracleSettings, compositions, device_classes, generous_room,
                                                      multiset_permutations, rest_of, vector_partitions)
from lightning_hexiscale.planner.plan import DP_SHARDINGS, Plan
from lightning_hexiscale.planner.search.batching import BatchTimer

_CHUNK = 256


class OracleTimeout(Exception):
    pass


class OracleTerms:
    """The cached terms and bounds of one oracle run (cluster, workload, global batch, settings)."""

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
        self.flags = s.flags
        """The recompute flags a pipeline may take: both under ``auto`` (each pipeline its own)."""
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
        self.rule = stage_rule(cluster, workload)
        """The TP groups estimate() prices (layer tables: measured degrees, in one machine; None: any),
        the same :class:`~lightning_hexiscale.planner.cost.sources.StageRule` the search plans under.
        Applied to stage sets (level 1); level 0's rate bound over every group stays a valid, looser
        bound."""
        self.timer = BatchTimer(cluster, workload, global_batch, [s.micro_batch_size] if s.micro_batch_size else None)
        self.timer.exact_comms = True  # its plans must agree with estimate(), memory included
        self.ms = [s.micro_batch_size] if s.micro_batch_size else list(range(1, global_batch + 1))
        self._l1: dict[tuple, tuple] = {}
        self._l2: dict[tuple, tuple] = {}

    def tick(self) -> None:
        if time.perf_counter() > self.deadline:
            raise OracleTimeout

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

    def layer_tb(self, st: tuple[int, ...], m: int, r: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one layer per micro-batch of m on the stage, recomputing or not."""
        key = (tuple(sorted(st)), m, r)
        if key not in self._lt:
            t_f, t_b, _, _ = E.layer_times(self.cluster, self.w, self.devices_of(key[0]), m, r)
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
        leader and the destination's devices. Priced with the hop's own flows only (no other pipeline's
        in its phase, :func:`nic.hop_alone_caps`): sharing NICs with more flows can only slow it, so
        this is a lower bound of the hop in any plan (exact for one pipeline)."""
        scatter = len(src) == len(dst) > 1
        key = (src, dst, m) if scatter else (src[:1], dst, m)
        if key not in self._hop:
            s_dev = self.devices_of(key[0])
            self._hop[key] = E.hop_time(self.cluster, self.w, s_dev, self.devices_of(dst, taken=s_dev), m, None,
                                        self.s.schedule)
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
            self._arr[key] = np.min([self.hop_bound((la,) + rest_of(a, la), (lb,) + rest_of(b, lb))
                                     for la in set(a) for lb in set(b)], axis=0)
        return self._arr[key]

    def cap(self, st: tuple[int, ...]) -> float:
        key = tuple(sorted(set(st)))
        if key not in self._cap:
            self._cap[key] = E.usable_memory(self.w, min(self.cluster.devices[self.classes[k][0]].memory_bytes
                                                        for k in key))
        return self._cap[key]

    def room_pos(self, sh: str, P: int, S: int, tp: int, cap: float, r: bool) -> np.ndarray:
        """(Q, S): the most layers a TP-tp stage with ``cap`` usable bytes holds at position j of an
        S-stage pipeline, per (m, n) pair, in every memory phase (:func:`estimate.stage_memory_at`),
        rounded generously: a bound may admit a split the exact check (``BatchTimer.fits``, the
        arithmetic of ``estimate()``) then rejects, never the reverse."""
        key = ("room", sh, P, S, tp, cap, r)
        if key not in self._arr:
            qm, qn = self.qpairs(P)[:2]
            room = np.empty((len(qm), S))
            for q, (m, n) in enumerate(zip(qm.tolist(), qn.tolist())):
                for j in range(S):
                    inflight = cm.inflight_micro_batches(self.s.schedule, S, j, n)
                    k = (sh, P, r, j == 0, j == S - 1, inflight, tp, m)
                    if k not in self._mem:
                        self._mem[k] = E.stage_memory_at(self.w, *k)
                    room[q, j] = generous_room(self._mem[k], cap)
            self._arr[key] = room
        return self._arr[key]

    def room_any(self, sh: str, P: int, S: int, tp: int, cap: float, r: bool) -> np.ndarray:
        """(Q,): the most layers at the stage's most favourable position (a relaxation)."""
        key = ("roomany", sh, P, S, tp, cap, r)
        if key not in self._arr:
            self._arr[key] = self.room_pos(sh, P, S, tp, cap, r).max(axis=1)
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

    def uw(self, st: tuple[int, ...], ctx: tuple, P: int, sh: str, r: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per micro-batch size of ``self.ms``: (time per layer per micro-batch, exposed DP time per
        layer), with the T_comm lower bound, recomputing or not."""
        key = ("uw", tuple(sorted(st)), ctx, sh, r)
        if key not in self._arr:
            tc = self.tc_lb(st, ctx, P)
            u, w = np.empty(len(self.ms)), np.empty(len(self.ms))
            for i, m in enumerate(self.ms):
                t_f, t_b = self.layer_tb(st, m, r)
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
        (hops, tails >= 0; memory ignored). Under ``auto`` a pipeline recomputes or not as a whole:
        the bound is the lesser of the two flags' bounds."""
        key = ("l0", v, P, sh)
        if key in self._arr:
            return self._arr[key]
        qm, qn, qb, qmi, starts, bvals = self.qpairs(P)
        present = [k for k in range(self.K) if v[k]]
        L = self.L
        T = np.full(len(qm), math.inf)
        for r in self.flags:
            rho = np.zeros((self.K, len(self.ms)))
            umin = np.full(len(self.ms), math.inf)
            head = np.full(len(self.ms), math.inf)
            for sub in itertools.product(*(range(c + 1) for c in v)):
                size = sum(sub)
                if not 1 <= size <= self.max_tp:
                    continue
                st = tuple(k for k in range(self.K) for _ in range(sub[k]))
                u = self.u0(st, sh, r)
                umin = np.minimum(umin, u)
                head = np.minimum(head, self.head_arr(st))
                for k in set(st):
                    rho[k] = np.maximum(rho[k], 1.0 / (u * size))
            R = sum(v[k] * rho[k] for k in present)
            T = np.minimum(T, np.maximum(qn * L / R[qmi], L * umin[qmi] + head[qmi] + (qn - 1) * L / R[qmi]))
        f0 = np.full(self.G + 1, math.inf)
        f0[bvals] = np.minimum.reduceat(T, starts)
        self._arr[key] = f0
        return f0

    def u0(self, st: tuple[int, ...], sh: str, r: bool) -> np.ndarray:
        key = ("u0", tuple(sorted(st)), sh, r)
        if key not in self._arr:
            self._arr[key] = np.array([E.layer_step(*self.layer_tb(st, m, r), 0.0, sh, self.theta)[0] for m in self.ms])
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
            if self.rule is not None and not all(self.rule(self.devices_of(st)) for st in stages):
                continue
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

    def set_fits(self, v: tuple[int, ...], P: int, sh: str, S: int, r: bool) -> np.ndarray:
        """(n, Q, K) whether each stage set of S stages can hold each layer split at each (m, n), with
        each stage at its most favourable position (:meth:`room_any`), recomputing or not."""
        key = ("fits", v, P, sh, S, r)
        if key not in self._arr:
            sets, idx, floor, tps, caps = self.stage_sets(v)[1][S]
            room = np.stack([np.stack([self.room_any(sh, P, S, int(t), float(c), r) for t, c in zip(tr, cr)], axis=1)
                             for tr, cr in zip(tps, caps)])  # (n, Q, S)
            Lc = self.comps(S)
            self._arr[key] = (Lc[None, None, :, :] <= room[:, :, None, :]).all(axis=3)
        return self._arr[key]

    # ---- level 1: unordered stage sets -------------------------------------------------------
    def level1(self, ctx: tuple, P: int, sh: str) -> tuple[list, np.ndarray]:
        """Every unordered set of stages of the pipeline ``ctx`` = (device counts, others') with its
        coarse bound per (m, n) pair (hops >= (S-1) x the cheapest hop between two of its stages,
        head >= its cheapest head, memory relaxed over positions), and f1[b], the least bound at
        batch b. Evaluated for all sets of a stage count at once; cached. Under ``auto`` a set's
        bound is the lesser of its bounds recomputing and not."""
        key = (ctx, sh)
        if key in self._l1:
            return self._l1[key]
        v = ctx[0]
        qm, qn, qb, qmi, starts, bvals = self.qpairs(P)
        catalog, by_s = self.stage_sets(v)
        f1 = np.full(self.G + 1, math.inf)
        out = []
        for S, (sets, idx, floor, tps, caps) in by_s.items():
            self.tick()
            Lc = self.comps(S)
            lb = np.full((len(sets), len(qm)), math.inf)
            for r in self.flags:
                Ucat = np.stack([self.uw(st, ctx, P, sh, r)[0] for st in catalog])
                Wcat = np.stack([self.uw(st, ctx, P, sh, r)[1] for st in catalog])
                fits = self.set_fits(v, P, sh, S, r)
                U = Ucat[idx].transpose(0, 2, 1)  # (n, M, S)
                W = Wcat[idx].transpose(0, 2, 1)
                LU = Lc[None, None, :, :] * U[:, :, None, :]  # (n, M, K, S)
                A = LU.sum(axis=3) + floor[:, :, None]
                B = A if S == 1 else LU.max(axis=3)
                C = (Lc[None, None, :, :] * W[:, :, None, :]).max(axis=3)
                T = A[:, qmi] + (qn - 1)[None, :, None] * B[:, qmi] + C[:, qmi]  # (n, Q, K)
                lb = np.minimum(lb, np.where(fits, T, math.inf).min(axis=2))  # (n, Q)
            out.extend(zip(sets, lb))
            f1[bvals] = np.minimum(f1[bvals], np.minimum.reduceat(lb.min(axis=0), starts))
        self._l1[key] = (out, f1)
        return self._l1[key]

    # ---- level 2: ordered chains with leaders ------------------------------------------------
    def level2(self, ctx: tuple, P: int, sh: str, cap: float) -> tuple[list, np.ndarray]:
        """Structures (chain, layer split, recompute flag) of the pipeline whose bound is below ``cap``
        at some batch, with their bound g[b] (rows, sorted by their least bound). Cached with the cap they were
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
            chains = [tuple((ld,) + rest_of(stages[i], ld) for i, ld in zip(order, leaders))
                      for order in multiset_permutations([stages.index(st) for st in stages])
                      for leaders in itertools.product(*(sorted(set(stages[i])) for i in order))]
            for lo, r in itertools.product(range(0, len(chains), _CHUNK), self.flags):
                part = chains[lo:lo + _CHUNK]
                T = self.chains_table(part, ctx, P, sh, r)  # (n, Q, K)
                g = np.full((len(part), T.shape[2], self.G + 1), math.inf)
                g[:, :, bvals] = np.minimum.reduceat(T, starts, axis=1).transpose(0, 2, 1)
                for c, k in zip(*np.nonzero(g.min(axis=2) < bar)):
                    structs.append((part[c], tuple(Lc[k].tolist()), r))
                    rows.append(g[c, k])
        garr = np.array(rows).reshape(len(rows), self.G + 1)
        order = np.argsort(garr.min(axis=1), kind="stable") if len(rows) else np.array([], dtype=np.int64)
        structs, garr = [structs[i] for i in order.tolist()], garr[order]
        self.stats["structures"] += len(structs)
        self._l2[key] = (structs, garr, bar)
        return structs, garr

    def chains_table(self, chains: list[tuple], ctx: tuple, P: int, sh: str, r: bool) -> np.ndarray:
        """Bound (chains, Q, layer splits) of stage chains of one length (class labels, leader first)
        recomputing or not: exact hops, head and memory, T_comm at its lower bound; inf where a stage
        does not fit."""
        qmi, qn = self.qpairs(P)[3], self.qpairs(P)[1]
        S = len(chains[0])
        Lc = self.comps(S)
        U = np.array([[self.uw(st, ctx, P, sh, r)[0] for st in ch] for ch in chains]).transpose(0, 2, 1)  # (n, M, S)
        W = np.array([[self.uw(st, ctx, P, sh, r)[1] for st in ch] for ch in chains]).transpose(0, 2, 1)
        # each stage's share of the hops (cost.model.hop_charges) at every micro-batch size, from a lower
        # bound of each hop (exact on the leader path): the charges are linear in the hops, so still a bound
        hop = np.array([[self.hop_bound(ch[j], ch[j + 1]) for j in range(S - 1)] + [np.zeros(len(self.ms))]
                        for ch in chains])  # (n, S, M)
        H = cm.hop_charges(hop, self.s.schedule, axis=1)
        H[:, -1] += np.array([self.head_arr(ch[-1]) for ch in chains])
        H = H.transpose(0, 2, 1)
        H[:, :, 0] += np.array([self.embed_arr(ch[0]) for ch in chains])
        room = np.array([[self.room_pos(sh, P, S, len(st), self.cap(st), r)[:, j] for j, st in enumerate(ch)]
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
        lb2 = self.chains_table([chain], ctx, P, sh, bool(pipe.recompute))[0, q, k]
        return float(self.level0(v, P, sh)[pipe.batch_size]), float(lb1), float(lb2)
