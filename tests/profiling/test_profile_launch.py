"""Rank discovery from launcher environments, and the local launcher's failure reporting."""

from __future__ import annotations

import os

import pytest

from lightning_hexiscale.profiling.launch import EnvRank, RankFailure, check_rendezvous_env, env_rank, run_local

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NAME")


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env,want", [
    ({}, None),
    ({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}, (5, 16, 1, "torchrun")),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "32", "SLURM_LOCALID": "1"}, (9, 32, 1, "slurm")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"}, None),  # srun --pty bash
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "interactive"}, None),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "profile"}, (2, 4, 0, "slurm")),
    # Lightning's script launcher: LOCAL_RANK, NODE_RANK, WORLD_SIZE (+ LOCAL_WORLD_SIZE when multi-node)
    ({"LOCAL_RANK": "3", "WORLD_SIZE": "4"}, (3, 4, 3, "lightning")),
    ({"LOCAL_RANK": "2", "NODE_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, (10, 16, 2, "lightning")),
])
def test_env_rank(clean_env, env, want):
    for k, v in env.items():
        clean_env.setenv(k, v)
    got = env_rank()
    assert (None if got is None else (got.rank, got.world, got.local_rank, got.launcher)) == want


SLURM = EnvRank(3, 8, 1, "slurm")


@pytest.mark.parametrize("env,refused", [
    ({"MASTER_PORT": "29500", "SLURM_NNODES": "1"}, None),  # one node: 127.0.0.1 is rank 0's host
    ({"MASTER_PORT": "29500"}, None),  # no node count: srun on one node
    ({"MASTER_ADDR": "n1", "MASTER_PORT": "29500", "SLURM_NNODES": "2"}, None),
    ({"MASTER_PORT": "29500", "SLURM_NNODES": "2"}, "MASTER_ADDR is not set under SLURM on 2 nodes"),
    ({"MASTER_PORT": "29500", "SLURM_JOB_NUM_NODES": "4"}, "MASTER_ADDR is not set under SLURM on 4 nodes"),
    ({"MASTER_ADDR": "", "MASTER_PORT": "29500", "SLURM_NNODES": "2"}, "MASTER_ADDR is not set"),
    ({"SLURM_NNODES": "2"}, "MASTER_ADDR and MASTER_PORT are not set under SLURM on 2 nodes"),
    ({"MASTER_ADDR": "n1"}, "MASTER_PORT is not set under slurm"),
])
def test_a_rendezvous_that_cannot_meet_is_refused_before_joining(env, refused):
    """srun sets neither MASTER_ADDR nor MASTER_PORT: on several nodes the default 127.0.0.1 sent
    every rank off the first node to a store on its own host, to wait out the whole timeout."""
    if refused is None:
        check_rendezvous_env(SLURM, env)
        return
    with pytest.raises(RankFailure, match=refused) as info:
        check_rendezvous_env(SLURM, env)
    assert "Fix: export MASTER_ADDR=" in str(info.value) and "scontrol show hostnames" in str(info.value)


def test_torchrun_without_master_port_is_refused_and_a_node_count_alone_needs_no_address():
    torchrun = EnvRank(0, 2, 0, "torchrun")
    check_rendezvous_env(torchrun, {"MASTER_PORT": "1", "SLURM_NNODES": "3"})  # torchrun inside SLURM
    with pytest.raises(RankFailure, match="MASTER_PORT is not set under torchrun"):
        check_rendezvous_env(torchrun, {})


def _ok(rank, world):
    import torch.distributed as dist

    return (rank, world, dist.get_world_size(), os.getpid())


def _raises_on_1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 would wait forever: the parent must kill it
    return rank


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_run_local_results_and_failures():
    res = run_local(3, _ok, timeout_s=30)
    assert [r[:3] for r in res] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)] and len({r[3] for r in res}) == 3
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_local(2, _raises_on_1, timeout_s=30)


def _closes_then_raises_on_1(rank, world):
    """Rank 1 drops its connections BEFORE it raises, so rank 0's "Connection closed by peer" is
    certainly reported first: the race that made the test above flaky, forced every time."""
    import time

    import torch.distributed as dist

    if rank == 1:
        dist.destroy_process_group()
        time.sleep(1.0)
        raise ValueError("boom on rank 1")
    dist.barrier()
    return rank


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_run_local_names_the_root_cause_not_the_broken_connection():
    with pytest.raises(RankFailure) as info:
        run_local(2, _closes_then_raises_on_1, timeout_s=30)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 failed first: ValueError: boom on rank 1"), str(info.value)[-2000:]
    assert "--- rank 0 ---" in str(info.value)  # the secondary error is still shown, after it


def test_root_cause_order_prefers_a_real_error_then_the_earliest():
    from lightning_hexiscale.profiling.launch import root_cause_order

    closed = "Traceback ...\nRuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
    errors = {0: (closed, 1.0), 1: ("Traceback ...\nValueError: boom", 2.0), 2: ("KeyError: 'x'", 1.5)}
    assert root_cause_order(errors) == [2, 1, 0]
    assert root_cause_order({0: (closed, 1.0), 3: (closed, 0.5)}) == [3, 0]


