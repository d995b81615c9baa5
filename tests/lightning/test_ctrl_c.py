"""Ctrl-C: while planning (``hexiscale plan``, ``recipes/train.py``) one line and exit status 130, no
traceback, nothing written; while training, a graceful stop: a message, every rank stops at the end
of the same step and saves it (``trainer.save_on_interrupt``, true by default), exit status 130, no
process left (and no empty log file); in every other phase (the ranks starting, the rendezvous,
their setup, a second Ctrl-C in a step or a save) the job ends within 5 s with one line naming it.

The signal is sent as a terminal sends it: to the whole process group of the job (the test starts
it in a session of its own). A child started from a background non-interactive shell (``make test
&``, nohup) inherits SIGINT ignored, and Python then keeps ignoring it: the children here get SIGINT
at its default before exec, as from an interactive shell.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from lightning_hexiscale.errors import TrainingInterrupted
from lightning_hexiscale.lightning.launch.interrupt import GracefulInterrupt

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c(cmd: list[str], marker: str, tmp: Path, deadline_s: float,
           then: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """Run ``cmd`` in a session of its own; once ``marker`` is printed, send SIGINT to its process
    group; for each of ``then``, once it is printed too, SIGINT again; (exit status, stdout,
    stderr). Fails if the group outlives the command by 30 s."""
    code, out, err, _ = timed_ctrl_c(cmd, (marker, *then), tmp, deadline_s)
    return code, out, err


def signal_when(cmd: list[str], tmp: Path, marker: str, send, deadline_s: float = 200, names=("stdout.txt", "stderr.txt"),
                **popen) -> tuple[int, Path, Path]:
    """Run ``cmd`` in a session of its own (stdout and stderr to ``tmp / names``, the rank variables of
    this process left out, the checkout on PYTHONPATH); once ``marker`` is in its stdout, ``send(p)``
    (the signal); (exit status within 60 s, stdout file, stderr file). Fails if it exits first or the
    marker takes ``deadline_s``; its process group is killed after."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out, err = tmp / names[0], tmp / names[1]
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=tmp, env=env, start_new_session=True, **popen)
    try:
        t0 = time.time()
        while marker not in out.read_text():
            assert p.poll() is None, err.read_text()[-3000:]
            assert time.time() - t0 < deadline_s, f"no {marker!r} in {deadline_s} s: {err.read_text()[-3000:]}"
            time.sleep(0.1)
        send(p)
        code = p.wait(timeout=60)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, out, err


