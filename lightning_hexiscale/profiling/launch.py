"""Starting the ranks: local forked CPU ranks, or an external launcher's environment.

Two ways in, one function shape ``fn(rank, world, *args)``:

- :func:`run_local` forks ``world`` processes on this host, each with ONE intra-op thread and its
  own gloo rank (TCP rendezvous on a free localhost port). Fork, not spawn: a forked child starts
  in ~0.05 s and inherits the already imported torch (spawn re-imports it: seconds per rank).
  Results come back through a queue; a rank that raises, dies, or is still running at the
  deadline makes every rank be killed and a :class:`RankFailure` be raised with the tracebacks,
  because every distributed mismatch otherwise shows up as a silent hang. The root cause comes
  first: the rank that raised something other than a broken connection, earliest first (a failing
  rank's peers fail a moment later with "Connection closed by peer", and on a loaded host their
  report may arrive first).
- :func:`run_from_env` joins a process group that an external launcher described in the
  environment: torchrun / ``torch.distributed.run`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
  SLURM's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), or Lightning's script launcher
  (LOCAL_RANK, NODE_RANK, WORLD_SIZE; global rank = NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK with
  LOCAL_WORLD_SIZE defaulting to WORLD_SIZE, i.e. one node). NCCL when CUDA is available, else gloo.
"""

from __future__ import annotations

import datetime
import os
import queue
import resource
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import HexiScaleError
from lightning_hexiscale.runtime.failure import is_peer_failure
from lightning_hexiscale.runtime.host import exit_without_finalizing, fork_context, slurm_launched, slurm_nodes


_JOINED_GROUP = False
"""Set once :func:`run_from_env` has joined a process group in this process (see :func:`exit_process`)."""

FAILURE_SETTLE_S = 2.0
"""After the first failure report, how long :func:`run_local` waits for the other ranks' reports
before it kills them (the root cause may report second; see :func:`root_cause_order`)."""


class RankFailure(HexiScaleError, RuntimeError):
    """A rank raised, died or hung; the message carries every rank's traceback or exit code."""


@dataclass(frozen=True)
class EnvRank:
    rank: int
    world: int
    local_rank: int
    launcher: str


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_and_report(rank: int, out, work) -> None:
    """Run ``work()`` and put this rank's report on ``out``: ``(rank, "ok", value, 0.0)``, or
    ``(rank, "error", traceback, time of the failure)`` for anything raised (everything goes back to
    the parent, which kills the others), or for a value that cannot be pickled. A refusal of bad input
    (a :class:`~lightning_hexiscale.errors.HexiScaleError`) is ``(rank, "refused", (traceback, the
    error), time)``: the parent can raise that error itself (:func:`agreed_refusal`)."""
    try:
        report = (rank, "ok", work(), 0.0)
    except HexiScaleError as e:
        report = (rank, "refused", (traceback.format_exc(), e), time.time())
    except BaseException:
        report = (rank, "error", traceback.format_exc(), time.time())
    try:
        out.put(report)
    except Exception:
        if report[1] == "refused":  # an error that does not pickle: its traceback still goes back
            report = (rank, "error", report[2][0], report[3])
            try:
                out.put(report)
                return
            except Exception:
                pass
        out.put((rank, "error", "result not picklable:\n" + traceback.format_exc(), time.time()))


def _child(rank: int, world: int, port: int, timeout_s: float, fn, args, out) -> None:
    torch.set_num_threads(1)  # one thread per rank: N ranks x default threads oversubscribe the cores

    def work():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return fn(rank, world, *args)

    try:
        # The time of a failure and the report go out BEFORE the process group is destroyed: tearing
        # it down closes this rank's sockets, and the peers' "Connection closed by peer" must not be
        # the first (or the only) thing the parent hears.
        run_and_report(rank, out, work)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def root_cause_order(errors: dict[int, tuple[str, float]]) -> list[int]:
    """Ranks that raised, root cause first: ranks whose error is not a peer's broken connection
    (:func:`~lightning_hexiscale.runtime.failure.is_peer_failure`), then by the time they failed, then by rank.

    A failing rank's sockets close when it exits, so its peers often fail a moment later with
    "Connection closed by peer"; on a loaded host their report can even reach the parent first.
    """
    def key(r: int):
        text, when = errors[r]
        return (is_peer_failure(text), when, r)

    return sorted(errors, key=key)


