"""The one module that touches Lightning's (and torch's) private attributes.

The strategy runs forward and backward itself, cuts every global batch into per-pipeline slices
and launches its own way; Lightning 2.x has no public switch for these, so a few private names are
set or read. They all live here, behind named functions, so that a Lightning upgrade that renames
one breaks in exactly one place, and :func:`check` (run by the strategy's ``setup`` and by
``tests/lightning/test_internals.py``, which also fails when a private Lightning name is used
outside this module or is missing from this list) says which name moved, in which Lightning
version, instead of failing deep inside a training step.

The touches: 11 (Lightning's own strategies: 4-8), one per function or class here, each name checked
by :data:`CHECKS`:

The step and the data (2):
  1. ``_FitLoop._skip_backward`` (read by ``_AutomaticOptimization``): :func:`skip_lightning_backward`
  2. ``Trainer._accelerator_connector.use_distributed_sampler``: :func:`keep_dataloader_sampler`
Idle ranks (2; the idle-rank switch reads ``StrategySettings.timeout``, not ``DDPStrategy._timeout``):
  3. ``trainer.call._call_teardown_hook``, ``Trainer._teardown``: :func:`end_without_training`
  4. a logger's ``_version``: :func:`logger_versions`, :func:`adopt_logger_versions`
Launching (4):
  5. ``DDPStrategy._configure_launcher``, ``_launcher``, ``_start_method``: :class:`LauncherHooks`,
     :func:`configure_launcher`
  6. ``_SubprocessScriptLauncher``, its ``_call_children_scripts``: :class:`ScriptLauncher`
  7. ``_MultiProcessingLauncher``, its ``_wrapping_function``, ``_collect_rank_zero_results``,
     ``_recover_results_in_main_process`` and ``_strategy``: :class:`ProcessLauncher` (idle ranks:
     the reporting worker; a worker stopped at once by Ctrl-C)
  8. ``Trainer.__init__``'s ``precision`` local, read from its frame: :func:`trainer_precision_argument`
Logging (1):
  9. ``Trainer._results`` (the active loop's ``_ResultCollection``), its ``batch_size``:
     :func:`logged_batch_size`
Prediction (1):
  10. ``_IndexBatchSamplerWrapper``, its ``_batch_sampler`` and ``_iterator`` (what the predict loop
      hands a ``BasePredictionWriter`` as batch indices): :func:`record_batch_indices`
SIGTERM (1):
  11. ``Trainer._signal_connector`` (its ``received_sigterm`` and ``_sigterm_notifier_fn``) and
      ``_TrainingEpochLoop._broadcast_sigterm_tensor``: :func:`stop_on_sigterm`

Torch's, not Lightning's: the LR scheduler's ``_opt_called`` / ``_wrapped_by_lr_sched``
(:func:`track_step_calls`) and ``sys._getframe`` (8.).

Tested with lightning 2.6 (pyproject bounds the version to ``>=2.4,<2.7``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import weakref
from typing import Any, Callable

from lightning_hexiscale.errors import HexiScaleError
from lightning_hexiscale.lightning.launch import job_watch, spawn_workers

TESTED = "2.4-2.6"
"""Lightning versions the attributes below were read from."""

_TRAINER = "lightning.pytorch.trainer.trainer.Trainer"
_FIT_LOOP = "lightning.pytorch.loops.fit_loop._FitLoop"
_DDP = "lightning.pytorch.strategies.ddp.DDPStrategy"
_SCRIPT = "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher"
_PROCESSES = "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher"
_INDEX_WRAPPER = "lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper"
_EPOCH_LOOP = "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop"
_WRAPPING_ARGS = ("self", "process_idx", "trainer", "function", "args", "kwargs", "return_queue")

CHECKS: tuple[tuple[int, str, str, str], ...] = (
    (1, _FIT_LOOP, "_skip_backward", "property"),
    (1, "lightning.pytorch.loops.optimization.automatic._AutomaticOptimization", "_skip_backward", "init"),
    (2, _TRAINER, "_accelerator_connector", "init"),
    (2, "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector",
     "use_distributed_sampler", "init"),
    (3, "lightning.pytorch.trainer.call", "_call_teardown_hook", "callable"),
    (3, _TRAINER, "_teardown", "callable"),
    (4, "lightning.pytorch.loggers.csv_logs.CSVLogger", "_version", "init"),
    (5, _DDP, "_configure_launcher", "callable"),
    (5, _DDP, "_launcher", "init"),
    (5, _DDP, "_start_method", "init"),
    (6, _SCRIPT, "_call_children_scripts", "callable"),
    (7, _PROCESSES, "_wrapping_function", "worker"),
    (7, _PROCESSES, "_collect_rank_zero_results", "callable"),
    (7, _PROCESSES, "_recover_results_in_main_process", "callable"),
    (7, _PROCESSES, "_strategy", "init"),
    (8, _TRAINER, "precision", "local"),
    (9, _TRAINER, "_results", "property"),
    (9, "lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection", "batch_size", "init"),
    (10, "lightning.pytorch.overrides.distributed", "_IndexBatchSamplerWrapper", "callable"),
    (10, _INDEX_WRAPPER, "_batch_sampler", "init"),
    (10, _INDEX_WRAPPER, "_iterator", "init"),
    (11, _TRAINER, "_signal_connector", "init"),
    (11, "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "_sigterm_notifier_fn", "callable"),
    (11, _EPOCH_LOOP, "_broadcast_sigterm_tensor", "callable"),
)
"""(touch number of the module doc, owner, name, kind) for every private name used here. Kinds:
``callable`` (a method or function of the owner), ``property``, ``init`` (assigned by the
``__init__`` of the owner or a base), ``worker`` (``_wrapping_function`` with the arguments
:class:`ProcessLauncher` passes), ``local`` (a local variable of the owner's ``__init__``)."""


class LightningInternalsChanged(HexiScaleError, RuntimeError):
    """A private Lightning attribute the strategy relies on is gone (a Lightning upgrade)."""


def _missing(where: str, attr: str) -> LightningInternalsChanged:
    return _missing_all([f"{where}.{attr}"])


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return importlib.import_module(path)


def _init_names(owner: type) -> set[str]:
    """Attribute names the ``__init__`` of ``owner`` or of a base sets or reads (under Lightning's
    decorators, e.g. the Trainer's environment-variable defaults)."""
    names: set[str] = set()
    for cls in owner.__mro__:
        code = getattr(inspect.unwrap(cls.__dict__.get("__init__", object)), "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def _present(owner: Any, name: str, kind: str) -> bool:
    if kind == "callable":
        return callable(getattr(owner, name, None))
    if kind == "property":
        return isinstance(getattr(owner, name, None), property)
    if kind == "init":
        return name in _init_names(owner)
    if kind == "local":
        return name in inspect.unwrap(owner.__init__).__code__.co_varnames
    if kind == "worker":
        fn = getattr(owner, name, None)
        return callable(fn) and fn.__code__.co_varnames[:len(_WRAPPING_ARGS)] == _WRAPPING_ARGS
    raise ValueError(f"unknown kind {kind!r}")


def check() -> None:
    """Raise :class:`LightningInternalsChanged` naming every private name of :data:`CHECKS` that moved."""
    gone = []
    for _touch, path, name, kind in CHECKS:
        try:
            owner = _resolve(path)
        except ImportError:
            owner = None
        if owner is None or not _present(owner, name, kind):
            gone.append(f"{path}.{name}" + (str(_WRAPPING_ARGS) if kind == "worker" else ""))
    if gone:
        raise _missing_all(gone)


def _missing_all(gone: list[str]) -> LightningInternalsChanged:
    import lightning

    return LightningInternalsChanged(
        f"{', '.join(gone)} {'is' if len(gone) == 1 else 'are'} missing in lightning {lightning.__version__}: the "
        f"hexiscale strategy relies on {'it' if len(gone) == 1 else 'them'} (tested with lightning {TESTED}). Fix: "
        f"pip install 'lightning>=2.4,<2.7', or update lightning_hexiscale/lightning/internals.py for this release")


# ---- the step and the data ---------------------------------------------------------------------
def skip_lightning_backward(trainer) -> None:
    """Lightning's closure would run zero_grad and backward after ``training_step``, wiping the
    gradients the pipeline schedule produced inside it (Lightning's automatic optimisation runs
    training_step, then zero_grad, then backward; NeMo sets the same flag for the same reason)."""
    trainer.fit_loop._skip_backward = True


def keep_dataloader_sampler(trainer) -> None:
    """No injected DistributedSampler: the strategy cuts the loader per pipeline itself, and the
    loader's own ``shuffle`` decides, as on one device."""
    connector = getattr(trainer, "_accelerator_connector", None)
    if connector is None:
        raise _missing("lightning.pytorch.Trainer", "_accelerator_connector")
    connector.use_distributed_sampler = False


# ---- idle ranks ---------------------------------------------------------------------------------------
def end_without_training(trainer) -> None:
    """End a Trainer call that stopped at the strategy's setup as Lightning ends one a tuner stops
    early (trainer/call.py, ``_TunerExitException``): the teardown hooks (callbacks, module,
    loggers), the Trainer's own teardown (the strategy's), status FINISHED."""
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.states import TrainerStatus

    call._call_teardown_hook(trainer)
    trainer._teardown()
    trainer.state.status = TrainerStatus.FINISHED
    trainer.state.stage = None


def logger_versions(trainer) -> list:
    """Each logger's version where it keeps one (CSV, TensorBoard: ``_version``), else None."""
    return [logger.version if hasattr(logger, "_version") else None for logger in trainer.loggers]


def adopt_logger_versions(trainer, versions: list | None) -> None:
    """Give the loggers ``versions`` (another rank's :func:`logger_versions`), so that whichever
    rank logs writes into the same version directory."""
    for logger, version in zip(trainer.loggers, versions or []):
        if version is not None and hasattr(logger, "_version"):
            logger._version = version


# ---- logging ------------------------------------------------------------------------------------------
def logged_batch_size(module) -> Callable[[int], None]:
    """``rows -> None``: the batch size by which Lightning weighs the values ``module`` logs for the
    current evaluation batch becomes ``rows``, the global batch's. Lightning takes it from the batch
    it hands the step, here the rank's slice (4 or 2 of 6, 3 or 2 of a last 5), while the loss is the
    global batch's: the epoch mean then weighed each batch by its slice (no sync_dist) or by the
    sum of the slices of every rank (sync_dist; a pipeline of 2 stages counts its slice twice), not
    by its size as on one device. An explicit ``self.log(..., batch_size=...)`` still wins."""
    def note(rows: int) -> None:
        results = module.trainer._results
        if results is not None:
            results.batch_size = rows

    return note


# ---- prediction -------------------------------------------------------------------------------------
def record_batch_indices(loader):
    """``loader`` (a ``PlanDataLoader``) over a batch sampler that records, per batch, the sample
    indices of the whole global batch: what the predict loop hands a ``BasePredictionWriter``. It
    finds them only in its own ``_IndexBatchSamplerWrapper``, which Lightning put around the user's
    batch sampler and the per-pipeline loader replaced (the writer got ``[]``); global rank 0's
    predictions are the whole batch's logits, so the indices are the whole batch's, as on one device."""
    return loader.with_batch_sampler(_GlobalBatchIndices(loader.batch_sampler))


try:  # module level, as Lightning's own; check() names a base that moved
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
except ImportError:  # pragma: no cover - a Lightning release without it
    _IndexBatchSamplerWrapper = object  # type: ignore[misc,assignment]


class _GlobalBatchIndices(_IndexBatchSamplerWrapper):
    """Lightning's wrapper, recording the global batch of each slice (``PlanBatchSampler.window``)."""

    def __next__(self) -> list[int]:
        batch = next(self._iterator)
        self.seen_batch_indices.append(list(self._batch_sampler.window))
        return batch


# ---- SIGTERM ----------------------------------------------------------------------------------------
def stop_on_sigterm(trainer) -> None:
    """Lightning's SIGTERM notifier broadcasts from inside the signal handler (a hang until the
    process-group timeout): :class:`~lightning_hexiscale.lightning.launch.sigterm.SigtermStop` replaces it
    and the per-batch broadcast of rank 0's flag (the notifier is read when Lightning registers its
    handlers, after the strategy's setup). Per Trainer call, on the ranks that run it."""
    from lightning_hexiscale.lightning.launch.sigterm import SigtermStop

    connector = trainer._signal_connector

    def mark_received() -> None:
        connector.received_sigterm = True

    stop = SigtermStop(trainer, mark_received)
    connector._sigterm_notifier_fn = stop.notify
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = stop.agree
    strategy = trainer.strategy
    for name in ("validation_step", "test_step", "predict_step"):  # every rank, at each evaluation batch
        step = getattr(type(strategy), name).__get__(strategy)

        def agreed(*args, _step=step, **kwargs):
            stop.agree_evaluation(_batch_index(args, kwargs))  # returns at once inside fit
            return _step(*args, **kwargs)

        setattr(strategy, name, agreed)


def _batch_index(args: tuple, kwargs: dict) -> int:
    """``batch_idx`` of a Lightning step call (``step(batch, batch_idx, ...)``)."""
    return int(kwargs.get("batch_idx", args[1] if len(args) > 1 else -1))


# ---- the optimizer (torch's private names) ------------------------------------------------------
def track_step_calls(optimizer) -> None:
    """Give ``optimizer.step`` what torch's LR scheduler gives its optimizer's when it is built
    (``LRScheduler.__init__``, ``patch_track_step_called``): a wrapper that records the call. An LR
    scheduler re-pointed at ``optimizer`` (ZeRO's sharded one) then neither warns that the step
    was "overridden" nor that it ran "before optimizer.step()". Idempotent."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref, func = weakref.ref(optimizer), type(optimizer).step

    @functools.wraps(func)
    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return func(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step


# ---- launchers ---------------------------------------------------------------------------------
class LauncherHooks:
    """A mixin placed before ``DDPStrategy``: Lightning calls ``_configure_launcher`` when the
    Trainer is built, with ``num_nodes`` and ``devices`` known. The strategy's
    ``before_launcher_configured()`` runs first (its checks), then :func:`configure_launcher` with
    the strategy's ``launch_guard``."""

    def _configure_launcher(self) -> None:
        self.before_launcher_configured()
        configure_launcher(self, self.launch_guard)


def trainer_precision_argument() -> str | None:
    """The ``precision`` argument of the ``Trainer(...)`` call being built, as the user gave it, or
    None outside one. Lightning's connector replaces ``16-mixed`` by ``bf16-mixed`` on CPU before a
    strategy sees its precision plugin; the strategy refuses 16-mixed on every device, so it reads
    the argument from the ``Trainer.__init__`` frame that is constructing it (it calls the strategy's
    ``_configure_launcher``)."""
    import inspect
    import sys

    from lightning.pytorch import Trainer

    code = inspect.unwrap(Trainer.__init__).__code__  # under Lightning's env-var defaults decorator
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            value = frame.f_locals.get("precision")
            # Lightning's short forms: 16 and "16" mean 16-mixed, "bf16" bf16-mixed
            return None if value is None else {"16": "16-mixed", "bf16": "bf16-mixed"}.get(str(value), str(value))
        frame = frame.f_back
    return None


def configure_launcher(strategy, guard) -> None:
    """Give ``strategy`` (a DDPStrategy) Lightning's launcher for its start method, with ``guard``
    (:class:`lightning_hexiscale.lightning.launch.guard.LaunchGuard`) around it:

    - ``popen``: Lightning's script launcher re-runs the script per local rank, but its process
      observer SIGKILLs every process, the launching one included, 5 s after any child exits non-zero,
      before the launching rank can say why (the job ends with -9). The guard's child watch replaces it.
    - ``spawn`` / ``fork``: the workers' exceptions reach the caller as torch's ``ProcessRaisedException``
      (a traceback as text) or ``ProcessExitedException``; the guard has rank 0's error travel back and
      raises the error itself.
    In every process the guard checks what it can before processes start and turns a rank's
    exception into the one the caller should see (:meth:`LaunchGuard.stop`).
    """
    if strategy._start_method == "popen":
        strategy._launcher = ScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes,
                                            guard)
    else:
        strategy._launcher = ProcessLauncher(strategy, strategy._start_method, guard)


try:  # module level, so that spawn can pickle the launcher; check() names a base that moved
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
except ImportError:  # pragma: no cover - a Lightning release without them
    _MultiProcessingLauncher = _SubprocessScriptLauncher = object  # type: ignore[misc,assignment]


class _DropRecords(logging.Filter):
    """Drops log records that start with ``prefix`` while ``when()`` holds."""

    def __init__(self, prefix: str, when=lambda: True):
        super().__init__()
        self.prefix, self.when = prefix, when

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(self.prefix) and self.when())