def timed_ctrl_c(cmd: list[str], markers: tuple[str, ...], tmp: Path, deadline_s: float,
                 last_to: tuple[int, ...] = (), last_signal: int = signal.SIGINT,
                 end_s: float | None = None) -> tuple[int, str, str, float]:
    """:func:`ctrl_c`, and the seconds from the last signal to the command's end (a failure after
    ``end_s``, default ``deadline_s``: a hang). With ``last_to`` (indices of ctrl_c_job.py's ``SLOW
    ... (pid N)`` lines, one per spawn/fork worker): the last signal, ``last_signal``, goes to those
    processes alone, not to the group."""
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=tmp, env=env, preexec_fn=_sigint_default,
                             start_new_session=True)
    try:
        t0 = time.time()
        for i, marker in enumerate(markers):
            workers = last_to if i == len(markers) - 1 else ()
            while (marker not in out.read_text() + err.read_text()
                   or len(slow_pids(out.read_text())) <= max(workers, default=-1)):
                assert p.poll() is None, f"ended before {marker!r}: {err.read_text()[-3000:]}"
                assert time.time() - t0 < deadline_s, f"no {marker!r} after {deadline_s} s"
                time.sleep(0.05)
            time.sleep(0.5)
            for w in workers:
                os.kill(slow_pids(out.read_text())[w], last_signal)
            if not workers:
                os.killpg(p.pid, signal.SIGINT)
            sent = time.time()
        try:
            code = p.wait(timeout=deadline_s if end_s is None else end_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {end_s} s after the last signal: {out.read_text()[-500:]}")
        took = time.time() - sent
        gone = time.time() + 30
        while time.time() < gone:  # the ranks end with it
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("processes of the job are still running 30 s after it ended")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, out.read_text(), err.read_text(), took


def slow_pids(out: str) -> list[int]:
    """The pids of ctrl_c_job.py's ``SLOW <phase> (pid N)`` lines, also where two workers' lines
    share one (``SLOW step (pid 1)SLOW step (pid 2)``: the per-line parse read one pid of the two,
    and the test waited its whole deadline for the second)."""
    return [int(pid) for pid in re.findall(r"SLOW [a-z ]+ \(pid (\d+)\)", out)]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_the_cli_plans(tmp_path):
    code, _, err = ctrl_c([sys.executable, "-m", "lightning_hexiscale.cli", "plan", "cluster=hetero3", "model=llama_30b",
                           "train.global_batch=256", "planner.iterations=100000", "--out", "plan.yaml"],
                          # the planner's notice, printed as the search starts (its bar is drawn on a terminal only)
                          "priced from datasheet figures", tmp_path, 90)
    assert code == 130, err[-2000:]
    assert "Traceback" not in err and err.rstrip().endswith("hexiscale plan: interrupted (Ctrl-C)"), err[-2000:]
    assert not (tmp_path / "plan.yaml").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_the_recipe_plans(tmp_path):
    code, out, err = ctrl_c([sys.executable, str(TRAIN), "cluster=hetero3", "model=llama_30b", "dry_run=true",
                             "planner.iterations=100000", f"hydra.run.dir={tmp_path / 'run'}"],
                            "planning for llama_30b", tmp_path, 90)
    assert code == 130, err[-2000:]
    # besides the one line, stderr may carry the planner's one datasheet-pricing notice (hetero3 is priced
    # from datasheet figures), one line as `hexiscale plan` prints it
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("recipes/train.py: warning: A800")]
    assert "Traceback" not in err and lines == ["recipes/train.py: interrupted (Ctrl-C) while planning"], err
    assert not (tmp_path / "run" / "plan.yaml").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_while_training_stops_at_a_step_and_saves_it(tmp_path):
    """cpu2 (2 ranks, popen), a checkpoint every 2 steps; Ctrl-C after step 3 is printed: every rank
    stops at the end of the same step and (trainer.save_on_interrupt, true by default) saves it."""
    from lightning_hexiscale.runtime import checkpoint as ckpt

    run = tmp_path / "run"
    code, out, err = ctrl_c([sys.executable, str(TRAIN), "cluster=cpu2", "model=llama_tiny", "train.global_batch=8",
                             "trainer.max_steps=1000", "trainer.checkpoint_every=2", "trainer.val_every=0",
                             "trainer.progress_bar=false", "trainer.log_every=1", f"hydra.run.dir={run}"],
                            "step     3", tmp_path, 200)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "Ctrl-C: stopping at the end of this step" in out
    last = run / "checkpoints" / "last.ckpt"
    # (a warning of the plan check, e.g. "the plan runs 145 % slower than priced" on a loaded host, may come before)
    lines = [ln for ln in err.splitlines() if ln.startswith("recipes/train.py:")
             and not ln.startswith("recipes/train.py: warning:")]
    assert len(lines) == 1 and "interrupted (Ctrl-C) after step" in lines[0], err[-3000:]
    stopped = int(lines[0].split("after step ")[1].split(";")[0])
    assert f"checkpoint of step {stopped} saved to {last} (resume with trainer.resume={last})" in lines[0]
    assert ckpt.read_meta(last)["global_step"] == stopped  # complete and loadable: no step lost
    # Hydra's per-run log files (train.log, train_ddp_process_1.log) exist only if something was logged
    assert [p.name for p in run.glob("train*.log") if p.stat().st_size == 0] == []


def test_save_on_interrupt_saves_the_step_on_every_rank_then_stops(tmp_path):
    """The flag is agreed at the end of the step (any rank's Ctrl-C stops all); the save, a collective,
    runs there on every rank; then TrainingInterrupted names the step and the checkpoint."""
    import torch

    saved, decisions = [], []

    def reduce(code, reduce_op="mean"):  # the strategy's all-reduce: rank 1 pressed Ctrl-C
        decisions.append((int(code), reduce_op))
        return torch.tensor(1)

    strategy = types.SimpleNamespace(reduce=reduce, root_device=torch.device("cpu"))
    trainer = types.SimpleNamespace(strategy=strategy, world_size=2, global_step=9, is_global_zero=True,
                                    save_checkpoint=saved.append)
    cb = GracefulInterrupt(save_to=tmp_path / "last.ckpt", last_checkpoint=tmp_path / "last.ckpt")
    with pytest.raises(TrainingInterrupted, match=f"after step 9; checkpoint of step 9 saved to {tmp_path}"):
        cb.on_train_batch_end(trainer, None, None, None, 0)
    assert saved == [str(tmp_path / "last.ckpt")] and decisions == [(0, "max")] and cb.stopped_at == 9
    quiet = GracefulInterrupt(last_checkpoint=tmp_path / "none.ckpt")
    strategy.reduce = lambda code, reduce_op="mean": code
    quiet.on_train_batch_end(trainer, None, None, None, 0)  # nobody pressed Ctrl-C: nothing happens
    quiet.requested = True
    with pytest.raises(TrainingInterrupted, match="after step 9; no checkpoint was written"):
        quiet.on_train_batch_end(trainer, None, None, None, 0)


