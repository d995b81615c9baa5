"""Subset-aware planning (planner/search/subsets.py): plans that leave devices idle, priced, named and
explained; the plan for a cluster is never slower than the search's plan for any machine subset;
the pruning bounds are sound; ``use_all_devices`` restores every device at work."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, SearchSettings, Stage, Workload, estimate, search
from lightning_hexiscale.planner.oracle.cases import random_case
from lightning_hexiscale.planner.search import subsets as S

FEW = SearchSettings(recompute=True, iterations=3)


# ---- symmetry, bounds, mapping -------------------------------------------------------------------
def test_machine_classes_group_swappable_machines_only(straggler):
    assert S.machine_classes(Cluster.load("case_study")) == [[0], [1], [2]]
    assert S.machine_classes(Cluster.load("hetero1")) == [[0], [1], [2, 3, 4]]
    assert S.machine_classes(Cluster.load("h800_h20_24")) == [[0, 1], [2, 3, 4]]
    # the same GPUs, but one machine pair with a link of its own: fast and fast2 are not swappable
    # with respect to a third machine only if their links to it differ; here they do not
    c = straggler
    assert S.machine_classes(c) == [[0, 2], [1]]
    odd = Cluster.from_config({
        "name": "odd", "machines": [{"name": f"m{i}", "gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"}
                                    for i in range(3)],
        "machine_links": [{"machines": ["m0", "m2"], "bandwidth": "25 GB/s"}],
        "inter_machine": {"bandwidth": "1 GB/s"}})
    # m1 sees m0 and m2 alike, but m0 and m2 see m1 alike too: m0 <-> m2 is a swap; m1 is apart
    assert S.machine_classes(odd) == [[0, 2], [1]]


def test_subset_vectors_cover_every_machine_subset_up_to_symmetry():
    classes = [[0, 2], [1]]
    vecs = S.subset_vectors(classes)
    assert vecs[0] == (2, 1) and len(vecs) == 3 * 2 - 1 and (0, 0) not in vecs
    assert S.machines_of(classes, (1, 1)) == [0, 1]


@pytest.mark.parametrize("seed", [0, 1, 5, 7, 9, 11])
def test_compute_bound_never_exceeds_the_time_of_a_plan(seed):
    """The bound holds for every plan the search produces (its plan, and its plans on each machine
    subset), on random clusters."""
    cluster, workload, batch = random_case(seed)
    rates = S.device_rates(cluster, workload, [1, 2, 4, 8, 16], True)
    cal = cluster.calibration
    theta = (cal.theta_ddp, cal.theta_zero2, cal.theta_zero3_fwd, cal.theta_zero3_bwd)
    try:
        r = search(cluster, workload, batch, SearchSettings(recompute=True, iterations=3, use_all_devices=True))
    except InfeasiblePlan:
        pytest.skip("nothing fits")
    for plan in [r.plan] + [S.lift(x.plan, x.devices, cluster) for x in _subset_plans(cluster, workload, batch)]:
        est = estimate(plan, cluster, workload)
        bound = S.compute_bound(rates, plan.device_order, workload, batch, theta)
        assert bound <= est.iteration_time_s * (1 + 1e-12), (bound, est.iteration_time_s)


def test_compute_bound_is_tight_on_one_device(small7b):
    """Not vacuous: one GPU, no communication, the plan's time is the layers' compute (the bound)
    plus the embedding and LM head."""
    c = Cluster.from_config({"name": "one", "machines": [{"name": "m", "gpu": "A800", "count": 1, "intra_bandwidth": "1 GB/s"}],
                             "inter_machine": {"bandwidth": "1 GB/s"}})
    r = search(c, small7b, 8, FEW)
    rates = S.device_rates(c, small7b, [1, 2, 4, 8], True)
    bound = S.compute_bound(rates, (0,), small7b, 8, (1.0, 1.0, 1.0, 1.0))
    assert bound <= r.estimate.iteration_time_s < 1.2 * bound


class _Found:
    def __init__(self, devices, plan):
        self.devices, self.plan = devices, plan


def _subset_plans(cluster, workload, batch):
    out = []
    for m in range(len(cluster.machines)):
        devices = S.devices_of(cluster, [k for k in range(len(cluster.machines)) if k != m])
        if devices:
            try:
                out.append(_Found(devices, search(cluster.subset(list(devices)), workload, batch,
                                                  SearchSettings(recompute=True, iterations=2, use_all_devices=True)).plan))
            except InfeasiblePlan:
                pass
    return out


def test_memory_possible_agrees_with_what_fits():
    c, w = Cluster.load("case_study"), Workload(LlamaConfig.load("llama2_13b"))
    assert S.memory_possible(c, w, range(8))
    assert not S.memory_possible(c, w, c.machines[2].devices)  # two 24 GiB GPUs for 13B's ~210 GB of state
    with pytest.raises(InfeasiblePlan):
        search(c.subset(list(c.machines[2].devices)), w, 24, SearchSettings(recompute=True, iterations=2, use_all_devices=True))


def test_lift_maps_a_subset_plan_back_and_names_the_rest_idle(straggler):
    c = straggler
    sub = c.subset([0, 1, 3, 4])
    plan = Plan((Pipeline(4, 1, (Stage((0, 1), (0, 2)), Stage((3, 2), (2, 4)))),), 4)
    lifted = S.lift(plan, (0, 1, 3, 4), c)
    assert [s.devices for s in lifted.pipelines[0].stages] == [(0, 1), (4, 3)]
    assert lifted.idle_devices == (2,) and lifted.launch_order == (0, 1, 2, 3, 4)
    assert lifted.meta["cluster"] == "straggler"
    lifted.validate(c)
    assert sub.num_devices == 4


def test_lift_keeps_each_pipelines_recompute_flag(straggler):
    """A plan of ``recompute: auto`` may recompute in one pipeline and not in another; lifted to the
    cluster's ids (the leave-out baseline lifts the search's plan on a machine subset), every
    pipeline came back recomputing (the default of a pipeline without a flag), priced slower."""
    plan = Plan((Pipeline(2, 1, (Stage((0,), (0, 4)),), recompute=False),
                 Pipeline(2, 1, (Stage((1,), (0, 4)),), recompute=True)), 4)
    assert plan.recompute is None
    lifted = S.lift(plan, (0, 3), straggler)
    assert lifted.recomputes == (False, True) and lifted.recompute is None
    assert [p.devices for p in lifted.pipelines] == [(0,), (3,)]


# ---- the search over subsets -----------------------------------------------------------------------
def test_straggler_is_left_idle_and_the_plan_says_why(small7b, straggler):
    c = straggler
    r = search(c, small7b, 16, FEW)
    assert r.plan.idle_devices and 2 in r.plan.idle_devices, r.plan.table(c)
    r.plan.validate(c, small7b.model, global_batch=16)
    assert r.plan.launch_order == tuple(range(c.num_devices))
    assert r.estimate.iteration_time_s == pytest.approx(estimate(r.plan, c, small7b).iteration_time_s)
    # what using them would cost: the best plan found on every device, in meta and in the report
    every = search(c, small7b, 16, SearchSettings(recompute=True, iterations=3, use_all_devices=True))
    assert not every.plan.idle_devices and every.subsets is None
    assert r.subsets.all_devices_s <= every.estimate.iteration_time_s * (1 + 1e-9)
    assert r.plan.meta["all_devices_time_s"] == pytest.approx(r.subsets.all_devices_s)
    assert r.estimate.iteration_time_s < r.subsets.all_devices_s
    assert "faster without them" in r.plan.meta["idle_reason"]
    # the written plan keeps them (a job launched on all five devices knows who stays out)
    again = Plan.from_dict(r.plan.to_dict())
    assert again.idle_devices == r.plan.idle_devices and again.meta["idle_reason"] == r.plan.meta["idle_reason"]


TOLERANCE = 0.97
"""The search's stated tolerance (planner/search/subsets.py): 0.97 of the throughput."""


