"""Roles, process-group lists and gradient segments for several plans (pure), plus group creation
and one collective per group on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.topology import segment_bounds, sync_segments
from lightning_hexiscale.runtime.topology import Topology, group_ranks, link_pairs, role_of


def plan_of(pipelines, num_layers=4) -> Plan:
    return Plan.from_dict({"num_layers": num_layers, "pipelines": [
        {"batch_size": b, "micro_batch_size": mb, "stages": [{"devices": d, "layers": list(lr)} for d, lr in st]}
        for b, mb, st in pipelines]})


FIG1 = [(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 3)), ([4], (3, 4))])]


def test_roles_fig1_bottom():
    plan = plan_of(FIG1)
    r1 = role_of(plan, 1)
    assert (r1.pipeline, r1.stage, r1.tp, r1.tp_rank, r1.leader) == (0, 0, 2, 1, 0)
    assert r1.is_first and r1.is_last and not r1.is_leader
    assert (r1.batch_offset, r1.batch_size, r1.num_micro_batches) == (0, 4, 2)
    r3 = role_of(plan, 3)
    assert (r3.pipeline, r3.stage, r3.num_stages, r3.layers) == (1, 1, 3, (2, 3))
    assert (r3.prev_leader, r3.next_leader) == (2, 4)
    assert not r3.is_first and not r3.is_last
    assert (r3.batch_offset, r3.batch_size) == (4, 2)
    assert not r3.scatter_gather_prev and not r3.scatter_gather_next


def test_roles_follow_sorted_device_ids_not_positions():
    # devices 7 and 3: rank 0 runs device 3 (sorted order), which is the second stage
    plan = plan_of([(2, 1, [([7], (0, 2)), ([3], (2, 4))])])
    r0 = role_of(plan, 0)
    assert (r0.device, r0.stage, r0.prev_leader, r0.next_leader) == (3, 1, 1, None)
    assert role_of(plan, 1).next_leader == 0


def test_scatter_gather_only_between_equal_tp_above_one():
    plan = plan_of([(2, 1, [([0, 1], (0, 1)), ([2, 3], (1, 2)), ([4], (2, 3)), ([5], (3, 4))])])
    assert role_of(plan, 0).scatter_gather_next and role_of(plan, 3).scatter_gather_prev
    assert not role_of(plan, 3).scatter_gather_next  # TP 2 -> TP 1: leader + broadcast
    assert not role_of(plan, 4).scatter_gather_next  # TP 1 -> TP 1: plain leader p2p
    # p2p links: TP rank r to TP rank r on the scatter/gather path, leaders otherwise
    assert link_pairs(plan) == [(0, 2), (1, 3), (2, 4), (4, 5)]
    assert role_of(plan, 1).link_peer("next") == 3 and role_of(plan, 3).link_peer("prev") == 1
    assert role_of(plan, 2).link_peer("next") == 4 and role_of(plan, 3).link_peer("next") is None
    assert role_of(plan, 0).link_peer("prev") is None


def test_rank_outside_plan_is_a_plan_error():
    with pytest.raises(PlanError, match="rank"):
        role_of(plan_of(FIG1), 5)


@pytest.mark.parametrize("a,b,expect", [
    ([(0, 4)], [(0, 4)], [(0, 4, (0, 0))]),
    ([(0, 2), (2, 4)], [(0, 4)], [(0, 2, (0, 0)), (2, 4, (1, 0))]),
    ([(0, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)], [(0, 2, (0, 0)), (2, 3, (1, 1)), (3, 4, (2, 1))]),
    ([(0, 34), (34, 67), (67, 100)], [(0, 50), (50, 100)],
     [(0, 34, (0, 0)), (34, 50, (1, 0)), (50, 67, (1, 1)), (67, 100, (2, 1))]),
])
def test_segment_bounds_union_of_boundaries(a, b, expect):
    assert segment_bounds([a, b]) == expect


def test_segments_tp3_vs_tp2_q_proj(tiny_mha):
    # 4 KV heads, unit u = g*d = 16 rows: TP 3 -> [0,32) [32,48) [48,64); TP 2 -> [0,32) [32,64)
    plan = plan_of([(2, 1, [([0, 1, 2], (0, 4))]), (2, 1, [([3, 4], (0, 4))])])
    q = [s for s in sync_segments(plan, tiny_mha) if s.name == "layers.0.attn.q_proj.weight"]
    assert [(s.start, s.end, s.ranks) for s in q] == [(0, 32, (0, 3)), (32, 48, (1, 4)), (48, 64, (2, 4))]
    o = [s for s in sync_segments(plan, tiny_mha) if s.name == "layers.0.attn.o_proj.weight"]
    assert all(s.shard_dim == 1 for s in o) and len(o) == 3
    norm = [s for s in sync_segments(plan, tiny_mha) if s.name == "layers.0.attn_norm.weight"]
    assert [(s.shard_dim, s.ranks) for s in norm] == [(None, (0, 3))]  # leaders only


def test_segments_cover_every_parameter_once_per_pipeline(tiny_gqa):
    plan = plan_of(FIG1)
    segs = sync_segments(plan, tiny_gqa)
    assert all(len(s.ranks) == 2 for s in segs)
    # vocabulary-parallel embedding and LM head: the TP-2 stage's two halves against rank 2
    # (first stage of pipeline 1) and rank 4 (its last stage); the final norm on the leaders only
    assert {s.ranks for s in segs if s.name == "embed.weight"} == {(0, 2), (1, 2)}
    assert {s.ranks for s in segs if s.name == "lm_head.weight"} == {(0, 4), (1, 4)}
    assert {s.ranks for s in segs if s.name == "norm.weight"} == {(0, 4)}
    # layer 2 lives on rank 3 in pipeline 1, split over ranks 0/1 in pipeline 0
    assert {s.ranks for s in segs if s.name == "layers.2.mlp.up_proj.weight"} == {(0, 3), (1, 3)}


def test_group_ranks(tiny_gqa):
    # TP group (0, 1), holder pairs across the pipelines, links (2, 3) and (3, 4) of pipeline 1
    assert group_ranks(plan_of(FIG1), tiny_gqa) == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (1, 4),
                                                    (2, 3), (3, 4)]
    # one pipeline of two TP-2 stages: TP groups and the scatter/gather links (0, 2), (1, 3); no DP groups
    assert group_ranks(plan_of([(2, 1, [([0, 1], (0, 2)), ([2, 3], (2, 4))])]), tiny_gqa) == [
        (0, 1), (0, 2), (1, 3), (2, 3)]
    # pure DP over 3 single-device pipelines: one group of everything
    pure = plan_of([(1, 1, [([d], (0, 4))]) for d in range(3)])
    assert group_ranks(pure, tiny_gqa) == [(0, 1, 2)]


def _groups_worker(rank, world, plan_dict, config):
    plan = Plan.from_dict(plan_dict)
    topo = Topology(plan, config)
    sums = {}
    for ranks, group in sorted(topo.groups.items()):  # same global order on every member
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        sums[ranks] = t.item()
    return {"sums": sums, "tp_group": topo.tp_group is not None}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_groups_created_everywhere_and_usable(run_ranks, tiny_gqa):
    plan = plan_of(FIG1)
    results = run_ranks(5, _groups_worker, plan.to_dict(), tiny_gqa)
    for rank, res in enumerate(results):
        expect = [g for g in group_ranks(plan, tiny_gqa) if rank in g]
        assert sorted(res["sums"]) == expect
        assert all(v == len(g) for g, v in res["sums"].items())
        assert res["tp_group"] == (rank in (0, 1))


def _wrong_world_worker(rank, world, plan_dict, config):
    try:
        Topology(Plan.from_dict(plan_dict), config)
    except PlanError as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world_size_mismatch_is_a_plan_error(run_ranks, tiny_gqa):
    msgs = run_ranks(2, _wrong_world_worker, plan_of(FIG1).to_dict(), tiny_gqa)
    assert all(m is not None and "world_size = 2" in m and "5 processes" in m for m in msgs)
