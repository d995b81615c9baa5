"""The fast lane's guard: under ``make test-fast`` (``HEXISCALE_FAST_LANE=1``, ``-m "not slow"``) a
test that starts a process fails at once with the fix ("mark it slow"), so the lane stays the pure
tests that run in seconds, and the ``slow`` marker stays true of every test that forks, spawns or
runs a command.

A process starts through ``os.fork`` (multiprocessing's fork start method, forked ranks),
``subprocess.Popen`` (the CLI, torchrun, recipes and benchmarks run as commands) or
``multiprocessing.util.spawnv_passfds`` (multiprocessing's spawn and forkserver start methods,
which call ``_posixsubprocess`` themselves). All three are patched for the test's duration.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager

ENV = "HEXISCALE_FAST_LANE"


class StartsProcess(BaseException):
    """Raised by the guard: the running test is not marked slow, yet it starts a process. A
    BaseException, so that a test's own ``pytest.raises(Exception)`` or ``except Exception`` cannot
    take it for the failure the test expects."""


def active() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


@contextmanager
def no_processes(test_id: str):
    """Within: ``os.fork`` and ``subprocess.Popen`` raise :class:`StartsProcess` naming ``test_id``."""
    def refuse(*_args, **_kwargs):
        raise StartsProcess(f"{test_id} starts a process but is not marked slow: add @pytest.mark.slow "
                            "(or `pytestmark = pytest.mark.slow` for a module of such tests); the fast lane "
                            "(make test-fast) runs only tests that start no process")

    import multiprocessing.util as mp_util

    fork, init, spawn = os.fork, subprocess.Popen.__init__, mp_util.spawnv_passfds
    os.fork = subprocess.Popen.__init__ = mp_util.spawnv_passfds = refuse
    try:
        yield
    finally:
        os.fork, subprocess.Popen.__init__, mp_util.spawnv_passfds = fork, init, spawn