def test_sigterm_on_any_rank_stops_every_rank_at_the_step_and_names_sigterm(tmp_path):
    """SIGTERM (kill, scancel) is agreed like Ctrl-C, in the same one all-reduce: the highest code
    wins (2: SIGTERM), so every rank raises TrainingInterrupted with signal_name SIGTERM, whichever
    rank got it; this rank's own SIGTERM handler sets the code it contributes."""
    import torch

    saved, codes = [], []

    def reduce(code, reduce_op="mean"):  # rank 1 got SIGTERM, this rank nothing
        codes.append(int(code))
        return torch.maximum(code, torch.tensor(2))

    strategy = types.SimpleNamespace(reduce=reduce, root_device=torch.device("cpu"))
    trainer = types.SimpleNamespace(strategy=strategy, world_size=2, global_step=4, is_global_zero=False,
                                    save_checkpoint=saved.append)
    cb = GracefulInterrupt(save_to=tmp_path / "last.ckpt")
    with pytest.raises(TrainingInterrupted, match="terminated \\(SIGTERM\\) after step 4; checkpoint of step 4") as e:
        cb.on_train_batch_end(trainer, None, None, None, 0)
    assert e.value.signal_name == "SIGTERM" and codes == [0] and saved == [str(tmp_path / "last.ckpt")]
    own = GracefulInterrupt()
    own._on_sigterm(15, None)  # this rank's SIGTERM: it contributes 2
    strategy.reduce = lambda code, reduce_op="mean": (codes.append(int(code)), code)[1]
    with pytest.raises(TrainingInterrupted) as e:
        own.on_train_batch_end(trainer, None, None, None, 0)
    assert e.value.signal_name == "SIGTERM" and codes[-1] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_the_job_while_training_stops_at_a_step_and_saves_it(tmp_path):
    """`kill <pid>` of the job (SLURM, a container stop): it hung until the process-group timeout
    (Lightning's SIGTERM handler broadcasts from inside the handler, which pairs with another rank's
    collective); now every rank stops at the end of the same step, saves it, exit status 143."""
    from lightning_hexiscale.runtime import checkpoint as ckpt

    run = tmp_path / "run"
    cmd = [sys.executable, str(TRAIN), "cluster=cpu2", "model=llama_tiny", "train.global_batch=8",
           "trainer.max_steps=1000", "trainer.val_every=0", "trainer.progress_bar=false", "trainer.log_every=1",
           "trainer.timeout_s=120", f"hydra.run.dir={run}"]
    # SIGTERM to the launching process only, as `kill <pid>` does; the old code: no progress until
    # trainer.timeout_s (120 s)
    code, out, err = signal_when(cmd, tmp_path, "step     3", lambda p: p.send_signal(signal.SIGTERM))
    text = err.read_text()
    assert code == 143 and "Traceback" not in text, (code, text[-3000:])
    assert "SIGTERM: stopping at the end of this step" in out.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("recipes/train.py:")
             and not ln.startswith("recipes/train.py: warning:")]
    assert len(lines) == 1 and "terminated (SIGTERM) after step" in lines[0], text[-3000:]
    stopped = int(lines[0].split("after step ")[1].split(";")[0])
    last = run / "checkpoints" / "last.ckpt"
    assert f"checkpoint of step {stopped} saved to {last}" in lines[0]
    assert ckpt.read_meta(last)["global_step"] == stopped


# ---- every phase of a training job: one line naming it, exit 130 within 5 s, no process left -------
JOB = ROOT / "tests" / "lightning" / "ctrl_c_job.py"


def job(phase: str, run: Path, *extra: str) -> list[str]:
    """A 2-rank job (cpu2, llama_tiny) with ``phase`` made slow (tests/lightning/ctrl_c_job.py)."""
    return [sys.executable, str(JOB), phase, "cluster=cpu2", "model=llama_tiny", "train.global_batch=8",
            "trainer.max_steps=6", "trainer.val_every=0", "trainer.progress_bar=false", "trainer.log_every=1",
            f"hydra.run.dir={run}", *extra]


