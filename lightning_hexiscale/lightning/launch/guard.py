"""Around the launch: what the caller sees when something is wrong, once, from the right process.

:class:`LaunchGuard` (installed by the strategy through ``internals.configure_launcher``) runs the
checks that need the Trainer call's arguments before processes start; :func:`agree` turns the same
check on every rank into one error, raised by rank 0, the other ranks ending quietly; a survivor's
communication error becomes :class:`RankFailure` naming the rank that failed; an idle rank's
:class:`IdleRankExit` ends its call cleanly; :class:`ChildWatch` replaces Lightning's popen observer.
Why: left alone, one configuration error gives N tracebacks, Lightning SIGKILLs the launching
process 5 s after a child fails, and a dead rank shows up as the survivors' raw "Connection closed
by peer". How each case is handled: docs/concepts/processes.md.
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_hexiscale.errors import (ConfigError, HexiScaleError, NonFiniteError, RankFailure, TrainingFailure,
                                       TrainingInterrupted)
from lightning_hexiscale.lightning.launch import job_watch
from lightning_hexiscale.runtime import EXIT_RANK_FAILED, host_slowdown, is_peer_failure

EXIT_CONFIG = 2
"""Exit status of a Lightning-started rank that stops on an error every rank agreed on (rank 0 reports it)."""
CHILD_ENV = "HEXISCALE_POPEN_CHILD"
"""Set in the environment of the processes the popen launcher starts (local ranks 1..n-1)."""


class IdleRankExit(BaseException):
    """Raised by the strategy's setup on a rank whose device the plan leaves idle
    (:mod:`~lightning_hexiscale.lightning.idle_ranks`); its launcher ends the Trainer call cleanly. A
    BaseException, like SystemExit: control flow that no ``except Exception`` of user code should swallow."""


# ---- one error from many ranks --------------------------------------------------------------------
def is_agreed(exc: BaseException) -> bool:
    """Raised on every rank after :func:`agree` (so rank 0 reports it for all)."""
    return hasattr(exc, "hexiscale_ranks")


def mark_agreed(exc: BaseException, ranks: list[int], world_size: int | None = None) -> BaseException:
    """Mark ``exc`` as raised alike on ``ranks`` (all of them: rank 0 reports it for all)."""
    exc.hexiscale_ranks = ranks
    if world_size is not None and len(ranks) < world_size:
        exc.__notes__ = [*getattr(exc, "__notes__", []), f"(raised on rank(s) {ranks} of {world_size})"]
    return exc


def _shared(exc: BaseException) -> bool:
    """An error every rank stops with alike, so that rank 0's report suffices: an agreed one, a
    non-finite step or a graceful Ctrl-C / SIGTERM stop (every rank takes those decisions together,
    at the same step) or another rank's failure."""
    return is_agreed(exc) or isinstance(exc, (RankFailure, NonFiniteError, TrainingInterrupted))


