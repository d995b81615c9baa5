"""SIGTERM in a user's script (no :class:`~.interrupt.GracefulInterrupt`): every rank stops at the same step.

Lightning's SIGTERM handler (lightning 2.6, ``_SignalConnector._sigterm_notifier_fn``) forwards the
signal to the launcher's processes and then broadcasts from rank 0 *inside the handler*, wherever
the rank's main thread happens to be: that broadcast pairs with another collective of a peer (a
pipeline exchange, an all-reduce) and the job hangs until the process-group timeout, then ends
with a misleading ``RankFailure: ... Application timeout caused pair closure`` (measured: a popen
job of 2 ranks, ``kill -TERM`` of the launching process at step 3: step 12, then the timeout). And
each rank's ``trainer.received_sigterm`` becomes true at a different moment, while the loops read
it at the end of each batch, so the ranks would not stop at the same one either.

:class:`SigtermStop` (installed by the strategy's setup, through ``internals.stop_on_sigterm``)
keeps what Lightning's handler does but the collective: the handler records the signal and
forwards it once to the launcher's processes (the popen children, spawn/fork workers). Where
Lightning broadcasts rank 0's flag at the start of each training batch, one all-reduce (max) of
every rank's flag decides instead (the same cost: one small collective per batch), so a SIGTERM
that reached any rank (``kill`` of the launching process, ``scancel``, torchrun's agent, ``kill``
of one rank) stops every rank at the same batch: ``trainer.received_sigterm`` becomes true
there, rank 0 prints one line, and every rank raises Lightning's ``SIGTERMException`` with exit
status 143 (128 + SIGTERM, as a shell reports it; Lightning's has none, so the script exited 0).

- During validation inside ``fit``: the flag waits for the next training batch (validation ends first).
- ``validate`` / ``test`` / ``predict``: the same agreement at the start of each batch
  (:meth:`SigtermStop.agree_evaluation`); before, the handler set ``received_sigterm`` at once: each
  rank stopped after its own batch with a codeless SIGTERMException (exit status 0, no message), and
  ``predict`` (whose loop reads no flag) ignored the signal and ran to its end.
- ``GracefulInterrupt`` (``hexiscale train``) and ``ElasticRun`` take SIGTERM over at train start
  (they register after this handler) and restore it at the end; the agreement then sees no flag.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_SIGTERM = 128 + signal.SIGTERM


class SigtermStop:
    """The SIGTERM notifier and the per-batch agreement of one Trainer call (module doc)."""

    def __init__(self, trainer, mark_received):
        self.trainer = trainer
        self.mark_received = mark_received
        """``() -> None``: sets ``trainer.received_sigterm`` (internals)."""
        self.received = False

    def notify(self, signum, frame) -> None:
        """Lightning's notifier without the broadcast: runs inside the signal handler."""
        first = not self.received
        self.received = True
        if first:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the processes this one started; a popen child started none

    def agree(self) -> None:
        """At the start of each training batch, on every rank: stop every rank when any got SIGTERM."""
        trainer = self.trainer
        if not self._any_received():
            return
        self.mark_received()
        if trainer.is_global_zero:
            print(f"hexiscale: terminated (SIGTERM) after step {trainer.global_step}: every rank stopped at this "
                  f"step (trainer.fit raises Lightning's SIGTERMException, exit status {EXIT_SIGTERM})",
                  file=sys.stderr, flush=True)
        raise SIGTERMException(EXIT_SIGTERM)

    def agree_evaluation(self, batch_idx: int) -> None:
        """At the start of each batch of ``validate`` / ``test`` / ``predict`` (not inside ``fit``: the
        next training batch agrees), on every rank: the same agreement. Lightning's prediction loop
        reads no SIGTERM flag at all, and its evaluation loop stops each rank after its own batch."""
        trainer = self.trainer
        if trainer.state.fn == TrainerFn.FITTING or not self._any_received():
            return
        self.mark_received()
        call = trainer.state.fn.value
        if trainer.is_global_zero:
            print(f"hexiscale: terminated (SIGTERM) during {call} before batch {batch_idx}: every rank stopped "
                  f"there (trainer.{call} raises Lightning's SIGTERMException, exit status {EXIT_SIGTERM})",
                  file=sys.stderr, flush=True)
        raise SIGTERMException(EXIT_SIGTERM)

    def _any_received(self) -> bool:
        trainer = self.trainer
        code = torch.tensor(int(self.received), device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            code = trainer.strategy.reduce(code, reduce_op="max")
        return bool(int(code.item()))


class ForwardToWorkers:
    """spawn / fork: the process that calls ``trainer.fit`` is no rank, and Lightning registers no
    SIGTERM handler there, so ``kill <pid>`` of the user's script ended it at once (exit status 143,
    nothing printed) and left its workers training on, orphaned. For the duration of the launch this
    handler forwards a SIGTERM to the workers instead (they stop at the same step, as above: rank 0
    prints the line) and the launch ends with Lightning's ``SIGTERMException`` (exit status 143) once
    they have ended. A second SIGTERM while they stop ends them and the caller at once (under
    ``hexiscale train`` with the job watch's one line and exit status 143; it ended silently). The
    caller's previous handler is restored after the launch."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.received = 0
        self._before = None
        self._pid = os.getpid()

    def __enter__(self) -> ForwardToWorkers:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._notify)
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)
            self._before = None

    @staticmethod
    def leave_in_worker() -> None:
        """In a fork worker (at its entry): the caller's previous handler again, so that Lightning's
        signal connector composes that one, not the forwarding, with its own."""
        handler = signal.getsignal(signal.SIGTERM)
        owner = getattr(handler, "__self__", None)
        if isinstance(owner, ForwardToWorkers) and owner._before is not None:
            signal.signal(signal.SIGTERM, owner._before)

    def _notify(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a fork worker before the strategy's setup replaced it: the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.received += 1
        if self.received == 1:
            self.launcher.kill(signal.SIGTERM)
            return
        self.launcher.kill(signal.SIGKILL)  # a second SIGTERM: stop waiting for the workers
        from lightning_hexiscale.lightning.launch import job_watch

        watch = job_watch.current()
        if watch is not None:  # hexiscale train: the job's one line (Lightning's exit path prints none)
            watch.end(watch.message(sigterm=True), EXIT_SIGTERM)
        raise SIGTERMException(EXIT_SIGTERM)
