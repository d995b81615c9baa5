"""A user's script that calls the Python API with the default ``popen`` launcher (which re-runs this
script per rank, so it cannot run inside pytest): the worker of test_api_errors.py.

    python api_error_job.py CASE

Cases: ``layers`` (a plan for 6 layers with a 4-layer model: every rank finds it in setup),
``kill`` (rank 1 dies by ``os._exit`` at step 2), ``interrupt`` (GracefulInterrupt; rank 1 records a
Ctrl-C as step 3 starts: every rank stops after it). The launching process catches what ``fit``
raises and prints ``CAUGHT <type>: <message>``, waits long enough that an observer killing it
would show, and prints ``ALIVE``. ``new_trainers``: after ``fit``, a new Trainer with a new strategy
(``cluster=None``, no plan) validates the same module, then one with another plan; every rank prints
``RESULT <rank> <val_loss>`` or ``CAUGHT <rank> <type>: <message>`` for each. ``sigterm``: 200 steps, rank 0
prints ``STEP <n>`` after each and sleeps (where the test's SIGTERM to this process lands); what
``fit`` raises is printed as ``CAUGHT <type> <exit code>`` and raised again.
``python api_error_job.py sigterm spawn`` (or ``fork``): the same with that start method; the
caller prints ``CAUGHT <type> ...`` for whatever ``fit`` raises there. ``ctrl_c START_METHOD CKPT``:
as ``sigterm``, with ``GracefulInterrupt(save_to=CKPT)``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.launchers import subprocess_script
from lightning.pytorch.utilities.exceptions import SIGTERMException
from strategy_helpers import PG_TIMEOUT, TINY, loader, module, plan_of

from lightning_hexiscale.lightning.launch.interrupt import GracefulInterrupt
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

# Lightning's popen observer, were it started here, would SIGKILL every process one tick after a child
# exits non-zero. Its tick is 5 s; at 0.2 s the launching process shows it is not killed by staying alive
# two ticks after its children have exited (ALIVE), instead of 6 s after fit raised (about 4 s of each
# popen test of test_api_errors.py).
OBSERVER_TICK_S, CHILDREN_LIMIT_S = 0.2, 6.0
subprocess_script._ChildProcessObserver.__init__.__defaults__ = (OBSERVER_TICK_S,)


def _running_children() -> list[str] | None:
    """The pids of this process's children that have not exited (zombies excluded), or None where
    /proc does not list children."""
    lists = list(Path("/proc/self/task").glob("*/children"))
    if not lists:
        return None
    pids = []
    for f in lists:
        try:  # a thread listed by the glob may have exited since (its task directory is gone)
            pids += f.read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != "Z":
            running.append(pid)
    return running


def outlive_the_observer() -> None:
    """Until the children have exited (at most CHILDREN_LIMIT_S), then two observer ticks: the
    observer acts on a child's exit status at its first tick after the exit."""
    deadline = time.monotonic() + CHILDREN_LIMIT_S
    while time.monotonic() < deadline and _running_children() != []:
        time.sleep(0.05)
    time.sleep(2 * OBSERVER_TICK_S)


class DiesOnRank1(type(module())):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step == 2:
            os._exit(9)  # as SIGKILL or the OOM killer would end it
        return super().training_step(batch, batch_idx)


def validate_with_new_trainers() -> None:
    """Lightning's habit of a fresh Trainer for evaluation, in the popen processes that hold the
    trained stage (a fork or spawn worker ends with its call): one with a strategy that plans nothing
    (cluster=None), then one with another plan."""
    plan = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])
    kw = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)
    mod = module()
    pl.Trainer(strategy=HexiScaleStrategy(plan=plan, timeout=PG_TIMEOUT), max_steps=3, **kw).fit(mod, loader(36, 6))
    rank = os.environ.get("LOCAL_RANK", "0")
    for other in (None, plan_of([(3, 1, [([0], (0, 4))]), (3, 1, [([1], (0, 4))])])):
        strategy = HexiScaleStrategy(cluster=None, plan=other, timeout=PG_TIMEOUT, plan_check=None)
        try:
            got = pl.Trainer(strategy=strategy, **kw).validate(mod, loader(12, 6, seed=1), verbose=False)
            line = f"RESULT {rank} {got[0]['val_loss']!r}"
        except Exception as e:  # noqa: BLE001 -- what the user's code sees is what is tested
            line = f"CAUGHT {rank} {type(e).__name__}: {e}"
        os.write(1, (line + "\n").encode())  # one write: the ranks share stdout, and print() may interleave


