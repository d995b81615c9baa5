"""Hand-written plans (files and Python) with values of the wrong type: one PlanError naming the key."""

import copy

import pytest

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.planner import Pipeline, Plan, Stage

BASE = {"num_layers": 4, "pipelines": [
    {"batch_size": 8, "micro_batch_size": 2, "stages": [{"devices": [0], "layers": [0, 2]}, {"devices": [1], "layers": [2, 4]}]},
    {"batch_size": 8, "micro_batch_size": 2, "stages": [{"devices": [2, 3], "layers": [0, 4]}]},
]}


def _set(path, value) -> dict:
    d = copy.deepcopy(BASE)
    o = d
    for k in path[:-1]:
        o = o[k]
    o[path[-1]] = value
    return d


@pytest.mark.parametrize("path,value,key", [
    (["num_layers"], 4.0, "plan.num_layers"),          # accepted, a float layer count in the plan
    (["num_layers"], "4", "plan.num_layers"),          # was blamed on pipelines[0].stages
    (["num_layers"], True, "plan.num_layers"),
    (["num_layers"], 0, "plan.num_layers"),
    (["pipelines"], 5, "plan.pipelines"),              # TypeError: 'int' object is not iterable
    (["pipelines"], "abc", "plan.pipelines"),
    (["pipelines", 0, "stages"], 3, "plan.pipelines[0].stages"),
    (["pipelines", 0, "stages"], {"devices": [0], "layers": [0, 4]}, "plan.pipelines[0].stages"),
    (["pipelines", 0, "micro_batch_size"], True, "plan.pipelines[0].micro_batch_size"),  # accepted as 1
    (["pipelines", 0, "batch_size"], True, "plan.pipelines[0].batch_size"),
    (["pipelines", 0, "stages", 0, "devices"], [False], "plan.pipelines[0].stages[0].devices"),  # ran device 0
])
def test_wrong_types_in_a_plan_file_name_their_key(path, value, key):
    with pytest.raises(PlanError) as ei:
        Plan.from_dict(_set(path, value)).validate()
    assert ei.value.key == key and ei.value.value == value, ei.value


def _one(stage) -> Plan:
    return Plan(pipelines=(Pipeline(2, 1, (stage,)),), num_layers=4)


@pytest.mark.parametrize("plan,key", [
    (lambda: Plan(pipelines=({"batch_size": 2},), num_layers=4), "plan.pipelines[0]"),       # AttributeError
    (lambda: Plan(pipelines=(Pipeline(2, 1, ({"devices": [0]},)),), num_layers=4), "plan.pipelines[0].stages[0]"),
    (lambda: _one(Stage((0,), (0, 2, 4))), "plan.pipelines[0].stages[0].layers"),            # ValueError: unpack
    (lambda: _one(Stage((0,), (0, 4.0))), "plan.pipelines[0].stages[0].layers"),             # accepted
    (lambda: _one(Stage(0, (0, 4))), "plan.pipelines[0].stages[0].devices"),                 # value [], 'no device'
])
def test_plans_built_in_python_with_wrong_parts_name_their_key(plan, key):
    built = plan()
    with pytest.raises(PlanError) as ei:
        built.validate()
    assert ei.value.key == key, ei.value
    part = built.pipelines[0]
    for name in key.split(".")[2:]:  # the error shows the value the plan holds at that key
        part = part.stages[0] if name == "stages[0]" else getattr(part, name)
    assert ei.value.value == part, ei.value


