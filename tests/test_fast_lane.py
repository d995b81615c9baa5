"""The fast lane's guard (tests/fast_lane.py) refuses a process started by an unmarked test, by
either door, and puts both doors back afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fast_lane


def test_guard_refuses_fork_and_popen_and_names_the_test():
    with fast_lane.no_processes("tests/x.py::test_y"):
        with pytest.raises(fast_lane.StartsProcess, match=r"tests/x.py::test_y .*@pytest.mark.slow"):
            os.fork()
        with pytest.raises(fast_lane.StartsProcess):
            subprocess.run([sys.executable, "-c", "pass"])
        import multiprocessing as mp

        with pytest.raises(fast_lane.StartsProcess):
            mp.get_context("fork").Process(target=print).start()
        with pytest.raises(fast_lane.StartsProcess):
            mp.get_context("spawn").Process(target=print).start()


@pytest.mark.slow
def test_guard_restores_both_doors():
    with fast_lane.no_processes("t"):
        pass
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_active_reads_the_environment(monkeypatch):
    monkeypatch.setenv(fast_lane.ENV, "1")
    assert fast_lane.active()
    monkeypatch.setenv(fast_lane.ENV, "0")
    assert not fast_lane.active()
