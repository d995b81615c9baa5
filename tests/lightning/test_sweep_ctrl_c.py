"""Ctrl-C and SIGTERM in a ``-m`` sweep of ``hexiscale train``: the one process runs every point
(Hydra's basic launcher), so the job watch's state of one point must not reach the next, and a stop
ends the sweep as a Ctrl-C ends any Hydra app's sweep: the interrupted point keeps its checkpoint,
one line names the jobs that did not run, exit status 130 (143 for SIGTERM)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from test_ctrl_c import signal_when

from lightning_hexiscale.cli import train as train_cli
from lightning_hexiscale.cli.train_job import HEXISCALE, not_run_line
from lightning_hexiscale.errors import TrainingInterrupted

SCRIPT = Path(sys.executable).parent / "hexiscale"


def _job(monkeypatch, points: list, multirun: bool):
    """A _Job whose run() is ``points.pop(0)(watch)``, with the watch's ``end`` recorded, not called."""
    from lightning_hexiscale.cli import train_run

    job = train_cli._Job(HEXISCALE, ["hexiscale", "train"])
    ended: list[str] = []
    monkeypatch.setattr(job.watch, "end", lambda line, code=130: ended.append(line))
    monkeypatch.setattr(train_run, "run", lambda cfg, watch, app: points.pop(0)(watch))
    monkeypatch.setattr(train_cli, "is_multirun", lambda: multirun, raising=False)
    monkeypatch.setattr(train_cli, "sweep_point", lambda: 0, raising=False)
    return job, ended


def _interrupted(watch) -> int:
    watch.set_phase("training", 3)
    watch.on_ctrl_c()  # the first Ctrl-C: every rank finishes its step
    raise TrainingInterrupted("interrupted (Ctrl-C) after step 3; no checkpoint was written")


def test_the_next_run_starts_without_the_last_runs_ctrl_c(monkeypatch, capsys):
    """Point 1 stopped by one Ctrl-C; in point 2 one Ctrl-C is again a graceful stop with its own line.
    The watch kept ``asked to finish`` and the claimed line: point 2's first Ctrl-C ended the job at
    once as ``Ctrl-C twice``, and printed nothing."""

    def second(watch) -> int:
        assert watch.phase == "planning" and not watch.ctrl_c.is_set() and not watch.finishing
        return _interrupted(watch)

    job, ended = _job(monkeypatch, [_interrupted, second], multirun=False)
    assert job.task(None) == 130 and job.task(None) == 130
    assert ended == []  # neither Ctrl-C ended a job at once
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["hexiscale train: interrupted (Ctrl-C) after step 3; no checkpoint was written"] * 2


def test_a_stopped_point_of_a_sweep_stops_the_sweep(monkeypatch):
    """Under -m an interrupted point raises SweepStopped (a KeyboardInterrupt: Hydra's sweep loop lets it
    through), also when the point ended normally after the Ctrl-C (its last step was already done)."""
    job, _ = _job(monkeypatch, [_interrupted], multirun=True)
    with pytest.raises(train_cli.SweepStopped) as stopped:
        job.task(None)
    assert isinstance(stopped.value, KeyboardInterrupt) and stopped.value.code == 130

    def finished_anyway(watch) -> int:
        watch.set_phase("training", 5)
        watch.on_ctrl_c()
        return 0

    job, _ = _job(monkeypatch, [finished_anyway], multirun=True)
    with pytest.raises(train_cli.SweepStopped):
        job.task(None)
    job, _ = _job(monkeypatch, [lambda watch: 0], multirun=True)
    assert job.task(None) == 0  # no signal: the sweep goes on

    def terminated(watch) -> int:
        watch.set_phase("training", 2)
        watch.on_sigterm()
        raise TrainingInterrupted("terminated (SIGTERM) after step 2; no checkpoint was written", signal_name="SIGTERM")

    job, _ = _job(monkeypatch, [terminated], multirun=True)
    with pytest.raises(train_cli.SweepStopped) as stopped:
        job.task(None)
    assert stopped.value.code == 143


