"""Signals reach every rank of a job and stop them together: SIGTERM (``kill``, ``scancel``, a container
stop) to a user's own script under the popen launcher stops every rank at the same step with
Lightning's SIGTERMException (exit status 143); SIGTERM or SIGINT to the caller of a spawn/fork job
reaches its workers; SIGTERM in ``validate`` / ``predict`` stops every rank at the same batch. The jobs
are ``api_error_job.py`` runs (moved here from test_api_errors.py, which had grown past 600 lines).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_to_a_user_script_stops_every_rank_at_the_same_step_popen(tmp_path):
    """`kill <pid>` (scancel, a container stop) of a user's script (no GracefulInterrupt): Lightning's
    SIGTERM handler broadcast from inside the handler, which paired with whatever collective a peer was
    in. Depending on where each rank was: a hang until the process-group timeout (here 45 s; 10 min by
    default), then "RankFailure ... Application timeout caused pair closure"; or, here, rank 0 left at
    once with SIGTERMException and exit status 0 while rank 1 printed c10d store errors with C++ frames.
    Now every rank stops at the same step within seconds: one line from rank 0, Lightning's
    SIGTERMException (exit status 143) in the script, no traceback, no process left."""
    import signal

    code, took, left, stdout, stderr = _signal_job(tmp_path, ["sigterm"], "STEP 3",
                                                   signal.SIGTERM, 40, 2)
    # exactly 143: no exit -6 from gloo's threads at interpreter exit (runtime.host.destroy_groups_at_exit)
    assert code == 143 and took < 30, (code, took, stdout[-1000:], stderr[-3000:])
    assert [ln for ln in stdout.splitlines() if ln.startswith("CAUGHT")] == ["CAUGHT SIGTERMException 143"], stdout
    steps = [int(ln.split()[1]) for ln in stdout.splitlines() if ln.startswith("STEP")]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("hexiscale:")]
    assert lines == [f"hexiscale: terminated (SIGTERM) after step {steps[-1]}: every rank stopped at this step "
                     "(trainer.fit raises Lightning's SIGTERMException, exit status 143)"], stderr[-3000:]
    assert steps[-1] < 10, steps  # within a step or two of the signal
    for text in ("Traceback", "timeout", "pair closure", "RankFailure", "c10d"):
        assert text not in stderr, stderr[-3000:]
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"ranks left running: {left}"


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_sigterm_to_the_caller_of_a_spawn_or_fork_job_stops_its_workers(tmp_path, start_method):
    """spawn / fork: the process that calls fit is no rank and Lightning registers no SIGTERM handler
    there, so `kill <pid>` of the user's script ended it at once (status 143, nothing printed, no
    exception in the script) and left both workers training on, orphaned (they ran the 200 steps).
    Now the caller forwards the signal to its workers for the duration of the launch: they stop at
    the same step, rank 0 prints one line, fit raises SIGTERMException in the caller (status 143),
    and no process is left."""
    import signal

    code, took, left, stdout, stderr = _signal_job(tmp_path, ["sigterm", start_method], "STEP 3",
                                                   signal.SIGTERM, 40, 3)
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"workers left running: {left}"
    # -6: gloo's 'terminate called without an active exception' at interpreter exit, after the job's work
    # and its lines (the teardown race the validate/predict test allows too; seen once in a clean-clone run)
    assert (code == 143 or (code == -6 and "terminate called" in stderr)) and took < 30, (
        code, took, stdout[-1000:], stderr[-3000:])
    assert [ln for ln in stdout.splitlines() if ln.startswith("CAUGHT")] == ["CAUGHT SIGTERMException 143"], stdout
    steps = [int(ln.split()[1]) for ln in stdout.splitlines() if ln.startswith("STEP")]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("hexiscale:")]
    assert lines == [f"hexiscale: terminated (SIGTERM) after step {steps[-1]}: every rank stopped at this step "
                     "(trainer.fit raises Lightning's SIGTERMException, exit status 143)"], stderr[-3000:]
    assert steps[-1] < 10, steps
    for text in ("Traceback", "Terminating process", "RankFailure"):
        assert text not in stderr, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_sigint_to_the_caller_alone_of_a_spawn_or_fork_job_stops_its_workers(tmp_path, start_method):
    """`kill -INT <pid>` of the script (a Ctrl-C that reaches the caller but not its workers, e.g. a
    supervisor forwarding it): Lightning's KeyboardInterrupt handling in the caller kills only a popen
    launcher's children, and the caller's exit (multiprocessing joins its workers) waited while both
    workers trained on to the last step. Now the workers get SIGINT too: the job ends within seconds
    as a terminal's Ctrl-C ends it (Lightning's one line, exit status 1), no process left."""
    import signal

    code, took, left, stdout, stderr = _signal_job(tmp_path, ["sigterm", start_method], "STEP 3",
                                                   signal.SIGINT, 30, 3, preexec=_sigint_default)
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"workers left running: {left}"
    assert code == 1 and "FINISHED" not in stdout, (code, stdout[-500:], stderr[-3000:])
    assert stderr.count("Detected KeyboardInterrupt") == 1 and "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_sigint_to_the_workers_alone_of_a_fork_script_ends_fit_in_the_caller(tmp_path):
    """`kill -INT` of a script's fork workers (or a terminal's second Ctrl-C that the busy caller got
    merged with its first): they stopped at once (KeyboardInterrupt; torch's worker wrapper makes it
    exit status 0) and handed back nothing, and the caller waited for rank 0's result for ever. Now
    rank 0 hands back "stopped at once" and fit raises KeyboardInterrupt in the caller, as when it
    gets the Ctrl-C: Lightning's one line, exit status 1, no process left."""
    import signal

    code, took, left, stdout, stderr = _signal_job(tmp_path, ["sigterm", "fork"], "STEP 3", signal.SIGINT, 20, 3,
                                                   preexec=_sigint_default, workers=True)
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"workers left running: {left}"
    assert code == 1 and "FINISHED" not in stdout, (code, stdout[-500:], stderr[-3000:])
    assert [ln for ln in stdout.splitlines() if ln.startswith("CAUGHT")] == ["CAUGHT SystemExit: 1"], stdout[-1000:]
    assert stderr.count("Detected KeyboardInterrupt") == 1 and "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("call", ["validate", "predict"])