def portable_error(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it survives pickling (to travel to other ranks), else a RuntimeError with its text."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 -- any unpicklable exception travels as text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def agree(fn: Callable[[], Any], rank: int, world_size: int) -> Any:
    """``fn()`` on every rank; if it raised on any rank, every rank raises the lowest failing rank's
    error (this rank's own, traceback included, when it is that rank), marked agreed.

    Collective: every rank of the default process group must call it at the same point (one
    all-gather of a small object, the same on every backend).
    """
    err: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 -- handed to every rank below
        err = e
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        errors: list[Any] = [None] * world_size
        dist.all_gather_object(errors, portable_error(err))
    else:
        errors = [err]
    failed = [r for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    first = failed[0]
    raise mark_agreed(err if (err is not None and first == rank) else errors[first], failed, world_size)


# ---- weights that stayed in spawn/fork workers -----------------------------------------------------
_FIT_IN_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Modules whose last ``fit`` ran in spawn/fork workers -> (start method, id of their
``init_state_dict`` then). Why not hand the weights back, as Lightning's ddp_spawn does: the model
exists only as the ranks' shards, and this process's module was never materialised."""


def fit_ran_in_workers(module, start_method: str) -> None:
    """After a ``fit`` whose ranks were spawn/fork workers: ``module`` in this process still holds its
    initial weights."""
    if module is not None:
        _FIT_IN_WORKERS[module] = (start_method, id(getattr(module, "init_state_dict", None)))


def check_trained_weights(trainer, arguments: dict[str, Any]) -> None:
    """A Trainer call given a module that a spawn/fork ``fit`` trained, and no checkpoint to load,
    would silently run on the module's initial weights (the trained ones stayed in the workers): a
    ConfigError before processes start. Not when a checkpoint is loaded (``ckpt_path``, or
    ``trainer.ckpt_path`` set), nor when the module was given other weights since
    (``init_state_dict``)."""
    module = arguments.get("model")
    if module is None or arguments.get("ckpt_path") is not None or getattr(trainer, "ckpt_path", None) is not None:
        return
    seen = _FIT_IN_WORKERS.get(module)
    if seen is None or seen[1] != id(getattr(module, "init_state_dict", None)):
        return
    raise ConfigError("ckpt_path", None, f"{type(module).__name__} was trained by a fit whose ranks ran in "
                      f"start_method='{seen[0]}' worker processes: the trained weights stayed there, and this "
                      "process's module, which this call would run, holds its initial weights",
                      "pass ckpt_path='last' (or 'best', or a checkpoint file the fit wrote), or train with "
                      "start_method='popen' (the default), where this process is rank 0 and keeps its trained stage")


def check_checkpoint_dirs(trainer) -> None:
    """The folders the ``fit``'s ModelCheckpoint callbacks save into (its ``dirpath``, else the first
    logger's ``save_dir`` or ``default_root_dir``, below which Lightning puts them), refused in the
    launching process when they are a file, lie below a file, or cannot be written: rank 0's raw
    ``OSError`` from ``mkdir`` came at the first save, after training, while the other ranks waited."""
    from lightning_hexiscale.config.recipe import check_output_dir

    for callback in trainer.checkpoint_callbacks:
        if callback.dirpath is not None:
            key, path = f"{type(callback).__name__}(dirpath)", callback.dirpath
        elif trainer.loggers and trainer.loggers[0].save_dir:
            key, path = f"{type(trainer.loggers[0]).__name__}(save_dir)", trainer.loggers[0].save_dir
        else:
            key, path = "Trainer(default_root_dir)", trainer.default_root_dir
        if "://" not in str(path):  # a remote file system: its own client says
            check_output_dir(key, path, f"pass {key} a directory, or a path where one can be created")


def check_tuner(trainer, start_method: str) -> None:
    """Lightning's learning-rate finder (``Tuner.lr_find``, or the ``LearningRateFinder`` callback)
    runs inside ``fit`` and ends it with a private exception that Lightning catches in the process
    that called ``fit``. A spawn/fork worker raises it to torch's join instead (a traceback from
    inside Lightning), and the suggested learning rate would stay in the workers: a ConfigError
    before processes start. Under popen this process is rank 0 and gets it, as on one device."""
    from lightning.pytorch.callbacks import LearningRateFinder

    if start_method == "popen" or not any(isinstance(cb, LearningRateFinder) for cb in trainer.callbacks):
        return
    raise ConfigError("HexiScaleStrategy(start_method)", start_method,
                      "Lightning's learning-rate finder (Tuner.lr_find, LearningRateFinder) runs inside fit and "
                      f"keeps its suggestion in the process that runs rank 0, here a {start_method} worker, which "
                      "ends the search with an exception only the calling process can catch",
                      "use start_method='popen' (the default), where this process is rank 0 and gets the suggested "
                      "learning rate, or find it on one device")


# ---- the guard -------------------------------------------------------------------------------------
class LaunchGuard:
    """The strategy's hooks in its launcher (see the module doc). ``strategy`` provides
    ``check_before_launch(fitting, arguments)``, ``keep_call_arguments(trainer, fitting, arguments)``,
    ``failure_reason(exc)``, ``note_failure(exc)``, ``end_idle_call(trainer)`` and ``global_rank``."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.child_watch: ChildWatch | None = None
        self.call_model = None
        """The module of the ``fit`` being launched (None for other calls)."""

    # -- launching process -----------------------------------------------------------------------
    def before_launch(self, function: Callable, args: tuple, kwargs: dict, trainer=None) -> None:
        """Checks with the call's arguments (those of the Trainer call's inner function: ``model``,
        ``train_dataloaders``, ...), which the strategy then keeps; ``trainer``'s state says which
        call it is. Runs in every process that calls ``launch``: the popen children and torchrun's
        workers too; spawn/fork workers inherit what it kept."""
        # popen: this process is rank 0 and will meet the others; spawn/fork: it only waits for workers
        job_watch.set_phase("starting" if self.strategy.settings.start_method == "popen" else "running")
        try:
            bound = inspect.signature(function).bind_partial(*args, **kwargs).arguments
        except (TypeError, ValueError):  # an unexpected callable: nothing to check
            bound = {}
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        check_trained_weights(trainer, bound)
        if fitting:
            check_tuner(trainer, self.strategy.settings.start_method)
            check_checkpoint_dirs(trainer)
        self.call_model = bound.get("model") if fitting else None
        self.strategy.check_before_launch(fitting, dict(bound))
        self.strategy.keep_call_arguments(trainer, fitting, dict(bound))

    @contextmanager
    def marked_children(self):
        """The popen children inherit :data:`CHILD_ENV` (the launching process does not keep it) and
        SIGINT blocked (:class:`~.job_watch.blocked_during`; they unblock it once they can record it)."""
        before = os.environ.get(CHILD_ENV)
        os.environ[CHILD_ENV] = "1"
        try:
            with job_watch.blocked_during():
                yield
        finally:
            if before is None:
                os.environ.pop(CHILD_ENV, None)
            else:
                os.environ[CHILD_ENV] = before

    def watch_children(self, procs: list) -> None:
        grace = 2 * float(getattr(self.strategy, "watchdog_grace_s", 5.0)) + 10.0
        watch = job_watch.current()
        if watch is not None:
            watch.children.extend(procs)
        self.child_watch = ChildWatch(procs, first_rank=self.strategy.global_rank + 1, grace_s=grace).start()

    def job_ended(self) -> None:
        """The launching process is done with the job (teardown): the child watch ends nothing any more."""
        if self.child_watch is not None:
            self.child_watch.disarm()

    # -- every rank ---------------------------------------------------------------------------------
    def stop(self, exc: BaseException) -> BaseException:
        """The exception this rank should stop with: ``exc`` itself (its own error, or one every rank
        agreed on), or :class:`RankFailure` when ``exc`` is the consequence of another rank's failure."""
        note = getattr(self.strategy, "note_failure", None)
        if note is not None:
            note(exc)  # the idle rank that hosts the store waits for the job: it ends with this error
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) or _shared(exc):
            return exc
        why = self.strategy.failure_reason(exc)
        if not is_peer_failure(exc):
            return exc
        return RankFailure(f"rank {self.strategy.global_rank} stopped because another rank failed: "
                           f"{why or _first_line(exc)}")

    def exit_status(self, exc: BaseException) -> int:
        if isinstance(exc, TrainingInterrupted):  # 128 + the signal's number, as a shell reports it
            return 128 + (signal.SIGTERM if exc.signal_name == "SIGTERM" else signal.SIGINT)
        if isinstance(exc, TrainingFailure):
            return EXIT_RANK_FAILED
        return EXIT_CONFIG if isinstance(exc, HexiScaleError) else 1

    def run(self, function: Callable, args: tuple, kwargs: dict, trainer=None) -> Any:
        """``function(*args, **kwargs)`` on this rank (popen, torchrun, SLURM); see :meth:`stop`.
        An idle rank's call ends cleanly (``strategy.end_idle_call``) and returns None."""
        if os.environ.get(CHILD_ENV) == "1":
            # a popen child of a script that installed no handler of its own: Python's (KeyboardInterrupt)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        else:
            job_watch.set_phase("rendezvous")  # next: init_process_group, which waits for every rank
        try:
            return function(*args, **kwargs)
        except IdleRankExit:
            self.strategy.end_idle_call(trainer)
            return None
        except BaseException as exc:
            out = self.stop(exc)
            if os.environ.get(CHILD_ENV) == "1" and _shared(out):
                # A popen child: rank 0 (the launching process) raises the same error to the caller.
                raise SystemExit(self.exit_status(out)) from None
            if out is exc:
                raise
            raise out from exc

    def worker_report(self, exc: BaseException, process_idx: int) -> BaseException | None:
        """spawn/fork worker: the exception rank 0 hands back to the caller (agreed, or a
        RankFailure), or None when ``exc`` is this rank's own error (torch reports it with its traceback)."""
        out = self.stop(exc)
        if isinstance(out, (KeyboardInterrupt, SystemExit)) or not _shared(out):
            return None
        return portable_error(out)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# ---- popen children ----------------------------------------------------------------------------------