class CtrlCOnRank1(pl.Callback):
    def __init__(self, interrupt):
        self.interrupt = interrupt

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            self.interrupt.requested = True


class SlowSteps(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:  # rank 1 meanwhile waits in the next batch's collectives
            print(f"STEP {trainer.global_step}", flush=True)
            time.sleep(0.3)


class SlowEvalBatches(pl.Callback):
    def _end(self, trainer, batch_idx):
        if trainer.is_global_zero:
            print(f"BATCH {batch_idx}", flush=True)
            time.sleep(0.3)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, batch_idx)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, batch_idx)


def evaluate_until_sigterm(case: str) -> None:
    """``sigterm_validate`` / ``sigterm_predict``: a 2-stage pipeline evaluates 200 batches; rank 0
    prints ``BATCH <i>`` after each and sleeps (where the test's SIGTERM lands)."""
    plan = plan_of([(4, 2, [([0], (0, 2)), ([1], (2, 4))])])
    trainer = pl.Trainer(strategy=HexiScaleStrategy(plan=plan, timeout=PG_TIMEOUT), accelerator="cpu", devices=2,
                         logger=False, callbacks=[SlowEvalBatches()], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = loader(800, 4)
    try:
        if case == "sigterm_validate":
            trainer.validate(module(), data, verbose=False)
        else:
            trainer.predict(module(), data, return_predictions=False)
        print("FINISHED", flush=True)
    except BaseException as e:
        if os.environ.get("HEXISCALE_POPEN_CHILD") != "1":
            print(f"CAUGHT {type(e).__name__}: {str(e)[:300]}", flush=True)
        raise


def main() -> None:
    case = sys.argv[1]
    torch.set_num_threads(1)
    if case == "new_trainers":
        validate_with_new_trainers()
        return
    if case in ("sigterm_validate", "sigterm_predict"):
        evaluate_until_sigterm(case)
        return
    layers = 6 if case == "layers" else 4
    plan = plan_of([(4, 2, [([0], (0, layers))]), (2, 1, [([1], (0, layers))])], num_layers=layers)
    start_method = sys.argv[2] if len(sys.argv) > 2 else "popen"
    strategy = HexiScaleStrategy(plan=plan, timeout=PG_TIMEOUT, start_method=start_method)
    interrupt = GracefulInterrupt(save_to=sys.argv[3] if case == "ctrl_c" else None)
    callbacks = [interrupt, CtrlCOnRank1(interrupt)] if case == "interrupt" else []
    callbacks += [SlowSteps()] if case in ("sigterm", "ctrl_c") else []
    callbacks += [interrupt] if case == "ctrl_c" else []
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2,
                         max_steps=200 if case in ("sigterm", "ctrl_c") else 6,
                         logger=False, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    mod = DiesOnRank1(TINY, dtype=torch.float64, init_seed=7) if case == "kill" else module()
    try:
        trainer.fit(mod, loader(36, 6))
        print("FINISHED", flush=True)
    except SIGTERMException as e:
        if os.environ.get("HEXISCALE_POPEN_CHILD") != "1":  # the launching process: the caller of fit
            print(f"CAUGHT {type(e).__name__} {e.code}", flush=True)
        raise
    except Exception as e:  # noqa: BLE001 -- what the user's code sees is what is tested
        print(f"CAUGHT {type(e).__name__}: {e}", flush=True)
        if case == "ctrl_c":
            raise
        outlive_the_observer()
        print("ALIVE", flush=True)
    except BaseException as e:  # spawn/fork caller: what else fit raised (KeyboardInterrupt, SystemExit)
        if os.environ.get("HEXISCALE_POPEN_CHILD") != "1":
            print(f"CAUGHT {type(e).__name__}: {str(e)[:200]}", flush=True)
        raise


if __name__ == "__main__":
    main()
