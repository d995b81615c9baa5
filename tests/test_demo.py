"""The demo (``make demo``: conf/config.yaml's defaults, cpu_demo + llama_demo) shows what HexiScale is
for: its searched plan genuinely has a tensor-parallel stage, a multi-stage pipeline and replicas
with unequal batches. Not forced: the search finds it, and it is the optimum of the plan space
(``exhaustive``) under the same cost model, so a better search cannot move away from it. Pure, ~1 s."""

from __future__ import annotations

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.planner import SearchSettings, exhaustive, search, workload_from_config


def _shape(plan) -> dict:
    return {"tp_stage": any(s.tp > 1 for p in plan.pipelines for s in p.stages),
            "multi_stage_pipeline": any(len(p.stages) > 1 for p in plan.pipelines),
            "unequal_replicas": len(plan.pipelines) > 1 and len({p.batch_size for p in plan.pipelines}) > 1}


@pytest.fixture(scope="module")
def demo():
    cfg = compose([])  # what `python recipes/train.py` and `make demo` plan
    assert cfg.cluster.name == "cpu_demo" and cfg.model.name == "llama_demo"
    cluster, workload = Cluster.from_config(cfg.cluster), workload_from_config(cfg)
    assert workload.dtype == "fp32"  # trainer.precision null on a CPU cluster: 32-true
    return cfg, cluster, workload


@pytest.mark.slow
def test_demo_plan_has_tp_pipeline_and_unequal_replicas(demo):
    cfg, cluster, workload = demo
    settings = SearchSettings.from_config(cfg, progress=False)
    res = search(cluster, workload, int(cfg.train.global_batch), settings)
    assert _shape(res.plan) == {"tp_stage": True, "multi_stage_pipeline": True, "unequal_replicas": True}, \
        res.plan.table(cluster)
    best = exhaustive(cluster, workload, int(cfg.train.global_batch), settings)
    assert _shape(best.plan) == _shape(res.plan), best.plan.table(cluster)
    assert res.estimate.iteration_time_s <= best.estimate.iteration_time_s * 1.001
