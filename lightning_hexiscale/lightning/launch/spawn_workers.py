"""The workers of the spawn and fork launchers, seen from the launching process (which is no rank):
they start with SIGINT ignored until their entry (:func:`workers_ignore_sigint_at_start`,
:func:`worker_entry`), report their phase and step through shared memory (:class:`WorkerPhases`,
read by the launching process's :class:`~.job_watch.JobWatch`), and are stopped when a Ctrl-C
reached the caller alone (:func:`stop_workers`). Torch-free, as :mod:`.job_watch`.
"""

from __future__ import annotations

import os
import shlex
import signal
import tempfile
import threading
import time
from contextlib import contextmanager

from lightning_hexiscale.lightning.launch import job_watch
from lightning_hexiscale.lightning.launch.job_watch import GRACEFUL, PHASES


WORKER_ENV = "HEXISCALE_WORKER_SIGINT_IGNORED"
"""Set in the environment of spawn workers started by :func:`workers_ignore_sigint_at_start`."""


@contextmanager
def workers_ignore_sigint_at_start():
    """``with workers_ignore_sigint_at_start(): start spawn/forkserver workers``: they start with
    SIGINT ignored until their entry (:func:`worker_entry`) puts Python's handler back.

    A spawn worker runs multiprocessing's bootstrap first (re-running the main script, unpickling
    the Trainer: imports of torch and Lightning), where a Ctrl-C printed a KeyboardInterrupt
    traceback. A blocked SIGINT does not reach it (the worker starts with an empty mask) and the
    package has no code there yet; an ignored SIGINT survives exec, and Python keeps ignoring a
    signal it found ignored. So the workers' interpreter is started by a two-line shell script
    that ignores SIGINT and execs it (multiprocessing's executable, meanwhile). The launching
    process keeps its own handler: its Ctrl-C still ends the job. Nothing changes where SIGINT is
    ignored already (nohup), or where the script cannot be run (a ``noexec`` temporary directory)."""
    import multiprocessing.spawn as spawn

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    real = spawn.get_executable()
    fd, path = tempfile.mkstemp(prefix="hexiscale-worker-", suffix=".sh")
    with os.fdopen(fd, "w") as f:
        f.write(f"#!/bin/sh\ntrap '' INT\nexport {WORKER_ENV}=1\nexec {shlex.quote(os.fsdecode(real))} \"$@\"\n")
    os.chmod(path, 0o700)
    watch = job_watch.current()
    if watch is not None:
        watch.files.append(path)
    usable = os.access(path, os.X_OK)  # False on a noexec mount
    if usable:
        spawn.set_executable(path)
    try:
        yield
    finally:
        if usable:
            spawn.set_executable(real)
        os.unlink(path)
        if watch is not None and path in watch.files:
            watch.files.remove(path)


def worker_entry() -> None:
    """First thing of a spawn worker's entry function: SIGINT back to Python's handler if the worker
    started ignoring it (:func:`workers_ignore_sigint_at_start`); its own processes start plain."""
    if os.environ.pop(WORKER_ENV, None) == "1" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)



