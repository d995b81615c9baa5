"""Ctrl-C and SIGTERM under ``trainer.launcher=fork`` / ``spawn`` (and a user's script's
``start_method``): the launching process is no rank; its workers train and report their phase to
it (``spawn_workers.WorkerPhases``). As under popen (test_ctrl_c.py, whose helpers these tests use):
the first Ctrl-C or SIGTERM while they train stops them at the end of the step and saves it, a
second Ctrl-C ends the job at once (also when the launching process saw only one of the two, or
none), a worker that dies meanwhile ends it naming the rank.
"""

from __future__ import annotations

import os
import signal
import sys
import types
from pathlib import Path

import pytest
from test_ctrl_c import TRAIN, ctrl_c, ended_at_once_in_step_3, job, one_line, signal_when, timed_ctrl_c


def _cpu2(run: Path, launcher: str, *extra: str) -> list[str]:
    return [sys.executable, str(TRAIN), "cluster=cpu2", "model=llama_tiny", "train.global_batch=8",
            "trainer.val_every=0", "trainer.progress_bar=false", "trainer.log_every=1", f"trainer.launcher={launcher}",
            f"hydra.run.dir={run}", *extra]


def _stopped_and_saved(code: int, err: str, run: Path, why: str, status: int) -> int:
    """The job's one line says ``why`` after step N and that step N was saved to last.ckpt; returns N."""
    from lightning_hexiscale.runtime import checkpoint as ckpt

    assert code == status and "Traceback" not in err, (code, err[-3000:])
    last = run / "checkpoints" / "last.ckpt"
    lines = [ln for ln in err.splitlines() if ln.startswith("recipes/train.py:")
             and not ln.startswith("recipes/train.py: warning:")]
    assert len(lines) == 1 and f"{why} after step" in lines[0], err[-3000:]
    stopped = int(lines[0].split("after step ")[1].split(";")[0])
    assert f"checkpoint of step {stopped} saved to {last} (resume with trainer.resume={last})" in lines[0]
    assert ckpt.read_meta(last)["global_step"] == stopped
    return stopped


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("launcher", ["fork", "spawn"])
def test_ctrl_c_then_sigterm_to_spawn_or_fork_workers_stop_at_a_step_and_save_it(tmp_path, launcher):
    """trainer.launcher=fork/spawn: the launching process is no rank, so its phase stayed "running the
    ranks" and the terminal's Ctrl-C, or SIGTERM to the job's process group (a container stop),
    ended the job at once there (exit 130 / 143, the workers killed mid-step, the interrupted step
    not saved), while the workers had just said they would stop at the end of the step. Now it
    waits for them, as under popen: every rank stops at the end of the same step and saves it, one
    line. Two runs (one start of each costs most of the time): Ctrl-C after step 3 (exit 130); the
    run resumed from its checkpoint goes on at the next step, and SIGTERM to its group saves (143)."""
    run = tmp_path / "run"
    code, out, err = ctrl_c(_cpu2(run, launcher, "trainer.max_steps=1000", "trainer.checkpoint_every=2"),
                            "step     3", tmp_path, 200)
    assert "Ctrl-C: stopping at the end of this step" in out
    stopped = _stopped_and_saved(code, err, run, "interrupted (Ctrl-C)", 130)
    last = run / "checkpoints" / "last.ckpt"
    resumed = tmp_path / "resumed"
    # SIGTERM to the whole group: the launching process and its workers
    code, stdout, stderr = signal_when(_cpu2(resumed, launcher, "trainer.max_steps=1000", f"trainer.resume={last}"),
                                       tmp_path, f"step {stopped + 2:5d}", lambda p: os.killpg(p.pid, signal.SIGTERM),
                                       names=("stdout2.txt", "stderr2.txt"))
    steps = [int(ln.split()[1]) for ln in stdout.read_text().splitlines() if ln.startswith("step ")]
    assert steps[:2] == [stopped + 1, stopped + 2], stdout.read_text()[-2000:]
    assert "SIGTERM: stopping at the end of this step" in stdout.read_text()
    _stopped_and_saved(code, stderr.read_text(), resumed, "terminated (SIGTERM)", 143)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher,second", [("fork", "group"), ("spawn", "workers")])
