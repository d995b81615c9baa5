"""benchmarks/bench_runtime.py runs end to end (tiny sizes) and prints the ratio and memory lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_script import run_script

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_runtime.py"


@pytest.mark.slow
def test_help(capsys):
    code, out, _ = run_script(RECIPE, ["--help"], capsys)
    assert code == 0 and "DistributedDataParallel" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_run_prints_ratio_and_memory():
    args = ["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "2",
            "--micro-batch", "1", "--steps", "2", "--warmup", "0", "--mem-steps", "1"]
    out = subprocess.run([sys.executable, str(RECIPE), *args], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "throughput ratio hexiscale / ddp" in out.stdout
    assert out.stdout.count("peak memory growth per rank") == 2
    assert "cost model (planner/cost/estimate.py) peak memory per rank" in out.stdout
