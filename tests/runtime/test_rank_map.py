"""A plan on part of the launched ranks (runtime/topology.py's rank map, profiling/rounds.py).

A plan whose ``idle_devices`` are launched too runs on the ranks of its used devices: here on
global ranks {2, 3} or {1, 2, 3} of 4, so the map is not the identity. Checked:

- equivalence: the losses of every step and every parameter element on every training rank equal
  the independent single-process reference (``test_equivalence``'s), for the pipeline p2p with tied
  embeddings, TP stages whose leader is not their smallest rank (the broadcast roots of the
  schedule, the ddp gradient sync and ZeRO), and ZeRO-3's p2p gathers;
- isolation, from the NCCL-semantics traces: an idle rank takes part in nothing but the
  ``new_group`` calls, a training rank in nothing that
  involves an idle rank, and the replay under NCCL's rules passes;
- the rounds: one plan on every rank and one on ranks {2, 3}, in one call, both timed.
"""

from __future__ import annotations

import dataclasses

import nccl_semantics
import pytest
import torch
from test_equivalence import SEED, STEPS, assert_matches_reference, make_batch, make_optimizer, reference

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.profiling.rounds import measure_plans_rank, slowest_rank
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.topology import create_groups, rank_map
from grad_step import train_step

IDLE = [0, 1]
WORLD = 4
TRAINING = (2, 3)


def subset_plan(pipelines, num_layers: int = 4, dp_sharding: str = "ddp", idle=IDLE) -> Plan:
    """Plan from [(batch, micro_batch, [(devices, (start, end)), ...]), ...] with ``idle`` idle devices."""
    return Plan.from_dict({"num_layers": num_layers, "schedule": "1f1b", "recompute": False,
                           "dp_sharding": dp_sharding, "idle_devices": list(idle),
                           "pipelines": [{"batch_size": b, "micro_batch_size": mb,
                                          "stages": [{"devices": d, "layers": list(lr)} for d, lr in st]}
                                         for b, mb, st in pipelines]})


DP_TP2 = [(2, 1, [([3, 2], (0, 4))]), (2, 1, [([1], (0, 4))])]
PLANS = {
    # the pipeline runs from global rank 3 to global rank 2; tied embeddings exchanged between them
    "pp2_tied": (subset_plan([(4, 1, [([3], (0, 2)), ([2], (2, 4))])]), True),
    # TP 1 -> a TP-2 stage led by device 3: its leader broadcasts what it received from global rank 1,
    # root global rank 3 (plan rank 2)
    "pp_tp2_leader_last": (subset_plan([(4, 2, [([1], (0, 2)), ([3, 2], (2, 4))])], idle=[0]), False),
    # a TP-2 pipeline led by device 3 beside a TP-1 one: the replicated gradients (ddp) and
    # parameters (ZeRO-2) are broadcast from global rank 3 after the data-parallel sync
    "dp_tp2_leader_last": (subset_plan(DP_TP2, idle=[0]), False),
    "dp_tp2_leader_last_zero2": (subset_plan(DP_TP2, idle=[0], dp_sharding="zero2"), False),
    # two pipelines under ZeRO-3: the block gathers are p2p between global ranks 2 and 3
    "dp2_zero3": (subset_plan([(3, 1, [([2], (0, 4))]), (1, 1, [([3], (0, 4))])], dp_sharding="zero3"), False),
}


def test_rank_map_follows_the_launch_order():
    plan = PLANS["pp2_tied"][0]
    assert rank_map(plan, 2) == (0, 1)  # launched on its used devices only
    assert rank_map(plan, 4) == (2, 3)  # one rank per device of launch_order (0, 1, 2, 3)
    sparse = subset_plan([(2, 1, [([5], (0, 4))]), (2, 1, [([0], (0, 4))])], idle=[3])
    assert rank_map(sparse, 3) == (0, 2)  # launch order (0, 3, 5): device 5 is launch rank 2
    with pytest.raises(PlanError, match=r"world_size = 3: .*exactly 2 processes.*or 4, one per device"):
        rank_map(plan, 3)


def _subset_worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig):
    plan = Plan.from_dict(plan_dict)
    ranks = rank_map(plan, world)
    if rank not in ranks:
        try:
            PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
            refused = None
        except PlanError as e:  # raised before any communication
            refused = str(e)
        create_groups(plan, config, ranks)  # its part of the collective set-up, nothing else
        return {"refused": refused}
    engine = PipelineEngine(plan, config, seed=SEED, dtype=torch.float64)
    opt = engine.wrap_optimizer(make_optimizer("sgd", engine.parameters()))
    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(config, plan.global_batch, step)
        losses.append(train_step(engine, tokens, targets))
        opt.step()
    return {"losses": losses, "shards": engine.local_shards(), "plan_rank": engine.topology.rank}