def test_the_plan_is_never_slower_than_the_search_on_any_machine_subset(small7b, tiny, straggler):
    """The property on every machine subset of two clusters: the search with the same settings on
    each subset (the subset's own plan, itself subset-aware) is never faster, within the tolerance.
    (With ``use_all_devices`` the straggler's plan on all devices is 5x slower than on the fast
    machines: this is the test that catches a search without subsets.)"""
    for c, w, batch in ((straggler, small7b, 16), (Cluster.load("cpu_demo"), tiny, 16)):
        best = search(c, w, batch, FEW)
        assert best.subsets.mode == "exhaustive"
        for k in range(1, len(c.machines)):
            for keep in itertools.combinations(range(len(c.machines)), k):
                devices = S.devices_of(c, list(keep))
                try:
                    sub = search(c.subset(list(devices)), w, batch, FEW)
                except InfeasiblePlan:
                    continue
                assert sub.estimate.cost / best.estimate.cost >= TOLERANCE, (c.name, keep)


def test_worth_gives_the_best_plan_without_each_machine(small7b, straggler):
    c = straggler
    r = search(c, small7b, 16, FEW, worth=True)
    assert set(r.subsets.without) == {0, 1, 2}
    assert r.subsets.without[0] == r.subsets.without[2]  # swappable machines are worth the same
    for m in range(3):
        keep = [k for k in range(3) if k != m]
        try:
            direct = search(c.subset(list(S.devices_of(c, keep))), small7b, 16, FEW).estimate.cost
        except InfeasiblePlan:
            direct = math.inf
        # the best without m is over every subset without m, so never above the search of all the
        # rest (within the tolerance: a trial gets a quarter of the final improvement's budget)
        assert direct / r.subsets.without[m] >= TOLERANCE or direct == r.subsets.without[m] == math.inf
        assert r.subsets.without[m] >= r.estimate.cost * (1 - 1e-9)


