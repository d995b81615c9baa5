import json

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, Stage

TAB7 = "conf/plans/hetero3_llama30b_tab7.yaml"


def fig1_plan() -> Plan:
    """The paper's Fig. 1 bottom on a toy model: a TP-2 one-stage pipeline next to a 3-stage TP-1 one."""
    return Plan(pipelines=(
        Pipeline(3, 1, (Stage((0, 1), (0, 4)),)),
        Pipeline(1, 1, (Stage((2,), (0, 2)), Stage((3,), (2, 3)), Stage((4,), (3, 4)))),
    ), num_layers=4)


def test_derived_fields():
    p = fig1_plan()
    assert p.global_batch == 4 and p.world_size == 5 and p.device_order == (0, 1, 2, 3, 4)
    assert p.pipelines[0].stages[0].tp == 2 and p.pipelines[1].num_micro_batches == 1
    assert p.rank_of(3) == 3


def test_tab7_plan_validates_and_matches_paper():
    plan = Plan.load(TAB7)
    plan.validate(Cluster.load("hetero3"), LlamaConfig.load("llama_30b"), global_batch=256)
    assert [p.batch_size for p in plan.pipelines] == [80, 64, 64, 48]
    assert [len(p.stages) for p in plan.pipelines] == [1, 4, 4, 8]
    assert plan.pipelines[0].stages[0].tp == 8 and plan.world_size == 56


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_round_trip(tmp_path, suffix):
    plan = Plan.load(TAB7)
    path = tmp_path / f"p{suffix}"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan and again.meta == plan.meta
    if suffix == ".json":
        json.loads(path.read_text())
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("reduce_dtype", [None, "bf16", "fp32"])
def test_reduce_dtype_round_trip(tmp_path, reduce_dtype):
    plan = Plan(fig1_plan().pipelines, 4, reduce_dtype=reduce_dtype).validate()
    plan.save(tmp_path / "p.yaml")
    again = Plan.load(tmp_path / "p.yaml")
    assert again == plan and again.reduce_dtype == reduce_dtype
    assert ("reduce_dtype: fp32" in (tmp_path / "p.yaml").read_text()) == (reduce_dtype == "fp32")
    assert Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "reduce_dtype"}).reduce_dtype is None


def _bad(mutate):
    d = fig1_plan().to_dict()
    mutate(d)
    return Plan.from_dict(d)


@pytest.mark.parametrize("mutate,key,fragment", [
    (lambda d: d["pipelines"][1]["stages"][0].update(devices=[1]), "pipelines[1].stages[0].devices", "already used"),
    (lambda d: d["pipelines"][1]["stages"][1].update(layers=[3, 3]), "pipelines[1].stages[1].layers", "continue at layer 2"),
    (lambda d: d["pipelines"][1]["stages"][2].update(layers=[2, 4]), "pipelines[1].stages[2].layers", "continue at layer 3"),
    (lambda d: d["pipelines"][0]["stages"][0].update(layers=[0, 3]), "pipelines[0].stages", "covers layers 0-2 of 4"),
    (lambda d: d["pipelines"][0].update(micro_batch_size=2), "pipelines[0].micro_batch_size", "must divide"),
    (lambda d: d["pipelines"][0].update(batch_size=0), "pipelines[0].batch_size", "positive integer"),
    (lambda d: d.update(schedule="zigzag"), "plan.schedule", "must be one of"),
    (lambda d: d.update(dp_sharding="zero9"), "plan.dp_sharding", "must be one of"),
    (lambda d: d.update(reduce_dtype="fp16"), "plan.reduce_dtype", "must be one of ('bf16', 'fp32') or null"),
    (lambda d: d.update(pipelines=[]), "plan.pipelines", "at least one pipeline"),
])
def test_validation_errors_name_key_and_rule(mutate, key, fragment):
    with pytest.raises(PlanError) as ei:
        _bad(mutate).validate()
    assert key in str(ei.value) and fragment in str(ei.value) and "Fix:" in str(ei.value)
    assert ei.value.fix not in GENERIC_FIXES, ei.value


GENERIC_FIXES = {"fix it", "fix the file", "fix the plan file", "add it"}
"""Fixes that only restate that something is wrong (they were the fix of some of these errors)."""


def test_validation_against_cluster_model_and_batch():
    plan = fig1_plan()
    with pytest.raises(PlanError, match="does not exist"):
        plan.validate(Cluster.load("cpu_hetero4"))
    tiny = LlamaConfig.load("llama_tiny")  # 4 layers, 2 KV heads
    plan.validate(model=tiny)
    with pytest.raises(PlanError, match="sum to 4"):
        plan.validate(global_batch=5)
    wide = Plan((Pipeline(1, 1, (Stage((0, 1, 2), (0, 4)),)),), 4)
    with pytest.raises(PlanError, match="at least one key/value head per rank"):
        wide.validate(model=tiny)
    with pytest.raises(PlanError, match="has 4 layers"):
        Plan((Pipeline(1, 1, (Stage((0,), (0, 3)),)),), 3).validate(model=tiny)


