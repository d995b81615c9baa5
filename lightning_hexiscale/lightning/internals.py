"""The one module that touches Lightning's (and torch's) private attributes.

The strategy runs forward and backward itself, cuts every global batch into per-pipeline slices
and steps a sharded optimizer; Lightning 2.x has no public switch for any of these, so a handful of
private attributes are set or read. They all live here, behind named functions, so that a
Lightning upgrade that renames one breaks in exactly one place, and :func:`check` (run by the
strategy's ``setup`` and by ``tests/strategy/test_internals.py``) says which attribute moved,
in which Lightning version, instead of failing deep inside a training step.

Tested with lightning 2.6 (pyproject bounds the version to ``>=2.4,<2.7``).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_hexiscale.errors import HexiScaleError
from lightning_hexiscale.lightning import job_watch

TESTED = "2.4-2.6"
"""Lightning versions the attributes below were read from."""


class LightningInternalsChanged(HexiScaleError, RuntimeError):
    """A private Lightning attribute the strategy relies on is gone (a Lightning upgrade)."""


def _missing(where: str, attr: str) -> LightningInternalsChanged:
    import lightning

    return LightningInternalsChanged(
        f"{where}.{attr} is missing in lightning {lightning.__version__}: the hexiscale strategy relies on it "
        f"(tested with lightning {TESTED}). Fix: pip install 'lightning>=2.4,<2.7', or update "
        f"lightning_hexiscale/lightning/internals.py for this release")


def check() -> None:
    """Raise :class:`LightningInternalsChanged` naming the first private attribute that moved."""
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    if not callable(getattr(_FitLoop, "_should_accumulate", None)):
        raise _missing("lightning.pytorch.loops.fit_loop._FitLoop", "_should_accumulate")
    if not isinstance(getattr(_FitLoop, "_skip_backward", None), property):
        raise _missing("lightning.pytorch.loops.fit_loop._FitLoop", "_skip_backward")
    if "_skip_backward" not in _AutomaticOptimization.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.loops.optimization.automatic._AutomaticOptimization", "_skip_backward")
    if "use_distributed_sampler" not in _AcceleratorConnector.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector",
                       "use_distributed_sampler")
    if "_data_source" not in _FitLoop.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.loops.fit_loop._FitLoop", "_data_source")
    if "_optimizer" not in LightningOptimizer.__init__.__code__.co_names:
        raise _missing("lightning.pytorch.core.optimizer.LightningOptimizer", "_optimizer")
    from lightning.fabric.utilities import optimizer as fabric_optimizer

    if not callable(getattr(fabric_optimizer, "_optimizers_to_device", None)):
        raise _missing("lightning.fabric.utilities.optimizer", "_optimizers_to_device")
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    if not callable(getattr(DDPStrategy, "_configure_launcher", None)):
        raise _missing("lightning.pytorch.strategies.DDPStrategy", "_configure_launcher")
    if not callable(getattr(_SubprocessScriptLauncher, "_call_children_scripts", None)):
        raise _missing("lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher",
                       "_call_children_scripts")
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer import call

    if not callable(getattr(call, "_call_teardown_hook", None)):
        raise _missing("lightning.pytorch.trainer.call", "_call_teardown_hook")
    if not callable(getattr(Trainer, "_teardown", None)):
        raise _missing("lightning.pytorch.Trainer", "_teardown")
    if not callable(getattr(_MultiProcessingLauncher, "_collect_rank_zero_results", None)):
        raise _missing("lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher",
                       "_collect_rank_zero_results")
    from lightning.pytorch.plugins.precision import Precision

    if not callable(getattr(Precision, "_wrap_closure", None)):
        raise _missing("lightning.pytorch.plugins.precision.Precision", "_wrap_closure")
    wrapping = getattr(_MultiProcessingLauncher, "_wrapping_function", None)
    if not callable(wrapping) or wrapping.__code__.co_varnames[:7] != _WRAPPING_ARGS:
        raise _missing("lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher",
                       f"_wrapping_function{_WRAPPING_ARGS}")


_WRAPPING_ARGS = ("self", "process_idx", "trainer", "function", "args", "kwargs", "return_queue")


def steps_after_this_batch(trainer) -> bool:
    """Does an optimizer step follow the current training batch (end of the accumulation window or
    of the epoch)? Lightning's own rule, ``fit_loop._should_accumulate``."""
    return not trainer.fit_loop._should_accumulate()


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