_RANK_SCRIPT = """
import atexit
import sys
import torch.distributed as dist
from lightning_hexiscale.profiling.launch import exit_process, run_from_env

def fn(rank, world):
    everything = [None] * world
    dist.all_gather_object(everything, rank)  # the last collective before the exit
    return everything

got = run_from_env(fn, timeout_s=30)
atexit.register(lambda: print(" atexit ran", end=""))
print("gathered", got, end="")  # no newline: only a flush at the exit writes it
exit_process(5)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_exit_process_after_a_group_flushes_and_keeps_the_code(tmp_path):
    """Ranks that joined a group leave through ``os._exit`` (see ``exit_process``): the code is
    theirs, their atexit handlers run and their buffered output is written."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as under a launcher
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "RANK": str(r),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    outs = [p.communicate(timeout=50) for p in procs]
    assert [p.returncode for p in procs] == [5, 5], outs
    assert [o for o, _ in outs] == ["gathered [0, 1] atexit ran"] * 2, outs


def test_exit_process_without_a_group_is_a_normal_exit():
    from lightning_hexiscale.profiling import launch

    assert launch._JOINED_GROUP is False  # this process never joined one
    with pytest.raises(SystemExit) as e:
        launch.exit_process(3)
    assert e.value.code == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bad_out_under_an_external_launch_is_refused_before_measuring(tmp_path):
    """torchrun-style ranks: rank 0 checks ``--out`` before any measurement and every rank stops with its
    error (an existing folder cannot be written as a file). Before, the ranks measured first and rank 0
    failed only when it wrote."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = str(Path(__file__).resolve().parents[2])
    (tmp_path / "taken").mkdir()
    cmd = [sys.executable, "-m", "lightning_hexiscale.cli", "profile", "--out", str(tmp_path / "taken"),
           "--sizes", "1KiB,64KiB", "--reps", "1", "--matmul-time", "0.1"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "RANK": str(r),
                                   "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert all(p.returncode not in (0, None) for p in procs), outs
    for out in outs:
        assert "--out" in out and str(tmp_path / "taken") in out, out[-2000:]
        assert "Traceback" not in out, out[-2000:]
    assert "FLOP/s" not in outs[0] and "alpha" not in outs[0], outs[0][-2000:]  # nothing was measured


def test_the_headline_is_the_exceptions_first_line_not_the_tail_of_its_message():
    """A ConfigError quoting a YAML error (a corrupted discovery cache) spans lines; the headline
    said 'rank 1 failed first:   in "c.yaml", line 2, column 1). Fix: ...' and lost what failed.
    gather_reports is fed reports as the ranks send them (no processes)."""
    import queue

    from lightning_hexiscale.profiling.launch import gather_reports

    tb = ('Traceback (most recent call last):\n  File "d.py", line 362, in discover\n    raise reuse\n'
          "lightning_hexiscale.errors.ConfigError: cache = 'c.yaml': the cached cluster file does not load "
          "(cannot read YAML (while parsing a flow node\nexpected the node content\n"
          '  in "c.yaml", line 2, column 1)). Fix: delete c.yaml\n')

    class Done:
        exitcode = 0

        def is_alive(self):
            return False

        def join(self, timeout=None):
            pass

    out = queue.Queue()
    out.put((1, "error", tb, 1.0))
    out.put((0, "ok", None, 0.0))
    with pytest.raises(RankFailure) as info:
        gather_reports([Done(), Done()], out, timeout_s=5, settle_s=0.1)
    first = str(info.value).splitlines()[0]
    assert first == ("rank 1 failed first: lightning_hexiscale.errors.ConfigError: cache = 'c.yaml': the cached "
                     "cluster file does not load (cannot read YAML (while parsing a flow node")
    from lightning_hexiscale.profiling.launch import error_headline

    assert error_headline("Traceback ...\nValueError: boom") == "ValueError: boom"  # no frames: the last line


class _Exited:
    """A rank process that has already exited cleanly (gather_reports fed by hand)."""

    exitcode = 0

    def is_alive(self):
        return False

    def join(self, timeout=None):
        pass


def _gather(reports):
    import queue

    from lightning_hexiscale.profiling.launch import gather_reports

    out = queue.Queue()
    for report in reports:
        out.put(report)
    return gather_reports([_Exited() for _ in reports], out, timeout_s=5, settle_s=0.1)


def test_a_refusal_every_rank_agreed_on_is_raised_once_as_itself():
    """A discovery cache that does not load (or cannot be written): every rank raises the same
    ConfigError, and `hexiscale discover` / `hexiscale train` cluster=auto printed a RankFailure with each
    rank's traceback after the headline. Now the ConfigError itself, once; a rank whose connection broke
    meanwhile does not change that, a rank with another error does (then every traceback is wanted)."""
    import queue

    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.profiling.launch import run_and_report

    def refuse():
        raise ConfigError("$HEXISCALE_CACHE_DIR", "/f/sub", "the cache folder cannot be written (Not a directory)",
                          "point HEXISCALE_CACHE_DIR at a writable folder")

    out = queue.Queue()
    run_and_report(0, out, refuse)
    run_and_report(1, out, refuse)
    reports = [out.get(), out.get()]
    assert [r[1] for r in reports] == ["refused", "refused"]
    with pytest.raises(ConfigError) as info:
        _gather(reports)
    assert str(info.value).startswith("$HEXISCALE_CACHE_DIR = '/f/sub': the cache folder cannot be written")
    assert "Traceback" not in str(info.value) and "rank" not in str(info.value)

    closed = "Traceback ...\nRuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
    with pytest.raises(ConfigError):
        _gather([reports[0], (1, "error", closed, 2.0)])
    with pytest.raises(RankFailure) as info:  # another error too: every traceback, as before
        _gather([reports[0], (1, "error", "Traceback ...\nValueError: boom", 2.0)])
    assert "ValueError: boom" in str(info.value) and "cache folder cannot be written" in str(info.value)
