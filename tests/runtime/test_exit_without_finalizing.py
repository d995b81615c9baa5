"""``runtime.host.exit_without_finalizing``: how ``hexiscale train``, its recipe and the other commands
that imported torch end. It keeps what a normal exit does for the job (its exit status, the
non-daemon threads joined, the atexit handlers, buffered output written) and skips only the
interpreter's teardown; under a profiler the exit is the normal one, so cProfile still writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import atexit, sys, threading, time
from lightning_hexiscale.runtime.host import exit_without_finalizing

def writer():  # a checkpoint writer's thread: the exit waits for it
    time.sleep(0.3)
    print(" thread done", end="")

threading.Thread(target=writer).start()
atexit.register(lambda: print(" atexit ran", end=""))
print("start", end="")  # no newline: only the flush at the exit writes it
exit_without_finalizing(7)
"""


def _run(tmp_path: Path, *prefix: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # block-buffered, as into a pipe
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *prefix, str(script)], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)


@pytest.mark.slow
def test_the_exit_keeps_the_code_threads_atexit_and_output(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 7, out.stderr
    assert out.stdout == "start thread done atexit ran", out.stdout


@pytest.mark.slow
def test_under_cprofile_the_exit_is_the_normal_one(tmp_path):
    out = _run(tmp_path, "-m", "cProfile", "-o", str(tmp_path / "job.prof"))
    assert out.returncode == 0, out.stderr  # cProfile's own: it catches the script's SystemExit
    assert out.stdout == "start thread done atexit ran", out.stdout
    assert (tmp_path / "job.prof").is_file()  # written after the script returned: not skipped by os._exit
