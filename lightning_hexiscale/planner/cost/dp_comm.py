"""Data-parallel T_comm (Appendix B eq. 4) of every stage of a plan, layer interval by layer interval.

The pipelines of a plan split the layers at different boundaries and with different TP degrees, so
the devices a layer's gradient is exchanged with change along the layers. :func:`dp_comm_all` sweeps
the global layer intervals and returns, per stage, ``[(layers, T_comm)]``; :func:`dp_comm_per_layer`
is the plain reference form of one stage (kept for tests). Both depend only on the plan's layout
(devices and layer ranges) and, given the model, on how its TP splits fall, not on batches,
micro-batches or sharding.

Bytes: each device's own share of the layer, as the runtime synchronises it (``wire.py``): heads
split in whole KV groups and FFN columns, so a rank may hold more than 1/t (Llama 3 8B's 8 KV
heads over TP 7: 2,1,1,1,1,1,1, the first rank 1.14/7 of the layer), and the norms on the stage
leader. Who a device's partners are (the latencies, the slowest link) still follows the even split
[r/t, (r+1)/t), which an uneven split moves by less than one KV head or FFN column.
"""

from __future__ import annotations

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost.cache import DP_COMM_ENTRIES, pricing_cache
from lightning_hexiscale.planner.cost import nic
from lightning_hexiscale.planner.cost.wire import local_matrix_params
from lightning_hexiscale.planner.plan import Plan, Stage


def _overlap(r: int, t: int, r2: int, t2: int) -> float:
    """Shared fraction of a layer between TP rank r of t and TP rank r2 of t2 (even splits)."""
    lo, hi = max(r / t, r2 / t2), min((r + 1) / t, (r2 + 1) / t2)
    return max(0.0, hi - lo)


def share_scale(model: LlamaConfig | None, t: int) -> list[float]:
    """Per TP rank r of t: the share of a layer's synchronised elements it holds (its matmul shard,
    plus the two norms on the leader), over the even share 1/t. All 1.0 without a model."""
    if model is None or t == 1:
        return [1.0] * t
    own = [local_matrix_params(model, t, r) + (2 * model.hidden_size if r == 0 else 0) for r in range(t)]
    return [t * n / model.layer_params for n in own]


def dp_comm_per_layer(plan: Plan, i: int, stage: Stage, cluster: Cluster, layer_bytes: float,
                      model: LlamaConfig | None = None) -> list[tuple[int, float]]:
    """[(layers, T_comm)] over the stage's layer intervals whose holders in other pipelines are fixed;
    ``model``: price each rank's own share of the layer (:func:`share_scale`), else 1/t.

    Reference form, one stage at a time (kept for tests); :func:`dp_comm_all` computes the same
    numbers for every stage at once and is what :func:`estimate` uses.
    """
    if plan.num_pipelines == 1:
        return [(stage.num_layers, 0.0)]
    cuts = {stage.layers[0], stage.layers[1]}
    for p in plan.pipelines:
        for s in p.stages:
            for b in s.layers:
                if stage.layers[0] < b < stage.layers[1]:
                    cuts.add(b)
    bounds = sorted(cuts)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        holders = []
        for k, p in enumerate(plan.pipelines):
            if k != i:
                holders.append(next(s for s in p.stages if s.layers[0] <= a < s.layers[1]))
        # the NICs the interval's rings share: every pipeline's holder, this stage in place i
        rates = nic.holder_rates(cluster, [h.devices for h in holders[:i]] + [stage.devices]
                                 + [h.devices for h in holders[i:]])[i]
        worst = 0.0
        scale = share_scale(model, stage.tp)
        for r, d in enumerate(stage.devices):
            partners = []
            for h in holders:
                for r2, d2 in enumerate(h.devices):
                    share = _overlap(r, stage.tp, r2, h.tp)
                    if share > 0:
                        partners.append((d, d2, share * scale[r]))
            # the NIC rate is the device's share of its NIC (nic.dp_ring_rates): it scales alike
            worst = max(worst, cm.comm_dp(partners, layer_bytes, plan.num_pipelines, cluster.bandwidth,
                                          cluster.latency, rates[r] * scale[r]))
        out.append((b - a, worst))
    return out