def run_local(world: int, fn, *args, timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks of this host; results by rank.

    ``timeout_s`` bounds the whole run (parent side) and every collective (child side).
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    ctx = fork_context()  # collects garbage first: see runtime.host.collect_before_fork
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, timeout_s, fn, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return gather_reports(procs, out, timeout_s, FAILURE_SETTLE_S)


def gather_reports(procs: list, out, timeout_s: float, settle_s: float, let_finish: bool = False) -> list:
    """The reports of ``procs`` (rank r = ``procs[r]``), each ``(rank, "ok" | "error", value or traceback,
    time of the failure)`` on the queue ``out``; their values by rank. Waits up to ``timeout_s``; after
    the first failure (a report of one, or a process that exited non-zero without a report) only
    ``settle_s`` more, for the root cause's report, which may come second (:func:`root_cause_order`).
    Then every process still alive is killed: all of them at once, or, with ``let_finish``, only when
    not every rank reported ok (a spawned NCCL rank leaves on its own after destroying its group).
    Raises :class:`RankFailure` with every traceback, root cause first, or the ranks that hung."""
    world = len(procs)
    results: dict[int, tuple[str, object, float]] = {}
    deadline = time.monotonic() + timeout_s
    settle_until: float | None = None
    try:
        while len(results) < world:
            now = time.monotonic()
            if now >= deadline or (settle_until is not None and now >= settle_until):
                break
            try:
                rank, status, value, when = out.get(timeout=min(deadline - now, 0.2))
            except queue.Empty:
                if settle_until is None and any(p.exitcode not in (None, 0) for p in procs):
                    settle_until = time.monotonic() + settle_s  # a rank died without a report
                continue
            results[rank] = (status, value, when)
            if status != "ok" and settle_until is None:
                # not the first report to arrive but the root cause is wanted; the other ranks'
                # reports, usually broken connections, follow within moments
                settle_until = time.monotonic() + settle_s
    finally:
        done = len(results) == world and all(st == "ok" for st, _, _ in results.values())
        for p in procs:
            if let_finish and done:
                p.join(timeout=30)
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    refusals = {r: v[1] for r, (st, v, w) in results.items() if st == "refused"}
    errors = {r: (v[0] if st == "refused" else v, w) for r, (st, v, w) in results.items() if st != "ok"}
    missing = [r for r in range(world) if r not in results]
    agreed = agreed_refusal(refusals, errors)
    if agreed is not None:
        raise agreed
    if errors:
        order = root_cause_order(errors)
        text = "\n".join(f"--- rank {r} ---\n{errors[r][0]}" for r in order)
        first = error_headline(errors[order[0]][0])
        raise RankFailure(f"rank {order[0]} failed first: {first}\nrank(s) raised (root cause first):\n{text}"
                          + (f"\n(ranks {missing} killed)" if missing else ""))
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s (hang?); exit codes {codes}")
    return [results[r][1] for r in range(world)]


def agreed_refusal(refusals: dict[int, HexiScaleError], errors: dict[int, tuple[str, float]]) -> HexiScaleError | None:
    """The one error to raise when the ranks refused bad input alike: every rank that raised, raised a
    HexiScaleError with the same message (ranks agree on a refusal before they measure, e.g. a discovery
    cache that does not load), or lost its connection to a rank that did. Its message is complete (key,
    value, rule, fix), so it is raised as it is, once, instead of a RankFailure with every rank's
    traceback. None when any rank raised something else: then every traceback is wanted."""
    if not refusals:
        return None
    messages = {str(e) for e in refusals.values()}
    if len(messages) != 1:
        return None
    if any(r not in refusals and not is_peer_failure(text) for r, (text, _) in errors.items()):
        return None
    return refusals[min(refusals)]


def error_headline(report: str) -> str:
    """The first line of the exception a rank's traceback ends with (``Type: message``). Not the
    traceback's last line: a message of several lines (a YAML error quoted in a ConfigError) would
    leave only its tail, e.g. ``in "c.yaml", line 2, column 1). Fix: ...``. The exception starts at
    the first unindented line after the last ``  File`` frame (its code and ``^^^`` lines are indented)."""
    lines = report.strip().splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith("  File ")]
    for ln in lines[frames[-1] + 1:] if frames else []:
        if ln and not ln[0].isspace():
            return ln
    return lines[-1] if lines else report


