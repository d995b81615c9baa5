"""The baselines' plans run the whole global batch in whole micro-batches, as the systems would.

Megatron/Galvatron tried micro-batch 2 on replicas of 3 sequences (priced as one micro-batch of 2:
two thirds of the batch), Metis micro-batch 8 on a global batch of 12 (priced as 8 sequences); the
short batch made those plans look fastest."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload
from lightning_hexiscale.planner import baselines as B


@pytest.mark.parametrize("name,gb", [("megatron", 12), ("galvatron", 12), ("metis", 12), ("megatron", 6)])
def test_baseline_plans_cover_the_global_batch_in_whole_micro_batches(name, gb):
    cluster, workload = Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny"))
    seen = []
    mp = pytest.MonkeyPatch()
    for kind in (B.systems._Best, B.systems._Believed):  # every plan a baseline prices, not only the winner
        def spy(self, plan, *args, _offer=kind.offer, **kwargs):
            seen.append(plan)
            return _offer(self, plan, *args, **kwargs)
        mp.setattr(kind, "offer", spy)
    try:
        r = getattr(B, name)(cluster, workload, gb, SearchSettings(iterations=2))
    finally:
        mp.undo()
    assert seen and r.plan is not None
    for plan in seen + [r.plan]:
        assert plan.global_batch == gb, plan
        assert all(p.batch_size % p.micro_batch_size == 0 for p in plan.pipelines), plan
