"""Ctrl-C during training: a graceful stop at the end of the step, agreed by every rank.

A terminal's Ctrl-C sends SIGINT to every process of the job (the ``popen`` launcher's ranks share
the terminal's process group). Python turns it into ``KeyboardInterrupt`` wherever each rank
happens to be: one inside a pipeline exchange, another inside an all-reduce; a rank that stops
there leaves its peers waiting, and a checkpoint saved afterwards would need every rank to enter
its collectives. :class:`GracefulInterrupt` instead turns the first SIGINT into a flag, which
every rank agrees on at the end of each training step (one all-reduce of a boolean, as elastic
training agrees on SIGTERM), and then every rank

1. saves a checkpoint of that step, when asked (``save_to``: a checkpoint path, e.g. the
   ``last.ckpt`` of the run's ModelCheckpoint), else keeps the checkpoints already written as they are;
2. raises :class:`~lightning_hexiscale.errors.TrainingInterrupted` naming the step and the checkpoint
   to resume from, which ends ``trainer.fit`` (``hexiscale train`` prints it and exits with 130).

Rank 0 says at once that the stop is coming. A second Ctrl-C restores the handler that was there
before (Python's: ``KeyboardInterrupt``, Lightning's immediate shutdown; under ``hexiscale train``,
the job watch's, which ends the job at once).

SIGTERM (``kill``, SLURM's ``scancel``, a container stop) stops the same way, and the error says so
(``signal_name``). Why the callback takes it over from Lightning: Lightning's SIGTERM handler
broadcasts from inside the handler, wherever the rank's main thread happens to be, so that
broadcast pairs with another collective of a peer and the job hangs until the process-group
timeout (measured: ``kill`` of ``hexiscale train`` on cpu2 after step 3, no progress and no line
after 5 minutes). The second SIGTERM only sets the flag again: the sender's SIGKILL follows it.

The callback also tells the job watch (:mod:`~lightning_hexiscale.lightning.launch.job_watch`) which phase
this rank is in: setup, training (and the step), saving (while ``trainer.save_checkpoint`` runs),
finishing; without a watch (a user's script) that is a no-op.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lightning_hexiscale.errors import TrainingInterrupted
from lightning_hexiscale.lightning.launch import job_watch


class GracefulInterrupt(Callback):
    """``Trainer(callbacks=[GracefulInterrupt()])``: Ctrl-C stops at the end of the step (module doc).

    Args:
        save_to: a checkpoint path to save the interrupted step to before stopping (None: save
            nothing; the last checkpoint written stays the one to resume from).
        last_checkpoint: where the last regular checkpoint is, for the message (e.g. the
            ``last.ckpt`` of the run's ModelCheckpoint); None: not named.
    """

    def __init__(self, save_to: str | Path | None = None, last_checkpoint: str | Path | None = None) -> None:
        super().__init__()
        self.save_to = None if save_to is None else str(save_to)
        self.last_checkpoint = None if last_checkpoint is None else Path(last_checkpoint)
        self.requested = False
        self.terminated = False
        """SIGTERM arrived on this rank (``requested`` is set too)."""
        self.stopped_at: int | None = None
        self._step_before: int | None = None
        self._previous: Any = None
        self._previous_term: Any = None
        self._rank0 = True

    def setup(self, trainer, pl_module, stage: str) -> None:
        # every rank has joined the process group; the strategy's setup (plan, stages) comes next
        job_watch.set_phase("setup")
        if not hasattr(trainer.save_checkpoint, "__wrapped__"):
            # ModelCheckpoint and the interrupted step's save both go through this method
            trainer.save_checkpoint = job_watch.phased(trainer.save_checkpoint, "saving", lambda: trainer.global_step)

    def on_train_start(self, trainer, pl_module) -> None:
        self._rank0 = trainer.is_global_zero
        job_watch.set_phase("training", trainer.global_step + 1)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            # replaces Lightning's handler, registered as the call began (module doc)
            self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigint(self, signum, frame) -> None:
        self.requested = True
        self._restore()  # a second Ctrl-C: the previous handler (stop at once)
        if self._rank0:
            print("\nCtrl-C: stopping at the end of this step (Ctrl-C again to stop at once)", flush=True)

    def _on_sigterm(self, signum, frame) -> None:
        first = not self.terminated
        self.requested = self.terminated = True
        if first and self._rank0:
            print("\nSIGTERM: stopping at the end of this step", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        job_watch.set_phase("training", trainer.global_step + 1)  # the step now running
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step_before:
            # A batch inside a gradient-accumulation window (accumulate_grad_batches > 1): no optimizer
            # step yet, and a checkpoint here would hold the loader past batches whose gradients it
            # lacks. Every rank is at the same batch, so every rank skips the agreement alike.
            return
        # one all-reduce (max) of 0 (go on), 1 (Ctrl-C) or 2 (SIGTERM): every rank stops, and names the
        # same signal, when any rank got one
        code = 2 if self.terminated else int(self.requested)
        if trainer.world_size > 1:
            code = int(trainer.strategy.reduce(torch.tensor(code, device=trainer.strategy.root_device),
                                               reduce_op="max").item())
        if not code:
            return
        step = trainer.global_step
        self.stopped_at = step
        if self.save_to is not None:
            trainer.save_checkpoint(self.save_to)  # collective: every rank is here, at the same step
            where = f"checkpoint of step {step} saved to {self.save_to}"
        elif self.last_checkpoint is not None and self.last_checkpoint.exists():
            where = (f"the last checkpoint, {self.last_checkpoint}, was kept (the steps after it are not saved: "
                     "trainer.save_on_interrupt=true, or GracefulInterrupt(save_to=...), saves the interrupted step)")
        else:
            where = ("no checkpoint was written (trainer.save_on_interrupt=true, or GracefulInterrupt(save_to=...), "
                     "saves the interrupted step)")
        if code == 2:
            raise TrainingInterrupted(f"terminated (SIGTERM) after step {step}; {where}", signal_name="SIGTERM")
        raise TrainingInterrupted(f"interrupted (Ctrl-C) after step {step}; {where}")

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()
        self._restore_sigterm()
        job_watch.set_phase("finishing")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()
        self._restore_sigterm()

    def _restore(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _restore_sigterm(self) -> None:
        if self._previous_term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
