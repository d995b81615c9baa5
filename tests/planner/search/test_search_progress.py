"""``planner.progress``: the search's bar is drawn on a terminal (or in a notebook) only. Into a pipe
or a log file (`hexiscale plan ... 2> log`, CI) each search wrote a line of carriage-returned bars, and
``hexiscale plan`` runs up to two searches per device subset (30 bars for hetero2). Each was named
``search`` alone, so that on a terminal the bars that restart from 0 % read as a loop: each now names
its devices and its recompute setting."""

import io
import re
import sys
import types

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search
from lightning_hexiscale.planner.search.two_phase import HEARTBEAT
from lightning_hexiscale.progress import Heartbeat, is_terminal, shown_as


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _search(progress: bool) -> None:
    search(Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny")), 8,
           SearchSettings(iterations=3, progress=progress, recompute=False, use_all_devices=True))


@pytest.mark.parametrize("stream, progress, notebook, drawn", [
    (Terminal, True, False, True),        # a terminal: the bar
    (io.StringIO, True, False, False),    # a pipe or a file: no bar
    (io.StringIO, True, True, True),      # a Jupyter kernel's stream is no terminal, and shows the bar
    (Terminal, False, False, False),      # planner.progress=false: never
])
def test_the_search_bar_is_drawn_on_a_terminal_only(monkeypatch, stream, progress, notebook, drawn):
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(HEARTBEAT, "every_s", 1e9)  # the bar alone here: the plain lines are tested below
    if notebook:
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    else:
        monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    _search(progress)
    # the bar names its search (one per device subset and recompute setting: bars of one name read as a loop)
    assert ("search (4 devices, recompute off):" in err.getvalue()) == drawn, err.getvalue()
    assert ("search" in err.getvalue()) == drawn, err.getvalue()


@pytest.mark.parametrize("argv", [["--json"], []])
def test_hexiscale_plan_draws_the_bar_on_a_terminal_with_or_without_json(monkeypatch, capsys, argv):
    """`hexiscale plan --json > plan.json` at a terminal searched in silence: --json turned the bar off.
    The bar goes to stderr, so stdout stays the JSON document."""
    import json

    from lightning_hexiscale.cli.main import main

    out = io.StringIO()
    err = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert main(["plan", *argv, "cluster=cpu_hetero4", "model=llama_tiny", "train.global_batch=8",
                 "planner.iterations=3", "train.recompute=false", "planner.use_all_devices=true"]) == 0
    assert "search (4 devices, recompute off):" in err.getvalue(), err.getvalue()
    if argv:
        assert json.loads(out.getvalue())["plan"]["pipelines"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_heartbeat_writes_one_line_per_period_from_its_first_beat():
    clock, lines, asked = Clock(), [], []
    beat = Heartbeat(every_s=10.0, clock=clock, write=lines.append)

    def line():
        asked.append(clock.t)
        return f"at {clock.t:g}"

    assert not beat.beat(line)  # the first beat starts the period
    for t, wrote in ((109.9, False), (110.0, True), (115.0, False), (119.9, False), (125.0, True), (200.0, True)):
        clock.t = t
        assert beat.beat(line) is wrote, t
    assert lines == ["at 110", "at 125", "at 200"]
    assert asked == [110.0, 125.0, 200.0]  # the line is formatted only when it is written
    beat.restart()
    clock.t = 500.0
    assert not beat.beat(line)  # a new piece of work: its own first period, not 300 s since the last line
    clock.t = 509.0
    assert not beat.beat(line) and lines[-1] == "at 200"
    with pytest.raises(ValueError, match="every_s"):
        Heartbeat(every_s=0)


def test_a_line_written_now_restarts_the_heartbeats_period():
    """Discovery writes a new phase's line at once (:meth:`Heartbeat.write_now`); the next beat's line
    comes ``every_s`` after it, not after the previous beat's."""
    clock, lines = Clock(), []
    beat = Heartbeat(every_s=10.0, clock=clock, write=lines.append)
    assert not beat.beat(lambda: "first")
    clock.t = 108.0
    beat.write_now("new phase")
    clock.t = 112.0
    assert not beat.beat(lambda: "too soon")  # 12 s after the first beat, 4 s after the line
    clock.t = 118.0
    assert beat.beat(lambda: "beat")
    assert lines == ["new phase", "beat"]


def test_is_terminal_is_false_for_what_is_no_terminal(tmp_path):
    import os

    closed = io.StringIO()
    closed.close()
    assert not is_terminal(None) and not is_terminal(object()) and not is_terminal(closed)
    assert not is_terminal(io.StringIO()) and is_terminal(Terminal())
    parent, child = os.openpty()  # a real one
    try:
        with os.fdopen(child, "w", closefd=False) as tty:
            assert is_terminal(tty)
    finally:
        os.close(parent)
        os.close(child)


def test_shown_as_a_bar_where_one_is_seen_else_as_lines(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert shown_as(True, Terminal()) == "bar" and shown_as(True, io.StringIO()) == "lines"
    assert shown_as(False, Terminal()) is None and shown_as(False, io.StringIO()) is None
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))  # a notebook draws tqdm's widget
    assert shown_as(True, io.StringIO()) == "bar"


@pytest.mark.parametrize("stream, progress, lines", [
    (io.StringIO, True, True),     # a pipe or a log file: plain lines (the bar would be carriage returns)
    (Terminal, True, False),       # a terminal: the bar, no lines
    (io.StringIO, False, False),   # planner.progress=false: nothing
])
def test_into_a_pipe_the_search_writes_plain_lines_now_and_then(monkeypatch, stream, progress, lines):
    """`hexiscale plan cluster=hetero2 2>&1 | tee log` said nothing for the 50 s of its 30 searches."""
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(HEARTBEAT, "every_s", 1e-9)  # every beat after the first writes
    _search(progress)
    printed = [ln for ln in err.getvalue().splitlines() if "iteration" in ln]
    if not lines:
        assert not printed, err.getvalue()
        return
    # one per iteration after the search's first (3 iterations), named as its bar is, no carriage return
    found = [re.fullmatch(r"search \(4 devices, recompute off\): iteration (\d)/3(, best [\d.]+ [un]?s)?", ln)
             for ln in printed]
    assert all(found) and [int(m.group(1)) for m in found] == [2, 3], printed
    assert "\r" not in err.getvalue()
