"""Baselines under the same cost model: valid plans, their restrictions, exhaustive >= search."""

import math

import pytest
from plan_memo import memoised_planner

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import baselines as B
from lightning_hexiscale.planner import SearchSettings, Workload, estimate, search

FAST = SearchSettings(iterations=6)


@pytest.fixture(scope="module", autouse=True)
def planned_once():
    """symmetric-best's and leave-out's tests price the same machine subsets of the straggler
    cluster (megatron, galvatron, the search): once per module for equal arguments (plan_memo.py)."""
    with pytest.MonkeyPatch.context() as mp, memoised_planner(mp) as stats:
        yield stats


@pytest.fixture(scope="module")
def hetero2_7b():
    # hetero2 rather than hetero1: with TP restricted to divisors of the 32 heads, no symmetric
    # Megatron plan of Llama-2 7B fits hetero1's 12 GiB 3080Ti under DDP.
    return Cluster.load("hetero2"), Workload(LlamaConfig.load("llama2_7b")), 64


@pytest.mark.parametrize("name", ["megatron", "galvatron", "metis", "random"])
def test_baselines_return_valid_plans_that_fit(name, hetero2_7b):
    c, w, gb = hetero2_7b
    r = B.run_baselines(c, w, gb, FAST, (name,))[name]
    assert r.plan is not None and r.estimate.feasible, r.note
    r.plan.validate(c, w.model, global_batch=gb)
    assert r.plan.meta["planner"] == name


@pytest.mark.slow
def test_baselines_use_their_own_sharding_unless_like_for_like(hetero2_7b):
    """Appendix G: Megatron and Metis run DDP, Galvatron ZeRO-3; like-for-like lets them choose."""
    res = B.run_baselines(*hetero2_7b, FAST, ("megatron", "galvatron", "metis"))
    assert {n: r.plan.dp_sharding for n, r in res.items()} == {"megatron": "ddp", "galvatron": "zero3", "metis": "ddp"}
    l4l = B.run_baselines(*hetero2_7b, FAST, ("metis",), like_for_like=True)["metis"]
    assert l4l.estimate.iteration_time_s <= res["metis"].estimate.iteration_time_s


def test_megatron_is_symmetric_with_equal_layers_and_batches(hetero2_7b):
    plan = B.megatron(*hetero2_7b, FAST).plan
    assert len({p.batch_size for p in plan.pipelines}) == 1
    assert len({s.num_layers for p in plan.pipelines for s in p.stages}) == 1
    assert len({s.tp for p in plan.pipelines for s in p.stages}) == 1
    assert len({len(p.stages) for p in plan.pipelines}) == 1
    assert plan.world_size == 32


def test_galvatron_shares_one_layer_split_over_replicas(hetero2_7b):
    plan = B.galvatron(*hetero2_7b, FAST).plan
    assert len({tuple(s.layers for s in p.stages) for p in plan.pipelines}) == 1
    assert len({s.tp for p in plan.pipelines for s in p.stages}) == 1


def test_metis_orders_stages_by_gpu_type(hetero2_7b):
    c, w, gb = hetero2_7b
    plan = B.metis(c, w, gb, FAST).plan
    for p in plan.pipelines:
        speeds = [c.devices[s.leader].flops for s in p.stages]
        assert speeds == sorted(speeds, reverse=True)


def test_megatron_on_the_case_study_is_out_of_memory_but_reports_its_time():
    """The paper's §3.1 case study ignores memory; under this cost model no symmetric plan fits."""
    c, w = Cluster.load("case_study"), Workload(LlamaConfig.load("llama2_13b"))
    r = B.megatron(c, w, 24, FAST)
    assert r.plan is None and "fits in memory" in r.note
    assert r.ignoring_memory is not None and r.ignoring_memory.iteration_time_s > 0


@pytest.mark.slow
def test_exhaustive_bounds_the_search_on_a_tiny_cluster(tiny):
    c = Cluster.load("cpu_hetero4")
    ex = B.exhaustive(c, tiny, 8, SearchSettings())
    se = search(c, tiny, 8, SearchSettings(iterations=30))
    ex.plan.validate(c, tiny.model, global_batch=8)
    assert ex.estimate.iteration_time_s <= se.estimate.iteration_time_s * (1 + 1e-9)
    assert ex.estimate.iteration_time_s / se.estimate.iteration_time_s >= 0.97


def test_exhaustive_refuses_large_clusters(tiny):
    with pytest.raises(ConfigError, match="max_devices"):
        B.exhaustive(Cluster.load("hetero2"), tiny, 8)


def test_random_search_logs_like_the_search(hetero2_7b):
    r = B.random_search(*hetero2_7b, FAST)
    assert len(r.log) == FAST.iterations and r.estimate.feasible


