"""The vectorised data-parallel terms of estimate() equal the per-stage reference form."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import dp_comm as D
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner import Plan, SearchSettings, pricing_cache, search


def _plans():
    yield Plan.load("conf/plans/hetero3_llama30b_tab7.yaml"), Cluster.load("hetero3"), LlamaConfig.load("llama_30b")
    yield Plan.load("conf/plans/case_study_llama2_13b.yaml"), Cluster.load("case_study"), LlamaConfig.load("llama2_13b")
    for name, model, gb in (("hetero1", "llama2_7b", 64), ("h800_h20_16", "llama_30b", 128)):
        c, m = Cluster.load(name), LlamaConfig.load(model)
        for seed in range(2):
            yield search(c, E.Workload(m), gb, SearchSettings(iterations=6, seed=seed, cut="max" if seed else "min")).plan, c, m


# Searched once for both tests: the four searches are most of this module's time (about 9 s on 2 cores,
# spent at collection, where --durations does not show it).
CASES = list(_plans())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1].name}-{c[0].num_pipelines}p")
def test_dp_terms_match_the_reference(case):
    plan, cluster, model = case
    layer_bytes = model.layer_params * 2
    pricing_cache(cluster).clear()
    fast = D.dp_comm_all(plan, cluster, layer_bytes)
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            ref = D.dp_comm_per_layer(plan, i, st, cluster, layer_bytes)
            assert [n for n, _ in fast[(i, j)]] == [n for n, _ in ref]
            assert [t for _, t in fast[(i, j)]] == pytest.approx([t for _, t in ref], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1].name}-{c[0].num_pipelines}p")
def test_edge_terms_match_the_reference(case):
    """The embedding / LM head / norms syncs, vectorised (dp_edge_all) vs per stage (dp_edge_times)."""
    plan, cluster, model = case
    w = E.Workload(model)
    fast = E.dp_edge_all(plan, cluster, w)
    for i, p in enumerate(plan.pipelines):
        for j in range(len(p.stages)):
            ref = E.dp_edge_times(plan, i, j, cluster, w)
            assert fast.get((i, j), (0.0, 0.0, 0.0)) == pytest.approx(ref, rel=1e-12, abs=1e-15)
