"""What the failure watch needs to know about this machine: how loaded it is, and whether a process
on it has ended.

- :func:`host_slowdown`: how many times longer CPU-bound work takes here now than on an idle host,
  from the 1-minute load average over the cores this process may use. On 2 cores with a load
  average of 20, every runnable process gets about 2/20 of a core: ``20 / 2 = 10``. Waits that cover
  work (a peer reaching its own timeout, a process's exception path) are multiplied by it.
- :func:`process_identity` / :func:`process_ended`: a process named by boot id, pid namespace, pid
  and start time (Linux ``/proc``), and whether that process has ended (gone, a zombie, or its pid
  reused). Only a process on the same kernel and in the same pid namespace can be checked; anywhere
  else the answer is "not known", never "ended".
- :func:`fork_context` / :func:`collect_before_fork`: ``fork`` only after this process's garbage is
  collected, so no forked child frees a process group it inherited (see there).
- :func:`destroy_groups_at_exit`: the process groups are destroyed while the interpreter is still
  whole, so a gloo worker thread never outlives it (see there); :func:`wait_for_gloo_workers`: the
  workers of groups still held elsewhere finish their last release before it finalizes.
- :func:`exit_without_finalizing`: a command's end that skips the interpreter's finalization of torch
  and Lightning (seconds per process; see there).
- :func:`slurm_launched`: whether srun started this process as one of a job's ranks (Lightning's rule);
  :func:`slurm_nodes`: on how many nodes.

No torch import: the test suite uses :func:`host_slowdown` to scale its own time limits.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

SLOWDOWN_CAP = 10.0
"""Most :func:`host_slowdown` says by default: a load average can be inflated by processes waiting on
I/O (a stalled network file system), and every wait it lengthens must stay bounded."""


def slurm_launched(environ=None) -> bool:
    """srun started this process as one of the job's ranks: Lightning's rule (``SLURMEnvironment.detect``),
    SLURM_NTASKS set and the job not named ``bash`` or ``interactive``. A shell in an interactive
    allocation (``srun --pty bash``) has SLURM_PROCID=0 and SLURM_NTASKS too, and there Lightning
    launches the processes itself, as without SLURM: its children inherit SLURM_PROCID=0. One rule for
    the recipe (rank 0, popen children, the Trainer's devices) and the profiling commands' launch."""
    e = os.environ if environ is None else environ
    return "SLURM_NTASKS" in e and e.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def slurm_nodes(environ=None) -> int:
    """Nodes of this SLURM job step (``SLURM_NNODES``, else ``SLURM_JOB_NUM_NODES``), 1 where neither is
    set or the value is not a whole number (which proves nothing about the node count)."""
    e = os.environ if environ is None else environ
    try:
        return max(1, int(e.get("SLURM_NNODES", e.get("SLURM_JOB_NUM_NODES", "1"))))
    except ValueError:
        return 1


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def host_slowdown(cap: float = SLOWDOWN_CAP) -> float:
    """``min(cap, max(1, load1 / cores))``: the 1-minute load average (runnable processes, averaged)
    over :func:`usable_cores`, i.e. how many processes compete for each core; 1.0 where the OS keeps
    no load average. It lags a sudden load by up to a minute (an exponential average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return min(cap, max(1.0, load / usable_cores()))


def _stat(pid: int | str) -> list[str]:
    """Fields 3.. of ``/proc/<pid>/stat`` (``pid`` may also be ``self/task/<tid>``, a thread; state
    first; the command name, which may hold spaces and parentheses, is cut off at its last ``)``)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


_STATE, _START_TIME = 0, 19  # stat fields 3 (state) and 22 (start time, clock ticks after boot)


def _machine() -> str:
    """Boot id and pid namespace: two processes with the same value see the same pids."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}|{os.readlink('/proc/self/ns/pid')}"


def process_identity(pid: int | None = None) -> str:
    """``boot_id|pid namespace|pid|start time`` of process ``pid`` (default: this one), or ``""``
    where ``/proc`` cannot tell (not Linux)."""
    pid = os.getpid() if pid is None else pid
    try:
        return f"{_machine()}|{pid}|{_stat(pid)[_START_TIME]}"
    except (OSError, IndexError, ValueError):
        return ""


def process_ended(identity: str) -> bool:
    """Whether the process ``identity`` (from :func:`process_identity`) has ended: its pid is gone,
    a zombie (ended, not yet reaped by its parent) or now another process. False where that cannot
    be checked from here (another machine or pid namespace, no ``/proc``, an empty identity)."""
    parts = identity.split("|")
    if len(parts) != 4:
        return False
    boot, namespace, pid, start = parts
    try:
        if _machine() != f"{boot}|{namespace}":
            return False
    except OSError:
        return False
    try:
        fields = _stat(int(pid))
    except (FileNotFoundError, ProcessLookupError):
        return True  # no such pid in this namespace (any more)
    except (OSError, IndexError, ValueError):
        return False
    return fields[_STATE] in ("Z", "X", "x") or fields[_START_TIME] != start


def collect_before_fork() -> None:
    """Collect this process's unreachable objects now, before it forks.

    Why: a forked child inherits the parent's uncollected garbage and collects it itself at some
    allocation of its own. An engine left in a reference cycle (autograd hooks close over their
    module) keeps its process groups alive after ``destroy_process_group``; freeing a gloo group
    waits for its worker threads, which exist only in the parent, so the child hangs there for good.
    Seen: a 7-rank checkpoint test timing out in the suite after an in-process world-of-one engine
    run (``tests/runtime/test_fork_hygiene.py`` reproduces it)."""
    gc.collect()


def fork_context():
    """``multiprocessing.get_context("fork")`` after :func:`collect_before_fork`."""
    collect_before_fork()
    return multiprocessing.get_context("fork")


_DESTROY_AT_EXIT = False
"""Whether :func:`destroy_groups_at_exit` registered its handler in this process."""


def destroy_groups_at_exit() -> None:
    """Destroy torch.distributed's process groups when this process exits normally, before the
    interpreter finalizes (an ``atexit`` handler, registered once per process).

    Why: a gloo worker thread drops its reference to a finished collective (and so to its tensors,
    Python objects whose release takes the GIL) just after waking the caller. When that last release
    comes while the interpreter finalizes, CPython ends the thread inside a ``noexcept`` destructor
    and the process dies with SIGABRT ("terminate called without an active exception", exit -6)
    after all its work is done; torchrun then reports a failed job. Measured: 7 of 60 processes of
    a 3-rank script ending in ``all_gather_object``; 0 of 60 with this handler. Destroying the groups
    first shuts gloo's threads down while the interpreter can still serve them; it is local (no
    collective) and took 0.02 s with a peer still running. Handlers registered earlier (a user's)
    run after this one. Processes that end with ``os._exit`` (multiprocessing children) skip it."""
    global _DESTROY_AT_EXIT
    if not _DESTROY_AT_EXIT:
        _DESTROY_AT_EXIT = True
        atexit.register(_destroy_groups)


def _destroy_groups() -> None:
    import torch.distributed as dist  # here, not at the top: this module stays free of torch (module doc)

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 -- at exit: one line, not a traceback; the job's outcome stands
            print(f"hexiscale: destroying the process groups at exit failed ({type(e).__name__}: {e})",
                  file=sys.stderr)
    wait_for_gloo_workers()


GLOO_WORKER = "pt_gloo_runloop"
"""The name torch gives a gloo process group's worker threads (``/proc/<pid>/task/<tid>/comm``)."""


def _gloo_worker_states() -> list[str] | None:
    """The scheduler state (``R`` runnable, ``S`` asleep, ...) of each gloo worker thread of this
    process, or None where ``/proc`` cannot tell (not Linux)."""
    tasks = Path("/proc/self/task")
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            if (tasks / tid / "comm").read_text().strip() == GLOO_WORKER:
                states.append(_stat(f"self/task/{tid}")[_STATE])
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
    return states


def wait_for_gloo_workers(limit_s: float = 1.0, poll_s: float = 0.005, states=_gloo_worker_states) -> bool:
    """Sleep, the GIL released, until every gloo worker thread of this process has been asleep at
    two polls ``poll_s`` apart (at most ``limit_s`` times :func:`host_slowdown`); True when they were.

    Why: :func:`dist.destroy_process_group` frees only the groups nothing else holds; the groups of
    a Lightning job stay referenced by the strategy and the module (their tensor-parallel layers)
    until the interpreter finalizes, and their worker threads with them. A worker that wakes the
    caller of a collective, is preempted, and only then drops its reference to that collective's
    tensors needs the GIL for it (a tensor whose Python object the caller already dropped is owned
    by C++). If the interpreter is finalizing by then, CPython ends the thread inside that
    ``noexcept`` release and the process aborts (exit -6, "terminate called without an active
    exception"; gdb on the core: ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit``). Seen after ``trainer.predict`` in a documented script, 1 run in about 10
    clean-clone suites, and in 2 of about 250 processes of a 3-rank script ending in
    ``all_gather_object``. A preempted worker is runnable (``R``); one waiting for the GIL gets it
    while this sleeps; a worker blocked inside a collective that a peer never joins sleeps (``S``)
    and is not waited for. Costs about 2 polls (10 ms) per process."""
    deadline = time.monotonic() + limit_s * host_slowdown()
    quiet = 0
    while True:
        now = states()
        if now is None:
            time.sleep(2 * poll_s)  # cannot tell: give a worker waiting for the GIL the two polls' time
            return False
        quiet = quiet + 1 if all(s == "S" for s in now) else 0
        if quiet >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def exit_without_finalizing(code: int | None) -> None:
    """End this process with ``code`` as a normal exit would, less the interpreter's finalization:
    the non-daemon threads are joined (``threading._shutdown``, what the interpreter calls first),
    the ``atexit`` handlers run (loggers, temporary files, :func:`destroy_groups_at_exit`), stdout
    and stderr are flushed, then ``os._exit``.

    Why: finalizing an interpreter that imported torch and Lightning tears down tens of thousands
    of module objects one by one: 1.3 CPU-seconds after the imports alone, 2 to 6 s of wall time
    after a 2-rank ``hexiscale train`` on a loaded 2-core host, in every rank and in the launching
    process, after the job's last line. ``multiprocessing`` children skip it the same way. What
    the finalization would still do is release memory the kernel takes back anyway, and flush files
    left open without ``close`` (none of this package's). Under a profiler or tracer (``python -m
    cProfile``, a debugger, coverage) the exit is the normal one: cProfile writes its file after the
    script returns."""
    if _traced():
        sys.exit(code)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()  # joins non-daemon threads (a checkpoint writer's pool among them), as the normal exit does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(0 if code is None else int(code))


def _traced() -> bool:
    """Whether a profiler, tracer or (Python 3.12+) ``sys.monitoring`` tool watches this process."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    return monitoring is not None and any(monitoring.get_tool(i) is not None for i in range(6))
