"""The planner's Python API called with wrong arguments, as a user's script would: each is a ConfigError
(or PlanError) naming the call's argument, the value, the rule and the fix, never a TypeError /
AttributeError / ValueError from deep inside, nor a silent reading of the value."""

import pytest

from lightning_hexiscale.config import Cluster
from lightning_hexiscale.errors import ConfigError, PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload


@pytest.fixture(scope="module")
def plan():
    # devices 0 and 2 run a stage each, 1 is idle, 3 is not in the plan
    return Plan(num_layers=4, pipelines=(Pipeline(2, 1, (Stage((0,), (0, 4)),)), Pipeline(2, 1, (Stage((2,), (0, 4)),))),
                idle_devices=(1,))


@pytest.mark.parametrize("device", [1, 3, -1, "0", None, True])
def test_rank_of_a_device_that_runs_no_stage(plan, device):
    # was tuple.index's "ValueError: tuple.index(x): x not in tuple" (and True was device 1's rank)
    with pytest.raises(PlanError, match=r"Plan.rank_of\(device\) = .*runs no stage of this plan: its stages run "
                                        r"devices \[0, 2\] \(idle: \[1\]\)\. Fix: pass one of the plan's device ids"):
        plan.rank_of(device)
    assert plan.rank_of(2) == 1


@pytest.mark.parametrize("model", ["llama_tiny", None, {"num_layers": 4}])
def test_check_model_takes_a_llama_config(plan, model):
    # was AttributeError: 'str' object has no attribute 'name'
    with pytest.raises(PlanError, match=r"Plan.check_model\(model\) = .*it must be a LlamaConfig\. Fix: pass a "
                                        r"LlamaConfig: LlamaConfig.load"):
        plan.check_model(model)
    plan.check_model(LlamaConfig.load("llama_tiny"))


@pytest.mark.parametrize("cluster", ["cpu_hetero4", 3])
def test_table_takes_a_cluster(plan, cluster):
    # was AttributeError: 'str' object has no attribute 'num_devices'
    with pytest.raises(PlanError, match=r"Plan.table\(cluster\) = .*it must be a Cluster or None\. Fix: pass a Cluster"):
        plan.table(cluster)
    assert "1xCPU-SLOW [2]" in plan.table(Cluster.load("cpu_hetero4"))


@pytest.mark.parametrize("path", [None, 3, ""])
def test_save_takes_a_path(plan, path, tmp_path, monkeypatch):
    # None / 3 were pathlib's "TypeError: expected str, bytes or os.PathLike object"; "" wrote nothing useful
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"Plan.save\(path\) = .*must be the path of a file"):
        plan.save(path)
    assert list(tmp_path.iterdir()) == []


def test_workload_for_cluster_takes_a_cluster():
    # was AttributeError: 'str' object has no attribute 'devices'
    with pytest.raises(ConfigError, match=r"Workload.for_cluster\(cluster\) = 'cpu_hetero4': is of type str; it must "
                                          r"be a Cluster\. Fix: pass a Cluster: Cluster.load"):
        Workload.for_cluster(LlamaConfig.load("llama_tiny"), "cpu_hetero4")


@pytest.mark.parametrize("gpu_types", ["CPU", [], None, [3]])
def test_workload_for_devices_takes_a_list_of_type_names(gpu_types):
    # 'CPU' was read one letter a device (types C, P, U), so the workload of a CPU run was priced as CUDA
    # (bf16-mixed, NCCL buffers) without a word; [] was a CUDA workload too
    with pytest.raises(ConfigError, match=r"Workload.for_devices\(gpu_types\) = .*must be a non-empty list of device "
                                          r"type names"):
        Workload.for_devices(LlamaConfig.load("llama_tiny"), gpu_types)
    assert Workload.for_devices(LlamaConfig.load("llama_tiny"), ["CPU"]).device == "cpu"


@pytest.mark.parametrize("worth", ["x", 1, None])
def test_search_worth_takes_a_bool(worth):
    # was read as truthy or falsy: "x" and 1 ran the per-machine searches, None skipped them
    from lightning_hexiscale.planner import search
    cluster = Cluster.load("cpu_hetero4")
    with pytest.raises(ConfigError, match=r"search\(worth\) = .*is of type \w+; it must be a bool\. Fix: pass worth=True"):
        search(cluster, Workload(LlamaConfig.load("llama_tiny")), 8, worth=worth)