def one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("recipes/train.py:")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_rank_0_waits_for_the_others_ends_the_job_at_once(tmp_path):
    """The reported hang: the other ranks still import torch, rank 0 waits for them in
    init_process_group (C++, where Python runs no signal handler); it waited ~10 min, then named
    the wrong phase. With the SIGINT-blocked start and the watch's thread: at once, the right phase."""
    code, _, err, took = timed_ctrl_c(job("child_sleeps", tmp_path / "run"), ("SLOW rendezvous",), tmp_path, 150)
    assert code == 130 and took < 5, (code, took, err[-3000:])
    assert one_line(err) == "recipes/train.py: interrupted (Ctrl-C) while waiting for the ranks to join (rendezvous)"


def _ignore_sigint() -> None:
    """preexec_fn: the job starts with SIGINT ignored, as under `nohup ... &` or a script's `cmd &`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


SIGINT_AT_START = pytest.mark.parametrize("sigint", ["default", "ignored"])
"""A job that inherited SIGINT ignored installed no watch at all: `kill` ended its launching process
alone (status -15, its ranks left running) and a rank that died went unnamed by the command."""


@pytest.mark.slow
@pytest.mark.timeout(200)
@SIGINT_AT_START
def test_a_rank_that_dies_while_the_job_starts_ends_it_with_one_line(tmp_path, sigint):
    t0 = time.time()
    p = subprocess.run(job("child_dies", tmp_path / "run"), capture_output=True, text=True, timeout=150, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)},
                       preexec_fn=_ignore_sigint if sigint == "ignored" else None)
    assert p.returncode == 4, p.stderr[-3000:]
    assert "rank 1: dying on purpose" in p.stderr
    assert one_line(p.stderr) == ("recipes/train.py: rank 1 exited with status 3 while waiting for the ranks to join "
                                  "(rendezvous); ending the job (exit status 4)")
    assert time.time() - t0 < 120  # not the process-group timeout (600 s)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_sweep_workers_start_prints_no_traceback(tmp_path):
    """-m starts the ranks with spawn: a worker that gets Ctrl-C in multiprocessing's bootstrap (before
    any code of the package runs there) printed a KeyboardInterrupt traceback. They start with SIGINT
    ignored (a SIGINT mask does not survive spawn, an ignored disposition does) until their entry."""
    cmd = job("worker_starts", tmp_path / "run", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    t0 = time.time()
    code, _, err, took = timed_ctrl_c([*cmd[:3], "-m", *cmd[3:]], ("SLOW worker start",), tmp_path, 150)
    assert code == 130 and took < 5, (code, took, err[-3000:])
    assert "KeyboardInterrupt" not in err, err[-3000:]
    assert one_line(err) == "recipes/train.py: interrupted (Ctrl-C) while running the ranks"
    assert not [p for p in Path(tempfile.gettempdir()).glob("hexiscale-worker-*.sh") if p.stat().st_mtime > t0], \
        "the workers' start script is removed when the job ends"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_the_ranks_set_up(tmp_path):
    code, _, err, took = timed_ctrl_c(job("setup", tmp_path / "run"), ("SLOW setup",), tmp_path, 150)
    assert code == 130 and took < 5, (code, took, err[-3000:])
    assert one_line(err) == ("recipes/train.py: interrupted (Ctrl-C) while setting up the ranks "
                             "(plan, devices, stages, checkpoint)")


@pytest.mark.slow
@pytest.mark.timeout(200)
@SIGINT_AT_START
def test_sigterm_while_the_ranks_set_up_ends_the_job_and_its_ranks(tmp_path, sigint):
    """`kill <pid>` of the launching process before training: SIGTERM's default action ended it
    alone, with no line (status -15), and left the rank it started running in the group."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(job("setup", tmp_path / "run"), stdout=o, stderr=e, cwd=tmp_path, env=env,
                             start_new_session=True, preexec_fn=_ignore_sigint if sigint == "ignored" else None)
    try:
        t0 = time.time()
        while "SLOW setup" not in out.read_text():
            assert p.poll() is None and time.time() - t0 < 150, err.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)  # the launching process only
        sent = time.time()
        code = p.wait(timeout=60)
        took = time.time() - sent
        gone = time.time() + 2
        while True:  # up to 2 s for the rank it started to go
            left = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(p.pid)], capture_output=True, text=True).stdout
            if not [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] or time.time() > gone:
                break
            time.sleep(0.1)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code == 143 and took < 5, (code, took, err.read_text()[-3000:])
    assert one_line(err.read_text()) == ("recipes/train.py: terminated (SIGTERM) while setting up the ranks "
                                         "(plan, devices, stages, checkpoint)")
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"ranks left running: {left}"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_second_ctrl_c_in_a_long_step_ends_the_job_at_once(tmp_path):
    """The first Ctrl-C asks every rank to finish the step; the step does not end (every rank sleeps
    in it); the second ends the job within 5 s and names the step and the checkpoint of step 2."""
    run = tmp_path / "run"
    code, out, err, took = timed_ctrl_c(job("step", run, "trainer.checkpoint_every=2"),
                                        ("SLOW step", "stopping at the end of this step"), tmp_path, 150)
    ended_at_once_in_step_3(code, took, err, run)