@pytest.mark.parametrize("text,fragment", [
    ("num_layers: 4\npipelines: [{batch_size: 1, micro_batch_size: 1, stages: [{devices: [0], layers: [0, 4]}], extra: 1}]", "unknown key"),
    ("num_layers: 4\npipelines: [{batch_size: 1, micro_batch_size: 1, stages: [{devices: [0], layers: [0]}]}]", "two integers"),
    ("pipelines: []", "required key is missing"),
    ("- 1\n- 2", "holds a mapping"),
    ("num_layers: [", "not valid YAML"),
])
def test_bad_plan_files(tmp_path, text, fragment):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(PlanError, match=fragment) as ei:
        Plan.load(p)
    assert ei.value.fix not in GENERIC_FIXES, ei.value
    # keyed 'plan', as Cluster.load's errors are 'cluster' (it said '--plan', a flag the caller had not typed)
    with pytest.raises(PlanError, match=r"^plan = '.*missing\.yaml': no such plan file"):
        Plan.load(tmp_path / "missing.yaml")


def test_table_lists_every_stage():
    plan = Plan.load(TAB7)
    t = plan.table(Cluster.load("hetero3"))
    assert "8xA800" in t and t.count("2xRTX3090") == 8 and "global batch 256" in t
    assert len(t.splitlines()) == 3 + sum(len(p.stages) for p in plan.pipelines)


def _with_idle(idle) -> Plan:
    """fig1_plan on devices 0-4 with ``idle`` declared idle."""
    import dataclasses
    return dataclasses.replace(fig1_plan(), idle_devices=tuple(idle))


def test_idle_devices_round_trip_and_launch_order(tmp_path):
    plan = _with_idle([5, 6])
    assert plan.world_size == 5 and plan.launch_order == (0, 1, 2, 3, 4, 5, 6)
    assert fig1_plan().launch_order == fig1_plan().device_order
    path = tmp_path / "p.yaml"
    plan.save(path)
    back = Plan.load(path)
    assert back == plan and back.idle_devices == (5, 6)
    assert "idle_devices" not in fig1_plan().to_dict()  # plans without idle devices read as before
    assert "idle:" in plan.table() and "idle" not in fig1_plan().table()


@pytest.mark.parametrize("idle, words", [([3], "idle and also runs plan.pipelines[1].stages[1]"),
                                         ([5, 5], "listed once"), ([-1], "integers >= 0"),
                                         ([9], "does not exist")])
def test_idle_devices_bad(idle, words):
    cluster = Cluster.load("cpu_hetero8")
    with pytest.raises(PlanError) as e:
        _with_idle(idle).validate(cluster)
    assert e.value.key == "plan.idle_devices" and words in str(e.value)


def test_layer_bounds_may_be_numpy_ints_or_whole_floats():
    """Another tool's plan dict (numpy ints, 4.0 from a JSON writer) loads; a fraction does not."""
    import numpy as np

    d = fig1_plan().to_dict()
    d["pipelines"][0]["stages"][0]["layers"] = [np.int64(x) for x in d["pipelines"][0]["stages"][0]["layers"]]
    d["pipelines"][0]["stages"][-1]["layers"] = [float(x) for x in d["pipelines"][0]["stages"][-1]["layers"]]
    assert Plan.from_dict(d) == fig1_plan()
    d["pipelines"][0]["stages"][0]["layers"][1] = 2.5
    with pytest.raises(PlanError, match=r"layers = .*must be \[start, end\) with two integers"):
        Plan.from_dict(d)


@pytest.mark.parametrize("pipeline,key", [
    ("{batch_size: 1, micro_batch_sizex: 1, stages: [{devices: [0], layers: [0, 4]}]}", "micro_batch_sizex"),  # from_dict
    ("{batch_size: 0, micro_batch_size: 1, stages: [{devices: [0], layers: [0, 4]}]}", "batch_size"),  # validate
])
def test_a_plan_file_error_is_keyed_as_validate_keys_it(tmp_path, pipeline, key):
    """Both checks of a plan file name the key in one form, ``plan.pipelines[i]...`` (the file's
    parse errors were ``<file name>.pipelines[i]...``, its validation errors ``plan.pipelines[i]...``)."""
    p = tmp_path / "mine.yaml"
    p.write_text(f"num_layers: 4\npipelines: [{pipeline}]\n")
    with pytest.raises(PlanError) as ei:
        Plan.load(p).validate()
    assert ei.value.key == f"plan.pipelines[0].{key}", ei.value


@pytest.mark.parametrize("layers,fix", [
    ([(0, 2), (2, 2), (2, 4)], "give it at least one layer (the end is exclusive): layers: [2, 3], up to [2, 4]"),
    ([(0, 2), (3, 4)], "start this stage at 2"),
    ([(0, 4), (4, 4)], "remove this stage: the stages before it run every layer (up to 4)"),
])
def test_an_empty_or_misplaced_stage_is_told_what_to_change(layers, fix):
    """An empty stage [2, 2] that starts where it should was told "start this stage at 2"."""
    stages = tuple(Stage((i,), span) for i, span in enumerate(layers))
    with pytest.raises(PlanError, match="stage layers must be non-empty") as e:
        Plan(pipelines=(Pipeline(1, 1, stages),), num_layers=4).validate()
    assert f"Fix: {fix}" in str(e.value), str(e.value)
