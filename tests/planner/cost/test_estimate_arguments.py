"""estimate(plan, cluster, workload) called with a plan for another cluster, an invalid plan or the
wrong types: one error naming the key before any pricing (was an IndexError deep in the cost model,
an AttributeError, or a price for a plan that cannot run)."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate


@pytest.fixture(scope="module")
def four():
    return Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny"))


def _plan(devices=((0,), (1,)), batch=2, micro=1, layers=4) -> Plan:
    return Plan(tuple(Pipeline(batch, micro, (Stage(d, (0, layers)),)) for d in devices), layers)


def test_a_plan_for_a_larger_cluster_names_the_missing_device(four):
    with pytest.raises(PlanError) as ei:  # IndexError: index 4 is out of bounds for axis 0 with size 4
        estimate(_plan(devices=((0,), (4, 5))), *four)
    assert ei.value.key == "plan.pipelines[1].stages[0].devices" and "does not exist" in ei.value.rule


@pytest.mark.parametrize("plan,key", [
    (lambda: _plan(batch=3, micro=2), "plan.pipelines[0].micro_batch_size"),  # priced as 1 micro-batch of 2
    (lambda: _plan(layers=6), "plan.num_layers"),                               # a 6-layer plan priced for 4
])
def test_a_plan_that_cannot_run_is_refused_not_priced(four, plan, key):
    with pytest.raises(PlanError) as ei:
        estimate(plan(), *four)
    assert ei.value.key == key, ei.value


def test_arguments_of_the_wrong_type_are_named(four):
    cluster, workload = four
    for args, key in (((_plan().to_dict(), cluster, workload), "estimate(plan)"),
                      ((_plan(), "cpu_hetero4", workload), "estimate(cluster)"),
                      ((_plan(), cluster, workload.model), "estimate(workload)")):
        with pytest.raises(ConfigError) as ei:  # AttributeError: 'dict' object has no attribute ...
            estimate(*args)
        assert ei.value.key == key, ei.value
    assert estimate(_plan(), cluster, workload).iteration_time_s > 0


def test_a_plan_for_another_model_with_the_same_layer_count_is_refused(four):
    """llama2_7b and llama3_8b both have 32 layers: a plan made for one was priced as the other."""
    import dataclasses

    from lightning_hexiscale.planner.plan import model_shape

    cluster = Cluster.load("hetero1")
    plan = dataclasses.replace(_plan(layers=32), meta={"model": "llama2_7b"})
    w8b = Workload(LlamaConfig.load("llama3_8b"))
    with pytest.raises(PlanError) as ei:
        estimate(plan, cluster, w8b)
    assert ei.value.key == "plan.meta.model" and ei.value.value == "llama2_7b"
    assert "num_kv_heads=32, ffn_hidden_size=11008, vocab_size=32000" in ei.value.rule
    assert "llama3_8b, has num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256" in ei.value.rule
    assert estimate(plan, cluster, Workload(LlamaConfig.load("llama2_7b"))).iteration_time_s > 0
    # the recorded shape wins over the name: a plan made with a model.* override
    m7 = LlamaConfig.load("llama2_7b")
    narrow = dataclasses.replace(m7, ffn_hidden_size=8192)
    made = dataclasses.replace(plan, meta={"model": "llama2_7b", "model_shape": model_shape(narrow)})
    with pytest.raises(PlanError, match=r"made for llama2_7b with ffn_hidden_size=8192.*model.ffn_hidden_size=8192") as ei:
        estimate(made, cluster, Workload(m7))
    assert ei.value.key == "plan.meta.model_shape"
    assert estimate(made, cluster, Workload(narrow)).iteration_time_s > 0
    assert estimate(Plan.from_dict(made.to_dict()), cluster, Workload(narrow)).iteration_time_s > 0  # round trip
    # nothing recorded, or a name that does not load here: not checked (layers and TP degrees still are)
    for meta in ({}, {"model": "my_own_model"}):
        assert estimate(dataclasses.replace(plan, meta=meta), cluster, w8b).iteration_time_s > 0


def test_the_model_a_plan_names_is_loaded_once_not_per_estimate(four, tmp_path, monkeypatch):
    """estimate() checks every plan it prices: a plan naming another model reloaded that model's YAML
    on each call. Now once per name and file version; a file edited in place is read again, and the
    shape handed out is a copy (changing it cannot change the next check)."""
    import dataclasses
    import os

    import yaml

    from lightning_hexiscale.planner.plan import model_check

    loads = []
    real = LlamaConfig.load
    monkeypatch.setattr(LlamaConfig, "load", classmethod(lambda cls, name: loads.append(name) or real(name)))
    cluster, workload = four
    f = tmp_path / "mine.yaml"  # a new path: no earlier test has cached it
    d = {k: v for k, v in workload.model.to_dict().items() if v is not None}
    f.write_text(yaml.safe_dump({**d, "name": "mine"}))
    plan = dataclasses.replace(_plan(), meta={"model": str(f)})
    other = Workload(dataclasses.replace(workload.model, name="tiny_copy"))
    for _ in range(3):
        assert estimate(plan, cluster, other).iteration_time_s > 0
    assert loads == [str(f)]
    shape = model_check.named_model_shape(str(f))
    shape["hidden_size"] = 99  # the caller's copy only
    assert model_check.named_model_shape(str(f))["hidden_size"] == d["hidden_size"] and loads == [str(f)]
    # the file edited in place: the next check reads the new shape
    f.write_text(yaml.safe_dump({**d, "name": "mine", "hidden_size": 2 * d["hidden_size"]}))
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later modification time, on any file system
    with pytest.raises(PlanError, match="hidden_size"):
        estimate(plan, cluster, other)
    assert loads == [str(f), str(f)]
