"""Each rank's GPU is the one its plan device describes (type and memory), or the job stops.

Global rank r runs cluster device ``plan.device_order[r]``, and device ids follow the order of the
cluster file's machines, so a torchrun/SLURM job whose nodes start in another order than the file
lists the machines puts the 4090's layers on the A800 and the reverse: the job runs, slowly or out
of memory, and nobody is told. Before any process group of the plan exists, every rank reports its
local GPU (``torch.cuda.get_device_name`` and total memory) to all ranks (one
``all_gather_object``), and every rank raises the same :class:`ConfigError` listing each mismatched
rank with its node and local rank.
"""

from __future__ import annotations

import re
import socket

import torch
import torch.distributed as dist

from lightning_hexiscale.config import catalog
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.units import format_bytes
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner import Plan

MEMORY_TOLERANCE = 0.10
"""Local total memory may differ from the described memory by this fraction (an 80 GiB A100
reports 79.3 GiB to CUDA; a 40 GB one is 50 % off)."""


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]


def gpu_mismatch(gpu_type: str, memory_bytes: float, local_name: str, local_memory: float) -> str | None:
    """Why a local GPU (CUDA name, total memory) is not the described ``gpu_type`` with
    ``memory_bytes``, or None when it is. The type matches when its name without a memory suffix
    (``A100-80G`` -> ``a100``; a profiled ``NVIDIA-A100-SXM4-80GB`` as a whole) equals a run of
    consecutive words of the CUDA name ("NVIDIA GeForce RTX 4090" holds ``rtx4090``; "NVIDIA H200"
    does not hold ``h20``); the memory within ``MEMORY_TOLERANCE``."""
    known = catalog.lookup(gpu_type)
    base = known.name.split("-")[0] if known is not None else gpu_type
    want = "".join(_tokens(base))
    words = _tokens(local_name)
    runs = {"".join(words[a:b]) for a in range(len(words)) for b in range(a + 1, len(words) + 1)}
    if want not in runs:
        return f"its GPU is '{local_name}', not a {gpu_type}"
    if abs(local_memory - memory_bytes) > MEMORY_TOLERANCE * memory_bytes:
        return (f"its GPU '{local_name}' has {format_bytes(local_memory)}, the cluster describes "
                f"{format_bytes(memory_bytes)} for a {gpu_type}")
    return None


def check_local_gpus(plan: Plan, cluster: Cluster, device: torch.device, node_rank: int, local_rank: int,
                     order: tuple[int, ...] | None = None) -> None:
    """Collective over the world: raise the same ConfigError on every rank when any rank's local GPU
    is not the device the plan gives it (rank r: ``order[r]``, by default ``plan.device_order[r]``;
    ``plan.launch_order`` for a job launched on the plan's idle devices too). Call once, after the
    process group exists, on CUDA."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mine = {"node": node_rank, "local": local_rank, "host": socket.gethostname(),
            "name": torch.cuda.get_device_name(index), "memory": float(torch.cuda.get_device_properties(index).total_memory)}
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    problems = []
    for rank, got in enumerate(everyone):
        dev = cluster.devices[(order or plan.device_order)[rank]]
        why = gpu_mismatch(dev.gpu_type, dev.memory_bytes, got["name"], got["memory"])
        if why:
            machine = cluster.machines[dev.machine].name
            problems.append(f"rank {rank} (node {got['node']} '{got['host']}', local rank {got['local']}) runs device "
                            f"{dev.id} on machine {machine} of cluster {cluster.name}, but {why}")
    if problems:
        raise ConfigError("HexiScaleStrategy(cluster)", cluster.name,
                          "every rank's GPU must be the device the plan gives it: " + "; ".join(problems),
                          "start node k on machine k of the cluster file (device ids, and so global ranks, follow "
                          "the order of its machines), or correct the machines' gpu types, or pass check_devices=False")