# ---- heterogeneity-unaware (faithful) megatron and galvatron -------------------------------------
def test_homogeneous_belief_is_one_device_kind_and_two_link_kinds():
    """Mean FLOP/s, smallest memory, median intra-machine and inter-machine links (case_study: three
    machines with NVLink 200 GB/s, PCIe 32 and 16 GB/s, joined at 1 GiB/s)."""
    c = Cluster.load("case_study")
    b = B.homogeneous_belief(c)
    assert b.num_devices == c.num_devices and [d.machine for d in b.devices] == [d.machine for d in c.devices]
    assert b.flops == pytest.approx([c.flops.mean()] * 8)
    assert set(b.memory.tolist()) == {c.memory.min()}
    intra = [b.bandwidth[i, j] for i in range(8) for j in range(8) if i != j and c.devices[i].machine == c.devices[j].machine]
    inter = [b.bandwidth[i, j] for i in range(8) for j in range(8) if c.devices[i].machine != c.devices[j].machine]
    # intra pairs: 6 on A (200 GB/s), 6 on B (32 GB/s), 2 on C (16 GB/s): the median is 32 GB/s
    assert set(intra) == {32e9} and set(inter) == {2.0 ** 30}


@pytest.mark.parametrize("name", ["megatron", "galvatron"])
def test_unaware_baselines_choose_under_the_belief_and_are_timed_truly(name, tiny):
    """cpu_hetero4: 2 fast + 2 slow devices. Believing 4 equal devices, galvatron (like megatron)
    picks equal batches and layers; knowing the truth it gives the fast devices more layers."""
    c, gb = Cluster.load("cpu_hetero4"), 8
    belief = B.homogeneous_belief(c)
    unaware = getattr(B, name)(c, tiny, gb, FAST)
    aware = getattr(B, name)(c, tiny, gb, FAST, aware=True)
    for r in (unaware, aware):
        r.plan.validate(c, tiny.model, global_batch=gb)
        assert r.estimate.feasible
        assert r.estimate.iteration_time_s == pytest.approx(estimate(r.plan, c, tiny).iteration_time_s)
    assert "homogeneous belief" in unaware.note
    assert len({p.batch_size for p in unaware.plan.pipelines}) == 1
    assert len({s.num_layers for p in unaware.plan.pipelines for s in p.stages}) == 1
    # the unaware pick is the best under the belief, the aware pick the best in truth
    assert estimate(unaware.plan, belief, tiny).cost <= estimate(aware.plan, belief, tiny).cost * (1 + 1e-9)
    assert aware.estimate.iteration_time_s <= unaware.estimate.iteration_time_s * (1 + 1e-9)
    if name == "galvatron":
        assert len({s.num_layers for p in aware.plan.pipelines for s in p.stages}) > 1


def test_unaware_baseline_retunes_when_the_believed_best_plan_does_not_fit(hetero2_7b):
    """Believing every GPU has the largest memory (an A800's 80 GiB), megatron's best plans run out of memory on the
    12 GiB 3080Ti: the next plan in believed order that fits the real devices is taken."""
    c, w, gb = hetero2_7b
    roomy = B.homogeneous_belief(c, memory_bytes=float(c.memory.max()))
    r = B.megatron(c, w, gb, FAST, belief=roomy)
    assert r.estimate.feasible and "believed-better plans do not fit" in r.note
    r.plan.validate(c, w.model, global_batch=gb)
    first = int(r.note.split("s, ")[-1].split()[0])
    assert first >= 1  # that many plans the belief preferred were skipped


@pytest.mark.slow
@pytest.mark.parametrize("preset,model,gb", [("cpu_hetero4", "llama_tiny", 8), ("hetero2", "llama2_7b", 64)])
def test_search_beats_or_equals_the_unaware_baselines(preset, model, gb):
    c, w = Cluster.load(preset), Workload(LlamaConfig.load(model))
    # 6 iterations are not enough on hetero2; every device at work, as the baselines (subsets can only help)
    se = search(c, w, gb, SearchSettings(iterations=20, use_all_devices=True))
    for name, r in B.run_baselines(c, w, gb, FAST, ("megatron", "galvatron")).items():
        assert r.estimate.feasible, (name, r.note)
        r.plan.validate(c, w.model, global_batch=gb)
        assert se.estimate.iteration_time_s <= r.estimate.iteration_time_s * (1 + 1e-9), name