def test_a_second_ctrl_c_in_a_long_step_of_spawn_or_fork_workers_ends_the_job_at_once(tmp_path, launcher, second):
    """As under popen: the first Ctrl-C asks the workers to finish the step (it used to end the job
    at once), the second ends it within 5 s and names the step and the checkpoint kept (step 2).

    ``group``: the second SIGINT reaches the workers and the launching process, and the workers may
    leave before the launching process reads it (the race of the watch's unit test below, which
    this test met about once in ten runs under load). ``workers``: it reaches the workers alone, as
    when a busy launching process got the terminal's two SIGINTs as one (a pending signal is not
    queued twice). The workers stopped at once, handed back nothing, and the launching process,
    whose watch had seen one Ctrl-C, waited for rank 0's result for ever (spawn); fork workers
    ignored their second Ctrl-C and slept out the step (300 s)."""
    run = tmp_path / "run"
    code, out, err, took = timed_ctrl_c(job("step", run, "trainer.checkpoint_every=2", f"trainer.launcher={launcher}"),
                                        ("SLOW step", "stopping at the end of this step"), tmp_path, 150,
                                        last_to=(0, 1) if second == "workers" else (), end_s=20)
    ended_at_once_in_step_3(code, took, err, run)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_fork_worker_that_dies_after_ctrl_c_ends_the_job_at_once_naming_it(tmp_path):
    """After the first Ctrl-C (the workers finish a long step) one worker is killed (SIGKILL: the OOM
    killer). It took 32 s (torch's join sent the survivor SIGTERM, which its GracefulInterrupt only
    records, and waited 30 s), printed torch's "Unable to shutdown process ... via SIGTERM" and named
    a second Ctrl-C that nobody pressed. Now the watch sees the worker gone and ends the job naming it."""
    run = tmp_path / "run"
    code, out, err, took = timed_ctrl_c(job("step", run, "trainer.checkpoint_every=2", "trainer.launcher=fork"),
                                        ("SLOW step", "stopping at the end of this step"), tmp_path, 150,
                                        last_to=(1,), last_signal=signal.SIGKILL, end_s=20)
    assert code == 4 and took < 5, (code, took, err[-3000:])
    last = run / "checkpoints" / "last.ckpt"
    line = one_line(err)
    assert line.startswith(("recipes/train.py: rank 0 was killed by signal SIGKILL while training (step 3), ",
                            "recipes/train.py: rank 1 was killed by signal SIGKILL while training (step 3), ")), line
    assert line.endswith(f"before the ranks could stop at the end of the step; ending the job (exit status 4); the "
                         f"last checkpoint, {last}, was kept (resume with trainer.resume={last})"), line
    assert "Terminating process" not in err and "Unable to shutdown" not in err, err[-3000:]