def test_sigterm_during_validate_or_predict_stops_every_rank_at_the_same_batch_popen(tmp_path, call):
    """`kill <pid>` of a script in trainer.validate / trainer.predict (2-stage pipeline, popen). Before:
    the handler set Lightning's flag at once, so validate stopped each rank after its own batch with a
    codeless SIGTERMException (exit status 0, nothing printed; a rank a batch ahead of its peer could
    leave it in a pipeline exchange), and predict, whose loop reads no flag, ignored the signal and
    ran all 200 batches. Now every rank agrees at each evaluation batch start: one line from rank 0,
    SIGTERMException(143) in the script, no process left."""
    import signal

    code, took, left, stdout, stderr = _signal_job(tmp_path, [f"sigterm_{call}"], "BATCH 3",
                                                   signal.SIGTERM, 30, 2)
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"ranks left running: {left}"
    # 143, or -6 with C++'s "terminate called" after the script's work and lines: the interpreter-exit
    # race the spawn/fork test above allows too. Seen once in a clean-clone run (predict, 2026-11-30),
    # after rank 0's line and the script's CAUGHT line. Exactly 143 is still required of fit's stop
    # (test_sigterm_to_a_user_script_stops_every_rank_at_the_same_step_popen): destroy_groups_at_exit's guard.
    assert code == 143 or (code == -6 and "terminate called" in stderr), (code, stdout[-500:], stderr[-3000:])
    assert [ln for ln in stdout.splitlines() if ln.startswith("CAUGHT")] == ["CAUGHT SIGTERMException: 143"], stdout
    lines = [ln for ln in stderr.splitlines() if ln.startswith("hexiscale:")]
    assert len(lines) == 1 and lines[0].startswith(f"hexiscale: terminated (SIGTERM) during {call} before batch ")
    assert "FINISHED" not in stdout and "Traceback" not in stderr, stderr[-3000:]


