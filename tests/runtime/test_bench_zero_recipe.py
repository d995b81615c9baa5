"""benchmarks/bench_zero.py runs: --help, and a tiny end-to-end run printing the measured vs estimated table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_script import run_script

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_zero.py"


@pytest.mark.slow
def test_help(capsys):
    code, out, _ = run_script(RECIPE, ["--help"], capsys)
    assert code == 0 and "--ranks" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_run_prints_ratios():
    out = subprocess.run([sys.executable, str(RECIPE), "--layers", "2", "--hidden", "128", "--seq", "16",
                          "--steps", "1"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    for word in ("ddp", "zero2/ddp", "zero3/ddp", "measured", "estimated"):
        assert word in out.stdout
    losses = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith(("ddp ", "zero2 ", "zero3 "))]
    assert len(losses) == 3 and len(set(losses)) == 1  # same training under every sharding
