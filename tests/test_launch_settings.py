"""``hexiscale train`` on GPUs: the Trainer's devices / num_nodes from the launcher that started the
job, and the launch commands of the "cannot launch here" message.

srun sets no WORLD_SIZE: every srun launch used to fall through to "cannot launch here", the message
that recommends srun. Lightning's SLURM environment takes ``devices`` from ``--ntasks-per-node`` and
``num_nodes`` from ``--nodes`` and refuses ``--ntasks`` alone, so the printed srun command is written
in those flags (and only where every machine has as many GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hexiscale.cli.train_job import HEXISCALE
from lightning_hexiscale.cli.train_plan import HardwareMissing, hardware_message, launch_settings, launched_world
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner import Pipeline, Plan, Stage

LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NAME")


def _cluster(*counts: int) -> Cluster:
    return Cluster.from_config({
        "name": "gpus", "machines": [{"name": f"m{i}", "gpu": "A100-80G", "count": c, "intra_bandwidth": "300 GB/s"}
                                     for i, c in enumerate(counts)],
        "inter_machine": {"bandwidth": "10 GB/s"}})


def _plan_on(devices: int) -> Plan:
    """One pipeline per device, each with the whole 2-layer model."""
    return Plan(pipelines=tuple(Pipeline(batch_size=1, micro_batch_size=1, stages=(Stage(devices=(d,), layers=(0, 2)),))
                                for d in range(devices)), num_layers=2)


@pytest.fixture
def gpus(monkeypatch):
    """This host seen with N CUDA GPUs, and no launcher in its environment."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)

    def have(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
        return monkeypatch

    return have


def test_srun_on_two_nodes_launches_with_its_tasks_per_node(gpus):
    env = gpus(4)
    for k, v in {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}.items():
        env.setenv(k, v)
    got = launch_settings(_cluster(4, 4), _plan_on(8), Path("plan.yaml"), HEXISCALE)
    assert got == {"accelerator": "gpu", "devices": 4, "num_nodes": 2}


def test_torchrun_launch_keeps_its_world_and_local_world(gpus):
    env = gpus(4)
    for k, v in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}.items():
        env.setenv(k, v)
    got = launch_settings(_cluster(2, 2, 2), _plan_on(6), Path("plan.yaml"), HEXISCALE)
    assert got == {"accelerator": "gpu", "devices": 2, "num_nodes": 3}


def test_srun_with_ntasks_alone_is_refused_with_the_flags_lightning_takes(gpus):
    env = gpus(4)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2"}.items():
        env.setenv(k, v)
    with pytest.raises(HardwareMissing, match=r"srun started 8 tasks on 2 node\(s\) without --ntasks-per-node.*"
                                              r"Fix: srun --nodes=2 --ntasks-per-node="):
        launch_settings(_cluster(4, 4), _plan_on(8), Path("plan.yaml"), HEXISCALE)


def test_a_job_of_another_size_gets_the_message_and_one_task_needs_no_flag(gpus):
    env = gpus(4)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1"}.items():
        env.setenv(k, v)
    with pytest.raises(HardwareMissing, match="the plan runs 8 processes"):
        launch_settings(_cluster(4, 4), _plan_on(8), Path("plan.yaml"), HEXISCALE)
    assert launched_world(4, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (1, 1, 1)
    assert launched_world(4, {}) is None


def test_the_message_prints_srun_in_lightnings_flags_only_for_equal_machines(gpus):
    gpus(0)
    even = hardware_message(_cluster(4, 4), _plan_on(8), 0, Path("p.yaml"), HEXISCALE)
    assert "srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 hexiscale train" in even, even
    assert "--ntasks=" not in even and "--gpus-per-task" not in even
    uneven = hardware_message(_cluster(2, 4), _plan_on(6), 0, Path("p.yaml"), HEXISCALE)
    assert "srun --nodes" not in uneven and "these machines have 2, 4 GPUs" in uneven, uneven
    assert "torchrun --nnodes=2" in uneven


@pytest.mark.parametrize("env,launcher,want", [
    # an interactive allocation (srun --pty bash, or a job named interactive): Lightning launches the
    # processes itself, so the plan's devices on this machine are launched as without SLURM
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"}, None, None),
    ({"SLURM_NTASKS": "8", "SLURM_JOB_NAME": "interactive", "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4",
      "LOCAL_WORLD_SIZE": "4"}, "torchrun", (4, 4, 1)),
    # torchrun inside a batch job: Lightning looks for SLURM first, and so does the recipe
    ({"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "job",
      "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, "slurm", (2, 2, 1)),
])
def test_the_launcher_is_the_one_lightning_detects(gpus, env, launcher, want):
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    monkeypatch = gpus(4)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launched_world(4) == want
    lightning_sees = "slurm" if SLURMEnvironment.detect() else "torchrun" if TorchElasticEnvironment.detect() else None
    assert lightning_sees == launcher


def test_an_interactive_allocation_launches_the_local_gpus(gpus):
    monkeypatch = gpus(4)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"}.items():
        monkeypatch.setenv(k, v)
    got = launch_settings(_cluster(4), _plan_on(4), Path("plan.yaml"), HEXISCALE)
    assert got == {"accelerator": "gpu", "devices": 4, "num_nodes": 1}


@pytest.mark.parametrize("env,popen_child,rank_zero", [
    # Lightning's own children in an interactive allocation: they inherit the shell's SLURM_PROCID=0
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash", "LOCAL_RANK": "1"}, True, False),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"}, False, True),  # the shell's command
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "job", "LOCAL_RANK": "1"}, False, False),  # srun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "job", "LOCAL_RANK": "0"}, False, True),
])
def test_ranks_of_an_interactive_allocation_are_lightnings_not_sruns(gpus, env, popen_child, rank_zero):
    """Every child of Lightning's launcher in ``srun --pty bash`` took itself for rank 0 (SLURM_PROCID=0) and
    for a SLURM rank: each printed and wrote what rank 0 alone writes, and Ctrl-C was raised in each."""
    from lightning_hexiscale.cli.train_job import is_popen_child, is_rank_zero

    monkeypatch = gpus(0)
    for k in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (is_popen_child(), is_rank_zero()) == (popen_child, rank_zero)