def test_greedy_on_clusters_with_many_machine_subsets(small7b):
    """Five different machines (31 subsets > MAX_EXHAUSTIVE): the greedy leaves the slowest out while
    that helps, and never returns worse than every device."""
    gpus = ["A800", "RTX4090", "RTX3090", "L40S", "RTX3080Ti"]
    c = Cluster.from_config({"name": "five", "machines": [
        {"name": f"m{i}", "gpu": g, "count": 1, "intra_bandwidth": "100 GB/s"} for i, g in enumerate(gpus)],
        "inter_machine": {"bandwidth": "0.3 GB/s", "latency": "50us"}})
    r = search(c, small7b, 16, FEW)
    assert r.subsets.mode == "greedy"
    assert r.estimate.cost <= r.subsets.all_devices_s * (1 + 1e-9)
    left = [t.left_out for t in r.subsets.trials if t.left_out]
    assert left and all(4 in out for out in left)  # the 3080Ti machine (slowest) goes first
    r.plan.validate(c, small7b.model, global_batch=16)


def test_large_clusters_price_subsets_by_shrinking_the_best_layout(tiny):
    c = Cluster.load("cpu_hetero8").replicate(9)  # 72 devices: past the searched limit
    r = search(c, tiny, 144, SearchSettings(recompute=True, iterations=3))
    assert r.subsets.mode == "greedy"
    assert {t.status for t in r.subsets.trials[1:]} <= {"shrunk", "bounded", "no memory"}
    r.plan.validate(c, tiny.model, global_batch=144)
    assert r.plan.launch_order == tuple(range(c.num_devices))


def test_shrink_takes_devices_out_and_resplits():
    from lightning_hexiscale.planner.search.two_phase import SearchRun

    w = Workload(LlamaConfig.load("llama_tiny"))
    c = Cluster.load("cpu_hetero4")
    sr = SearchRun(c, w, 8, SearchSettings(recompute=True, iterations=4, use_all_devices=True))
    sr.run()
    cost, plan = sr.without(frozenset({3}))
    assert plan is not None and 3 not in plan.device_order and math.isfinite(cost)
    assert estimate(plan, c, w).iteration_time_s == pytest.approx(cost)
    assert sr.without(frozenset(range(4))) == (math.inf, None)


def test_use_all_devices_restores_every_device_at_work(small7b, straggler):
    c = straggler
    r = search(c, small7b, 16, SearchSettings(recompute=True, iterations=6, use_all_devices=True))
    assert r.plan.world_size == c.num_devices and not r.plan.idle_devices


def test_use_all_devices_is_a_hydra_key_with_a_clear_error():
    cfg = compose(["planner.use_all_devices=true"])
    assert SearchSettings.from_config(cfg).use_all_devices is True
    assert SearchSettings.from_config(compose([])).use_all_devices is False
    with pytest.raises(ConfigError, match="planner.use_all_devices"):
        SearchSettings(recompute=True, use_all_devices="yes")


def test_deterministic_for_a_seed(small7b, straggler):
    c = straggler
    a, b = (search(c, small7b, 16, SearchSettings(recompute=True, iterations=2, seed=3)) for _ in range(2))
    assert a.plan.to_dict() == b.plan.to_dict()


def test_more_devices_than_the_model_can_occupy_leaves_the_rest_idle(tiny):
    """A one-layer model with 2 KV heads at global batch 1 gives work to at most 1 x 1 x 2 = 2
    devices; on one machine of 4 the search refused ("no plan gives every device work") although
    the plan may leave devices idle, and the oracle's optimum uses 2 of them. Now the plan runs on
    the devices that can work and names the others idle; use_all_devices still refuses, saying why."""
    import dataclasses

    c = Cluster.from_config({"name": "one4", "machines": [
        {"name": "m", "gpu": "CPU-FAST", "count": 4, "intra_bandwidth": "10 GB/s"}]})
    w = Workload(dataclasses.replace(tiny.model, num_layers=1))
    r = search(c, w, 1, SearchSettings(iterations=3))
    r.plan.validate(c, w.model, global_batch=1)
    assert r.plan.world_size <= 2 and r.plan.launch_order == (0, 1, 2, 3)
    assert r.estimate.cost == pytest.approx(estimate(r.plan, c, w).cost, rel=1e-12)
    assert "idle_reason" in r.plan.meta
    with pytest.raises(InfeasiblePlan, match="needs at most 2"):
        search(c, w, 1, SearchSettings(iterations=3, use_all_devices=True))


def test_each_subset_is_one_trial_even_when_the_worth_report_asks_for_it_again(small7b):
    """``subsets.trials`` (``hexiscale plan --json``: "every subset tried") listed a subset twice:
    the exhaustive pass found that the small machine alone cannot hold the model ("no memory"), and
    the per-machine report priced the cluster without the big machine, the same subset, again."""
    c = Cluster.from_config({"name": "big_tiny", "inter_machine": {"bandwidth": "1 GB/s"},
                             "gpu_types": {"TINY": {"flops": "10 TFLOPS", "memory": "1100 MiB"}},
                             "machines": [{"name": "big", "gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"},
                                          {"name": "tiny", "gpu": "TINY", "count": 1}]})
    r = search(c, small7b, 8, FEW, worth=True)
    kept = [t.devices for t in r.subsets.trials]
    assert len(kept) == len(set(kept)), r.subsets.trials
    assert r.subsets.without == {0: math.inf, 1: pytest.approx(r.estimate.cost)}  # without big: nothing fits
