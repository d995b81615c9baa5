"""Peak memory per rank under bf16-mixed on CPU (2 forked gloo ranks, GPipe, 8 micro-batches in flight)
against estimate(): within 15 % for ddp, zero2, zero3; and recipes/bench_memory.py prints its table.

Measured as in recipes/bench_memory.py (peak resident-set growth after a warm-up step). The
zero3 row with one micro-batch is an overestimate of ~1.2-1.3 (the gradient of a layer replaces
its stored tensors during the one backward; not modelled), so it is not part of the 15 % check."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import bench_memory  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "zero3"])
def test_bf16_mixed_peak_within_15_percent(sharding):
    config = bench_memory.bench_config(layers=4, hidden=256, seq=32)
    (row,) = bench_memory.rows(2, config, "bf16-mixed", [8], steps=2, shardings=(sharding,))
    ratio = row["estimated"] / row["measured"]
    assert 0.85 <= ratio <= 1.15, row


@pytest.mark.timeout(300)
def test_bench_memory_recipe_tiny():
    out = subprocess.run([sys.executable, "recipes/bench_memory.py", "--layers", "1", "--hidden", "64", "--seq", "8",
                          "--steps", "1", "--micro-batches", "1", "2", "--shardings", "ddp", "zero2"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert any("est/meas" in ln and "estimated MiB" in ln for ln in lines)
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["ddp"], ["zero2"])]
    assert [(r[0], r[1]) for r in rows] == [("ddp", "1"), ("ddp", "2"), ("zero2", "1"), ("zero2", "2")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
