"""No forked rank frees a process group it inherited from its parent.

A gloo process group that becomes garbage in a reference cycle is freed by whichever process runs
the next collection. In a forked child that means waiting for the group's worker threads, which
exist only in the parent: the child hangs for good (the suite once lost a 7-rank checkpoint test to
it, after an in-process world-of-one engine run). The fork sites collect first
(``runtime.host.fork_context``), and the world-of-one engine of the GPU checks frees its engine
while its group is alive.
"""

from __future__ import annotations

import datetime
import gc
import socket

import pytest
import torch
import torch.distributed as dist

from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.topology import Topology


class _Cycle:
    """An object in a reference cycle, as an engine's hooks make one."""

    def __init__(self, *held):
        self.me, self.held = self, held


def _collect(rank: int, world: int) -> bool:
    gc.collect()  # frees whatever garbage this rank inherited: must not hang
    return True


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_forked_ranks_do_not_inherit_a_dead_process_group(run_ranks):
    """The parent leaves a destroyed world-of-one group (and a subgroup) in a reference cycle; the
    forked ranks then collect their garbage. Without the collection before the fork they hang."""
    gc.disable()  # the garbage must still be there when the ranks fork (no automatic collection)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.ones(4)
        dist.all_reduce(t)  # the group's threads have run
        _Cycle(dist.group.WORLD, dist.new_group([0]))
        dist.destroy_process_group()
        assert run_ranks(2, _collect, timeout=20) == [True, True]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.enable()


@pytest.mark.timeout(120)
def test_the_world_of_one_engine_leaves_no_engine_behind():
    """``gpu_checks.run_engine_steps`` (the GPU checks' engine, also run on the CPU by the suite)
    frees its engine, with the process groups it holds, before destroying its group."""
    from lightning_hexiscale.bench import gpu_checks
    from lightning_hexiscale.models.config import LlamaConfig

    config = LlamaConfig(name="fork_hygiene", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, vocab_size=64, seq_len=8)
    gc.collect()
    gc.disable()
    try:
        losses = gpu_checks.run_engine_steps(gpu_checks.one_device_plan(2, 2, 1, False), config, "cpu", steps=1)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, (PipelineEngine, Topology))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(losses) == 1 and not left, left
