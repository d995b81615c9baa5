"""Plan's Python API refuses arguments of the wrong type with a PlanError naming them:
Plan(meta='abc') was an AttributeError from check_model ('str' object has no attribute 'get'),
Plan(idle_devices=3) a TypeError from validate() (and idle_devices='' passed as none),
plan.validate(cluster='cpu_hetero4') an AttributeError ('str' object has no attribute
'num_devices'), plan.with_recompute(None) a TypeError ('not iterable')."""

import dataclasses

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan

PLAN = Plan.load("tests/bad_configs/good_tiny_plan.yaml")


@pytest.mark.parametrize("changes, key", [
    ({"meta": "abc"}, "plan.meta"),
    ({"meta": [1]}, "plan.meta"),
    ({"idle_devices": 3}, "plan.idle_devices"),
    ({"idle_devices": ""}, "plan.idle_devices"),
    ({"idle_devices": {}}, "plan.idle_devices"),
])
def test_a_plan_field_of_the_wrong_type_is_a_plan_error(changes, key):
    with pytest.raises(PlanError) as e:
        dataclasses.replace(PLAN, **changes)
    assert e.value.key == key and e.value.fix


@pytest.mark.parametrize("kwargs, key", [
    ({"cluster": "cpu_hetero4"}, "Plan.validate(cluster)"),
    ({"cluster": 4}, "Plan.validate(cluster)"),
    ({"model": "llama_tiny"}, "Plan.validate(model)"),
    ({"model": {}}, "Plan.validate(model)"),
])
def test_validate_names_an_argument_of_the_wrong_type(kwargs, key):
    with pytest.raises(PlanError) as e:
        PLAN.validate(**kwargs)
    assert e.value.key == key and e.value.fix


@pytest.mark.parametrize("flags", [None, 1, "yes", 0.5])
def test_with_recompute_refuses_what_is_no_flag(flags):
    with pytest.raises(PlanError) as e:
        PLAN.with_recompute(flags)
    assert e.value.key == "recompute"


def test_good_arguments_still_validate():
    PLAN.validate(Cluster.load("cpu_hetero4"), LlamaConfig.load("llama_tiny"))
    assert dataclasses.replace(PLAN, idle_devices=[], meta=None).with_recompute([True, False]).recomputes == (True, False)