def ended_at_once_in_step_3(code: int, took: float, err: str, run: Path) -> None:
    """A second Ctrl-C in step 3 ended the job within 5 s (exit 130), in one line that names the step
    and keeps step 2's checkpoint (``trainer.checkpoint_every=2``)."""
    assert code == 130 and took < 5, (code, took, err[-3000:])
    last = run / "checkpoints" / "last.ckpt"
    assert one_line(err) == (f"recipes/train.py: interrupted (Ctrl-C twice) while training (step 3); the last "
                             f"checkpoint, {last}, was kept (resume with trainer.resume={last})")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_second_ctrl_c_while_saving_ends_the_job_and_leaves_no_half_checkpoint(tmp_path):
    run = tmp_path / "run"
    code, out, err, took = timed_ctrl_c(job("save", run, "trainer.checkpoint_every=2"),
                                        ("SLOW save", "stopping at the end of this step"), tmp_path, 150)
    assert code == 130 and took < 5, (code, took, err[-3000:])
    assert one_line(err) == ("recipes/train.py: interrupted (Ctrl-C twice) while saving the checkpoint of step 2; "
                             "that checkpoint was not completed")
    assert not (run / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ctrl_c_while_the_train_command_discovers(tmp_path, monkeypatch):
    """`hexiscale train` without cluster= discovers first (forked ranks): Ctrl-C there ends the job
    within 5 s, one line naming discovery (it said "while planning"), no rank left, nothing cached."""
    monkeypatch.setenv("HEXISCALE_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err, took = timed_ctrl_c([sys.executable, "-m", "lightning_hexiscale.cli", "train", "trainer.max_steps=2",
                                       f"hydra.run.dir={tmp_path / 'run'}"],
                                      ("discovering this machine's cluster",), tmp_path, 120)
    assert code == 130, err[-2000:]
    assert took < 5.0, took
    lines = [ln for ln in err.strip().splitlines() if "interrupted" in ln]
    assert "Traceback" not in err and lines == ["hexiscale train: interrupted (Ctrl-C) while discovering this "
                                                "machine's cluster"], err[-2000:]
    assert not list((tmp_path / "cache").glob("**/*.yaml"))


def test_the_watch_acts_by_phase_and_prints_one_line(tmp_path, monkeypatch):
    """What each Ctrl-C does in each phase (the processes themselves: the tests above), without ending
    this process: ``end`` is recorded instead."""
    from lightning_hexiscale.lightning.launch.job_watch import JobWatch

    ended = []
    watch = JobWatch("hexiscale train", backstop_s=60)
    monkeypatch.setattr(watch, "end", lambda line, code=130: ended.append(line))
    watch.out = tmp_path
    for phase in ("discovering", "starting", "rendezvous", "setup", "running", "finishing"):
        watch.set_phase(phase)
        watch._asked_to_finish = False
        watch.on_ctrl_c()
    assert [line.split(" while ")[1] for line in ended] == [
        "discovering this machine's cluster", "starting the ranks", "waiting for the ranks to join (rendezvous)",
        "setting up the ranks (plan, devices, stages, checkpoint)", "running the ranks", "finishing"]
    ended.clear()
    watch.set_phase("training", 7)
    watch.on_ctrl_c()  # the first: every rank finishes the step (GracefulInterrupt)
    assert ended == []
    (tmp_path / "checkpoints" / "last.ckpt").mkdir(parents=True)
    watch.on_ctrl_c()
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert ended == [f"hexiscale train: interrupted (Ctrl-C twice) while training (step 7); the last checkpoint, "
                     f"{last}, was kept (resume with trainer.resume={last})"]
    watch.set_phase("saving", 8)
    assert watch.message(twice=True).startswith("hexiscale train: interrupted (Ctrl-C twice) while saving the "
                                                "checkpoint of step 8; that checkpoint was not completed")
    with pytest.raises(ValueError, match="unknown job phase"):
        watch.set_phase("resting")
    assert watch.claim() and not watch.claim()  # the one line is printed once, whoever ends the job


