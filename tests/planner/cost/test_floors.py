"""The search's lower bounds (planner/search/floors.py) never exceed what the batch timer prices: a floor
above the exact time would drop layouts that could win."""

import numpy as np
import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost.compute import effective_cluster
from lightning_hexiscale.planner import SearchSettings, Workload
from lightning_hexiscale.planner.search import floors as F
from lightning_hexiscale.planner.search.batching import BatchTimer
from lightning_hexiscale.planner.search.two_phase import SearchRun


def _scored_layouts(cluster: Cluster, w: Workload, global_batch: int) -> tuple[BatchTimer, list]:
    """(the search's batch timer, every layout it scored) of a short all-device search."""
    run = SearchRun(effective_cluster(cluster, w), w, global_batch,
                    SearchSettings(recompute=True, iterations=8, progress=False, use_all_devices=True))
    seen: list = []
    best = BatchTimer.best

    def spy(timer, layout, meta=None):
        seen.append(layout)
        return best(timer, layout, meta)

    BatchTimer.best = spy
    try:
        run.run()
    finally:
        BatchTimer.best = best
    return run.timer, seen


def test_link_ceiling_is_the_kth_fastest_link():
    c = Cluster.load("hetero3")
    rng = np.random.default_rng(0)
    for k in (1, 2, 7, 8, 9, 30, c.num_devices - 1):
        got = F.link_ceiling(c, k)
        for d in rng.choice(c.num_devices, 6, replace=False).tolist():
            others = np.sort(np.delete(c.bandwidth[d], d))[::-1]
            assert got[d] == others[k - 1], (k, d)
    with pytest.raises(ValueError):
        F.link_ceiling(c, c.num_devices)


@pytest.mark.parametrize("name,copies,model,shared", [("hetero2", 4, "llama2_7b", False),
                                                     ("h800_h20_32", 2, "llama2_13b", True)])
def test_exposed_floor_is_below_the_exact_tail_of_every_scored_layout(name, copies, model, shared):
    """Every layout a short search scores: the floor of each pipeline's exposed DP time <= the
    batch timer's exact C (its tail: DP terms of every layer interval, embedding and head syncs),
    at two micro-batch sizes, for the layout's sharding; and close to it on some layouts (a floor of
    0 would pass the first check and prune nothing; it is weak by design where P - 1 partners fit
    inside one machine, whose fast links then bound the slowest one)."""
    cluster = Cluster.load(name)
    if shared:  # one NIC per machine (the default without `nics`): the NIC rates slow the rings down
        c = cluster
        cluster = Cluster(c.name, list(c.devices), list(c.machines), c.bandwidth.copy(), c.latency.copy(),
                          c.calibration, c.description)
        assert cluster.nics_shared
    cluster = cluster.replicate(copies)
    w = Workload(LlamaConfig.load(model))
    G = 4 * cluster.num_devices
    timer, seen = _scored_layouts(cluster, w, G)
    ratios = []
    checked = 0
    for layout in seen:
        if layout.num_pipelines < 2:
            continue
        dp, edges = timer.dp(layout), timer.edges(layout)
        for m in timer.ms[:2]:
            _, _, C = timer.abc_all(layout, dp, edges, m)
            floor = F.exposed_floor(timer, [[s.devices for s in p.stages] for p in layout.pipelines],
                                    [[s.num_layers for s in p.stages] for p in layout.pipelines], m,
                                    layout.dp_sharding, layout.recompute)
            assert (floor <= C * (1 + 1e-9)).all(), (layout.num_pipelines, layout.dp_sharding, m)
            ratios.append(float(np.max(floor / C)))
            checked += 1
    assert checked >= 5
    assert max(ratios) > 0.5


def test_zero3_step_floor_is_below_the_exact_layer_time():
    """Every multi-pipeline layout a short search scores, under ZeRO-3: each stage's draft compute
    (theta_3f T_f + theta_3b T_b per layer) plus :func:`floors.zero3_step_floor` <= the stage's
    exact per-micro-batch layer time (sum over its layer intervals of n * step_3(T_comm), the batch
    timer's terms), at two micro-batch sizes; and close to it somewhere (a floor of 0 would pass
    and prune nothing)."""
    from dataclasses import replace

    from lightning_hexiscale.planner.cost import estimate as E

    cluster = Cluster.load("hetero2").replicate(4)
    w = Workload(LlamaConfig.load("llama2_7b"))
    timer, seen = _scored_layouts(cluster, w, 4 * cluster.num_devices)
    th_f, th_b = timer.theta[2], timer.theta[3]
    ratios, checked = [], 0
    for layout in seen:
        if layout.num_pipelines < 2:
            continue
        z3 = replace(layout, dp_sharding="zero3")
        dp = timer.dp(z3)
        stages = [[s.devices for s in p.stages] for p in z3.pipelines]
        layers = [[s.num_layers for s in p.stages] for p in z3.pipelines]
        for m in timer.ms[:2]:
            extra = F.zero3_step_floor(timer, stages, layers, m, z3.recompute)
            for i, p in enumerate(z3.pipelines):
                for j, st in enumerate(p.stages):
                    t_f, t_b = timer.layer_tb(st.devices, m, z3.recompute)
                    exact = sum(n * E.layer_step(t_f, t_b, tc, "zero3", timer.theta)[0] for n, tc in dp[(i, j)])
                    bound = st.num_layers * (th_f * t_f + th_b * t_b) + extra[i][j]
                    assert bound <= exact * (1 + 1e-9), (z3.num_pipelines, i, j, m, bound, exact)
                    ratios.append(extra[i][j] / max(exact - st.num_layers * (th_f * t_f + th_b * t_b), 1e-30))
                    checked += 1
    assert checked >= 20
    assert max(ratios) > 0.5