class ScriptLauncher(_SubprocessScriptLauncher):
    """``popen``: Lightning's ``launch`` (lightning 2.6, launchers/subprocess_script.py) with the
    guard's checks, its child watch instead of Lightning's observer, and its ``run``."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, guard):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.guard = guard

    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self.guard.before_launch(function, args, kwargs, trainer)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            with self.guard.marked_children():
                self._call_children_scripts()
            self.guard.watch_children(self.procs)
        return self.guard.run(function, args, kwargs, trainer)


class ProcessLauncher(_MultiProcessingLauncher):
    """``spawn`` / ``fork``: rank 0's error (an error every rank agreed on, a non-finite step, or the
    failure of another rank) comes back through a queue and is raised in the caller's process."""

    def __init__(self, strategy, start_method: str, guard):
        super().__init__(strategy, start_method=start_method)
        self.guard = guard
        self._errors = None
        self._phases = None

    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        import multiprocessing

        from lightning.pytorch.utilities.exceptions import SIGTERMException
        from torch.multiprocessing import ProcessExitedException

        from lightning_hexiscale.lightning.launch.guard import fit_ran_in_workers
        from lightning_hexiscale.lightning.launch.sigterm import EXIT_SIGTERM, ForwardToWorkers
        from lightning_hexiscale.runtime import collect_before_fork

        self.guard.before_launch(function, args, kwargs, trainer)
        if self._start_method == "fork":  # no child may free a process group it inherited
            collect_before_fork()
        context = multiprocessing.get_context(self._start_method)
        self._errors = context.SimpleQueue()
        # the workers' phases: a Ctrl-C / SIGTERM while they train waits for them to stop at the end of the step
        self._phases = spawn_workers.WorkerPhases(context, self._strategy.num_processes)
        watch = job_watch.current()
        if watch is not None:
            watch.workers = self._phases
            watch.worker_procs = lambda: list(self.procs)  # Lightning sets them once started
        # Once rank 0 has handed its error back and exited, torch's join terminates the other
        # workers (already on their way out) and logs a warning per worker: noise then.
        sigterm = ForwardToWorkers(self)  # this process is no rank: a SIGTERM goes to the workers
        # (after a Ctrl-C or SIGTERM too: a worker that died then ends the job with the watch's line)
        quiet = _DropRecords("Terminating process", lambda: not self._errors.empty() or sigterm.received
                             or (watch is not None and watch.finishing))
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        spawn_log.addFilter(quiet)
        try:
            with sigterm, spawn_workers.workers_ignore_sigint_at_start():  # no traceback from a worker's bootstrap
                result = super().launch(function, *args, trainer=trainer, **kwargs)
            if isinstance(result, StoppedAtOnce):  # a call without a Trainer (with one: _recover_results_...)
                _stopped_at_once()
            fit_ran_in_workers(self.guard.call_model, self._start_method)
            return result
        except KeyboardInterrupt:
            if self._phases.graceful() and self._wait_for_workers():
                # a script's GracefulInterrupt: the workers stop at the end of the step (and save it)
                if not self._errors.empty():
                    raise self._errors.get() from None
                raise
            spawn_workers.stop_workers(self.procs)  # SIGINT to the caller alone: Lightning's exit waited for them
            raise
        except ProcessExitedException:
            if not self._errors.empty():
                raise self._errors.get() from None
            if sigterm.received:
                raise SIGTERMException(EXIT_SIGTERM) from None
            raise
        finally:
            spawn_log.removeFilter(quiet)
            if watch is not None:
                # the job is where its workers left it (e.g. training, step 3, when a Ctrl-C stopped
                # them): this process's line names that phase, not "running the ranks"
                left_at = self._phases.job()
                if left_at is not None and watch.phase == "running":
                    watch.set_phase(*left_at)
                watch.workers = watch.worker_procs = None

    def _wait_for_workers(self) -> bool:
        """After a Ctrl-C in a script (no job watch) while every worker trains with GracefulInterrupt:
        wait for them to stop at the end of the step; False at a second Ctrl-C (stop them now)."""
        try:
            for p in self.procs:
                p.join()
        except KeyboardInterrupt:
            return False
        return True

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, return_queue,
                           global_states=None) -> None:
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from lightning_hexiscale.lightning.launch.guard import IdleRankExit

        from lightning_hexiscale.lightning.launch.sigterm import ForwardToWorkers

        spawn_workers.worker_entry()
        job_watch.enter_worker(self._phases, process_idx)  # its phases go to the caller's watch
        ForwardToWorkers.leave_in_worker()  # fork: the caller's forwarding handler is not this worker's
        self._collected = None
        try:
            try:
                super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
            except IdleRankExit:  # an idle device: the call ends cleanly; the first training rank reports
                end_without_training(trainer)
                return
            except BaseException as exc:  # noqa: BLE001 -- classified by the guard, re-raised when it is the cause
                report = self.guard.worker_report(exc, process_idx)
                if report is None:
                    if isinstance(exc, KeyboardInterrupt) and self._reports(process_idx):
                        self._hand_back_stopped(return_queue)
                    raise  # this rank's own error: torch sends its traceback to the caller
                if self._reports(process_idx):
                    self._errors.put(report)
                    raise SystemExit(self.guard.exit_status(report)) from None
                # Other ranks end quietly and successfully, so that torch's join waits for rank 0's report.
                return
            if process_idx != 0 and self._reports(process_idx):  # rank 0 is idle: training rank 0 reports
                return_queue.put(move_data_to_device(self._collected, "cpu"))
        finally:
            job_watch.leave_worker()  # the caller's watch counts it no more

    @staticmethod
    def _hand_back_stopped(return_queue) -> None:
        """The reporting worker was stopped at once by Ctrl-C (KeyboardInterrupt: its second one).
        Torch's worker wrapper swallows KeyboardInterrupt (exit status 0), so the caller's join
        succeeds and it waits for rank 0's result in ``return_queue.get()``: for ever when it saw
        one Ctrl-C and its workers two (two SIGINTs coalesced in a busy caller, or ``kill -INT`` of
        the workers). The worker hands back :class:`StoppedAtOnce` instead, which the caller raises
        as its own KeyboardInterrupt (:meth:`_recover_results_in_main_process`), and marks itself
        so in the caller's job watch, which ends the job at once (without waiting for the workers'
        interpreters to end, seconds under spawn)."""
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third Ctrl-C must not cut the hand-over short
        return_queue.put(StoppedAtOnce())
        job_watch.stopped_at_once()  # hexiscale train: the caller's watch ends the job now

    def _recover_results_in_main_process(self, worker_output, trainer) -> None:
        if isinstance(worker_output, StoppedAtOnce):
            _stopped_at_once()
        super()._recover_results_in_main_process(worker_output, trainer)

    def _reports(self, process_idx: int) -> bool:
        """Whether this worker hands results and errors to the caller: worker 0, or, when the plan
        leaves worker 0's device idle, the worker that is rank 0 of the training ranks."""
        layout = getattr(self._strategy, "_layout", None)
        if layout is None:
            return process_idx == 0
        return not layout.idle and layout.rank == 0

    def _collect_rank_zero_results(self, trainer, results):
        if self._strategy.local_rank == 0 or not self._reports(self._strategy.local_rank):
            return super()._collect_rank_zero_results(trainer, results)
        strategy = self._strategy
        self._strategy = _AsLocalRankZero(strategy)  # Lightning collects on local rank 0 only
        try:
            self._collected = super()._collect_rank_zero_results(trainer, results)
        finally:
            self._strategy = strategy
        return self._collected


class StoppedAtOnce:
    """What the reporting spawn/fork worker hands back in place of its result when Ctrl-C stopped it
    at once (:meth:`ProcessLauncher._hand_back_stopped`)."""


def _stopped_at_once() -> None:
    """In the caller: its workers were stopped at once by Ctrl-C, so no step is saved. Under a job
    watch (``hexiscale train``) the job ends now, as at a second Ctrl-C the watch saw: its one line
    (``Ctrl-C twice`` when the watch saw the first; ``Ctrl-C`` when the SIGINTs went to the workers
    alone) names the workers' step and the checkpoint kept, exit status 130. In a script: the
    caller's KeyboardInterrupt (Lightning's one line, exit status 1), as when it gets the Ctrl-C."""
    watch = job_watch.current()
    if watch is not None:
        watch.ctrl_c.set()
        watch.end(watch.message())
    raise KeyboardInterrupt


class _AsLocalRankZero:
    """The strategy, seen as local rank 0 (for Lightning's result collection on the reporting worker)."""

    def __init__(self, strategy):
        self._inner = strategy

    local_rank = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)
