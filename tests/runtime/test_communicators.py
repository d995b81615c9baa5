"""planner/cost/communicators.py counts the process groups each rank joins without torch.distributed:
the count equals what runtime/topology.py creates, on real gloo ranks (asymmetric TP included), and
its group list equals topology.group_ranks on the shipped Tab. 7 plan."""

from __future__ import annotations

import pytest

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost.communicators import (communicator_groups, communicators_lower_bound,
                                                            communicators_per_rank)
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.topology import Topology, group_ranks


def plan_of(pipelines, num_layers=4) -> Plan:
    return Plan.from_dict({"num_layers": num_layers, "pipelines": [
        {"batch_size": b, "micro_batch_size": mb, "stages": [{"devices": d, "layers": list(lr)} for d, lr in st]}
        for b, mb, st in pipelines]})


PLANS = {
    # Fig. 1 bottom: a TP-2 pipeline beside a 3-stage one
    "fig1": [(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 3)), ([4], (3, 4))])],
    # asymmetric TP: TP 3 (heads 2,1,1; FFN 34,33,33) beside TP 2, uneven boundaries
    "tp3_vs_tp2": [(2, 1, [([0, 1, 2], (0, 4))]), (2, 1, [([3, 4], (0, 4))])],
    # two TP-2 stages (scatter/gather links) beside a two-stage TP-1 pipeline cut elsewhere
    "tp2_pp2_vs_pp2": [(2, 1, [([0, 1], (0, 2)), ([2, 3], (2, 4))]), (2, 1, [([4], (0, 3)), ([5], (3, 4))])],
    # tied embeddings held by TP-1 first stages; TP 3 vs TP 2 on the second stages: there the FFN
    # split (34, 33, 33 vs 50, 50) has a holder set that no other parameter has
    "tied_tp3_vs_tp2_late": [(2, 1, [([0], (0, 1)), ([1, 2, 3], (1, 4))]), (2, 1, [([4], (0, 1)), ([5, 6], (1, 4))])],
}
MHA = LlamaConfig(name="tiny_mha", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                  ffn_hidden_size=100, vocab_size=256, seq_len=16)
TIED = LlamaConfig(name="tiny_mha_tied", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                   ffn_hidden_size=100, vocab_size=256, seq_len=16, tie_word_embeddings=True)


def _count_worker(rank, world, plan_dict, config):
    topo = Topology(Plan.from_dict(plan_dict), config)
    return len(topo.groups) + 1  # + the default (world) group


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(PLANS))
def test_count_equals_the_runtime_groups(run_ranks, name):
    plan, config = plan_of(PLANS[name]), TIED if name.startswith("tied") else MHA
    counted = communicators_per_rank(plan, config)
    assert run_ranks(plan.world_size, _count_worker, plan.to_dict(), config) == counted
    # the search's cheap bound (per stage) never exceeds the count of the stage's busiest rank;
    # asymmetric TP joins more groups than it
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            bound = communicators_lower_bound(st.tp, j == 0, j == len(p.stages) - 1, plan.num_pipelines)
            ranks = [plan.device_order.index(d) for d in st.devices]
            assert max(counted[r] for r in ranks) >= bound
    if name == "tp3_vs_tp2":
        assert max(counted) > communicators_lower_bound(3, True, True, 2)


def test_tab7_groups_equal_topology():
    plan = Plan.load("conf/plans/hetero3_llama30b_tab7.yaml")
    model = LlamaConfig.load("llama_30b")
    assert communicator_groups(plan, model) == group_ranks(plan, model)
    assert max(communicators_per_rank(plan, model)) >= 15