def _groups_of(steps) -> set[tuple[int, ...]]:
    """Every group a rank communicated on, apart from new_group (recorded on the world group); p2p
    peers count as one-rank 'groups'."""
    out = set()
    for s in steps:
        if s.coll == "new_group":
            continue
        out.add(s.group)
        out.update((o.peer,) for o in s.ops)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(PLANS))
def test_subset_plan_trains_like_the_reference(run_ranks_traced_fixture, tiny_gqa, case):
    plan, tied = PLANS[case]
    config = dataclasses.replace(tiny_gqa, tie_word_embeddings=True) if tied else tiny_gqa
    plan.validate(model=config)
    results, traces = run_ranks_traced_fixture(WORLD, _subset_worker, plan.to_dict(), config)
    report = nccl_semantics.replay(traces)
    assert report.ok, str(report)

    ranks, idle = rank_map(plan, WORLD), plan.idle_devices
    assert ranks == tuple(r for r in range(WORLD) if r not in idle) != tuple(range(plan.world_size))
    training = [results[r] for r in ranks]
    assert [res["plan_rank"] for res in training] == list(range(plan.world_size))
    ref_losses, ref_state = reference(config, plan.global_batch, "sgd")
    assert_matches_reference(training, ref_losses, ref_state)

    world = tuple(range(WORLD))
    for r in idle:
        assert "leaves idle" in results[r]["refused"]
        # new_group calls (recorded on the world group), nothing else
        assert traces[r] and {s.coll for s in traces[r]} == {"new_group"} and {s.group for s in traces[r]} == {world}
    for r in ranks:
        used = _groups_of(traces[r])
        assert used and all(set(g) <= set(ranks) for g in used), f"rank {r} communicated on {sorted(used)}"
    # every rank made the same new_group calls, in the same order (the plan group last)
    calls = [[s.detail for s in t if s.coll == "new_group"] for t in traces]
    assert all(c == calls[0] for c in calls) and calls[0][-1] == ",".join(map(str, ranks))


# ---- the rounds ----------------------------------------------------------------------------------
ROUNDS_CONFIG = LlamaConfig(name="t", hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=32,
                            vocab_size=32, seq_len=4)
ALL_RANKS = subset_plan([(1, 1, [([d], (0, 2))]) for d in range(WORLD)], num_layers=2, idle=[])
FAST_ONLY = subset_plan([(4, 2, [([3], (0, 1)), ([2], (1, 2))])], num_layers=2)


def _rounds_worker(rank: int, world: int, plans: dict, config: LlamaConfig):
    from lightning_hexiscale.profiling.rounds import gather_to_rank0

    return gather_to_rank0(measure_plans_rank(rank, world, plans, config, steps=2, warmup=1, rounds=2))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rounds_measure_a_subset_plan_beside_an_all_rank_plan(run_ranks):
    plans = {"all": ALL_RANKS.to_dict(), "fast-only": FAST_ONLY.to_dict()}
    per_rank = run_ranks(WORLD, _rounds_worker, plans, ROUNDS_CONFIG)[0]  # judged by the NCCL harness
    assert len(per_rank) == WORLD and all(list(r) == ["all", "fast-only"] for r in per_rank)
    for r, times in enumerate(per_rank):
        assert len(times["all"]) == 2 and all(len(x) == 2 and min(x) > 0 for x in times["all"])
        if r in IDLE:
            assert times["fast-only"] is None  # absent, not a time
        else:
            assert len(times["fast-only"]) == 2 and all(len(x) == 2 and min(x) > 0 for x in times["fast-only"])
    slow = slowest_rank(per_rank)
    assert slow["fast-only"].per_round == [[max(per_rank[r]["fast-only"][k][j] for r in TRAINING) for j in range(2)]
                                           for k in range(2)]
    assert slow["all"].per_round == [[max(t["all"][k][j] for t in per_rank) for j in range(2)] for k in range(2)]


def test_slowest_rank_skips_the_ranks_a_plan_leaves_idle():
    assert slowest_rank([{"p": None}, {"p": [[1.0, 4.0]]}, {"p": [[2.0, 3.0]]}])["p"].per_round == [[2.0, 4.0]]
    with pytest.raises(ValueError, match="no rank ran it"):
        slowest_rank([{"p": None}, {"p": None}])
    with pytest.raises(ValueError, match="different measurements"):
        slowest_rank([{"p": [[1.0]]}, {"q": [[1.0]]}])


def test_rounds_refuse_a_plan_for_another_world_before_any_communication():
    with pytest.raises(PlanError, match=r"plan fast-only: world_size = 3: .*exactly 2 processes"):
        measure_plans_rank(0, 3, {"fast-only": FAST_ONLY.to_dict()}, ROUNDS_CONFIG, 1, 0, 1)
