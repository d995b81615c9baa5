"""The planner picks dp_sharding per cluster with the cost model, or takes it from the caller
(``train.dp_sharding`` / ``HexiScaleStrategy(dp_sharding=...)``), through the entry point the
strategy and the recipe use (:func:`lightning_hexiscale.lightning.plan_resolution.search_plan`)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.lightning.plan_resolution import search_plan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload, estimate


@pytest.mark.parametrize("cluster,model,batch", [("hetero1", "llama2_7b", 64), ("cpu_hetero4", "llama_tiny", 16)])
def test_search_picks_the_cheapest_sharding_for_its_layout(cluster, model, batch):
    c, m = Cluster.load(cluster), LlamaConfig.load(model)
    w = Workload.for_cluster(m, c)  # what the strategy prices: the cluster's devices, the default precision
    plan, est = search_plan(c, w, batch, {}, iterations=4)
    assert plan.dp_sharding in ("ddp", "zero2", "zero3")
    # Same layout under the other shardings: none is feasible and faster than the chosen one.
    for other in ("ddp", "zero2", "zero3"):
        alt = estimate(dataclasses.replace(plan, dp_sharding=other), c, w)
        if alt.feasible:
            assert est.iteration_time_s <= alt.iteration_time_s * (1 + 1e-9), other


@pytest.mark.parametrize("sharding", ["ddp", "zero2", "zero3"])
def test_explicit_sharding_binds_the_search(sharding):
    c = Cluster.load("cpu_hetero4")
    plan, _ = search_plan(c, Workload.for_cluster(LlamaConfig.load("llama_tiny"), c), 16,
                          {"dp_sharding": sharding}, iterations=3)
    assert plan.dp_sharding == sharding


def test_use_all_devices_reaches_the_search_through_plan_for(straggler):
    """The strategy's (and the elastic recipe's) door to the planner: by default the plan may leave
    the straggler idle; use_all_devices=True gives every device work."""
    from lightning_hexiscale.lightning.plan_resolution import plan_for

    c = straggler
    w = Workload.for_cluster(dataclasses.replace(LlamaConfig.load("llama2_7b"), num_layers=8), c)
    subset = plan_for(None, c, w, 16, {}, iterations=2)
    every = plan_for(None, c, w, 16, {}, iterations=2, use_all_devices=True)
    assert 2 in subset.idle_devices and subset.launch_order == (0, 1, 2, 3, 4)
    assert every.world_size == 5 and not every.idle_devices

