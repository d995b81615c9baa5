"""The phase of a training job and its Ctrl-C watch: Ctrl-C ends the job within seconds whatever it
is doing, with one line that names what it was doing, exit status 130 and no process left.

:class:`JobWatch` acts by the job's phase (:func:`set_phase`): in ``training`` and ``saving`` the
first Ctrl-C stops every rank at the end of the step (:class:`~.interrupt.GracefulInterrupt`), a
second one, or the first in any other phase, ends the job (:meth:`JobWatch.claim`, SIGKILL to every
process this one started, ``os._exit(130)``). Why a thread and a pipe (:func:`signal.set_wakeup_fd`)
beside the handler: Python runs a SIGINT handler only when the main thread returns to the
interpreter, which it does not while it waits inside torch. One watch per process; the ranks the
popen launcher starts only record Ctrl-C (:func:`record_in_child`); the workers of the spawn and fork
launchers report their phase to it (:class:`~.spawn_workers.WorkerPhases`). SIGTERM outside training ends the job
the same way, with status 143 (:meth:`JobWatch.on_sigterm`). Torch-free, so that the command
line installs it before anything heavy is imported. The phases: docs/guide/interrupts.md; the
mechanism: docs/concepts/processes.md.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

EXIT_INTERRUPTED = 130
"""128 + SIGINT, as shells report a job Ctrl-C ended."""
EXIT_TERMINATED = 143
"""128 + SIGTERM."""
EXIT_RANK_FAILED = 4
"""A rank failed: ``runtime.failure.EXIT_RANK_FAILED`` (this module imports no torch)."""

PHASES = {
    "planning": "planning",
    "discovering": "discovering this machine's cluster",
    "starting": "starting the ranks",
    "rendezvous": "waiting for the ranks to join (rendezvous)",
    "setup": "setting up the ranks (plan, devices, stages, checkpoint)",
    "running": "running the ranks",
    "training": "training",
    "saving": "saving a checkpoint",
    "finishing": "finishing",
    "between": "between two jobs of the sweep",
}
"""Phase -> the words of the one line (``interrupted (Ctrl-C) while <words>``)."""
IN_MAIN_THREAD = frozenset({"planning", "between"})
"""Phases whose work is Python code of the main thread: KeyboardInterrupt there ends them cleanly."""
GRACEFUL = frozenset({"training", "saving"})
"""Phases where the first Ctrl-C asks every rank to stop at the end of the step."""

_current: JobWatch | None = None
_worker: tuple[Any, int] | None = None
"""In a spawn/fork worker: where it reports its phase (:func:`enter_worker`)."""


def current() -> JobWatch | None:
    """This process's installed watch (None outside ``hexiscale train``: e.g. a user's script)."""
    return _current


def set_phase(phase: str, step: int | None = None) -> None:
    """Record the job's phase on this process's watch, if one is installed, or report it to the
    launching process from a spawn/fork worker (a no-op otherwise)."""
    if _current is not None:
        _current.set_phase(phase, step)
    elif _worker is not None:
        _worker[0].report(_worker[1], phase, step)


def _phase_now() -> tuple[str, int | None] | None:
    """This process's phase and step (its watch's, or the one this worker reported); None without either."""
    if _current is not None:
        return _current.phase, _current.step
    if _worker is not None:
        return _worker[0].of(_worker[1])
    return None


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), read from /proc; [] where there is none."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ')'
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_descendants(extra: list[Any] = (), reap_s: float = 2.0) -> None:
    """SIGKILL every process below this one and ``extra`` (Popen-like objects: where /proc is
    absent), then reap the direct children (up to ``reap_s``): a child left a zombie goes to an init
    that may never reap it, and still counts as a process of the job."""
    pids = set(descendants(os.getpid())) | {p.pid for p in extra if p.poll() is None}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + reap_s
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (a grandchild), or reaped already
                done = pid
            if done:
                waiting.discard(pid)
        if waiting:
            time.sleep(0.02)


def _flush_stdout(timeout_s: float) -> None:
    """Flush stdout from a helper thread: the main thread may hold its lock (blocked in a write)."""
    t = threading.Thread(target=lambda: sys.stdout.flush(), daemon=True)
    t.start()
    t.join(timeout_s)


class JobWatch:
    """The phase of this process's job and its Ctrl-C handling (module doc).

    Args:
        prog: the prefix of the one line (``hexiscale train``).
        quiet: print nothing (every rank but rank 0 under torchrun/SLURM: rank 0 speaks for the job).
        backstop_s: in ``planning``, how long after Ctrl-C the main thread may take to end the
            process before the watch ends it (it raised KeyboardInterrupt; only C code that never
            returns to Python can keep it).
    """

    def __init__(self, prog: str, quiet: bool = False, backstop_s: float = 4.0):
        self.prog, self.quiet, self.backstop_s = prog, quiet, backstop_s
        self.phase = "planning"
        self.step: int | None = None
        self.out: Path | None = None
        """The run's output directory, once known: its ``checkpoints/last.ckpt`` is named in the line."""
        self.ctrl_c = threading.Event()
        """Set at the first Ctrl-C."""
        self.children: list[Any] = []
        """Processes the launcher started (Popen-like), killed with the job where /proc is absent."""
        self.files: list[str] = []
        """Temporary files to remove when the watch ends the job (os._exit runs no ``finally``)."""
        self._claim = threading.Lock()
        self._claimed = False
        self._asked_to_finish = False
        self._finishing = False
        self._ending = False
        self._pipe: tuple[int, int] | None = None
        self._previous: tuple[Any, int] | None = None
        self._previous_term: Any = None
        self.workers: Any = None
        """spawn/fork: the phases its workers report (a :class:`~.spawn_workers.WorkerPhases`, which
        imports this module), while this process (no rank) runs them."""
        self.worker_procs: Callable[[], list] | None = None
        """spawn/fork: their processes (multiprocessing's; index = rank), [] until started."""
        self.sweep_line: Callable[[str], str] | None = None
        """In phase ``between`` (a ``-m`` sweep, after a job ended): the line for a Ctrl-C or SIGTERM
        there, given ``"Ctrl-C"`` or ``"SIGTERM"``: the jobs of the sweep that will not run."""

    def begin_run(self) -> None:
        """A new run of this process (each point of a ``-m`` sweep): the previous run's Ctrl-C, SIGTERM,
        phase, step, output directory and claimed line are forgotten. Kept, they made the next point's
        first Ctrl-C end it at once as ``Ctrl-C twice`` and print nothing (the line already claimed)."""
        with self._claim:
            self._claimed = False
        self._asked_to_finish = self._finishing = False
        self.ctrl_c.clear()
        self.out = None
        self.set_phase("planning")

    @property
    def finishing(self) -> bool:
        """A Ctrl-C or SIGTERM asked every rank to stop at the end of the step."""
        return self._finishing

    # ---- the phase -------------------------------------------------------------------------------
    def set_phase(self, phase: str, step: int | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown job phase {phase!r}; one of {', '.join(PHASES)}")
        self.step = step  # before the phase: the watch's thread reads the phase first (now)
        self.phase = phase

    def now(self) -> tuple[str, int | None]:
        """The job's phase and step: this process's, or, while it runs spawn/fork workers (phase
        ``running``), theirs (:meth:`~.spawn_workers.WorkerPhases.job`), e.g. ``training`` at step 12."""
        if self.phase == "running" and self.workers is not None:
            seen = self.workers.job()
            if seen is not None:
                return seen
        return self.phase, self.step

    def describe(self) -> str:
        """The phase in words: ``training (step 12)``, ``saving the checkpoint of step 12``."""
        phase, step = self.now()
        if phase == "training" and step is not None:
            return f"training (step {step})"
        if phase == "saving" and step is not None:
            return f"saving the checkpoint of step {step}"
        return PHASES[phase]

    def last_checkpoint(self) -> Path | None:
        """``<out>/checkpoints/last.ckpt`` if it exists (complete: only complete ones are renamed into place)."""
        last = self.out / "checkpoints" / "last.ckpt" if self.out is not None else None
        return last if last is not None and last.exists() else None

    def wait_if_ending(self, wait_s: float = 30.0) -> None:
        """In the main thread, at an error: when this watch's thread is ending the job (:meth:`end`:
        its line printed, the ranks being killed and reaped, up to a few seconds), wait for its exit
        status instead of racing it. The workers it kills make the main thread's launcher raise, and
        its own exit (status 1, or 130) came first: a job ended by ``rank 1 was killed ...`` left
        with 1, not 4."""
        deadline = time.monotonic() + wait_s
        while self._ending and time.monotonic() < deadline:
            time.sleep(0.05)

    @property
    def asked_to_finish(self) -> bool:
        """Whether a Ctrl-C asked every rank to finish its step (training or saving); the job goes on,
        and a second Ctrl-C ends it from this watch's thread."""
        return self._asked_to_finish

    def message(self, twice: bool | None = None, sigterm: bool = False) -> str:
        """The one line: the phase, and the checkpoint to resume from. ``twice`` (default: whether a
        Ctrl-C already asked the ranks to finish the step) names a second Ctrl-C."""
        if self.phase == "between" and self.sweep_line is not None:
            return self.sweep_line("SIGTERM" if sigterm else "Ctrl-C")
        what = "Ctrl-C twice" if (self._asked_to_finish if twice is None else twice) else "Ctrl-C"
        line = (f"{self.prog}: terminated (SIGTERM) while {self.describe()}" if sigterm
                else f"{self.prog}: interrupted ({what}) while {self.describe()}")
        return line + self._checkpoint_note()

    def worker_died(self, worker: int, code: int) -> str:
        """The line for a spawn/fork worker that died (exit status ``code``; negative: a signal)
        while the ranks finished their step after a Ctrl-C or SIGTERM."""
        how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"exited with status {code}")
        return (f"{self.prog}: rank {worker} {how} while {self.describe()}, before the ranks could stop at the end "
                f"of the step; ending the job (exit status {EXIT_RANK_FAILED})" + self._checkpoint_note())

    def _checkpoint_note(self) -> str:
        line = ""
        phase = self.now()[0]
        if phase == "saving":
            line += "; that checkpoint was not completed"
        last = self.last_checkpoint()
        if last is not None:
            line += f"; the last checkpoint, {last}, was kept (resume with trainer.resume={last})"
        elif phase == "training":
            line += "; no checkpoint was written"
        return line

    def claim(self) -> bool:
        """True for the first caller only: whoever prints the job's one line (the main thread's
        exception handler or this watch's thread) claims it first."""
        with self._claim:
            first, self._claimed = not self._claimed, True
            return first

    def say(self, line: str) -> None:
        """Print ``line`` on stderr if this process speaks for the job and nobody has yet."""
        if self.claim() and not self.quiet:
            if threading.current_thread() is threading.main_thread():
                print(line, file=sys.stderr, flush=True)
            else:  # the watch's thread: never wait for a lock the blocked main thread may hold
                os.write(2, (line + "\n").encode())

    # ---- ending the job --------------------------------------------------------------------------
    def end(self, line: str | None, code: int = EXIT_INTERRUPTED) -> None:
        """Print ``line`` (once), kill every process this one started, leave with ``code`` now."""
        self._ending = True
        _flush_stdout(0.5)
        if line is not None:
            self.say(line)
        # The line is the last word: what the main thread still prints while the ranks are killed
        # (torch's "Terminating process ..." as it sees a worker die) goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        kill_descendants(self.children)
        for path in list(self.files):
            try:
                os.unlink(path)
            except OSError:
                pass
        os._exit(code)

    def on_ctrl_c(self) -> None:
        """One Ctrl-C, seen by the watch's thread (the table of the module doc)."""
        first = not self.ctrl_c.is_set()
        self.ctrl_c.set()
        phase = self.now()[0]
        if phase in IN_MAIN_THREAD:
            if first:  # a daemon: a process that ends by itself does not wait for it
                timer = threading.Timer(self.backstop_s, self._backstop)
                timer.daemon = True
                timer.start()
            return
        if phase in GRACEFUL and not self._asked_to_finish:
            # GracefulInterrupt (every rank) stops at the end of the step
            self._asked_to_finish = self._finishing = True
            return
        # After a graceful first one, any phase: spawn/fork workers got this SIGINT too, and may have
        # stopped at once and left before this thread read it (then their phase is only their last).
        self.end(self.message())

    def _backstop(self) -> None:
        self.end(self.message())

    def on_sigterm(self) -> None:
        """SIGTERM, seen by the watch's thread. In training and saving, GracefulInterrupt's handler
        (which replaced Lightning's) stops every rank at the end of the step; in any other phase the
        job ends now, ranks included: without this, SIGTERM's default action ended this process
        alone, silently, and the popen ranks it started stayed behind."""
        if self.now()[0] not in GRACEFUL:
            self.end(self.message(sigterm=True), EXIT_TERMINATED)
        self._finishing = True

    # ---- installing ------------------------------------------------------------------------------
    def install(self) -> JobWatch:
        """Make this the process's watch: a SIGINT handler (KeyboardInterrupt while planning, only
        recorded after), a SIGTERM one and the wakeup pipe's reader thread. Main thread only. A
        process that inherited SIGINT ignored (``nohup ... &``, a background job of a script) keeps
        ignoring it, and is still watched otherwise: it returned here before, so ``kill`` of such a
        job ended the launching process alone (its ranks left running) and a rank that died was
        reported without the command's name."""
        global _current
        r, w = os.pipe()
        os.set_blocking(w, False)  # set_wakeup_fd requires it: the C handler must never block
        self._pipe = (r, w)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            self._previous = (signal.SIG_IGN, old_fd)  # uninstall leaves it ignored
        else:
            self._previous = (signal.signal(signal.SIGINT, self._handler), old_fd)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # a Python handler, so that SIGTERM reaches the pipe; the thread acts on it (on_sigterm)
            self._previous_term = signal.signal(signal.SIGTERM, _record_only)
        threading.Thread(target=self._read, args=(r,), name="hexiscale-ctrl-c", daemon=True).start()
        _current = self
        return self

    def uninstall(self) -> None:
        """Put back the previous handler and wakeup fd; the reader thread ends."""
        global _current
        if self._previous is not None:
            handler, old_fd = self._previous
            signal.signal(signal.SIGINT, handler)
            signal.set_wakeup_fd(old_fd)
            self._previous = None
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
        if self._pipe is not None:
            os.close(self._pipe[1])  # the reader sees end-of-file
            self._pipe = None
        if _current is self:
            _current = None

    def _handler(self, signum, frame) -> None:
        self.ctrl_c.set()
        if self.phase in IN_MAIN_THREAD:
            if _importing():
                # KeyboardInterrupt inside an import can abort the process: torch's C++ start-up turns
                # it into pybind11's error_already_set, then std::terminate (exit -6, a C++ trace)
                self.end(self.message())
            raise KeyboardInterrupt

    def _read(self, fd: int, poll_s: float = 0.2) -> None:
        while True:
            try:
                ready = select.select([fd], [], [], poll_s)[0]
                data = os.read(fd, 64) if ready else b""
            except OSError:
                return
            if ready and not data:
                os.close(fd)
                return
            for signum in data:
                if signum == signal.SIGINT:
                    self.on_ctrl_c()
                elif signum == signal.SIGTERM:
                    self.on_sigterm()
            self.check_workers()

    def check_workers(self) -> None:
        """spawn/fork: Ctrl-C stopped the reporting worker at once
        (:meth:`~.spawn_workers.WorkerPhases.stopped_at_once`), so no result will come: the job ends
        now (polled every ``poll_s``), as at a second Ctrl-C this watch saw. It may have seen one,
        or none (two SIGINTs that reach a busy process close together can be delivered as one;
        ``kill -INT`` of the workers), and the main thread would wait for rank 0's result until the
        workers' interpreters had ended (seconds), or for ever without
        :class:`~lightning_hexiscale.lightning.internals.StoppedAtOnce`. After a Ctrl-C or SIGTERM
        (the ranks finish the step), a worker that died without leaving its call ends the job too."""
        workers = self.workers
        if workers is not None and workers.stopped_at_once():
            self.ctrl_c.set()
            self.end(self.message())
        if workers is None or not self._finishing or self.worker_procs is None:
            return
        # A worker that died without leaving its call (a signal, os._exit, the OOM killer) while the
        # others finish the step: that step cannot be saved, and torch's join would first send the
        # others SIGTERM, which their GracefulInterrupt only records, and wait 30 s for them.
        for i, proc in enumerate(self.worker_procs()):
            try:
                code = proc.exitcode
            except ValueError:  # closed: torch's join has it, and says why
                continue
            if code not in (None, 0) and not workers.left(i):
                self.end(self.worker_died(i, code), EXIT_RANK_FAILED)