def test_the_watch_of_a_spawn_or_fork_job_acts_by_its_workers_phase(tmp_path, monkeypatch):
    """The launching process of a spawn/fork job stays in "running"; its watch acts by the phase its
    workers report (WorkerPhases): at once while any of them sets up, gracefully while all train."""
    import multiprocessing

    from lightning_hexiscale.lightning.launch.job_watch import JobWatch
    from lightning_hexiscale.lightning.launch.spawn_workers import WorkerPhases

    ended = []
    watch = JobWatch("hexiscale train", backstop_s=60)
    monkeypatch.setattr(watch, "end", lambda line, code=130: ended.append((line, code)))
    watch.out = tmp_path
    watch.set_phase("running")
    watch.workers = phases = WorkerPhases(multiprocessing.get_context("fork"), 3)
    assert watch.now() == ("running", None)
    phases.report(0, "training", 5)
    phases.report(1, "setup")
    phases.report(2, "setup")
    assert watch.now() == ("setup", None) and not phases.graceful()
    phases.leave(2)  # an idle rank that left at setup
    phases.report(1, "training", 5)
    assert watch.now() == ("training", 5) and phases.graceful()
    watch.on_sigterm()
    watch.on_ctrl_c()  # the first: the workers finish the step
    assert ended == []
    phases.report(1, "saving", 5)
    watch.on_ctrl_c()
    assert ended == [("hexiscale train: interrupted (Ctrl-C twice) while saving the checkpoint of step 5; that "
                      "checkpoint was not completed", 130)]
    # The race of a terminal's second Ctrl-C: it reached the workers too, whose KeyboardInterrupt
    # ended them before this watch read it. It said "interrupted (Ctrl-C) while running the ranks".
    ended.clear()
    phases.report(1, "training", 5)
    phases.leave(0)
    phases.leave(1)
    assert watch.now() == ("training", 5) and phases.graceful()  # every worker left: the furthest phase
    watch.on_ctrl_c()
    assert ended == [("hexiscale train: interrupted (Ctrl-C twice) while training (step 5); no checkpoint was "
                      "written", 130)]
    assert watch.message().startswith("hexiscale train: interrupted (Ctrl-C twice)")  # the main thread's line too
    phases.report(0, "finishing")  # workers that ended normally: a Ctrl-C now ends the job at once
    assert watch.now() == ("finishing", None) and not phases.graceful()


def test_a_worker_stopped_at_once_ends_the_wait_of_the_launching_process(tmp_path, monkeypatch):
    """Two SIGINTs that reach a busy launching process close together may be delivered to it as one
    (a pending signal is not queued twice), while its workers see both: their second stops them at
    once, exit status 0 (torch's worker wrapper swallows KeyboardInterrupt), no step saved, and the
    launching process waited for rank 0's result in ``return_queue.get()`` for ever. The reporting
    worker now hands back StoppedAtOnce (raised in the caller as its KeyboardInterrupt) and marks
    itself in WorkerPhases, which the watch polls: it ends the job with its line."""
    import multiprocessing

    from lightning_hexiscale.lightning import internals
    from lightning_hexiscale.lightning.launch import job_watch
    from lightning_hexiscale.lightning.launch.job_watch import JobWatch
    from lightning_hexiscale.lightning.launch.spawn_workers import WorkerPhases

    ended = []
    watch = JobWatch("hexiscale train", backstop_s=60)
    monkeypatch.setattr(watch, "end", lambda line, code=130: ended.append((line, code)))
    watch.set_phase("running")
    watch.workers = phases = WorkerPhases(multiprocessing.get_context("fork"), 2)
    phases.report(0, "training", 3)
    phases.report(1, "training", 3)
    watch.on_ctrl_c()  # the one Ctrl-C this process saw: the workers finish the step
    phases.leave(1)  # a worker that left (its KeyboardInterrupt) is no reason to end the job
    watch.check_workers()
    assert ended == [] and not phases.stopped_at_once()
    # worker 0 reports to the caller: what its KeyboardInterrupt does (in this process: the handler put back)
    queue = multiprocessing.get_context("fork").SimpleQueue()
    before = signal.getsignal(signal.SIGINT)
    job_watch.enter_worker(phases, 0)
    try:
        internals.ProcessLauncher._hand_back_stopped(queue)
        job_watch.leave_worker()
    finally:
        signal.signal(signal.SIGINT, before)
    assert phases.stopped_at_once() and phases.left(0) and isinstance(queue.get(), internals.StoppedAtOnce)
    watch.check_workers()
    assert ended == [("hexiscale train: interrupted (Ctrl-C twice) while training (step 3); no checkpoint was "
                      "written", 130)]
    # without a job watch (a user's script): the caller's KeyboardInterrupt, as if it had the Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        internals.ProcessLauncher._recover_results_in_main_process(None, internals.StoppedAtOnce(), None)


