"""The best batches and micro-batch sizes for a fixed layout, exactly (shared by the search and the oracle).

A *layout* is a Plan whose stages (devices, layer ranges) and dp sharding are fixed; its batches and
micro-batch sizes are free. Under ``estimate()`` pipeline i with micro-batch size m and n
micro-batches takes

    T_i(m, n) = A_i(m) + (n - 1) * B_i(m) + C_i(m)

with A = sum_j (Stage_j + Hop_j), B = max_j (Stage_j + Hop_j) per micro-batch and C the largest
exposed data-parallel tail (Appendix B eq. 5 and 8). The data-parallel T_comm and the embedding /
LM head syncs depend on the layout only, so they are computed once (:func:`estimate.dp_terms`,
:func:`estimate.dp_edge_all`). Memory decides which (m, n) fit. Then
g_i(b) = min over m | b that fit of T_i(m, b / m), and the iteration time of the best integer
batch split is the minimax

    min_{b_1 + ... + b_P = G, b_i >= 1}  max_i g_i(b_i)

solved exactly by :func:`minimax_split` (binary search over candidate values with a bitset
subset-sum test). This replaces §4.4's proportional batch assignment, which rounds and ignores that
the micro-batch size may differ per pipeline. Beyond 64 devices (hundreds of pipelines, batches
of thousands), or past a global batch of 4,096, the subset-sum is too slow for a search that
scores many layouts: there every pipeline gets the same micro-batch size m (each m dividing G is
tried) and the micro-batch counts come from water-filling, which is exact for one m because every
pipeline's time grows linearly with its count (:meth:`BatchTimer.best_uniform`).
"""

from __future__ import annotations

import math

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner.cost import compose
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.cost import nic
from lightning_hexiscale.planner.cost.communicators import stage_communicators
from lightning_hexiscale.planner.cost.compute import without_place
from lightning_hexiscale.planner.cost.estimate import Workload
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage

_BITS = np.array([1 << b for b in range(63)], dtype=np.int64)
_EXACT_DEVICES = 64
_EXACT_BATCH = 4096
"""Global batches above this take the water-filling split too: the subset-sum's bitsets are G bits
long and the search scores hundreds of layouts, so its time grows about as G^2 (2 CPU devices,
llama_tiny: G = 30,000 in 3 s, 100,000 in 29 s, 10^7 not within hours: a global batch typed in
tokens hung ``hexiscale plan``). Water-filling takes seconds at G = 10^9 and found the same times
as the exact split on case_study (llama2_7b, G = 8,192) and cpu2 (llama_tiny, G = 100,000)."""
_PIPE_CACHE = 20000
"""Pipelines whose batch times are memoised (a search revisits the same pipelines often)."""
_LAYOUT_CACHE = 64
"""Layout structures whose sharding-free terms (data-parallel terms, communicator counts) are kept:
a layout is scored under every dp sharding within a few calls, and on large clusters one entry
holds a term per stage of hundreds of pipelines."""


def sumset(reach: int, allowed: int, limit: int) -> int:
    """Bitset of a + b for a in ``reach``, b in ``allowed`` (bits above ``limit`` dropped).

    ``allowed`` is taken run by run: a run of w consecutive values [a, a + w) contributes
    (reach << a) smeared over w positions, built by doubling in O(log w) shifts, so long runs (a
    pipeline that may take any batch in a range) cost a few big-integer operations, not w."""
    out, top = 0, (1 << (limit + 1)) - 1
    b = 0
    while allowed:
        if not allowed & 1:
            skip = (allowed & -allowed).bit_length() - 1
            allowed >>= skip
            b += skip
            continue
        w = (~allowed & (allowed + 1)).bit_length() - 1  # length of the run of ones at the bottom
        r, covered = (reach << b) & top, 1
        while covered < w:
            step = min(covered, w - covered)
            r |= r << step
            covered += step
        out |= r
        allowed >>= w
        b += w
    return out & top