def _record_only(signum, frame) -> None:
    """The main thread's SIGTERM handler under a watch: nothing; the watch's thread acts."""


def _importing() -> bool:
    """A module is being imported (its import lock is held): importlib's table of module locks is
    not empty (CPython; a private table, read only, absent elsewhere: then False)."""
    import importlib._bootstrap as bootstrap

    return bool(getattr(bootstrap, "_module_locks", None))


def record_in_child(flag: threading.Event) -> None:
    """A rank the popen launcher started: Ctrl-C only sets ``flag`` (the launching process ends the
    job, or every rank stops at the end of the step), and SIGINT, which the launcher blocked while
    it started this process (:func:`blocked_during`), is unblocked: a Ctrl-C that came while this
    process imported torch is delivered now, to this handler, instead of a KeyboardInterrupt
    traceback in the middle of an import."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class blocked_during:
    """``with blocked_during(): start processes``: SIGINT is blocked in this thread meanwhile, so
    the processes started inherit it blocked (a signal mask survives fork and exec) until they
    install their handler (:func:`record_in_child`). Here a Ctrl-C of that moment stays pending
    until the block ends, or is handled at once by another thread of the process: never lost."""

    def __enter__(self) -> blocked_during:
        self._was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return self

    def __exit__(self, *exc) -> None:
        if signal.SIGINT not in self._was:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def enter_worker(phases: Any, worker: int) -> None:
    """First thing of a spawn/fork worker: its phases go to ``phases`` (for the launching process's
    watch) instead of a watch of its own. A fork worker inherits the launching process's watch and
    its signal wakeup pipe: each Ctrl-C the worker got would reach the launching process's watch as
    one more Ctrl-C of its own (the second one ends the job at once), so the worker drops both, and
    the watch's SIGINT handler, which only records a Ctrl-C outside planning: with it a fork
    worker's second Ctrl-C did nothing (it finished the step), a spawn worker's stopped it at once."""
    global _current, _worker
    if _current is not None and threading.current_thread() is threading.main_thread():
        signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGINT) == _current._handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    _current = None
    _worker = None if phases is None else (phases, worker)


def stopped_at_once() -> None:
    """The spawn/fork worker that reports to the caller was stopped at once by Ctrl-C: its watch
    ends the job now (:meth:`JobWatch.check_workers`)."""
    if _worker is not None:
        _worker[0].stop_at_once(_worker[1])


def leave_worker() -> None:
    """A spawn/fork worker's Trainer call has ended: the launching process no longer counts it."""
    global _worker
    if _worker is not None:
        _worker[0].leave(_worker[1])
        _worker = None


def phased(fn: Callable, phase: str, step: Callable[[], int | None]) -> Callable:
    """``fn`` wrapped so that the job is in ``phase`` (at ``step()``) while it runs, then back in
    the phase it was in (e.g. ``trainer.save_checkpoint``: saving, then training again)."""
    def wrapper(*args, **kwargs):
        before = _phase_now()
        if before is None:
            return fn(*args, **kwargs)
        set_phase(phase, step())
        try:
            return fn(*args, **kwargs)
        finally:
            now = _phase_now()
            if now is not None and now[0] == phase:
                set_phase(*before)
    wrapper.__wrapped__ = fn
    return wrapper
