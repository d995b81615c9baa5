"""A global batch of 2**70 sequences (a typo, or tokens given as sequences) is a ConfigError naming
its key, from the command line, the strategy's arguments and a plan file: it was an OverflowError
traceback from inside the search (``Python int too large to convert to C long``), and a plan file's
pipeline of that batch was accepted and priced."""

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, Stage
from lightning_hexiscale.planner.plan import MAX_GLOBAL_BATCH

HUGE = 2**70


def test_hexiscale_plan_refuses_a_huge_global_batch(capsys):
    assert main(["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1",
                 f"train.global_batch={HUGE}"]) == 2
    err = capsys.readouterr().err
    assert f"train.global_batch = {HUGE}: must be at most 16,777,216" in err and "Fix:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("kwargs, key", [
    ({"global_batch": HUGE}, "HexiScaleStrategy(global_batch)"),
    ({"global_batch": 8, "micro_batch_size": HUGE}, "HexiScaleStrategy(micro_batch_size)"),
])
def test_the_strategy_refuses_a_huge_batch_at_construction(kwargs, key):
    from lightning_hexiscale import HexiScaleStrategy

    with pytest.raises(ConfigError) as e:
        HexiScaleStrategy(cluster="cpu_hetero4", **kwargs)
    assert e.value.key == key and "at most 16,777,216" in e.value.rule


def test_plan_for_refuses_a_huge_global_batch_before_searching():
    from lightning_hexiscale.lightning.plan_resolution import plan_for
    from lightning_hexiscale.planner import Workload

    with pytest.raises(ConfigError, match=r"train.global_batch = 1180591620717411303424: must be at most"):
        plan_for(None, Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny")), HUGE, {}, key="plan")


def _plan(*batches):
    return Plan(pipelines=tuple(Pipeline(b, 1, (Stage((i,), (0, 4)),)) for i, b in enumerate(batches)), num_layers=4)


@pytest.mark.parametrize("batches, key", [
    ((HUGE, 1), "plan.pipelines[0].batch_size"),
    ((MAX_GLOBAL_BATCH, MAX_GLOBAL_BATCH), "plan.pipelines"),
])
def test_a_plan_with_a_huge_batch_does_not_validate(batches, key):
    with pytest.raises(PlanError) as e:
        _plan(*batches).validate(Cluster.load("cpu_hetero4"), LlamaConfig.load("llama_tiny"))
    assert e.value.key == key and e.value.fix


def test_the_largest_global_batch_still_validates():
    _plan(MAX_GLOBAL_BATCH - 1, 1).validate(Cluster.load("cpu_hetero4"), LlamaConfig.load("llama_tiny"))
