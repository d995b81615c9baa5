"""Discovery's local ranks (``hexiscale discover --local N``, ``hexiscale train`` with cluster=auto):
which ranks, which backend and which environment, with ``torch.cuda`` mocked (no CUDA: 4 forked gloo
ranks; CUDA: one spawned NCCL rank per visible GPU); the spawned launch itself with gloo ranks on the CPU;
and the real thing on the GPUs when there are any."""

from __future__ import annotations

import argparse
import os
import re

import pytest
import torch

from lightning_hexiscale.cli import discover as discover_cli
from lightning_hexiscale.cli import discover_local
from lightning_hexiscale.cli.discover_local import CPU_RANKS, LocalLaunch, local_launch, run_spawned
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.profiling.launch import RankFailure


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_without_cuda_four_forked_gloo_ranks(monkeypatch):
    _gpus(monkeypatch, 0)
    assert local_launch() == LocalLaunch(CPU_RANKS, "gloo", "fork", 0) and CPU_RANKS == 4
    assert local_launch(2) == LocalLaunch(2, "gloo", "fork", 0)
    assert "no CUDA: CPU processes" in local_launch().describe()


def test_with_cuda_one_spawned_nccl_rank_per_gpu(monkeypatch):
    _gpus(monkeypatch, 3)
    launch = local_launch()
    assert launch == LocalLaunch(3, "nccl", "spawn", 3)
    assert launch.describe() == "3 local ranks, one per CUDA GPU (NCCL, spawned)"
    assert local_launch(1) == LocalLaunch(1, "nccl", "spawn", 3)
    assert local_launch(1).describe() == "1 local rank, one per CUDA GPU (NCCL, spawned)"
    with pytest.raises(ConfigError, match=r"--local = 4: on a CUDA machine discovery runs one rank per GPU, and 3 "
                                          r"GPU\(s\) are visible.*Fix: use --local 3 or fewer"):
        local_launch(4)


def test_each_gpu_rank_gets_torchruns_environment_for_its_own_device():
    launch = LocalLaunch(2, "nccl", "spawn", 2)
    assert launch.rank_env(1, 29511) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                         "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 local ranks"):
        launch.rank_env(2, 29511)


def test_discover_local_on_cuda_spawns_nccl_ranks_instead_of_forking_gloo(monkeypatch):
    """``hexiscale discover --local 2`` on a (mocked) 2-GPU machine: run_spawned with nccl, never run_local."""
    _gpus(monkeypatch, 2)
    seen = []
    monkeypatch.setattr(discover_local, "run_spawned", lambda launch, fn, *a, timeout_s: seen.append(launch) or ["found"])
    monkeypatch.setattr("lightning_hexiscale.profiling.launch.run_local",
                        lambda *a, **k: pytest.fail("forked gloo ranks on a CUDA machine"))
    args = discover_cli.local_args(2, "bf16-mixed")
    assert discover_cli.run_discover(args, model=object()) == "found"
    assert seen == [LocalLaunch(2, "nccl", "spawn", 2)]
    _gpus(monkeypatch, 0)  # and without CUDA: the forked gloo ranks, as before
    monkeypatch.setattr("lightning_hexiscale.profiling.launch.run_local", lambda world, fn, *a, timeout_s: ["forked"] * world)
    assert discover_cli.run_discover(discover_cli.local_args(4, None), model=object()) == "forked"


def _who(rank: int, world: int, tag: str):
    import torch.distributed as dist

    return (rank, world, os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], dist.get_backend(), tag)


def _fails_on_rank_1(rank: int, world: int):
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    return rank


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_spawned_ranks_join_with_the_launch_environment_and_report():
    """The spawned launch of the GPU path, run with gloo on the CPU: each rank joins through run_from_env
    with the environment rank_env gave it; a rank that raises is a RankFailure naming it."""
    launch = LocalLaunch(2, "gloo", "spawn", 0)
    assert run_spawned(launch, _who, "x", timeout_s=120) == [(0, 2, "0", "127.0.0.1", "gloo", "x"),
                                                              (1, 2, "1", "127.0.0.1", "gloo", "x")]
    with pytest.raises(RankFailure, match=r"rank 1 failed first: RuntimeError: rank 1 broke on purpose"):
        run_spawned(launch, _fails_on_rank_1, timeout_s=120)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")
def test_discover_on_this_machines_gpus(tmp_path, monkeypatch):
    """The real GPU path: one NCCL rank per visible GPU measures llama_tiny; every GPU is a device of the file."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig

    monkeypatch.setenv("HEXISCALE_CACHE_DIR", str(tmp_path / "cache"))
    launch = local_launch()
    assert launch.backend == "nccl" and launch.ranks == torch.cuda.device_count()
    args: argparse.Namespace = discover_cli.local_args(launch.ranks, "bf16-mixed")
    found = discover_cli.run_discover(args, LlamaConfig.load("llama_tiny"))
    cluster = Cluster.load(found.path)
    assert cluster.num_devices == launch.ranks
    names = {re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(i)).strip("-") for i in range(launch.ranks)}
    assert {d.gpu_type for d in cluster.devices} == names  # the GPUs were measured, not the CPU
    again = discover_cli.run_discover(args, LlamaConfig.load("llama_tiny"))
    assert again.reused and again.path == found.path