# ---- symmetric-best, leave-out and uniform-tp: the baselines a user would compare with ----------------
def test_symmetric_best_is_the_best_symmetric_plan_over_every_machine_subset(small7b, straggler):
    from itertools import combinations

    from lightning_hexiscale.planner.search.subsets import devices_of

    c, gb = straggler, 16
    r = B.symmetric_best(c, small7b, gb, FAST)
    r.plan.validate(c, small7b.model, global_batch=gb)
    assert r.plan.meta["planner"] == "symmetric-best" and r.plan.launch_order == tuple(range(5))
    used = set(r.plan.device_order)
    # whole machines, symmetric: equal batches, one TP degree, one stage count
    assert all(set(m.devices) <= used or not (set(m.devices) & used) for m in c.machines)
    assert len({p.batch_size for p in r.plan.pipelines}) == 1
    assert len({s.tp for p in r.plan.pipelines for s in p.stages}) == 1
    assert r.compute_ceiling == pytest.approx(c.flops.sum() / c.flops[sorted(used)].sum())
    # here the best symmetric plan leaves machines out: it is also the best that does
    assert r.plan.idle_devices and r.leaving_out is not None
    assert r.leaving_out.estimate.cost == pytest.approx(r.estimate.cost)
    # no machine subset has a better megatron or galvatron plan (strongest reading)
    for k in range(1, 4):
        for keep in combinations(range(3), k):
            sub = c.subset(list(devices_of(c, list(keep))))
            for fn in (B.megatron, B.galvatron):
                other = fn(sub, small7b, gb, FAST, like_for_like=True, aware=True)
                if other.estimate is not None:
                    assert r.estimate.cost <= other.estimate.cost * (1 + 1e-9), (keep, fn.__name__)
    # and the search is at least as fast
    assert search(c, small7b, gb, FAST).estimate.cost <= r.estimate.cost * (1 + 1e-9)


@pytest.mark.slow
def test_leave_out_is_the_best_plan_of_any_style_that_leaves_a_machine_out(small7b, straggler):
    """Independent reference: the search and the strongest symmetric plans on EVERY strict machine
    subset, enumerated here (leave_out runs the search only on the cluster less one machine per class)."""
    from itertools import combinations

    from lightning_hexiscale.planner.search.subsets import devices_of, lift

    c, gb = straggler, 16
    r = B.leave_out(c, small7b, gb, FAST)
    r.plan.validate(c, small7b.model, global_batch=gb)
    assert r.plan.meta["planner"] == "leave-out" and r.plan.launch_order == tuple(range(c.num_devices))
    used = set(r.plan.device_order)
    left_out = [m for m in range(len(c.machines)) if not set(c.machines[m].devices) & used]
    assert left_out, "a leave-out plan keeps at least one machine idle"
    assert r.estimate.cost == pytest.approx(estimate(r.plan, c, small7b).cost)  # timed on the whole cluster
    best = math.inf
    for k in range(1, len(c.machines)):
        for keep in combinations(range(len(c.machines)), k):
            devs = devices_of(c, list(keep))
            sub = c.subset(list(devs))
            try:
                best = min(best, estimate(lift(search(sub, small7b, gb, FAST).plan, devs, c), c, small7b).cost)
            except InfeasiblePlan:
                pass
            for fn in (B.megatron, B.galvatron):
                other = fn(sub, small7b, gb, FAST, like_for_like=True, aware=True)
                if other.estimate is not None and other.estimate.feasible:
                    best = min(best, estimate(lift(other.plan, devs, c), c, small7b).cost)
    assert r.estimate.cost <= best * (1 + 1e-9)
    # each style alone, and the default is the better of them
    sym = B.leave_out(c, small7b, gb, FAST, style="symmetric")
    assert sym.estimate.cost == pytest.approx(B.symmetric_best(c, small7b, gb, FAST).leaving_out.estimate.cost)
    only = B.leave_out(c, small7b, gb, FAST, style="search")
    assert r.estimate.cost == pytest.approx(min(sym.estimate.cost, only.estimate.cost))
    # the whole cluster's search is never slower than what leaves a machine out
    assert search(c, small7b, gb, FAST).estimate.cost <= r.estimate.cost * (1 + 1e-9)


def test_leave_out_on_one_machine_has_no_plan_and_a_bad_style_is_refused(tiny):
    one = Cluster.from_config({"name": "one", "machines": [{"gpu": "RTX4090", "count": 2, "intra_bandwidth": "32 GB/s"}],
                               "inter_machine": {"bandwidth": "1 GB/s"}})
    r = B.leave_out(one, tiny, 8, FAST)
    assert r.plan is None and "one machine" in r.note
    with pytest.raises(ConfigError, match=r"leave_out\(style\).*search, symmetric or None"):
        B.leave_out(Cluster.load("cpu_hetero4"), tiny, 8, FAST, style="fast")


