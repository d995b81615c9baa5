"""A layer split that sees data parallelism (beyond §4.4's split in proportion to compute).

§4.4 gives each stage layers in proportion to its speed. But every layer a stage holds also has
to be synchronised with the other pipelines (Appendix B eq. 4-5): a stage whose devices reach the
other pipelines only over a slow link pays, per layer, an exposed data-parallel time that no
compute balance sees. Once phase 1 has fixed the pipelines, the links from a stage to the other
pipelines are known, so its per-layer data-parallel time can be estimated:

    T_comm(stage) ~ max_{d in stage} [ sum_{k != i} min_{x in D_k} alpha(d, x)
                                       + (P - 1) * layer_bytes / (t * P * min_{k != i} max_{x in D_k} beta(d, x)) ]

(each device exchanges its 1/t share of the layer with the holders in every other pipeline; the
best link to each pipeline is assumed, which is what a good split can hope for, and the slowest
of those paces the bytes, as in ``cost.model.comm_dp``). When that slowest link leaves the
machine, the rings of the stage's devices behind one NIC share it (``planner/cost/nic.py``): beta is
then at most B_nic(d)(machine of x) / (the stage's devices using d's NIC), the NIC's figure toward
that machine (``nics.to``, else its bandwidth). With u_j, w_j the
per-micro-batch and exposed per-iteration times of one layer on stage j at that T_comm
(``estimate.layer_step``) and f_j its hop and head, the split minimises the pipeline's time

    sum_j (l_j u_j + f_j) + (n - 1) max_j (l_j u_j + f_j) + max_j l_j w_j

over every split that fits in memory (all of them when there are at most ``_ENUMERATE`` splits,
else by single-layer moves from the compute-proportional split).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.search.assemble import DraftContext, Evaluator, PipeDraft

_ENUMERATE = 4096


def stage_comm(ev: Evaluator, stage: tuple[int, ...], others: list[tuple[int, ...]], num_pipelines: int) -> float:
    """The estimated data-parallel T_comm of one layer on ``stage`` (module docstring)."""
    if not others:
        return 0.0
    layer_bytes = E.dp_layer_bytes(ev.workload)
    t = len(stage)
    worst = 0.0
    nic_of, machine = ev.cluster.nic_of, ev.machine
    for d in stage:
        alpha = sum(float(ev.lat[d, list(peers)].min()) for peers in others)
        best = [max(peers, key=lambda x: ev.bw[d, x]) for peers in others]
        slowest = min(float(ev.bw[d, x]) for x in best)
        cross = [x for x in best if machine[x] != machine[d]]
        if cross:  # the stage's rings leave through d's NIC, at its figure toward each peer's machine (nics.to)
            sharing = sum(1 for e in stage if nic_of[e] == nic_of[d])
            nic = min(float(ev.cluster.nic_to[nic_of[d], machine[x]]) for x in cross)
            slowest = min(slowest, nic / sharing)
        worst = max(worst, alpha + len(others) * layer_bytes / (t * num_pipelines * slowest))
    return worst


def resplit(ev: Evaluator, draft: PipeDraft, others: list[tuple[int, ...]], ctx: DraftContext) -> PipeDraft:
    """``draft`` with its layers split for its full time, data-parallel tail included; the same
    draft when nothing better fits."""
    return resplit_cost(ev, draft, others, ctx)[0]


def resplit_cost(ev: Evaluator, draft: PipeDraft, others: list[tuple[int, ...]],
                 ctx: DraftContext) -> tuple[PipeDraft, float]:
    """:func:`resplit` and the estimated pipeline time of the result (module docstring)."""
    S, L = len(draft.stages), ev.model.num_layers
    if S == 1 or not others:
        return draft, draft.time_s(ctx.n_mb)
    theta = E.calibration_theta(ev.cluster)
    u, w = np.empty(S), np.empty(S)
    for j, st in enumerate(draft.stages):
        t_f, t_b = ev.layer_tb(st, ctx.mb)
        u[j], w[j] = E.layer_step(t_f, t_b, stage_comm(ev, st, others, ctx.num_pipelines), ctx.sharding, theta)
    plain = np.array([ev.layer_s(st, ctx.mb, ctx.sharding) for st in draft.stages])
    fixed = np.array(draft.per_mb_s) - np.array(draft.layers) * plain
    mem_n = draft.max_micro if draft.max_micro < (1 << 40) else S
    caps = np.array([ev.max_layers(st, j, S, ctx.mb, mem_n, ctx.sharding, ctx.num_pipelines)
                     for j, st in enumerate(draft.stages)])
    n = ctx.n_mb

    def cost(split: np.ndarray) -> np.ndarray:
        x = split * u + fixed
        return x.sum(axis=-1) + (n - 1) * x.max(axis=-1) + (split * w).max(axis=-1)

    if math.comb(L - 1, S - 1) <= _ENUMERATE:
        cuts = np.array(list(itertools.combinations(range(1, L), S - 1)), dtype=np.int64).reshape(-1, S - 1)
        splits = np.diff(np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts,
                                         np.full((len(cuts), 1), L, np.int64)], axis=1), axis=1)
        costs = np.where((splits <= caps).all(axis=1), cost(splits), math.inf)
        k = int(np.argmin(costs))
        if not math.isfinite(costs[k]):
            return draft, float(cost(np.array(draft.layers)))
        best = splits[k]
    else:
        best = np.array(draft.layers)
        cur = float(cost(best))
        improved = True
        while improved:
            improved = False
            for a, b in itertools.permutations(range(S), 2):
                if best[a] > 1 and best[b] < caps[b]:
                    best[a] -= 1
                    best[b] += 1
                    c = float(cost(best))
                    if c < cur * (1 - 1e-12):
                        cur, improved = c, True
                    else:
                        best[a] += 1
                        best[b] -= 1
    layers = tuple(int(x) for x in best)
    value = float(cost(best))
    if layers == draft.layers:
        return draft, value
    per = tuple(float(layers[j] * plain[j] + fixed[j]) for j in range(S))
    return PipeDraft(draft.stages, layers, per, draft.max_micro), value