class WorkerPhases:
    """The phase and step of each spawn/fork worker, and whether it has left, in shared memory
    (three ints per worker), read by the launching process's watch (:meth:`~.job_watch.JobWatch.now`).

    Why: under spawn and fork the launching process is no rank; its phase stays ``running`` while
    its workers train, so a terminal's Ctrl-C (which reaches the workers too, and their
    GracefulInterrupt stops them at the end of the step) ended the job at once there, and the
    interrupted step was not saved. With the workers' phases, the first Ctrl-C or SIGTERM in
    training waits for them as under popen, and a second Ctrl-C ends the job at once. A worker that
    left keeps its last phase: a terminal's Ctrl-C reaches the workers and the launching process
    at once, and a worker's second Ctrl-C (KeyboardInterrupt) can end it before the launching
    process's watch has read that signal; the watch must still see "training (step 3)".

    Args:
        context: the launcher's multiprocessing context (its shared memory reaches spawn workers
            as they start).
        workers: how many workers.
    """

    NAMES = tuple(PHASES)

    def __init__(self, context, workers: int):
        # phase (index in NAMES), step (-1: none), left (1; 2: stopped at once by Ctrl-C, no result handed back)
        self._cells = context.RawArray("i", 3 * workers)
        for i in range(workers):  # until a worker says more: it is starting, or joining the others
            self.report(i, "running", None)

    def report(self, worker: int, phase: str, step: int | None = None) -> None:
        """Worker ``worker`` is in ``phase``, at ``step``."""
        self._cells[3 * worker + 1] = -1 if step is None else int(step)
        self._cells[3 * worker] = self.NAMES.index(phase)

    def leave(self, worker: int) -> None:
        """Worker ``worker``'s Trainer call has ended (an idle rank that left, or any at the end): it
        keeps its last phase, but counts only once every worker has left."""
        self._cells[3 * worker + 2] = max(1, self._cells[3 * worker + 2])

    def stop_at_once(self, worker: int) -> None:
        """Ctrl-C stopped worker ``worker`` at once (its second one), and it is the worker that hands
        the caller its result or error: none will come (:meth:`~.job_watch.JobWatch.check_workers`)."""
        self._cells[3 * worker + 2] = 2

    def stopped_at_once(self) -> bool:
        return any(self._cells[3 * i + 2] == 2 for i in range(len(self._cells) // 3))

    def of(self, worker: int) -> tuple[str, int | None]:
        """Worker ``worker``'s last phase and step."""
        code, step = self._cells[3 * worker], self._cells[3 * worker + 1]
        return self.NAMES[code], None if step < 0 else step

    def left(self, worker: int) -> bool:
        return bool(self._cells[3 * worker + 2])

    def job(self) -> tuple[str, int | None] | None:
        """The job's phase as its workers report it: the first live worker's that is not graceful (a
        Ctrl-C there ends the job at once), else the first one saving, else the first with a step
        (an idle rank that waits reports none). Once every worker has left: the furthest phase any
        of them reached (NAMES is in the order of a job; an idle rank leaves at setup). None: no worker."""
        workers = range(len(self._cells) // 3)
        live = [self.of(i) for i in workers if not self.left(i)]
        for pick in (lambda s: s[0] not in GRACEFUL, lambda s: s[0] == "saving", lambda s: s[1] is not None,
                     lambda s: True):
            for seen in live:
                if pick(seen):
                    return seen
        # (ties: one with a step, not an idle rank's "training" while it waited)
        return max(map(self.of, workers), key=lambda s: (self.NAMES.index(s[0]), s[1] is not None), default=None)

    def graceful(self) -> bool:
        """Every worker still running is training or saving (its GracefulInterrupt stops it at the end of
        the step), or, once all have left, they left training or saving (:meth:`job`)."""
        seen = self.job()
        return seen is not None and seen[0] in GRACEFUL


def stop_workers(procs: list, own_s: float = 1.0, grace_s: float = 10.0) -> None:
    """Ctrl-C in the caller of a spawn/fork job (``procs``: its workers). A terminal's Ctrl-C reached
    the workers too (each ends through Lightning's KeyboardInterrupt handling); a SIGINT to the caller
    alone did not, and the caller's exit (multiprocessing joins its workers) waited for the whole
    training. Workers still alive after ``own_s`` get SIGINT, those alive after ``grace_s`` SIGKILL."""
    def alive() -> list:
        return [p for p in procs if p.is_alive() and p.pid is not None]

    for deadline, signum in ((own_s, signal.SIGINT), (grace_s, signal.SIGKILL)):
        end = time.monotonic() + deadline
        while alive() and time.monotonic() < end:
            time.sleep(0.05)
        for p in alive():
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(timeout=2.0)