def train_dataloader(trainer) -> Any:
    """The training DataLoader the fit loop will use, without consuming it; ``None`` when none is
    reachable yet (the caller then asks for an explicit global batch)."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is None:
        return None
    try:
        return source.dataloader() if source.is_defined() else None
    except Exception:  # the user's *_dataloader hook may need setup that has not run: treat as unknown
        return None


def preload_checkpoint(trainer, path: str) -> None:
    """Load ``path`` as if it had been ``fit(ckpt_path=path)`` (elastic resume, chosen during the
    strategy's setup). Lightning's ``_run`` then calls ``resume_start(None)``, which keeps the
    loaded checkpoint, and restores the model, callbacks, loops and optimizers from it."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or not callable(getattr(connector, "resume_start", None)):
        raise _missing("lightning.pytorch.Trainer", "_checkpoint_connector.resume_start")
    connector.resume_start(path)
    if not getattr(connector, "_loaded_checkpoint", None):
        raise _missing("lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
                       "_loaded_checkpoint")


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


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (or the argument itself)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def run_closure_and_hooks(plugin, model, optimizer, closure) -> Any:
    """What a Lightning ``Precision`` runs before ``optimizer.step``: the closure (training step),
    then ``on_before_optimizer_step`` and gradient clipping (``Precision._wrap_closure``); returns
    the closure's result. For a plugin that steps another optimizer than the one Lightning holds."""
    return plugin._wrap_closure(model, optimizer, closure)


def record_step_called(raw_optimizer) -> None:
    """What torch's LR-scheduler wrapper of ``optimizer.step`` records when the step ran (the
    scheduler warns about ``scheduler.step`` before ``optimizer.step`` otherwise)."""
    raw_optimizer._opt_called = True


def optimizers_to_device(optimizers, device) -> None:
    """Move optimizer state tensors to ``device`` (Lightning's private fabric helper)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


# ---- launchers ---------------------------------------------------------------------------------
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
    (:class:`lightning_hexiscale.lightning.launching.LaunchGuard`) around it:

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
        self.guard.before_launch(function, args, kwargs)
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

    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        import multiprocessing

        from torch.multiprocessing import ProcessExitedException

        from lightning_hexiscale.runtime import collect_before_fork

        self.guard.before_launch(function, args, kwargs)
        if self._start_method == "fork":  # no child may free a process group it inherited
            collect_before_fork()
        self._errors = multiprocessing.get_context(self._start_method).SimpleQueue()
        # Once rank 0 has handed its error back and exited, torch's join terminates the other
        # workers (already on their way out) and logs a warning per worker: noise then.
        quiet = _DropRecords("Terminating process", lambda: not self._errors.empty())
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        spawn_log.addFilter(quiet)
        try:
            with job_watch.workers_ignore_sigint_at_start():  # no traceback from a worker's bootstrap
                return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException:
            if not self._errors.empty():
                raise self._errors.get() from None
            raise
        finally:
            spawn_log.removeFilter(quiet)

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, return_queue,
                           global_states=None) -> None:
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from lightning_hexiscale.lightning.launching import IdleRankExit

        job_watch.worker_entry()
        self._collected = None
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except IdleRankExit:  # an idle device: the call ends cleanly; the first training rank reports
            end_without_training(trainer)
            return
        except BaseException as exc:  # noqa: BLE001 -- classified by the guard, re-raised when it is the cause
            report = self.guard.worker_report(exc, process_idx)
            if report is None:
                raise  # this rank's own error: torch sends its traceback to the caller
            if self._reports(process_idx):
                self._errors.put(report)
                raise SystemExit(self.guard.exit_status(report)) from None
            # Other ranks end quietly and successfully, so that torch's join waits for rank 0's report.
            return
        if process_idx != 0 and self._reports(process_idx):  # rank 0 is idle: training rank 0 reports
            return_queue.put(move_data_to_device(self._collected, "cpu"))

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


class _AsLocalRankZero:
    """The strategy, seen as local rank 0 (for Lightning's result collection on the reporting worker)."""

    def __init__(self, strategy):
        self._inner = strategy

    local_rank = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)
