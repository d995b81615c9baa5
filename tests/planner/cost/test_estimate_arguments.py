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
