"""recipes/bench_checkpoint.py runs: --help, and a tiny end-to-end run printing the table and the ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench_checkpoint.py"


def test_help():
    out = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--ranks" in out.stdout and "torch.save" in out.stdout


@pytest.mark.timeout(120)
def test_tiny_run_prints_table_and_ratios(tmp_path):
    out = subprocess.run([sys.executable, str(RECIPE), "--ranks", "2", "--hidden", "64", "--layers", "2",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("2 ")]
    assert len(rows) == 1 and all(float(x) >= 0 for x in rows[0] if x not in ("|", "||"))
    assert "ratios to one process's torch.save" in out.stdout and "save " in out.stdout and "load " in out.stdout
    assert not any(tmp_path.iterdir())  # the benchmark cleans up what it wrote


def test_bad_ranks_are_refused():
    out = subprocess.run([sys.executable, str(RECIPE), "--ranks", "9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--ranks" in out.stderr