@pytest.mark.slow
def test_uniform_tp_uses_one_tp_degree_in_every_stage(small7b, straggler):
    c = straggler
    r = B.uniform_tp(c, small7b, 16, FAST)
    r.plan.validate(c, small7b.model, global_batch=16)
    assert len({s.tp for p in r.plan.pipelines for s in p.stages}) == 1
    assert r.plan.meta["planner"] == "uniform-tp" and r.plan.launch_order == tuple(range(5))
    assert r.compute_ceiling >= 1.0
    # a restriction to TP 2: every stage is a TP-2 pair inside a machine; the odd GPUs stay idle
    c = Cluster.load("case_study")
    two = search(c, small7b, 24, SearchSettings(iterations=2, tp_degrees=(2,), use_all_devices=True))
    assert {s.tp for p in two.plan.pipelines for s in p.stages} == {2}
    assert all(len({c.devices[d].machine for d in s.devices}) == 1 for p in two.plan.pipelines for s in p.stages)
    assert len(two.plan.idle_devices) >= 2  # 3 + 3 + 2 GPUs: at least one of each 3-GPU machine


def test_run_baselines_gives_every_plan_its_compute_ceiling(tiny):
    c = Cluster.load("cpu_hetero4")
    res = B.run_baselines(c, tiny, 8, FAST, ("megatron", "symmetric-best"))
    assert res["megatron"].compute_ceiling == pytest.approx(1.0)  # all devices
    assert res["symmetric-best"].compute_ceiling >= 1.0
    with pytest.raises(ConfigError, match="symmetric-best"):
        B.run_baselines(c, tiny, 8, FAST, ("nope",))
    # the old name is refused with both of the names it was split into
    with pytest.raises(ConfigError, match="use symmetric-best .* or leave-out"):
        B.run_baselines(c, tiny, 8, FAST, ("fast-only",))


@pytest.mark.parametrize("name", ["megatron", "galvatron", "symmetric-best"])
def test_a_users_micro_batch_skips_the_dp_degrees_it_does_not_divide(name, tiny):
    """8 devices, global batch 24, micro-batch 2: DP 8 gives replicas of 3 sequences, which 2 does not
    divide. That degree is not a candidate (it used to raise the user's micro-batch as bad input
    from inside the baseline); the others are, and the plan keeps the user's micro-batch."""
    c = Cluster.from_config({"name": "one_by_eight", "machines": [{"gpu": "RTX4090", "count": 8,
                                                                   "intra_bandwidth": "32 GB/s"}],
                             "inter_machine": {"bandwidth": "1 GB/s"}})
    s = SearchSettings(iterations=2, micro_batch_size=2)
    r = B.run_baselines(c, tiny, 24, s, (name,))[name]
    assert r.plan is not None, r.note
    r.plan.validate(c, tiny.model, global_batch=24)
    assert {p.micro_batch_size for p in r.plan.pipelines} == {2}
    assert r.plan.num_pipelines != 8
    with pytest.raises(ConfigError, match="train.micro_batch_size"):  # a size the global batch refuses still is bad input
        B.run_baselines(c, tiny, 24, SearchSettings(iterations=2, micro_batch_size=5), (name,))


@pytest.mark.parametrize("aware", [True, False])
def test_a_space_without_candidates_says_why_not_memory(tiny, aware):
    """7 devices, llama_tiny (4 layers, 4 heads), batch 24: no (dp, tp, pp) of 7 suits Megatron's space
    (24 % 7, 4 % 7, 7 > 4 layers); the note says so instead of "no configuration fits in memory (0 tried)"."""
    c = Cluster.from_config({"name": "seven", "machines": [{"gpu": "RTX4090", "count": 7, "intra_bandwidth": "32 GB/s"}],
                             "inter_machine": {"bandwidth": "1 GB/s"}})
    r = B.megatron(c, tiny, 24, FAST, aware=aware)
    assert r.plan is None
    assert "dp x tp x pp = 7 devices" in r.note and "memory" not in r.note, r.note


def test_candidates_with_no_layer_split_that_fits_are_a_memory_failure():
    """The case study (Llama-2 13B, batch 24), Galvatron as `--baselines` runs it (unaware of the
    heterogeneity): every candidate has a (dp, tp, pp) but no layer split that fits. The note said "no (dp, tp, pp) ... suits the model and batch" (the space was not
    empty: its ignoring-memory figure was priced from those candidates); it is a memory failure."""
    c = Cluster.load("case_study")
    w = Workload(LlamaConfig.load("llama2_13b"))
    r = B.galvatron(c, w, 24, FAST)
    assert r.plan is None and r.ignoring_memory is not None
    assert "no configuration fits in memory" in r.note and "with no layer split that fits" in r.note, r.note
    assert "suits the model" not in r.note, r.note
