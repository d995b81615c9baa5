"""benchmarks/bench_checkpoint.py runs: --help, and a tiny end-to-end run printing the table and the ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_script import run_script
import torch

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_checkpoint.py"


@pytest.mark.slow
def test_help(capsys):
    code, out, _ = run_script(RECIPE, ["--help"], capsys)
    assert code == 0 and "--ranks" in out and "torch.save" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_run_prints_table_and_ratios(tmp_path):
    out = subprocess.run([sys.executable, str(RECIPE), "--ranks", "2", "--hidden", "64", "--layers", "2",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("2 ")]
    assert len(rows) == 1 and all(float(x) >= 0 for x in rows[0] if x not in ("|", "||"))
    assert "ratios to one process's torch.save" in out.stdout and "save " in out.stdout and "load " in out.stdout
    assert not any(tmp_path.iterdir())  # the benchmark cleans up what it wrote


@pytest.mark.slow
def test_bad_ranks_are_refused(capsys):
    code, _, err = run_script(RECIPE, ["--ranks", "9"], capsys)
    assert code == 2 and "--ranks" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(300)
def test_cuda_peaks_stay_within_own_shards(tmp_path):
    """On CUDA the peak is max_memory_allocated per rank (NCCL ranks, one GPU each)."""
    out = subprocess.run([sys.executable, str(RECIPE), "--ranks", "2", "--hidden", "256", "--layers", "2",
                          "--device", "cuda", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line.split() for line in out.stdout.splitlines() if line.strip().startswith("2 "))
    own, save_extra, load_extra = float(row[2]), float(row[5]), float(row[13])
    assert save_extra <= own + 16 and load_extra <= own + 16  # MiB, the bound of test_checkpoint_shards.py