def mask(g: np.ndarray, below: float, strict: bool = True) -> int:
    """Bitset of the indices b with g[b] < below (<= when not ``strict``)."""
    hit = g < below if strict else g <= below
    if len(g) <= 63:
        return int(_BITS[:len(g)][hit].sum())
    return int.from_bytes(np.packbits(hit[::-1]).tobytes(), "big") >> (-len(g) % 8)


def minimax_split(g: list[np.ndarray], total: int) -> tuple[float, list[int]]:
    """min over b_1 + ... + b_P = total (b_i >= 1) of max_i g[i][b_i], and a split reaching it.

    ``g[i][b]`` is pipeline i's time with batch b (inf: not allowed). Exact: binary search over the
    distinct finite values v for the least one with a split where every g[i][b_i] <= v (a subset-sum
    over bitsets), then a split is read back. Returns (inf, []) when no split exists.
    """
    vals = np.unique(np.concatenate([x[np.isfinite(x)] for x in g])) if g else np.array([])
    if not len(vals):
        return math.inf, []

    def reach_of(v: float) -> list[int] | None:
        reach = [1]
        for x in g:
            reach.append(sumset(reach[-1], mask(x, v, strict=False) & ~1, total))
        return reach if (reach[-1] >> total) & 1 else None

    lo, hi = 0, len(vals) - 1
    if reach_of(float(vals[hi])) is None:
        return math.inf, []
    while lo < hi:
        mid = (lo + hi) // 2
        if reach_of(float(vals[mid])) is not None:
            hi = mid
        else:
            lo = mid + 1
    v = float(vals[lo])
    reach = reach_of(v)
    split, left = [], total
    for i in range(len(g) - 1, -1, -1):
        for b in np.flatnonzero(g[i] <= v).tolist():
            if 1 <= b <= left and (reach[i] >> (left - b)) & 1:
                split.append(b)
                left -= b
                break
    split.reverse()
    return v, split


def with_batches(layout: Plan, batches: list[int], micro_batches: list[int], meta: dict | None = None,
                 recompute: list[bool] | None = None) -> Plan:
    """The layout with the given batch and micro-batch size per pipeline (and recomputation flag,
    when given; else each pipeline keeps its own)."""
    flags = recompute or [p.recompute for p in layout.pipelines]
    pipes = tuple(Pipeline(int(b), int(m), p.stages, bool(r))
                  for p, b, m, r in zip(layout.pipelines, batches, micro_batches, flags))
    return Plan(pipes, layout.num_layers, layout.schedule, None, layout.dp_sharding,
                dict(layout.meta if meta is None else meta), reduce_dtype=layout.reduce_dtype)


def layout_plan(stages: list[list[tuple[int, ...]]], splits: list[tuple[int, ...]], sharding: str, schedule: str,
                recompute: bool, num_layers: int, meta: dict | None = None) -> Plan:
    """A layout (batch 1, micro-batch 1 per pipeline) from stage device tuples and layer counts."""
    pipes = []
    for devs, split in zip(stages, splits):
        bounds = np.concatenate([[0], np.cumsum(split)]).astype(int).tolist()
        pipes.append(Pipeline(1, 1, tuple(Stage(tuple(int(x) for x in d), (bounds[j], bounds[j + 1]))
                                          for j, d in enumerate(devs))))
    return Plan(tuple(pipes), num_layers, schedule=schedule, recompute=recompute, dp_sharding=sharding,
                meta=dict(meta or {}))


