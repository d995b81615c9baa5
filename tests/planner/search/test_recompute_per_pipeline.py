"""``recompute: auto`` decided per pipeline (issue 40, item 3): next to a roomy A800 pipeline that
runs without recomputation, a 24 GiB RTX 4090 pipeline recomputes (planner/search/recompute.py);
the plan file carries the flag per pipeline and still reads the old top-level one; an explicit
True / False sets every pipeline."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, SearchSettings, Stage, Workload, estimate, search
from lightning_hexiscale.planner.search.assemble import batch_micro_sizes
from lightning_hexiscale.planner.search.batching import BatchTimer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # datasheet pricing of both types


@pytest.fixture(scope="module")
def a800_4090() -> Cluster:
    """Device 0: an 80 GiB A800; device 1: a 24 GiB RTX 4090 on another machine."""
    return Cluster.from_config({"name": "a800_4090", "machines": [
        {"name": "a", "gpu": "A800", "count": 1, "intra_bandwidth": "200 GB/s"},
        {"name": "b", "gpu": "RTX4090", "count": 1, "intra_bandwidth": "32 GB/s"}],
        "inter_machine": {"bandwidth": "25 GB/s", "latency": "10us"}})


@pytest.fixture(scope="module")
def long_seq(a800_4090) -> Workload:
    """8 layers of Llama-3.2-1B at 16,384 tokens: one sequence's activations need ~35 GiB without
    recomputation (the A800 holds them, the 4090 does not), ~24 GiB with it (the 4090 fits)."""
    model = dataclasses.replace(LlamaConfig.load("llama3_2_1b"), seq_len=16384, num_layers=8)
    return Workload.for_cluster(model, a800_4090, "bf16-mixed")


def two_pipelines(flags: bool | None = None, pipe_flags=(None, None)) -> Plan:
    """One single-device pipeline per device, batch 1 each."""
    pipes = tuple(Pipeline(1, 1, (Stage((d,), (0, 8)),), f) for d, f in zip((0, 1), pipe_flags))
    return Plan(pipes, 8, recompute=flags)


def test_the_premise_one_pipeline_fits_without_recomputation_and_one_does_not(a800_4090, long_seq):
    off = estimate(two_pipelines(False), a800_4090, long_seq)
    assert [o.device for o in off.out_of_memory] == [1]  # the 4090 only
    assert estimate(two_pipelines(True), a800_4090, long_seq).feasible


def test_the_cost_model_prices_each_pipeline_with_its_own_flag(a800_4090, long_seq):
    """Pipeline i of a mixed plan costs what it costs in the uniform plan with its flag: time,
    compute, TP traffic and peak memory (nothing of one pipeline's flag reaches another's price)."""
    mixed = estimate(two_pipelines(None, (False, True)), a800_4090, long_seq)
    alike = {r: estimate(two_pipelines(r), a800_4090, long_seq) for r in (False, True)}
    for i, r in enumerate((False, True)):
        got, want = mixed.pipelines[i], alike[r].pipelines[i]
        assert got.time_s == pytest.approx(want.time_s)
        assert got.stages[0].compute_s == pytest.approx(want.stages[0].compute_s)
        assert got.stages[0].peak_memory_bytes == pytest.approx(want.stages[0].peak_memory_bytes)
    assert mixed.feasible and mixed.iteration_time_s < alike[True].iteration_time_s * (1 + 1e-12)


def test_each_pipeline_decides_on_a_fixed_layout(a800_4090, long_seq):
    from lightning_hexiscale.planner.search.recompute import per_pipeline, recompute_each, turn_off_where_fits

    layout = two_pipelines(True)
    timer = BatchTimer(a800_4090, long_seq, 2, batch_micro_sizes(2, None, 2))
    cost, plan = recompute_each(timer, layout)
    assert plan.recomputes == (False, True) and plan.recompute is None
    est = estimate(plan, a800_4090, long_seq)
    assert est.feasible and est.iteration_time_s == pytest.approx(cost)
    # the same answer past the exact split's size: flags turned off where the batches still fit
    assert turn_off_where_fits(layout, a800_4090, long_seq).recomputes == (False, True)
    mixed, mixed_est = per_pipeline(a800_4090, long_seq, 2, None, layout)
    assert mixed.recomputes == (False, True) and mixed_est.feasible
    # the A800's pipeline runs faster without (one forward per layer less)
    on = estimate(layout, a800_4090, long_seq)
    assert mixed_est.pipelines[0].time_s < on.pipelines[0].time_s


def test_auto_search_gives_false_true_and_beats_both_uniform_searches(a800_4090, long_seq):
    few = dict(iterations=4, progress=False, use_all_devices=True)
    auto = search(a800_4090, long_seq, 4, SearchSettings(**few))
    plan = auto.plan
    by_device = {p.stages[0].devices: p.recompute for p in plan.pipelines}
    assert by_device == {(0,): False, (1,): True}, plan.table(a800_4090)
    assert auto.estimate.feasible and plan.meta["recompute"].startswith("auto: per pipeline"), plan.meta
    assert estimate(plan, a800_4090, long_seq).iteration_time_s == pytest.approx(auto.estimate.iteration_time_s)
    for pinned in (False, True):  # an explicit setting wins: every pipeline alike
        r = search(a800_4090, long_seq, 4, SearchSettings(recompute=pinned, **few))
        assert set(r.plan.recomputes) == {pinned} and r.plan.recompute is pinned
        assert auto.estimate.iteration_time_s < r.estimate.iteration_time_s


def test_an_explicit_flag_sets_every_pipeline():
    mixed = two_pipelines(None, (False, True))
    assert mixed.recompute is None and mixed.recomputes == (False, True)
    assert dataclasses.replace(mixed, recompute=True).recomputes == (True, True)  # a user's override
    assert mixed.with_recompute(False).recomputes == (False, False)
    assert two_pipelines(None).recomputes == (True, True)  # no flag anywhere: the old default
    with pytest.raises(PlanError, match="one flag per pipeline"):
        mixed.with_recompute([True])


def test_yaml_round_trip_writes_the_flags_per_pipeline_only_when_they_differ(tmp_path):
    mixed = two_pipelines(None, (False, True))
    doc = mixed.to_dict()
    assert "recompute" not in doc and [p["recompute"] for p in doc["pipelines"]] == [False, True]
    path = tmp_path / "plan.yaml"
    mixed.save(path)
    back = Plan.load(path)
    assert back == mixed and back.recomputes == (False, True)
    uniform = two_pipelines(False).to_dict()  # the old format, unchanged
    assert uniform["recompute"] is False and all("recompute" not in p for p in uniform["pipelines"])
    assert "recompute per pipeline: off, on" in mixed.table() and "recompute off" in two_pipelines(False).table()


def test_an_old_plan_file_with_one_top_level_flag_loads_for_every_pipeline():
    text = """
num_layers: 8
recompute: false
pipelines:
  - {batch_size: 1, micro_batch_size: 1, stages: [{devices: [0], layers: [0, 8]}]}
  - {batch_size: 1, micro_batch_size: 1, stages: [{devices: [1], layers: [0, 8]}]}
"""
    plan = Plan.from_dict(yaml.safe_load(text))
    assert plan.recomputes == (False, False) and plan.recompute is False
    # the top-level flag is the default of a pipeline that has none of its own
    doc = yaml.safe_load(text)
    doc["pipelines"][1]["recompute"] = True
    assert Plan.from_dict(doc).recomputes == (False, True)


@pytest.mark.parametrize("where", ["top", "pipeline"])
def test_a_flag_that_is_not_a_bool_names_its_key(where):
    doc = two_pipelines(True).to_dict()
    if where == "top":
        doc["recompute"] = "auto"
        key = "plan.recompute"
    else:
        doc["pipelines"][1]["recompute"] = "yes"
        key = "plan.pipelines[1].recompute"
    with pytest.raises(PlanError) as e:
        Plan.from_dict(doc)
    assert e.value.key == key and "true or false" in str(e.value)