def test_a_fork_worker_drops_the_watch_s_sigint_handler(monkeypatch):
    """A fork worker inherits the launching process's watch handler, which only records a Ctrl-C
    outside planning: its second Ctrl-C did nothing (it slept out a long step), where a spawn
    worker's stopped it at once. It gets Python's handler (KeyboardInterrupt) as it enters."""
    from lightning_hexiscale.lightning.launch import job_watch
    from lightning_hexiscale.lightning.launch.job_watch import JobWatch

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    watch = JobWatch("hexiscale train").install()
    try:
        watch.set_phase("running")
        assert signal.getsignal(signal.SIGINT) == watch._handler
        job_watch.enter_worker(None, 0)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and job_watch.current() is None
    finally:
        monkeypatch.setattr(job_watch, "_current", watch)
        watch.uninstall()
        signal.signal(signal.SIGINT, before)


def test_a_worker_that_dies_while_the_others_finish_the_step_ends_the_job(tmp_path, monkeypatch):
    """After a Ctrl-C or SIGTERM (the workers finish the step), a worker that died without leaving
    its call ends the job at once with a line naming it, exit status 4: torch's join sent the others
    SIGTERM, which their GracefulInterrupt only records, and waited 30 s. Before a Ctrl-C, and for a
    worker that left with its own error, the launcher's own path reports it."""
    import multiprocessing

    from lightning_hexiscale.lightning.launch.job_watch import EXIT_RANK_FAILED, JobWatch
    from lightning_hexiscale.lightning.launch.spawn_workers import WorkerPhases
    from lightning_hexiscale.runtime import EXIT_RANK_FAILED as RUNTIME_EXIT

    ended = []
    watch = JobWatch("hexiscale train", backstop_s=60)
    monkeypatch.setattr(watch, "end", lambda line, code=130: ended.append((line, code)))
    watch.set_phase("running")
    watch.workers = phases = WorkerPhases(multiprocessing.get_context("fork"), 3)
    procs = [types.SimpleNamespace(exitcode=None) for _ in range(3)]
    watch.worker_procs = lambda: procs
    for i in range(3):
        phases.report(i, "training", 3)
    procs[1].exitcode = -9
    watch.check_workers()  # no Ctrl-C yet: the survivors' RankFailure says it
    assert ended == [] and not watch.finishing
    watch.on_sigterm()  # every rank finishes the step
    procs[1].exitcode, procs[2].exitcode = None, 1
    phases.leave(2)  # its own error: torch's join reports it with its traceback
    watch.check_workers()
    assert ended == [] and watch.finishing
    procs[1].exitcode = -9
    watch.check_workers()
    assert ended == [("hexiscale train: rank 1 was killed by signal SIGKILL while training (step 3), before the "
                      "ranks could stop at the end of the step; ending the job (exit status 4); no checkpoint was "
                      "written", 4)]
    assert EXIT_RANK_FAILED == RUNTIME_EXIT


def test_a_second_sigterm_to_the_caller_of_a_spawn_or_fork_job_prints_the_job_s_line(monkeypatch):
    """Under hexiscale train the second SIGTERM (workers killed, SIGTERMException) ended the job
    with status 143 and nothing printed; now with the watch's line."""
    import multiprocessing

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_hexiscale.lightning.launch import job_watch
    from lightning_hexiscale.lightning.launch.job_watch import JobWatch
    from lightning_hexiscale.lightning.launch.spawn_workers import WorkerPhases
    from lightning_hexiscale.lightning.launch.sigterm import ForwardToWorkers

    ended, killed = [], []
    watch = JobWatch("hexiscale train", backstop_s=60)
    monkeypatch.setattr(watch, "end", lambda line, code=130: ended.append((line, code)))
    monkeypatch.setattr(job_watch, "_current", watch)
    watch.set_phase("running")
    watch.workers = phases = WorkerPhases(multiprocessing.get_context("fork"), 1)
    phases.report(0, "training", 3)
    forward = ForwardToWorkers(types.SimpleNamespace(kill=killed.append))
    forward._notify(signal.SIGTERM, None)  # the first: forwarded, the workers finish the step
    assert killed == [signal.SIGTERM] and ended == []
    with pytest.raises(SIGTERMException):
        forward._notify(signal.SIGTERM, None)
    assert killed == [signal.SIGTERM, signal.SIGKILL]
    assert ended == [("hexiscale train: terminated (SIGTERM) while training (step 3); no checkpoint was written", 143)]