class ChildWatch:
    """Polls the popen children of the launching process (local ranks 1..n-1).

    Lightning's own observer kills every process 5 s after a child exits non-zero. Before every rank
    has joined the process group (``torch.distributed`` not yet initialized here), a child's exit
    ends the job at once: the launching process waits in ``init_process_group`` for it and would
    only stop at the timeout. Afterwards a child's exit only starts a clock: the launching process normally stops by itself at once (an agreed
    error, or the dead peer's closed connection, or its failure watch); if it is still inside the
    job after ``grace_s`` times :func:`host_slowdown` (read when the clock starts: on a loaded host
    its exception path takes that much longer), the watch kills the remaining children, names the
    rank and ends the launching process with status 4. After the job (``disarm``), it only reaps.
    """

    def __init__(self, procs: list, first_rank: int, grace_s: float, poll_s: float = 0.5):
        self.procs, self.first_rank, self.grace_s, self.poll_s = list(procs), first_rank, grace_s, poll_s
        self._armed = threading.Event()
        self._armed.set()
        self._joined = False

    def start(self) -> ChildWatch:
        threading.Thread(target=self._run, name="hexiscale-child-watch", daemon=True).start()
        return self

    def disarm(self) -> None:
        self._armed.clear()

    def _before_join(self) -> bool:
        """Not every rank has joined the process group yet: the job watch's phase when there is one,
        else whether this process has had a process group (an idle rank 0 leaves it later)."""
        watch = job_watch.current()
        if watch is not None:
            return watch.phase in ("starting", "rendezvous")
        self._joined = self._joined or (dist.is_available() and dist.is_initialized())
        return not self._joined

    def _run(self) -> None:
        since: float | None = None
        grace = self.grace_s
        while True:
            codes = [p.poll() for p in self.procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad and self._armed.is_set() and self._before_join():
                self._end(*bad[0], None)  # even the last child: rank 0 would wait for it until the timeout
            if all(c is not None for c in codes):
                return
            if bad and self._armed.is_set():
                if since is None:
                    since, grace = time.monotonic(), self.grace_s * host_slowdown()
                if time.monotonic() - since > grace:
                    self._end(*bad[0], grace)
            time.sleep(self.poll_s)

    def _end(self, index: int, code: int, grace_s: float | None) -> None:
        if not self._armed.is_set():
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        watch = job_watch.current()
        if grace_s is None:
            where = f"while {watch.describe()}" if watch is not None else "before every rank joined the process group"
            line = f"rank {self.first_rank + index} {how} {where}; ending the job (exit status {EXIT_RANK_FAILED})"
        else:
            line = (f"rank {self.first_rank + index} {how} and rank 0 did not stop within {grace_s:.0f} s; "
                    f"ending the job (exit status {EXIT_RANK_FAILED})")
        if watch is not None:
            watch.end(f"{watch.prog}: {line}", EXIT_RANK_FAILED)
        sys.stderr.write(f"hexiscale: {line}\n")
        sys.stderr.flush()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        os._exit(EXIT_RANK_FAILED)