def env_rank() -> EnvRank | None:
    """This process's rank as an external launcher set it, or None when none did."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return EnvRank(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in e and slurm_launched(e):  # not a shell of an interactive allocation: --local N there
        return EnvRank(int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", 0)), "slurm")
    if "LOCAL_RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        local_world = int(e.get("LOCAL_WORLD_SIZE", world))
        node = int(e.get("NODE_RANK", e.get("GROUP_RANK", 0)))
        return EnvRank(node * local_world + int(e["LOCAL_RANK"]), world, int(e["LOCAL_RANK"]), "lightning")
    return None


def check_rendezvous_env(er: EnvRank, environ=None) -> None:
    """Refuse, before joining, an env:// rendezvous that cannot meet: no MASTER_PORT, or no
    MASTER_ADDR in a SLURM job on several nodes. torchrun and Lightning's launcher set both; srun sets
    neither (the CLI fills them from SLURM's variables, :mod:`lightning_hexiscale.cli.slurm_env`, where
    it finds them), and the one-host default 127.0.0.1 would send every rank off the first node to a
    store on its own host, where it waits out the whole timeout (10 minutes) instead of failing."""
    e = os.environ if environ is None else environ
    nodes = slurm_nodes(e)
    needs_address = er.launcher == "slurm" and nodes > 1  # on one node 127.0.0.1 is rank 0's host
    missing = [k for k, needed in (("MASTER_ADDR", needs_address), ("MASTER_PORT", True)) if needed and not e.get(k)]
    if not missing:
        return
    where = (f"under SLURM on {nodes} nodes" if "MASTER_ADDR" in missing else
             f"under {er.launcher}")
    raise RankFailure(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set {where}: "
                      "the ranks could not find rank 0's rendezvous store. Fix: export "
                      "MASTER_ADDR=<the first node's host name> (under SLURM: $(scontrol show hostnames "
                      "\"$SLURM_JOB_NODELIST\" | head -n1)) and MASTER_PORT=<a free port, e.g. 29500> "
                      "before srun (torchrun sets both)")


def run_from_env(fn, *args, timeout_s: float = 600.0, backend: str | None = None):
    """Join the launcher's process group (env:// rendezvous), run ``fn(rank, world, *args)`` on this
    rank, destroy the group, return ``fn``'s value. One intra-op thread per rank on CPU."""
    er = env_rank()
    if er is None:
        raise RankFailure("no launcher environment found (RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or "
                          "LOCAL_RANK/WORLD_SIZE). Fix: run under torchrun, srun or Lightning, or use --local N")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(er.local_rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    check_rendezvous_env(er)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    global _JOINED_GROUP
    _JOINED_GROUP = True
    dist.init_process_group(backend, init_method="env://", rank=er.rank, world_size=er.world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        return fn(er.rank, er.world, *args)
    finally:
        dist.destroy_process_group()


def exit_process(code: int):
    """End this process with ``code``. After :func:`run_from_env` the interpreter is left with
    ``os._exit`` once stdout and stderr are flushed, instead of the normal shutdown.

    Why: a gloo worker thread drops its reference to a finished collective (e.g. the last
    ``all_gather_object``) only after waking the caller, and the work's tensors are Python objects,
    so their release needs the GIL. If that happens while the interpreter is finalizing, CPython
    ends the thread with ``pthread_exit``, whose unwinding through the work's ``noexcept`` destructor
    calls ``std::terminate``: the rank dies with SIGABRT ("terminate called without an active
    exception", exit -6) after its work is done, and the launcher reports a failed job (seen in CI
    about one run in six of the benchmark's workers). ``destroy_process_group`` does not join gloo's
    threads. :func:`~lightning_hexiscale.runtime.host.exit_without_finalizing` (the ``atexit``
    handlers still run first); everything this package writes is closed before the caller returns
    its code."""
    if not _JOINED_GROUP:
        sys.exit(code)
    exit_without_finalizing(code)


# ---- load from other jobs on a shared host -----------------------------------------------------------
def _cpu_jiffies() -> tuple[int, int] | None:
    """(total, idle + iowait) jiffies of all CPUs since boot, from /proc/stat (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v[:8]), v[3] + v[4]


def host_busy_fraction(window_s: float = 1.0) -> float:
    """Fraction of all CPUs' time that was busy during the next ``window_s`` seconds (0..1)."""
    a = _cpu_jiffies()
    time.sleep(window_s)
    b = _cpu_jiffies()
    if a is None or b is None or b[0] == a[0]:
        return 0.0
    return 1.0 - (b[1] - a[1]) / (b[0] - a[0])


def wait_for_quiet_host(max_busy: float = 0.1, window_s: float = 1.0, timeout_s: float = 300.0) -> float:
    """Wait until the host is at most ``max_busy`` busy over a window (other jobs idle), at most
    ``timeout_s``; return the last busy fraction seen (above ``max_busy`` when it timed out)."""
    deadline = time.monotonic() + timeout_s
    busy = host_busy_fraction(window_s)
    while busy > max_busy and time.monotonic() < deadline:
        busy = host_busy_fraction(window_s)
    return busy


class HostLoad:
    """Context manager measuring the CPU time OTHER processes used while it was open, as a fraction
    of the host's capacity (wall time x CPUs): others = all busy CPU time (from /proc/stat) minus
    this process's and its reaped children's CPU time (getrusage). Wrap :func:`run_local`, whose
    children are joined before it returns. ``others_fraction`` 0.25 on 2 cores = half a core taken."""

    def __enter__(self) -> HostLoad:
        self._t0, self._j0 = time.monotonic(), _cpu_jiffies()
        self._r0 = self._ours()
        self.others_fraction = 0.0
        return self

    @staticmethod
    def _ours() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def __exit__(self, *exc) -> None:
        j1 = _cpu_jiffies()
        wall = time.monotonic() - self._t0
        if self._j0 is None or j1 is None or wall <= 0:
            return
        hz = os.sysconf("SC_CLK_TCK")
        busy_s = ((j1[0] - self._j0[0]) - (j1[1] - self._j0[1])) / hz
        others = max(0.0, busy_s - (self._ours() - self._r0))
        self.others_fraction = others / (wall * (os.cpu_count() or 1))
