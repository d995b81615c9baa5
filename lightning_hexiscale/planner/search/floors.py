"""Lower bounds of a layout's iteration time, cheap enough to skip hopeless layouts before they are
scored (large clusters, :meth:`planner.search.two_phase.SearchRun.evaluate`): :func:`local_time` (the pipelines
water-filled with micro-batches) plus :func:`exposed_floor` (their exposed data-parallel time) and,
under ZeRO-3, :func:`zero3_step_floor` (its per-use gathers, which the drafts leave out).

Scoring a layout exactly (:class:`planner.search.batching.BatchTimer`) needs every stage's DP terms
(:func:`planner.cost.dp_comm.dp_comm_all`: O(N^2) pair terms per layer interval), and on 1000s of devices
layouts of many small pipelines cost the most to score while their data parallelism over slow
links makes them the worst plans: the pipelines alone (no DP) do not show it.
This bound does, in O(stages):

A slot (a device holding 1/t of a stage's layers, :mod:`planner.cost.dp_comm`) exchanges each layer's
gradient with the holders of the same rows in the other P - 1 pipelines: P - 1 distinct devices.
Eq. 4 paces the bytes by the slowest of those links, which is at most beta_(P-1)(d), the (P-1)-th
fastest link of device d to any other device. Dropping the latencies (>= 0) and the NIC rates (which
only slow a ring down):

    T_comm(slot) >= (P - 1) / (P * t) * layer_bytes / beta_(P-1)(d)          [s per layer]

at the reduce and at the parameter bytes, combined by :func:`estimate.dp_t_comm`. A pipeline's
exposed DP time per iteration (the C of ``A + (n - 1) B + C``, :meth:`BatchTimer.abc`) is at least
the max over its stages of n_layers * exposed(T_f, T_b, T_comm floor) (:func:`estimate.layer_step`:
non-decreasing in T_comm); the embedding / head / norm syncs (>= 0) are left out.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.cost.cache import pricing_cache


def link_ceiling(cluster: Cluster, k: int) -> np.ndarray:
    """beta_k(d) for every device d: the k-th largest bandwidth (bytes/s) from d to another device
    (1 <= k <= N - 1). Each row's distinct values and their counts are kept in the cluster's
    :class:`cost.cache.PricingCache` (rows hold few distinct values: a machine's links, its NIC's,
    the network's), so a query is O(N)."""
    n = cluster.num_devices
    if not 1 <= k < n:
        raise ValueError(f"k = {k}: a device has {n - 1} links")
    cache = pricing_cache(cluster)
    table = cache.link_ceiling
    if table is None:
        rows_v, rows_c = [], []
        for d in range(n):
            row = np.delete(cluster.bandwidth[d], d)
            vals, counts = np.unique(row, return_counts=True)
            rows_v.append(vals[::-1])
            rows_c.append(np.cumsum(counts[::-1]))
        width = max(len(v) for v in rows_v)
        vals = np.full((n, width), np.nan)
        cum = np.full((n, width), n, dtype=np.int64)  # padding: reached by every k
        for d, (v, c) in enumerate(zip(rows_v, rows_c)):
            vals[d, :len(v)], cum[d, :len(c)] = v, c
        table = cache.link_ceiling = (vals, cum)
    vals, cum = table
    first = (cum >= k).argmax(axis=1)  # the first distinct value (fastest first) reaching k links
    return vals[np.arange(n), first]


def exposed_floor(timer, stages_per_pipe: list[list[tuple[int, ...]]], layers_per_pipe: list[tuple[int, ...]],
                  mb: int, sharding: str, recompute: bool) -> np.ndarray:
    """Per pipeline, a lower bound (s) of its exposed DP time per iteration (module docstring), for
    the layout of these stages and layer counts under ``sharding`` at micro-batch size ``mb``.
    ``timer``: the search's :class:`BatchTimer` (its cluster, workload, theta and memoised layer times)."""
    P = len(stages_per_pipe)
    out = np.zeros(P)
    if P < 2:
        return out
    red_bt = bt = timer.w.dtype_bytes  # search layouts carry no reduce_dtype (estimate.wire_element_bytes)
    red_bytes, par_bytes = E.dp_layer_bytes(timer.w, red_bt), E.dp_layer_bytes(timer.w, bt)
    ceiling = link_ceiling(timer.cluster, P - 1)
    flat = [st for stages in stages_per_pipe for st in stages]
    sizes = np.array([len(st) for st in flat])
    slowest = np.minimum.reduceat(ceiling[np.concatenate([np.asarray(st) for st in flat])],
                                  np.cumsum(sizes) - sizes).tolist()  # per stage: min over its devices
    memo: dict[tuple, float] = {}  # stages on equal hardware with equal layers and ceilings price alike
    k = 0
    for i, (stages, layers) in enumerate(zip(stages_per_pipe, layers_per_pipe)):
        worst = 0.0
        for devices, n_layers in zip(stages, layers):
            key = (timer.shape(devices), n_layers, slowest[k])
            k += 1
            if key not in memo:
                per_byte = (P - 1) / (P * len(devices)) / key[2]
                t_comm = E.dp_t_comm(sharding, per_byte * red_bytes, per_byte * par_bytes)
                t_f, t_b = timer.layer_tb(devices, mb, recompute)
                memo[key] = n_layers * E.layer_step(t_f, t_b, t_comm, sharding, timer.theta)[1]
            worst = max(worst, memo[key])
        out[i] = worst
    return out


def zero3_step_floor(timer, stages_per_pipe: list[list[tuple[int, ...]]], layers_per_pipe: list[tuple[int, ...]],
                     mb: int, recompute: bool) -> list[list[float]]:
    """Per pipeline, per stage: a lower bound (s) of what ZeRO-3's parameter gathers add to one
    micro-batch of the stage beyond the compute its draft prices (theta_3f T_f + theta_3b T_b per
    layer, :meth:`assemble.Evaluator.layer_s`):

        n_layers * (step_3(T_floor) - theta_3f T_f - theta_3b T_b),
        step_3(T) = theta_3f max(T_f, T) + theta_3b max(T_b, T) + serve(T)     (estimate.layer_step)

    with T_floor = (P - 1) / (P t) * param_bytes / beta_(P-1)(slowest device) (module docstring;
    ZeRO-3's T_comm is its parameter gathers', :func:`estimate.dp_t_comm`). step_3 is
    non-decreasing in T, and every layer interval's T_comm is at least T_floor, so the stage's exact
    per-micro-batch time is at least its draft's plus this. All zero with one pipeline."""
    P = len(stages_per_pipe)
    if P < 2:
        return [[0.0] * len(stages) for stages in stages_per_pipe]
    par_bytes = E.dp_layer_bytes(timer.w, timer.w.dtype_bytes)
    ceiling = link_ceiling(timer.cluster, P - 1)
    th_f, th_b = timer.theta[2], timer.theta[3]
    memo: dict[tuple, float] = {}
    out = []
    for stages, layers in zip(stages_per_pipe, layers_per_pipe):
        row = []
        for devices, n_layers in zip(stages, layers):
            slowest = float(ceiling[list(devices)].min())
            key = (timer.shape(devices), n_layers, slowest)
            if key not in memo:
                t_c = (P - 1) / (P * len(devices)) * par_bytes / slowest
                t_f, t_b = timer.layer_tb(devices, mb, recompute)
                step = E.layer_step(t_f, t_b, t_c, "zero3", timer.theta)[0]
                memo[key] = n_layers * max(0.0, step - (th_f * t_f + th_b * t_b))
            row.append(memo[key])
        out.append(row)
    return out


def local_time(drafts: list, total_micro: int, tail: np.ndarray | None = None) -> float:
    """The slowest pipeline's own time with ``total_micro`` micro-batches shared by water-filling:
    pipeline i takes sum_i + (n_i - 1) * max_i + tail_i (``tail``: a floor of each pipeline's exposed
    data-parallel time, :func:`exposed_floor`; none: 0)."""
    P = len(drafts)
    if total_micro < P:
        return math.inf
    s = np.array([d.sum_s for d in drafts])
    if tail is not None:
        s = s + tail
    m = np.array([d.max_s for d in drafts])
    lo, hi = float(s.max()), float((s + (total_micro - 1) * m).max())
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if np.floor((mid - s) / m + 1).clip(min=0).sum() >= total_micro:
            hi = mid
        else:
            lo = mid
    return hi
