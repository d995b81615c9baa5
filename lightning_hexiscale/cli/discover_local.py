"""The local ranks of ``hexiscale discover --local N`` and of ``hexiscale train`` with ``cluster=auto`` (its
default): on a machine without CUDA, forked gloo CPU processes (:func:`lightning_hexiscale.profiling.launch.run_local`);
on a machine with CUDA, one spawned NCCL rank per visible GPU.

Why spawn for the GPUs: a forked child of a process that has initialised CUDA cannot use CUDA, and the
launching process of ``hexiscale train`` is the job's rank 0 (it has asked torch how many GPUs there are, and
trains on cuda:0 afterwards); a spawned child is a fresh interpreter with nothing of the parent's CUDA state. It
pays for that with an import of torch per rank (seconds, once per discovery). Each GPU rank gets the environment
torchrun would give it (:meth:`LocalLaunch.rank_env`) and joins through
:func:`~lightning_hexiscale.profiling.launch.run_from_env` with ``backend="nccl"``, which pins it to
``cuda:LOCAL_RANK``: one device per rank, every visible device measured (``CUDA_VISIBLE_DEVICES`` narrows them).
Gloo ranks on a GPU machine would measure the CPU instead of the GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CPU_RANKS = 4
"""Local ranks on a machine without CUDA: as many as the demo's processes (a CPU machine has no device count
to read, and 4 ranks discover within the 60 s budget)."""


@dataclass(frozen=True)
class LocalLaunch:
    """How many local ranks discover, with which backend and start method."""

    ranks: int
    backend: str
    """``gloo`` (CPU processes) or ``nccl`` (one rank per CUDA GPU)."""
    start_method: str
    """``fork`` (gloo: inherits the imported torch) or ``spawn`` (nccl: no CUDA state inherited)."""
    gpus: int
    """CUDA devices visible to this process (0 without CUDA)."""

    def describe(self) -> str:
        """Half a sentence for the banner: how many ranks, on what."""
        if self.backend == "nccl":
            return f"{self.ranks} local rank{'s' if self.ranks != 1 else ''}, one per CUDA GPU (NCCL, spawned)"
        return f"{self.ranks} local ranks (no CUDA: CPU processes, as many as the demo's)"

    def rank_env(self, rank: int, port: int) -> dict[str, str]:
        """What a spawned GPU rank sets before it joins: torchrun's variables for one machine of ``ranks``
        processes, rank ``rank`` on ``cuda:rank``, rendezvous at ``127.0.0.1:port``."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not one of the {self.ranks} local ranks")
        return {"RANK": str(rank), "WORLD_SIZE": str(self.ranks), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}


def local_launch(ranks: int | None = None) -> LocalLaunch:
    """The local ranks: ``ranks`` (``--local N``) or, when None, one per visible CUDA GPU, else :data:`CPU_RANKS`.
    On CUDA, ``ranks`` may not exceed the GPUs (one device per rank): a ConfigError naming ``--local``.

    ``torch.cuda.device_count()`` is read, not a device property: it does not create a CUDA context."""
    import torch

    from lightning_hexiscale.errors import ConfigError

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus <= 0:
        return LocalLaunch(ranks or CPU_RANKS, "gloo", "fork", 0)
    if ranks is not None and ranks > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError("--local", ranks, f"on a CUDA machine discovery runs one rank per GPU, and {gpus} GPU(s) "
                          "are visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""),
                          f"use --local {gpus} or fewer (or torchrun without --local: one rank per GPU of every machine)")
    return LocalLaunch(ranks or gpus, "nccl", "spawn", gpus)


def run_local_ranks(launch: LocalLaunch, fn, *args, timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``launch``'s local ranks; results by rank. Gloo: forked ranks
    (``run_local``); NCCL: :func:`run_spawned`. A rank that raises, dies or hangs: RankFailure."""
    if launch.backend == "gloo":
        from lightning_hexiscale.profiling.launch import run_local

        return run_local(launch.ranks, fn, *args, timeout_s=timeout_s)
    return run_spawned(launch, fn, *args, timeout_s=timeout_s)


def spawned_rank_main(env: dict[str, str], backend: str, timeout_s: float, fn, args: tuple, out) -> None:
    """A spawned rank: take ``env`` (torchrun's variables), join with ``backend``, run ``fn``, report to ``out``
    (``(rank, "ok" | "error", value or traceback, time of the failure)``, as ``run_local``'s children do)."""
    os.environ.update(env)
    rank = int(env["RANK"])
    from lightning_hexiscale.profiling.launch import run_and_report, run_from_env

    run_and_report(rank, out, lambda: run_from_env(fn, *args, timeout_s=timeout_s, backend=backend))
    out.close()
    out.join_thread()  # the report is in the pipe before this process exits


SETTLE_S = 5.0
"""After the first failure, how long the other ranks' reports are awaited before they are killed (a failing
NCCL rank's peers block in their next collective instead of failing at once; the root cause usually reports first)."""


def run_spawned(launch: LocalLaunch, fn, *args, timeout_s: float = 600.0) -> list:
    """``launch.ranks`` spawned processes, rank r with :meth:`LocalLaunch.rank_env` joined with ``launch.backend``
    (nccl on GPUs; a test spawns gloo ranks the same way), run ``fn(rank, world, *args)``; results by rank.

    ``timeout_s`` bounds the whole run (parent side) and every collective (rank side). A rank that raises or
    dies ends the run after :data:`SETTLE_S`: every rank is killed and a RankFailure carries the tracebacks,
    root cause first (``root_cause_order``)."""
    import multiprocessing

    from lightning_hexiscale.profiling.launch import free_port, gather_reports

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=spawned_rank_main,
                         args=(launch.rank_env(r, port), launch.backend, timeout_s, fn, args, out), daemon=True)
             for r in range(launch.ranks)]
    for p in procs:
        p.start()
    return gather_reports(procs, out, timeout_s, SETTLE_S, let_finish=True)