def test_a_stop_between_two_jobs_names_the_jobs_that_will_not_run(monkeypatch, capsys):
    """After a job of a sweep ended and before the next began (Hydra's code, in the main thread): a
    Ctrl-C leaves the sweep's loop and the line names the jobs that will not run; a SIGTERM's line
    does too. Before, both said ``interrupted (Ctrl-C) while finishing`` (or ``while planning``)."""
    import hydra

    job, _ = _job(monkeypatch, [lambda watch: 0], multirun=True)
    job.sweep_argv = ["-m", "cluster=cpu2", "trainer.lr=1e-3,2e-3,3e-3"]
    assert job.task(None) == 0
    assert job.watch.phase == "between"
    left = "2 of its 3 jobs did not run (#1 trainer.lr=0.002; #2 trainer.lr=0.003)"
    assert job.watch.message() == f"hexiscale train: Ctrl-C stopped the sweep after job #0 ended; {left}"
    assert job.watch.message(sigterm=True) == f"hexiscale train: SIGTERM stopped the sweep after job #0 ended; {left}"
    with pytest.raises(KeyboardInterrupt):  # the main thread's handler: Hydra's loop is left
        job.watch._handler(signal.SIGINT, None)
    job.watch.begin_run()  # the next job's own phases again
    assert job.watch.message() == "hexiscale train: interrupted (Ctrl-C) while planning"

    # The command's main(): Hydra runs job #0, then a Ctrl-C arrives before job #1
    from lightning_hexiscale.cli import train_run

    def sweep(**_):
        def decorate(task):
            def run_sweep():
                task(None)
                raise KeyboardInterrupt  # what the watch's handler raises in phase "between"
            return run_sweep
        return decorate

    monkeypatch.setattr(hydra, "main", sweep)
    monkeypatch.setattr(train_run, "run", lambda cfg, watch, app: 0)
    capsys.readouterr()
    assert train_cli.main(["-m", "cluster=cpu2", "trainer.lr=1e-3,2e-3"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hexiscale train: Ctrl-C stopped the sweep after job #0 ended; 1 of its 2 jobs did not run (#1 trainer.lr=0.002)")


def test_each_point_of_a_sweep_prints_its_own_warnings(monkeypatch):
    """The same warning from the same line in two points of a sweep is shown in both (Python's
    registry showed it in the first only), and a filter added during a point stays for the next."""
    import warnings

    def notice() -> None:
        warnings.warn("RTX3090: priced from datasheet figures", UserWarning)

    def point(watch) -> int:
        notice()
        return 0

    def adds_a_filter(watch) -> int:
        warnings.filterwarnings("ignore", message="a filter the first point added")
        return point(watch)

    job, _ = _job(monkeypatch, [adds_a_filter, point], multirun=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        assert job.task(None) == 0 and job.task(None) == 0
        assert any(getattr(f[1], "pattern", None) == "a filter the first point added" for f in warnings.filters)
    assert [str(w.message) for w in seen] == ["RTX3090: priced from datasheet figures"] * 2


def test_the_line_names_the_jobs_that_did_not_run():
    argv = ["-m", "cluster=cpu2", "trainer.lr=1e-3,2e-3", "train.global_batch=8,16", "hydra.sweep.dir=x"]
    assert not_run_line(argv, 1) == ("2 of its 4 jobs did not run (#2 trainer.lr=0.002 train.global_batch=8; "
                                     "#3 trainer.lr=0.002 train.global_batch=16)")
    assert not_run_line(argv, 3) == "it was the sweep's last job"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_in_the_first_point_of_a_sweep_ends_the_sweep(tmp_path):
    """The command itself: one Ctrl-C (to the process group, as a terminal sends it) while job #0 trains.
    Before, job #0 stopped and saved, then job #1 started, and its first Ctrl-C ended it at once, silently."""
    if not SCRIPT.is_file():
        pytest.skip(f"no console script at {SCRIPT}")
    sweep = tmp_path / "sweep"
    cmd = [str(SCRIPT), "train", "-m", "cluster=cpu2", "model=llama_tiny", "train.global_batch=8",
           "trainer.progress_bar=false", "data.num_samples=64", "trainer.max_steps=2000", "trainer.val_every=0",
           "trainer.log_every=1", "trainer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"]
    # one Ctrl-C to the process group, as a terminal sends it
    code, out, err = signal_when(cmd, tmp_path, "step     2 ", lambda p: os.killpg(p.pid, signal.SIGINT), 240,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    text = err.read_text()
    assert code == 130, text[-3000:]
    assert "interrupted (Ctrl-C) after step" in text, text[-3000:]
    assert text.strip().splitlines()[-1] == ("hexiscale train: Ctrl-C stopped the sweep at job #0; 1 of its 2 jobs "
                                             "did not run (#1 trainer.lr=0.002)"), text[-3000:]
    assert (sweep / "0" / "checkpoints" / "last.ckpt").exists() and not (sweep / "1").exists()