def test_a_plan_built_from_lists_equals_its_file_and_prices():
    """Lists where the dataclasses annotate tuples (as a client writes them) are held as tuples: the
    plan equals its YAML round trip and hashes, which the cost model's caches need (it raised
    TypeError: unhashable type: 'list' from dp_comm.py); None for idle_devices / meta means none."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.planner import estimate, workload_from_config

    cfg = compose(["cluster=cpu_hetero4", "model=llama_tiny"])
    cluster, workload = Cluster.from_config(cfg.cluster), workload_from_config(cfg)
    n = workload.model.num_layers
    listed = Plan(pipelines=[Pipeline(4, 1, [Stage([0], [0, n // 2]), Stage([1], [n // 2, n])]),
                             Pipeline(4, 1, [Stage([2], [0, n])])], num_layers=n, idle_devices=[3], meta=None)
    assert listed == Plan.from_dict(listed.to_dict()) == Plan.from_dict(__import__("yaml").safe_load(listed.to_yaml()))
    assert hash(listed) == hash(Plan.from_dict(listed.to_dict())) and listed.meta == {}
    assert estimate(listed.validate(cluster, workload.model, 8), cluster, workload).feasible in (True, False)
    assert Plan(pipelines=(Pipeline(2, 1, (Stage((0,), (0, n)),)),), num_layers=n, idle_devices=None).idle_devices == ()
    with pytest.raises(PlanError) as ei:
        Plan(pipelines=None, num_layers=n)  # TypeError: 'NoneType' object is not iterable
    assert ei.value.key == "plan.pipelines"


def test_a_stage_past_the_last_layer_is_told_to_end_there():
    """It was blamed on the pipeline with 'Fix: extend its last stage to layer 4' for layers [2, 6]."""
    with pytest.raises(PlanError) as ei:
        Plan.from_dict(_set(["pipelines", 0, "stages", 1, "layers"], [2, 6])).validate()
    assert ei.value.key == "plan.pipelines[0].stages[1].layers" and ei.value.value == [2, 6], ei.value
    assert "[2, 4]" in ei.value.fix and "extend" not in ei.value.fix, ei.value


def test_save_writes_what_the_suffix_says_with_numpy_in_meta(tmp_path):
    """A .JSON path was written as YAML (a JSON reader refused it); numpy values in meta (a client's
    timings) made save() raise RepresenterError (YAML) / 'int64 is not JSON serializable'."""
    import json

    import numpy as np

    plan = Plan.from_dict(BASE)
    plan = Plan(plan.pipelines, plan.num_layers, meta={"time_s": np.float64(1.5), "seed": np.int64(3), "ids": (1, 2)})
    for name in ("plan.JSON", "plan.json", "plan.yaml"):
        plan.save(tmp_path / name)
        back = Plan.load(tmp_path / name)
        assert back == plan and back.meta == {"time_s": 1.5, "seed": 3, "ids": [1, 2]}
    assert json.loads((tmp_path / "plan.JSON").read_text())["meta"]["seed"] == 3


def test_json_is_strict_with_a_non_finite_meta_value(tmp_path):
    """meta={'time_s': inf} was written as the token Infinity, which strict JSON parsers refuse."""
    import json

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    plan = Plan.from_dict(BASE)
    plan = Plan(plan.pipelines, plan.num_layers, meta={"time_s": float("inf"), "gap": [float("nan"), 1.0]})
    plan.save(tmp_path / "plan.json")
    meta = json.loads((tmp_path / "plan.json").read_text(), parse_constant=refuse)["meta"]
    assert meta == {"time_s": None, "gap": [None, 1.0]}
    plan.save(tmp_path / "plan.yaml")  # YAML has .inf
    assert Plan.load(tmp_path / "plan.yaml").meta["time_s"] == float("inf")


@pytest.mark.parametrize("text,key", [
    # a second pipelines: block (a user appending a pipeline) replaced the first: plan of device 1 only
    ("num_layers: 4\npipelines:\n  - {batch_size: 2, micro_batch_size: 1, stages: [{devices: [0], layers: [0, 4]}]}\n"
     "pipelines:\n  - {batch_size: 2, micro_batch_size: 1, stages: [{devices: [1], layers: [0, 4]}]}\n", "pipelines"),
    ('{"num_layers": 4, "pipelines": [{"batch_size": 2, "batch_size": 4, "micro_batch_size": 1, '
     '"stages": [{"devices": [0], "layers": [0, 4]}]}]}', "batch_size"),  # JSON: ran batch 4
])
def test_a_key_given_twice_is_refused_not_overwritten(tmp_path, text, key):
    path = tmp_path / ("p.json" if text.startswith("{") else "p.yaml")
    path.write_text(text)
    with pytest.raises(PlanError, match=f"key '{key}' is given twice") as caught:
        Plan.load(path)
    assert f'in "{path}", line' in str(caught.value)  # the file by its path, not "<unicode string>"
    # YAML merge keys still read: explicit keys override what '<<' brings in
    path.write_text("num_layers: 4\npipelines:\n  - &p {batch_size: 2, micro_batch_size: 1, stages: [{devices: [0], "
                    "layers: [0, 4]}]}\n  - {<<: *p, batch_size: 4, stages: [{devices: [1], layers: [0, 4]}]}\n")
    assert [p.batch_size for p in Plan.load(path).pipelines] == [2, 4]