def test_children_start_with_sigint_blocked_and_the_block_ends_after():
    from lightning_hexiscale.lightning.launch.job_watch import blocked_during

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with blocked_during():
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def test_sigterm_without_graceful_interrupt_is_agreed_at_the_next_batch():
    """A user's script (launch/sigterm.py): the handler only records the signal and forwards it once
    to the launcher's processes (no collective inside the handler); at the next training batch one
    all-reduce (max) stops every rank, also the ranks that got no SIGTERM themselves."""
    import torch
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_hexiscale.lightning.launch.sigterm import SigtermStop

    killed, marked, codes = [], [], []

    def reduce(code, reduce_op="mean"):  # another rank got SIGTERM, this one nothing
        codes.append((int(code), reduce_op))
        return torch.maximum(code, torch.tensor(1))

    launcher = types.SimpleNamespace(kill=killed.append)
    strategy = types.SimpleNamespace(reduce=reduce, root_device=torch.device("cpu"), launcher=launcher)
    trainer = types.SimpleNamespace(strategy=strategy, world_size=2, global_step=4, is_global_zero=False,
                                    state=types.SimpleNamespace(fn=TrainerFn.FITTING))
    stop = SigtermStop(trainer, lambda: marked.append(True))
    with pytest.raises(SIGTERMException) as e:
        stop.agree()
    assert e.value.code == 143 and codes == [(0, "max")] and marked == [True]
    mine = SigtermStop(trainer, lambda: marked.append("mine"))
    mine.notify(signal.SIGTERM, None)
    mine.notify(signal.SIGTERM, None)  # forwarded once; while fitting, the flag waits for the agreement
    assert killed == [signal.SIGTERM] and mine.received and marked == [True]
    strategy.reduce = lambda code, reduce_op="mean": code
    quiet = SigtermStop(trainer, lambda: marked.append("quiet"))
    quiet.agree()  # nobody got SIGTERM: training goes on
    trainer.state.fn = TrainerFn.VALIDATING
    quiet.notify(signal.SIGTERM, None)  # validate/test/predict: agreed at the next evaluation batch too
    assert marked == [True] and quiet.received
    with pytest.raises(SIGTERMException) as e:
        quiet.agree_evaluation(5)
    assert e.value.code == 143 and marked == [True, "quiet"]


def test_an_error_after_a_graceful_ctrl_c_is_a_failure_with_its_traceback(monkeypatch, capsys):
    """After the first Ctrl-C of training (every rank finishes its step) the job goes on; an error then
    is a failure of its own: its traceback and the failed rank, exit 1. It was printed as "interrupted
    (Ctrl-C twice)" with exit 130 and no traceback. An error while planning after a Ctrl-C (a
    KeyboardInterrupt an import turned into another error) stays the one Ctrl-C line."""
    import lightning_hexiscale.cli.train_run as train_run
    from lightning_hexiscale.cli.train import HEXISCALE, _Job

    job = _Job(HEXISCALE, ["hexiscale", "train"])

    def fails_after_a_graceful_ctrl_c(cfg, watch, app):
        watch.set_phase("training", 3)
        watch.on_ctrl_c()  # GracefulInterrupt's: the ranks finish the step
        raise RuntimeError("a rank's own error")

    monkeypatch.setattr(train_run, "run", fails_after_a_graceful_ctrl_c)
    assert job.task(None) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a rank's own error" in err and "rank 0 failed" in err, err
    assert "interrupted" not in err, err

    job = _Job(HEXISCALE, ["hexiscale", "train"])

    def an_import_turned_ctrl_c_into_an_error(cfg, watch, app):
        watch.ctrl_c.set()  # as the watch's thread does at a Ctrl-C while planning
        raise ImportError("interrupted import")

    monkeypatch.setattr(train_run, "run", an_import_turned_ctrl_c_into_an_error)
    assert job.task(None) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted (Ctrl-C) while planning" in err, err
