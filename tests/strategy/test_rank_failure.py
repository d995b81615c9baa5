"""A failed rank stops the job cleanly: when one of 3 independent CPU ranks (torchrun-style, no
launcher to kill the others) raises, is killed or hangs mid-step, every other rank exits, non-zero, within
a bounded time, and says which rank failed.

Bound: the failure is seen at once where a peer's socket closes, else by the FailureWatch within
its grace (3 s here), else by the process-group timeout (10 s here: the hung rank's peers); every rank must be gone
within that timeout + 10 s of the failure, and the test kills them itself after 60 s (a hang fails
the test).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
WORLD, FAIL_RANK, FAIL_STEP, PG_TIMEOUT_S = 3, 2, 2, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, how: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "SLURM_"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                   LOCAL_RANK=str(rank), GROUP_RANK="0", LOCAL_WORLD_SIZE=str(WORLD), NODE_RANK="0",
                   TORCHELASTIC_RUN_ID="test", PYTHONPATH=os.pathsep.join(map(str, (HERE, HERE.parent, ROOT))),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "rank_job.py"), str(out), str(FAIL_RANK), str(FAIL_STEP), how, str(PG_TIMEOUT_S)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait_all(procs: list[subprocess.Popen], limit_s: float) -> tuple[list[int | None], list[str], list[float]]:
    """Exit codes (None: still running after ``limit_s``, then killed), stderr, and exit times."""
    t0 = time.monotonic()
    ended = [0.0] * len(procs)
    while time.monotonic() - t0 < limit_s and any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if p.poll() is not None and not ended[i]:
                ended[i] = time.time()
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    for i, p in enumerate(procs):
        ended[i] = ended[i] or time.time()
        if p.poll() is None:
            p.kill()
    errs = [p.communicate()[1] for p in procs]
    return codes, errs, ended


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["raise", "kill", "hang"])
def test_every_rank_stops_and_names_the_failed_one(tmp_path, how):
    codes, errs, ended = _wait_all(_launch(tmp_path, how), limit_s=60)
    detail = "\n".join(f"--- rank {r} (exit {c}):\n{e[-1500:]}" for r, (c, e) in enumerate(zip(codes, errs)))
    assert all(c is not None for c in codes), f"a rank hung:\n{detail}"
    assert all(c != 0 for c in codes), detail
    assert not list(tmp_path.glob("done*")), detail
    failed_at = float((tmp_path / "failed_at").read_text())
    took = max(ended) - failed_at
    assert took < PG_TIMEOUT_S + 10, f"the last rank exited {took:.1f} s after the failure:\n{detail}"
    survivors = [r for r in range(WORLD) if r != FAIL_RANK]
    for r in survivors:
        line = next((ln for ln in errs[r].splitlines() if ln.startswith(f"hexiscale: rank {r} ")), "")
        assert f"rank {FAIL_RANK} " in line, detail
    if how == "raise":
        assert any("injected failure on rank 2" in errs[r] for r in survivors), detail
    elif how == "kill":
        assert all("rank 2 stopped without reporting an error" in errs[r] for r in survivors), detail
    else:  # the others time out after PG_TIMEOUT_S; the hung rank is ended by its watch
        assert all("rank 2 is alive but never joined the collective" in errs[r] for r in survivors), detail
        assert codes[FAIL_RANK] == 4 and "hexiscale: rank 2 stops:" in errs[FAIL_RANK], detail