class BatchTimer:
    """Exact pipeline times of layouts over batches and micro-batch sizes, for one cluster, workload
    and global batch G; the per-stage terms are memoised across layouts."""

    def __init__(self, cluster: Cluster, workload: Workload, global_batch: int,
                 micro_batch_sizes: list[int] | None = None):
        self.cluster, self.w, self.G = cluster, workload, global_batch
        self.exact = cluster.num_devices <= _EXACT_DEVICES and global_batch <= _EXACT_BATCH
        """Per-pipeline micro-batch sizes and the exact minimax split up to _EXACT_DEVICES devices
        and a global batch of _EXACT_BATCH; beyond, one micro-batch size for all and water-filling
        (:meth:`best_uniform`)."""
        self.ms = sorted(set(micro_batch_sizes)) if micro_batch_sizes else list(range(1, global_batch + 1))
        self.theta = E.calibration_theta(cluster)
        self._lt: dict[tuple, tuple[float, float]] = {}
        self._shape: dict[tuple[int, ...], tuple] = {}
        kinds: dict = {}  # devices with equal figures (type, FLOP/s, memory, ...) share a kind
        self._kind = np.array([kinds.setdefault(without_place(d), len(kinds))
                               for d in cluster.devices], dtype=np.int64)
        self._machine = np.array([d.machine for d in cluster.devices], dtype=np.int64)
        self._extra: dict[tuple, float] = {}
        self._hop: dict[tuple, float] = {}
        self._mem: dict[tuple, E.MemoryTerms] = {}
        self._cap: dict[tuple, float] = {}
        self._q: dict[int, tuple] = {}
        self._limit: dict[tuple, np.ndarray] = {}
        self._pipe: dict[tuple, tuple[np.ndarray, dict]] = {}
        self._edges: tuple[Plan, dict] | None = None
        self._caps: tuple[Plan, dict] | None = None
        self._comms: tuple[Plan, dict] | None = None
        self._comms_of: dict[tuple, dict] = {}
        self.exact_comms = cluster.num_devices <= _EXACT_DEVICES and workload.device == "cuda" and workload.comm_buffer_bytes > 0
        """Up to _EXACT_DEVICES devices the memory check counts each stage's NCCL communicators as
        ``estimate()`` does (``communicators.stage_communicators``, a few ms per layout there); beyond,
        the per-position lower bound (the count takes ~0.5 s for a 1024-GPU layout)."""
        self._dp_terms: dict[tuple, tuple] = {}
        """Stages of a layout -> its :func:`estimate.dp_terms`, which no sharding changes (kept for
        every layout, not the last one only: regroup scores each layer split under every sharding
        in turn, so the last one was never the same)."""
        self._flat: tuple[Plan, tuple] | None = None
        self._known: tuple | None = None
        """(plan, breakdown) of the last winner of :meth:`best_uniform` (saves recomputing it)."""

    def qpairs(self, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(m, n, b = m * n, index of m in ``self.ms``) of the pairs a pipeline of a P-pipeline plan
        may take (b <= G - P + 1; b = G for one pipeline)."""
        if P not in self._q:
            hi = self.G - (P - 1)
            pairs = sorted((m * n, m, n) for m in self.ms if m <= hi for n in range(1, hi // m + 1)
                           if P > 1 or m * n == self.G)
            qm, qn, qb = (np.array([p[k] for p in pairs], dtype=np.int64) for k in (1, 2, 0))
            self._q[P] = (qm, qn, qb, np.searchsorted(np.array(self.ms), qm))
        return self._q[P]

    def shape(self, devices: tuple[int, ...]) -> tuple:
        """What a group's per-micro-batch terms (:func:`estimate.layer_times`, ``stage_extra_times``,
        ``hop_time`` with given NIC shares) read of the cluster, device for device in order: each
        device's figures, which devices share a machine, and the links among them. Groups of one
        shape price alike; a replicated cluster has few shapes but thousands of groups, so the terms
        are memoised by shape (each computed once instead of once per group)."""
        key = self._shape.get(devices)
        if key is None:
            idx = np.array(devices, dtype=np.int64)
            ix = np.ix_(idx, idx)
            mach = self._machine[idx]
            key = (self._kind[idx].tobytes(), (mach[:, None] == mach[None, :]).tobytes(),
                   self.cluster.bandwidth[ix].tobytes(), self.cluster.latency[ix].tobytes())
            self._shape[devices] = key
        return key

    def layer_tb(self, devices: tuple[int, ...], m: int, recompute: bool) -> tuple[float, float]:
        key = (self.shape(devices), m, recompute)
        if key not in self._lt:
            self._lt[key] = E.layer_times(self.cluster, self.w, devices, m, recompute)[:2]
        return self._lt[key]

    def extra(self, devices: tuple[int, ...], m: int, first: bool, last: bool) -> float:
        """Head + embedding time per micro-batch of a stage (:func:`estimate.stage_extra_times`, summed)."""
        key = (self.shape(devices), m, first, last)
        if key not in self._extra:
            comp, comm = E.stage_extra_times(self.cluster, self.w, devices, m, first, last)
            self._extra[key] = comp + comm
        return self._extra[key]

    def hop(self, src: tuple[int, ...], dst: tuple[int, ...], m: int, caps: tuple[float, ...] = ()) -> float:
        """:func:`estimate.hop_time` with the NIC fair shares ``caps`` of its flows (:meth:`hop_caps`)."""
        key = (self.shape(src + dst), len(src), m, caps)
        if key not in self._hop:
            self._hop[key] = E.hop_time(self.cluster, self.w, src, dst, m, caps)
        return self._hop[key]

    def hop_caps(self, layout: Plan) -> dict:
        """:func:`nic.hop_caps` of the layout ((i, j) -> the NIC fair shares of hop j of pipeline i, as
        ``estimate()`` takes them; batch-independent), kept for the last layout asked."""
        if self._caps is None or self._caps[0] is not layout:
            chains = [[st.devices for st in p.stages] for p in layout.pipelines]
            self._caps = (layout, nic.hop_caps(self.cluster, chains, layout.schedule))
        return self._caps[1]

    def cap(self, devices: tuple[int, ...]) -> float:
        if devices not in self._cap:
            self._cap[devices] = E.usable_memory(self.w, min(self.cluster.devices[d].memory_bytes for d in devices))
        return self._cap[devices]

    def mem(self, plan: Plan, S: int, j: int, tp: int, m: int, n: int, comms: int | None = None,
            recompute: bool = True) -> E.MemoryTerms:
        """Memory terms of stage j of an S-stage pipeline of ``plan`` that recomputes or not."""
        inflight = cm.inflight_micro_batches(plan.schedule, S, j, n)
        key = (plan.dp_sharding, plan.num_pipelines, recompute, j == 0, j == S - 1, inflight, tp, m, comms)
        if key not in self._mem:
            self._mem[key] = E.stage_memory_at(self.w, *key)
        return self._mem[key]

    def comms(self, layout: Plan) -> dict:
        """(i, j) -> communicators of stage j of pipeline i as ``estimate()`` counts them, or {} (then
        :meth:`mem` takes the per-position lower bound; also where no communicator buffers are priced:
        CPU runs, or ``comm_buffer_bytes`` 0); kept for the last layout asked."""
        if not (self.exact_comms and self.w.device == "cuda" and self.w.comm_buffer_bytes):
            return {}
        if self._comms is None or self._comms[0] is not layout:
            # the groups depend on the rank order and the stages (devices, layers) only, not on the
            # dp sharding, batches or schedule: a layout drafted under three shardings counts once
            key = (layout.device_order,
                   tuple(tuple((st.devices, st.layers) for st in p.stages) for p in layout.pipelines))
            found = self._comms_of.get(key)
            if found is None:
                if len(self._comms_of) > _LAYOUT_CACHE:
                    self._comms_of.clear()
                found = self._comms_of[key] = stage_communicators(layout, self.w.model)
            self._comms = (layout, found)
        return self._comms[1]

    def fits(self, layout: Plan, i: int, m: int, n: int) -> bool:
        """Whether every stage of pipeline i fits with n micro-batches of m (``estimate()``'s check:
        fixed + layers * per_layer <= usable memory of the stage's smallest device)."""
        stages, recompute = layout.pipelines[i].stages, layout.pipelines[i].recompute
        S = len(stages)
        comms = self.comms(layout)
        for j, st in enumerate(stages):
            if (self.mem(layout, S, j, st.tp, m, n, comms.get((i, j)), recompute).peak(st.num_layers)
                    > self.cap(st.devices)):
                return False
        return True

    def most_micro_batches(self, layout: Plan, i: int, m: int, n_top: int) -> int:
        """The largest n <= n_top with pipeline i fitting n micro-batches of m (0: none). Memory
        grows with the in-flight micro-batches, which grow with n (1F1B: min(S - j, n), constant
        from n = S on; GPipe: n), so the n that fit are a prefix: bisection."""
        S = len(layout.pipelines[i].stages)
        if layout.schedule != "gpipe" and n_top >= S and self.fits(layout, i, m, S):
            return n_top
        if not self.fits(layout, i, m, 1):
            return 0
        lo, hi = 1, n_top if layout.schedule == "gpipe" else min(n_top, S)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(layout, i, m, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def limits(self, layout: Plan, i: int) -> np.ndarray:
        """Per micro-batch size of ``self.ms``: the most micro-batches pipeline i fits (memoised)."""
        stages = layout.pipelines[i].stages
        P = layout.num_pipelines
        comms = self.comms(layout)
        # what :meth:`fits` reads of a stage: its smallest device's usable memory, its TP degree, its
        # layer count and communicators (its position is the tuple's): pipelines on equal memory
        # share one entry, which on large clusters of repeated machines is most of them
        shape = (P, layout.dp_sharding, layout.schedule, layout.pipelines[i].recompute,
                 tuple((self.cap(st.devices), st.tp, st.num_layers, comms.get((i, j))) for j, st in enumerate(stages)))
        if shape not in self._limit:
            n_top = max(self.G - (P - 1), 1)
            limit = np.zeros(len(self.ms), dtype=np.int64)
            for k, m in enumerate(self.ms):
                if m > n_top:
                    break
                limit[k] = self.most_micro_batches(layout, i, m, n_top // m)
                if not limit[k]:  # a larger micro-batch needs more memory still
                    break
            if len(self._limit) > _PIPE_CACHE:
                self._limit.clear()
            self._limit[shape] = limit
        return self._limit[shape]

    def pipeline(self, layout: Plan, i: int, dp: dict, wanted: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        """g[b]: pipeline i's exact time at batch b with its best micro-batch size (inf where nothing
        fits or ``wanted[b]`` is False), and that size per b. Same arithmetic as ``estimate()``.
        Memoised per pipeline by what it reads: the shape (:meth:`shape`) of each stage's devices
        and of each hop's two groups, the layers, TP degrees, data-parallel terms, hops' NIC shares
        and communicators, and the plan-wide settings. Not by the devices themselves: a pipeline
        dealt onto another machine of the same kind prices alike (regroup deals the same TP groups
        over every machine of a replicated cluster; 6,641 -> 2,729 computed for hetero1)."""
        P, sh = layout.num_pipelines, layout.dp_sharding
        stages = layout.pipelines[i].stages
        S = len(stages)
        # shape() holds what layer_tb, extra, hop and cap (through limits) read of the devices
        shape = (P, sh, layout.schedule, layout.pipelines[i].recompute,
                 tuple((self.shape(st.devices), st.tp, st.layers) for st in stages),
                 tuple(self.shape(a.devices + b.devices) for a, b in zip(stages, stages[1:])))
        edges, caps, comms = self.edges(layout), self.hop_caps(layout), self.comms(layout)
        key = (shape, tuple(tuple(dp[(i, j)]) for j in range(S)), tuple(edges.get((i, j)) for j in range(S)),
               tuple(caps.get((i, j), ()) for j in range(S)), tuple(comms.get((i, j)) for j in range(S)))
        if wanted is None and key in self._pipe:
            return self._pipe[key]
        qm, qn, qb, qmi = self.qpairs(P)
        ok = qn <= self.limits(layout, i)[qmi]
        if wanted is not None:
            ok &= wanted[qb]
        sel = np.flatnonzero(ok)
        g = np.full(self.G + 1, math.inf)
        if not len(sel):
            if wanted is None:
                self._pipe[key] = (g, {})
            return g, {}
        A, B, C = np.empty(self.G + 1), np.empty(self.G + 1), np.empty(self.G + 1)
        for m in np.unique(qm[sel]).tolist():
            A[m], B[m], C[m] = self.abc(layout, i, dp, edges, m)
        m_sel, n_sel, b_sel = qm[sel], qn[sel], qb[sel]
        T = compose.pipeline_seconds(A[m_sel], B[m_sel], C[m_sel], n_sel)
        order = np.lexsort((T, b_sel))
        first = np.ones(len(order), dtype=bool)
        first[1:] = b_sel[order][1:] != b_sel[order][:-1]
        best_q = order[first]
        g[b_sel[best_q]] = T[best_q]
        out = (g, dict(zip(b_sel[best_q].tolist(), m_sel[best_q].tolist())))
        if wanted is None:
            if len(self._pipe) > _PIPE_CACHE:
                self._pipe.clear()
            self._pipe[key] = out
        return out

    def abc(self, layout: Plan, i: int, dp: dict, edges: dict, m: int) -> tuple[float, float, float]:
        """(A, B, C) of pipeline i at micro-batch size m: its time with n micro-batches is
        (A + (n - 1) * B) + C: :func:`cost.compose.pipeline_time`, the composition estimate() calls."""
        stages, sh = layout.pipelines[i].stages, layout.dp_sharding
        S = len(stages)
        per_mb, hops, tails = [], [], []
        caps = self.hop_caps(layout)
        for j, st in enumerate(stages):
            t_f, t_b = self.layer_tb(st.devices, m, layout.pipelines[i].recompute)
            stage_mb, tail = compose.stage_time(t_f, t_b, dp[(i, j)], self.extra(st.devices, m, j == 0, j == S - 1),
                                                edges.get((i, j)), st.num_layers, sh, self.theta)
            per_mb.append(stage_mb)
            hops.append(self.hop(st.devices, stages[j + 1].devices, m, caps.get((i, j), ())) if j + 1 < S else 0.0)
            tails.append(tail)
        t = compose.pipeline_time(per_mb, hops, tails, layout.schedule)
        return t.A, t.B, t.C

    def abc_all(self, layout: Plan, dp: dict, edges: dict, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`abc` of every pipeline at once (arrays A, B, C), vectorised over the stages and
        their data-parallel intervals: the same terms, summed in another order (float rounding
        apart). For large clusters (:meth:`best_uniform`), where a layout has hundreds of pipelines."""
        flat = self._flat_layout(layout, dp, edges)
        (reps, cls), iv_stage, iv_n, iv_tc, e_emb, e_head, e_norm, n_layers, starts = flat
        ns = len(cls)
        # the per-micro-batch terms once per class of stages that price alike (_flat_layout)
        nc = len(reps)
        tf_c, tb_c, per0_c, hop_c = np.empty(nc), np.empty(nc), np.empty(nc), np.zeros(nc)
        for k, (devices, first, last, nxt, caps, recompute) in enumerate(reps):
            tf_c[k], tb_c[k] = self.layer_tb(devices, m, recompute)
            hop_c[k] = self.hop(devices, nxt, m, caps) if nxt is not None else 0.0
            per0_c[k] = self.extra(devices, m, first, last)
        tf, tb, per0, hop = tf_c[cls], tb_c[cls], per0_c[cls], hop_c[cls]
        per0 += cm.hop_charges(hop, layout.schedule)  # the pipelines end to end (each last hop is 0)
        sh = layout.dp_sharding
        step, exposed = compose.layer_steps(tf[iv_stage], tb[iv_stage], iv_tc, sh, self.theta)
        per = np.bincount(iv_stage, weights=iv_n * step, minlength=ns) + per0
        head = compose.head_exposed(e_head, n_layers * tb, sh)
        tail = np.bincount(iv_stage, weights=iv_n * exposed, minlength=ns) + e_emb + head + e_norm
        return compose.pipelines_abc(per, tail, starts)

    def _flat_layout(self, layout: Plan, dp: dict, edges: dict) -> tuple:
        """The m-independent arrays of :meth:`abc_all`, kept for the last layout."""
        if self._flat is not None and self._flat[0] is layout:
            return self._flat[1]
        stages, iv_stage, iv_n, iv_tc, emb, head, norm, nl, starts = [], [], [], [], [], [], [], [], []
        caps = self.hop_caps(layout)
        for i, p in enumerate(layout.pipelines):
            starts.append(len(stages))
            S = len(p.stages)
            for j, st in enumerate(p.stages):
                k = len(stages)
                stages.append((st.devices, j == 0, j == S - 1, p.stages[j + 1].devices if j + 1 < S else None,
                               caps.get((i, j), ()), p.recompute))
                for n, tc in dp[(i, j)]:
                    iv_stage.append(k)
                    iv_n.append(n)
                    iv_tc.append(tc)
                e = edges.get((i, j), (0.0, 0.0, 0.0))
                emb.append(e[0])
                head.append(e[1])
                norm.append(e[2])
                nl.append(st.num_layers)
        # classes of stages whose per-micro-batch terms are equal (the memo keys of layer_tb, extra
        # and hop): a layout of 1000s of stages on a replicated cluster has a few dozen
        index: dict[tuple, int] = {}
        reps: list[tuple] = []
        cls = np.empty(len(stages), dtype=np.int64)
        for k, st in enumerate(stages):
            devices, first, last, nxt, cap, recompute = st
            key = (self.shape(devices), first, last, None if nxt is None else self.shape(devices + nxt), cap, recompute)
            c = index.get(key)
            if c is None:
                c = index[key] = len(reps)
                reps.append(st)
            cls[k] = c
        flat = ((reps, cls), np.array(iv_stage, dtype=np.int64), np.array(iv_n, dtype=float), np.array(iv_tc),
                np.array(emb), np.array(head), np.array(norm), np.array(nl, dtype=float), np.array(starts))
        self._flat = (layout, flat)
        return flat

    def best_uniform(self, layout: Plan, dp: dict, meta: dict | None,
                     limits: np.ndarray | None = None) -> tuple[float, Plan | None]:
        """Large clusters: one micro-batch size m for every pipeline (m dividing G), the integer
        micro-batch counts by water-filling, exact for each m: pipeline i's time A_i + (n - 1) B_i + C_i
        grows linearly in n, so the least slowest pipeline with sum n_i = G / m, 1 <= n_i <= memory
        cap, is found by bisection on the level v (n_i = floor((v - A_i - C_i) / B_i) + 1) and then
        taking the surplus off the slowest pipelines."""
        P = layout.num_pipelines
        edges = self.edges(layout)
        if limits is None:
            limits = np.array([self.limits(layout, i) for i in range(P)], dtype=np.int64)
        best: tuple[float, Plan | None] = (math.inf, None)
        for k, m in enumerate(self.ms):
            if self.G % m:
                continue
            N = self.G // m
            caps = limits[:, k]
            if N < P or caps.min() < 1 or caps.sum() < N:
                continue
            A, B, C = self.abc_all(layout, dp, edges, m)
            lo, hi = float(((A + C).max())), float((A + (np.minimum(caps, N) - 1) * B + C).max())

            def counts(v: float) -> np.ndarray:
                with np.errstate(divide="ignore", invalid="ignore"):
                    n = np.floor((v - A - C) / np.where(B > 0, B, np.inf)) + 1
                return np.clip(np.where(B > 0, n, caps), 1, caps).astype(np.int64)

            for _ in range(64):
                if hi - lo <= 1e-12 * hi:  # the level to 1e-12: a surplus is taken off below
                    break
                mid = 0.5 * (lo + hi)
                if counts(mid).sum() >= N:
                    hi = mid
                else:
                    lo = mid
            n = counts(hi)
            for _ in range(int(n.sum() - N)):  # the surplus leaves the slowest pipelines
                t = compose.pipeline_seconds(A, B, C, n)
                t[n <= 1] = -math.inf
                n[int(np.argmax(t))] -= 1
            t = compose.pipeline_seconds(A, B, C, n)
            cost = float(t.max())
            if cost < best[0]:
                plan = with_batches(layout, (n * m).tolist(), [m] * P, meta)
                w = int(np.argmax(t))
                stages = layout.pipelines[w].stages
                caps = self.hop_caps(layout)
                hops = sum(self.hop(a.devices, b.devices, m, caps.get((w, j), ()))
                           for j, (a, b) in enumerate(zip(stages, stages[1:])))
                best = (cost, plan)
                self._known = (plan, (float(C[w]), float(n[w] * hops + (A[w] - B[w]))))
        return best

    def breakdown(self, plan: Plan) -> tuple[float, float]:
        """(exposed data-parallel time, hops + bubble) per iteration of the plan's slowest pipeline:
        the inputs of §4.4's choice between the two cut options."""
        if self._known is not None and self._known[0] is plan:
            return self._known[1]
        dp = self.dp(plan)
        edges = self.edges(plan)
        worst, out = -math.inf, (0.0, 0.0)
        for i, p in enumerate(plan.pipelines):
            m, n = p.micro_batch_size, p.num_micro_batches
            A, B, C = self.abc(plan, i, dp, edges, m)
            t = compose.pipeline_seconds(A, B, C, n)
            if t > worst:
                caps = self.hop_caps(plan)
                hops = sum(self.hop(a.devices, b.devices, m, caps.get((i, j), ()))
                           for j, (a, b) in enumerate(zip(p.stages, p.stages[1:])))
                worst, out = t, (C, n * hops + (A - B))
        return out

    def dp(self, layout: Plan) -> dict:
        """Per stage, [(layers, T_comm)] with T_comm as DP-Overhead-Layer takes it (:func:`estimate.dp_terms`
        at the reduce and parameter bytes, combined by :func:`compose.dp_intervals`)."""
        shape = tuple(tuple((st.devices, st.layers) for st in p.stages) for p in layout.pipelines)
        terms = self._dp_terms.get(shape)
        if terms is None:
            if len(self._dp_terms) > _LAYOUT_CACHE:
                self._dp_terms.clear()
            terms = self._dp_terms[shape] = E.dp_terms(layout, self.cluster, self.w)
        return compose.dp_intervals(*terms, layout.dp_sharding)

    def edges(self, layout: Plan) -> dict:
        """:func:`estimate.dp_edge_all` of the layout ((i, j) -> embedding / head / norms sync times;
        batch-independent), kept for the last layout asked (its pipelines ask in turn)."""
        if self._edges is None or self._edges[0] is not layout:
            self._edges = (layout, E.dp_edge_all(layout, self.cluster, self.w))
        return self._edges[1]

    def best(self, layout: Plan, meta: dict | None = None) -> tuple[float, Plan | None]:
        """The layout's least iteration time over batch splits and per-pipeline micro-batch sizes,
        and that plan (None when nothing fits)."""
        limits = [self.limits(layout, i) for i in range(layout.num_pipelines)]
        if any(not lim.any() for lim in limits):
            return math.inf, None  # a pipeline fits no micro-batch: no need for the DP terms
        dp = self.dp(layout)
        if not self.exact:
            return self.best_uniform(layout, dp, meta, np.array(limits, dtype=np.int64))
        gs, picks = [], []
        for i in range(layout.num_pipelines):
            g, m_of = self.pipeline(layout, i, dp)
            if not np.isfinite(g).any():
                return math.inf, None
            gs.append(g)
            picks.append(m_of)
        cost, batches = minimax_split(gs, self.G)
        if not batches:
            return math.inf, None
        return cost, with_batches(layout, batches, [picks[i][b] for i, b in enumerate(batches)], meta)


def layout_key(plan: Plan) -> tuple:
    """What identifies a layout: sharding and, per pipeline, its stages' devices and layer ranges."""
    return (plan.dp_sharding, tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines))