def _running_in_session(sid: int, within_s: float) -> str:
    """``ps`` lines (pid, state) of the processes of session ``sid`` still running (zombies aside:
    their parent is gone, nobody reaps them here) after up to ``within_s``; polled, so a session
    that empties at once costs no wait."""
    import time

    end = time.time() + within_s
    while True:
        left = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(sid)], capture_output=True, text=True).stdout
        if not [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] or time.time() > end:
            return left
        time.sleep(0.1)


def _sigint_default() -> None:
    """In the child: SIGINT back to its default (a test runner may ignore it, and children inherit that)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_job(tmp_path, args: list[str], ready: str, sig, wait_s: int, settle_s: int, preexec=None,
                group: bool = False, workers: bool = False):
    """Run ``api_error_job.py ARGS`` in a session of its own, send ``sig`` to its first process (to the
    whole session with ``group``, as a terminal's Ctrl-C; to its spawn/fork workers alone with
    ``workers``) once it printed ``READY`` (e.g. "STEP 3"),
    wait at most ``wait_s`` (a pytest failure beyond: the old code's hang), then up to ``settle_s`` for
    its processes to go; kill what is left. Returns (exit code, seconds from the signal to the exit, ``ps``
    lines of the session's processes still running after ``settle_s``, stdout, stderr)."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "MASTER_", "WORLD_", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (HERE, HERE.parent, HERE.parents[1])))
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen([sys.executable, str(HERE / "api_error_job.py"), *args], stdout=o, stderr=e, env=env,
                             start_new_session=True, preexec_fn=preexec)
    try:
        t0 = time.time()
        while ready + "\n" not in out.read_text():
            assert p.poll() is None and time.time() - t0 < 100, err.read_text()[-3000:]
            time.sleep(0.05)
        if group:
            os.killpg(p.pid, sig)
        elif workers:  # the caller's children but multiprocessing's resource tracker
            for child in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split():
                try:  # a child that exited since the list was read has no cmdline left
                    cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if b"resource_tracker" not in cmdline:
                    os.kill(int(child), sig)
        else:
            p.send_signal(sig)  # the first process only, as `kill <pid>` does
        sent = time.time()
        try:
            code = p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {wait_s} s after {signal.Signals(sig).name}: {out.read_text()[-500:]}")
        took = time.time() - sent
        left = _running_in_session(p.pid, settle_s)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, took, left, out.read_text(), err.read_text()



@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_ctrl_c_to_a_spawn_or_fork_script_with_graceful_interrupt_saves_the_step(tmp_path, start_method):
    """A terminal's Ctrl-C (SIGINT to the whole group) to a user's script whose workers train with
    GracefulInterrupt(save_to=...): the caller stopped them within a second (SIGINT again: their
    second Ctrl-C, then SIGKILL), so the step was not saved. Now it waits for them to finish the step
    and save it, and fit raises their TrainingInterrupted in the caller (uncaught: exit status 1, as
    under popen)."""
    import signal

    from lightning_hexiscale.runtime import checkpoint as ckpt

    last = tmp_path / "last.ckpt"
    code, took, left, stdout, stderr = _signal_job(tmp_path, ["ctrl_c", start_method, str(last)], "STEP 3",
                                                   signal.SIGINT, 40, 3, preexec=_sigint_default, group=True)
    assert [ln for ln in left.splitlines() if "Z" not in ln.split()[1]] == [], f"workers left running: {left}"
    assert code == 1 and "FINISHED" not in stdout, (code, stdout[-500:], stderr[-3000:])
    caught = [ln for ln in stdout.splitlines() if ln.startswith("CAUGHT")]
    assert len(caught) == 1 and caught[0].startswith("CAUGHT TrainingInterrupted: interrupted (Ctrl-C) after step"), \
        (stdout[-1000:], stderr[-3000:])
    stopped = int(caught[0].split("after step ")[1].split(";")[0])
    assert f"checkpoint of step {stopped} saved to {last}" in caught[0]
    assert ckpt.read_meta(last)["global_step"] == stopped