def dp_comm_all(plan: Plan, cluster: Cluster, layer_bytes: float,
                model: LlamaConfig | None = None) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """:func:`dp_comm_per_layer` for every stage (i, j) at once, vectorised with numpy.

    Sweep the global layer intervals (between any two stage boundaries of any pipeline). For each
    device slot keep, per pipeline k, over the TP ranks r2 of k's current holder that share
    weights with the slot: A[slot, k] = sum of alpha, B[slot, k] = the smallest beta (eq. 4 with
    the slowest link pacing the bytes, :func:`cost.model.comm_dp`); at a boundary only the columns
    of the pipelines whose holder changed, and the rows of the devices that start a stage, are
    recomputed, so a plan costs O(N^2) pair terms in a few dozen array operations instead of a
    Python loop over every (stage, interval, rank, partner). The shares need no pair array: every other
    pipeline holds all of the slot's part s of the layer (1/t, or the rank's own share given the
    model: :func:`share_scale`), so they sum to (N_dp - 1)*s. A slot's T_comm is
    sum_k A + (N_dp - 1)*s * layer_bytes / (N_dp * min(min_k B, R)), R the rate its rings get from
    the NICs the interval's rings share (:func:`nic.dp_ring_rates`, scaled by s*t alike); a stage's on
    an interval is the max over its devices. Same terms as the reference, summed in a different order (differences
    at the level of float rounding). Results are memoised in the cluster's :class:`.cache.PricingCache` for the last few plan
    layouts (they do not depend on batch, micro-batch or sharding).
    """
    P = plan.num_pipelines
    if P == 1:
        return {(0, j): [(st.num_layers, 0.0)] for j, st in enumerate(plan.pipelines[0].stages)}
    key = (layer_bytes, model, tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines))
    cache = pricing_cache(cluster).dp_comm
    if key in cache:
        return cache[key]
    bw, lat = cluster.bandwidth, cluster.latency
    # device slots, stage by stage
    dev, lo, hi, pipe_of, scale = [], [], [], [], []
    first_slot: dict[tuple[int, int], int] = {}
    for k, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            first_slot[(k, j)] = len(dev)
            t = st.tp
            scale += share_scale(model, t)
            for r, d in enumerate(st.devices):
                dev.append(d)
                lo.append(r / t)
                hi.append((r + 1) / t)
                pipe_of.append(k)
    dev_a, lo_a, hi_a, pipe_a = np.array(dev), np.array(lo), np.array(hi), np.array(pipe_of)
    scale_a = np.array(scale)
    bounds = sorted({b for p in plan.pipelines for s in p.stages for b in s.layers})
    starts = np.array(bounds[:-1])
    holder = np.empty((P, len(starts)), dtype=np.int64)
    for k, p in enumerate(plan.pipelines):
        holder[k] = np.searchsorted(np.array([s.layers[1] for s in p.stages]), starts, side="right")

    # per (pipeline, stage): its first slot and TP degree, padded to the longest pipeline, so that
    # the slots of any choice of one stage per pipeline are built in array operations (the sweep
    # below visits every interval, and a Python loop over P pipelines there dominated large plans)
    S_max = max(len(p.stages) for p in plan.pipelines)
    first_a = np.zeros((P, S_max), dtype=np.int64)
    tp_a = np.zeros((P, S_max), dtype=np.int64)
    for (k, j), a in first_slot.items():
        first_a[k, j], tp_a[k, j] = a, plan.pipelines[k].stages[j].tp

    def slots_of(ks: np.ndarray, js: np.ndarray) -> np.ndarray:
        """The slots of stage js[q] of pipeline ks[q], for every q, concatenated in that order."""
        f, t = first_a[ks, js], tp_a[ks, js]
        if not len(t):
            return np.zeros(0, dtype=np.int64)
        offsets = np.cumsum(t) - t
        return np.repeat(f - offsets, t) + np.arange(int(t.sum()))

    def terms(rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta) of every (row, col) pair; pairs that share nothing: (0, inf)."""
        share = np.minimum(hi_a[rows][:, None], hi_a[cols][None, :]) - np.maximum(lo_a[rows][:, None], lo_a[cols][None, :])
        ix = np.ix_(dev_a[rows], dev_a[cols])
        ok = share > 0
        return np.where(ok, lat[ix], 0.0), np.where(ok, bw[ix], np.inf)

    def by_pipeline(t: tuple[np.ndarray, np.ndarray], cols: np.ndarray):
        """Per pipeline (cols are grouped by pipeline, in pipeline order): alpha summed, beta minimised."""
        ks, first = np.unique(pipe_a[cols], return_index=True)
        return ks, np.add.reduceat(t[0], first, axis=1), np.minimum.reduceat(t[1], first, axis=1)

    shares = (P - 1) * (hi_a - lo_a) * scale_a  # per slot: all other pipelines' shares of its own part
    A = np.zeros((len(dev), P))
    B = np.full((len(dev), P), np.inf)
    # per slot, over the other pipelines: sum_k A (kept by deltas) and min_k B with the k that
    # gives it; a full row pass only for new stages' rows and rows whose minimum column changed
    # (the row reductions over every active slot and pipeline dominated plans of 1000s of devices)
    row_a = np.zeros(len(dev))
    row_b = np.full(len(dev), np.inf)
    arg_b = np.full(len(dev), -1)
    worst = np.zeros((P, len(starts)))  # [k, g]: the worst slot of pipeline k's holder on interval g
    every = np.arange(P)
    prev = np.full(P, -1)

    def reduce_rows(rows: np.ndarray) -> None:
        if len(rows):
            row_a[rows] = A[rows].sum(axis=1)
            arg_b[rows] = B[rows].argmin(axis=1)
            row_b[rows] = B[rows, arg_b[rows]]

    for g in range(len(starts)):
        js = holder[:, g]
        changed = np.flatnonzero(js != prev)
        prev = js.copy()
        active = slots_of(every, js)
        fresh = slots_of(changed, js[changed])
        staying = np.setdiff1d(active, fresh, assume_unique=True)
        if len(fresh):  # new stages: whole rows against every current holder
            ks, a, b = by_pipeline(terms(fresh, active), active)
            A[fresh], B[fresh] = 0.0, np.inf
            A[np.ix_(fresh, ks)], B[np.ix_(fresh, ks)] = a, b
            own = pipe_a[fresh]  # a pipeline does not synchronise with itself
            A[fresh, own], B[fresh, own] = 0.0, np.inf
            reduce_rows(fresh)
        if len(staying):  # unchanged stages: only the columns of pipelines whose holder changed
            # (a staying slot's own pipeline kept its holder, so its own column is not among ks)
            ks, a, b = by_pipeline(terms(staying, fresh), fresh)
            cols = np.ix_(staying, ks)
            row_a[staying] += (a - A[cols]).sum(axis=1)
            A[cols], B[cols] = a, b
            lost = np.isin(arg_b[staying], ks)  # the minimum's column was replaced: full pass
            reduce_rows(staying[lost])
            keep = staying[~lost]
            if len(keep):
                kb = b[~lost]
                new_min = kb.min(axis=1)
                better = new_min < row_b[keep]
                row_b[keep] = np.where(better, new_min, row_b[keep])
                arg_b[keep] = np.where(better, ks[kb.argmin(axis=1)], arg_b[keep])
        # the interval's rings share NICs (nic.dp_ring_rates): the slower of that and the slowest link
        rates = nic.dp_ring_rates(cluster, dev_a[active], lo_a[active], hi_a[active]) * scale_a[active]
        cost = row_a[active] + shares[active] * (layer_bytes / P) / np.minimum(row_b[active], rates)
        t = tp_a[every, js]
        worst[:, g] = np.maximum.reduceat(cost, np.cumsum(t) - t)
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for k, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            a, b = bounds.index(st.layers[0]), bounds.index(st.layers[1])
            out[(k, j)] = [(bounds[q + 1] - bounds[q], float(worst[k, q])) for q in range(a, b)]
    if len(cache) >= DP_COMM_ENTRIES:
        cache.pop(next(iter(cache)))
    cache[key] = out
    return out
