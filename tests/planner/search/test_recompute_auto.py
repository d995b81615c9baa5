"""``recompute: auto`` (the default): the planner prices a plan without and with activation
recomputation and keeps the faster one that fits (planner/search/recompute.py: auto_recompute); an
explicit True / False still wins. Before, recomputation was a config default (on), which cost one
H200 running Llama-3.2-1B at global batch 8 x 2048 about a fifth of its speed for memory it did not need."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan, PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, SearchSettings, Workload, estimate, search

FEW = dict(iterations=4, progress=False)


def one_device(gpu: str, memory: str | None = None) -> Cluster:
    """One device of the catalog's ``gpu`` (its memory replaced by ``memory`` when given)."""
    doc = {"name": f"one_{gpu}", "machines": [{"name": "m0", "gpu": gpu, "count": 1, "intra_bandwidth": "900 GB/s"}]}
    if memory is not None:
        doc["gpu_types"] = {gpu: {"memory": memory}}
    return Cluster.from_config(doc)


def llama1b(seq_len: int) -> LlamaConfig:
    return dataclasses.replace(LlamaConfig.load("llama3_2_1b"), seq_len=seq_len)


def test_one_h200_llama3_2_1b_batch_8x2048_plans_without_recomputation():
    c = one_device("H200")
    assert c.devices[0].memory_bytes >= 139 * 2**30  # the catalog's H200 (141 GB HBM3e)
    w = Workload.for_cluster(llama1b(2048), c, "bf16-mixed")
    r = search(c, w, 8, SearchSettings(**FEW))
    assert r.plan.recompute is False and r.estimate.feasible
    assert r.plan.meta["recompute"].startswith("auto: off"), r.plan.meta
    # it is the faster of the two, and the same plan with recomputation costs more time
    pinned = search(c, w, 8, SearchSettings(recompute=True, **FEW))
    assert pinned.plan.recompute is True
    assert r.estimate.iteration_time_s < pinned.estimate.iteration_time_s
    # the micro-batch size is the planner's too (none was fixed): one micro-batch of all 8 fits
    assert r.plan.pipelines[0].micro_batch_size == 8


def test_tight_memory_plans_with_recomputation():
    """Llama-3.2-1B at 8192 tokens on one 32 GiB device: without recomputation one sequence's
    activations alone overflow it (37 GiB), with it the plan fits (26 GiB)."""
    c = one_device("H100", memory="32 GiB")
    w = Workload.for_cluster(llama1b(8192), c, "bf16-mixed")
    with pytest.raises(InfeasiblePlan):
        search(c, w, 2, SearchSettings(recompute=False, **FEW))
    r = search(c, w, 2, SearchSettings(**FEW))
    assert r.plan.recompute is True and r.estimate.feasible
    assert r.plan.meta["recompute"].startswith("auto: on (without inf s"), r.plan.meta
    assert estimate(r.plan, c, w).iteration_time_s == pytest.approx(r.estimate.iteration_time_s)


def test_an_explicit_setting_wins():
    c = one_device("H200")
    w = Workload.for_cluster(llama1b(2048), c, "bf16-mixed")
    r = search(c, w, 8, SearchSettings(recompute=True, **FEW))
    assert r.plan.recompute is True and "recompute" not in r.plan.meta


def test_auto_is_the_default_of_the_config_and_bad_values_name_the_key():
    assert SearchSettings().recompute == "auto"
    assert SearchSettings.from_config(compose([])).recompute == "auto"
    assert SearchSettings.from_config(compose(["train.recompute=false"])).recompute is False
    assert SearchSettings.from_config(compose(["train.recompute=true"])).recompute is True
    with pytest.raises(ConfigError) as e:
        SearchSettings.from_config(compose(["train.recompute=maybe"]))
    assert e.value.key == "train.recompute" and "auto, true or false" in str(e.value)
    with pytest.raises(ConfigError, match="train.recompute"):
        SearchSettings(recompute="yes")


def test_a_plan_file_says_true_or_false():
    doc = {"num_layers": 2, "recompute": "auto", "pipelines": [
        {"batch_size": 1, "micro_batch_size": 1, "stages": [{"devices": [0], "layers": [0, 2]}]}]}
    with pytest.raises(PlanError) as e:
        Plan.from_dict(doc)
    assert e.value.key == "plan.recompute" and "true or false" in str(e.value)


def test_the_strategy_default_lets_the_planner_decide():
    """``HexiScaleStrategy(recompute=None)`` (its default) searches with auto; True pins it."""
    from lightning_hexiscale.lightning.plan_resolution import search_plan

    c = one_device("H200")
    w = Workload.for_cluster(llama1b(2048), c, "bf16-mixed")
    plan, _ = search_plan(c, w, 8, {"recompute": None}, iterations=3)
    assert plan.recompute is False and plan.meta["recompute"].startswith("auto")
    plan, _ = search_plan(c, w, 8, {"recompute": True}, iterations=3)
    assert plan.recompute is True


@pytest.mark.parametrize("recompute", [False, True, "auto"])
def test_activations_that_do_not_fit_offer_recomputation_only_where_it_was_not_tried(recompute):
    """Two 1050 MiB devices (52 MiB past the reserve) hold the states of 8 layers at 4,096 tokens but
    not their activations, with or without recomputation. The fix offered train.recompute=true under
    recompute=true and auto too, where every plan tried already recomputed."""
    model = LlamaConfig(name="t", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=1, ffn_hidden_size=128,
                        vocab_size=128, seq_len=4096)
    cluster = Cluster.from_config({"name": "c", "gpu_types": {"T": {"flops": "1 TFLOPS", "memory": "1050 MiB"}},
                                   "machines": [{"name": "m", "gpu": "T", "count": 2, "intra_bandwidth": "2 GB/s"}]})
    with pytest.raises(InfeasiblePlan, match="the states fit, the activations do not") as e:
        search(cluster, Workload.from_precision(model, "32-true", device="cpu"), 4,
               SearchSettings(recompute=recompute, **FEW))
    tried = recompute is not False
    assert ("train.recompute=true" in str(e.value)) is not tried, str(e.value)
    assert ("even with recomputation" in str(e.value)) is tried, str(e.value)
