"""Multi-process CPU/gloo harness for the runtime tests, exposed as the ``run_ranks`` fixture.

``run_ranks(world_size, fn, *args, timeout=...)`` forks ``world_size`` processes; rank r runs
``fn(rank, world_size, *args)`` inside its own gloo process group (fresh TCP port per call, one
intra-op thread per rank) and its return value comes back, serialised with ``torch.save``, through
a queue. Any exception on a rank, or any rank still running at the parent-side deadline (every
distributed bug shows up as a hang), kills all ranks and FAILS the test with the ranks' tracebacks.

Every rank runs under the NCCL-semantics harness (``tests/nccl_semantics.py``): p2p tags are forced
to 0 (order-only matching, as on NCCL) and every communication call is recorded; when all ranks
succeed, the parent replays the traces under NCCL's rules and FAILS the test on anything that would
hang or mismatch on NCCL. ``run_ranks_traced`` returns ``(results, traces)`` without judging them
(for tests of the harness itself); a rank can label its steps through ``nccl_semantics.current().mark``.

Fork (not spawn) because it costs ~0.05 s instead of seconds per rank; the heavy modules are
imported here, in the parent, so the children inherit them instead of each paying seconds of imports
(``import torch, lightning`` alone takes about 2 s on this project's CI hosts).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint  # noqa: F401  (pre-import for the forked children)

import lightning_hexiscale.runtime.engine  # noqa: F401  (pre-import: pulls in the whole runtime)
import nccl_semantics
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.runtime.host import fork_context

PG_TIMEOUT_S = 60
"""Collective timeout inside the children: a mismatch raises there instead of hanging forever."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn, args, out: mp.Queue) -> None:
    torch.set_num_threads(1)  # 8 ranks on 2 cores: 9x slower without this
    status, value = "ok", None
    recorder = nccl_semantics.Recorder()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        nccl_semantics.set_current(recorder.install())
        value = fn(rank, world, *args)
    except BaseException:  # report everything, the parent fails the test
        status, value = "error", traceback.format_exc()
    finally:
        recorder.uninstall()
        if dist.is_initialized():
            try:
                if status == "ok":
                    # Rank 0 hosts the store that new_group's rendezvous uses: a rank that returns
                    # right after building its groups must not tear it down while a peer is still
                    # connecting (torch 2.4's gloo: "Connection reset by peer" in new_group).
                    dist.barrier()
            except Exception:
                status, value = "error", traceback.format_exc()
            finally:
                dist.destroy_process_group()
    buf = io.BytesIO()
    try:
        torch.save((rank, status, value, recorder.steps), buf)
    except Exception:
        buf = io.BytesIO()
        torch.save((rank, "error", "result not serialisable:\n" + traceback.format_exc(), []), buf)
    out.put(buf.getvalue())


def run_ranks_traced(world: int, fn, *args, timeout: float = 90.0) -> tuple[list, list]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks under the recorder; return the
    results and the communication traces by rank (not judged)."""
    ctx = fork_context()  # collects garbage first: see runtime.host.collect_before_fork
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    failed = False
    while len(results) < world and not failed:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            item = out.get(timeout=min(left, 0.5))
        except queue.Empty:
            # A rank that died without reporting (segfault, os._exit) would otherwise cost the whole timeout.
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)
                while not out.empty():
                    rank, status, value, steps = torch.load(io.BytesIO(out.get()), weights_only=False)
                    results[rank] = (status, value, steps)
                break
            continue
        rank, status, value, steps = torch.load(io.BytesIO(item), weights_only=False)
        results[rank] = (status, value, steps)
        failed = status == "error"
    if failed:  # the first report may be a peer's "connection closed": give the root cause 2 s to arrive
        grace = time.monotonic() + 2.0
        while len(results) < world and time.monotonic() < grace:
            try:
                rank, status, value, steps = torch.load(io.BytesIO(out.get(timeout=0.2)), weights_only=False)
                results[rank] = (status, value, steps)
            except queue.Empty:
                continue
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    # Root causes first: a rank's own exception before the broken connections it caused in its peers.
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v, _) in
              sorted(results.items(), key=lambda kv: ("Connection closed" in str(kv[1][1]), kv[0])) if s == "error"]
    missing = [r for r in range(world) if r not in results]
    if errors:
        pytest.fail("rank(s) raised:\n" + "\n".join(errors) + (f"\n(ranks {missing} killed)" if missing else ""))
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        pytest.fail(f"ranks {missing} did not finish within {timeout:.0f} s (hang?); exit codes {codes}")
    return [results[r][1] for r in range(world)], [results[r][2] for r in range(world)]


def run_ranks_impl(world: int, fn, *args, timeout: float = 90.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; return the results by rank,
    after checking the ranks' communication against NCCL's rules."""
    results, traces = run_ranks_traced(world, fn, *args, timeout=timeout)
    report = nccl_semantics.replay(traces)
    if not report.ok:
        pytest.fail(str(report))
    return results


@pytest.fixture
def run_ranks():
    """The multi-process runner (see module docstring)."""
    return run_ranks_impl


@pytest.fixture
def run_ranks_traced_fixture():
    """The runner without the NCCL judgement: returns (results, traces)."""
    return run_ranks_traced


@pytest.fixture
def tiny_gqa() -> LlamaConfig:
    """4 layers, width 64, 4 query heads over 2 KV heads, FFN 100 (uneven over TP 3), vocab 256."""
    return LlamaConfig(name="tiny_gqa", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=100, vocab_size=256, seq_len=16)


@pytest.fixture
def tiny_mha() -> LlamaConfig:
    """Like ``tiny_gqa`` with 4 KV heads, so TP 3 splits the heads 2,1,1."""
    return LlamaConfig(name="tiny_mha", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                       ffn_hidden_size=100, vocab_size=256, seq_len=16)
