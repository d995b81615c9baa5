"""Under the strategy, a finished fit frees its engine: two fits in one torchrun-style process
(``release_job.py``) each leave no parameter of their stage alive once the Trainer is dropped.
Before the tensor hooks held their owner weakly (``runtime/weak_hooks.py``) the first fit left 29
of its 39 parameters alive (the matmul weights that the main-grads copies' hooks reached), and the
second fit 29 more of its own: on a GPU, memory that a notebook or an in-process sweep never got
back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_fits_in_one_process_free_their_engines():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "SLURM_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               GROUP_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK="0", TORCHELASTIC_RUN_ID="test",
               PYTHONPATH=os.pathsep.join(map(str, (HERE, HERE.parent, ROOT))), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(HERE / "release_job.py")], env=env, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    fits = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(fits) == 2, done.stdout
    for i, fit in enumerate(fits):
        assert fit["main_grads"] and fit["params"] > 0, fit  # the hooks that held the engine are installed
        assert fit["alive"] == 0 and not fit["engine_alive"], f"fit {i}: {fit}"
