"""Peak memory per rank under bf16-mixed on CPU (2 gloo ranks forked from a fresh fork server, GPipe, 1 and 8
micro-batches in flight, 3.3 M parameters) against estimate(): within 15 % for ddp, zero2, zero3; and
benchmarks/bench_memory.py prints its table. Measured as in benchmarks/bench_memory.py (peak resident-set
growth per rank over two steps, after a warm-up step)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slow_host import scaled  # the limits stretch with the host's load, as pytest's own timeout does

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_memory  # noqa: E402

from lightning_hexiscale.config.cluster import Cluster  # noqa: E402
from lightning_hexiscale.planner import Workload, estimate  # noqa: E402


RECIPES = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def measured_rows() -> dict[tuple[str, int], dict]:
    """All six rows, measured once in a fresh interpreter with a minimal environment: the peak is a
    resident-set growth, and a long pytest process (its heap, what earlier tests left in os.environ
    and in torch's global state) moved it by up to 18 MiB here, in either direction, even for ranks
    forked from a fork server of its own."""
    code = ("import json, bench_memory as b; c = b.bench_config(layers=4, hidden=256, seq=128); "
            "print(json.dumps(b.rows(2, c, 'bf16-mixed', [1, 8], steps=2)))")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONPATH": os.pathsep.join([str(RECIPES.parent), str(RECIPES)]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=scaled(280))
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["sharding"], r["micro_batches"]): r for r in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("micro_batches", [1, 8])
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "zero3"])
def test_bf16_mixed_peak_within_15_percent(measured_rows, sharding, micro_batches):
    config = bench_memory.bench_config(layers=4, hidden=256, seq=128)
    row = measured_rows[(sharding, micro_batches)]
    ratio = row["estimated"] / row["measured"]
    assert 0.85 <= ratio <= 1.15, row
    if micro_batches == 8 and sharding != "zero3":
        # the check discriminates: 16-bit pricing of bf16-mixed is further from the measured peak (since
        # the fast path's main grads and chunked loss, ddp-8 measured 0.926 priced as run against 0.865
        # for the 16-bit pricing, so the 15 % band alone no longer tells the two apart there)
        plan = bench_memory.gpipe_plan(2, config, micro_batches, sharding)
        sixteen = Workload(config, dtype="bf16", optimizer_bytes_per_param=12.0, reserve_bytes=0.0, device="cpu")
        old = max(s.peak_memory_bytes for p in estimate(plan, Cluster.load("cpu2"), sixteen).pipelines for s in p.stages)
        assert abs(old / row["measured"] - 1) > abs(ratio - 1), (old, row)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_memory_recipe_tiny():
    out = subprocess.run([sys.executable, "benchmarks/bench_memory.py", "--layers", "1", "--hidden", "64", "--seq", "8",
                          "--steps", "1", "--micro-batches", "1", "2", "--shardings", "ddp", "zero2"],
                         capture_output=True, text=True, timeout=scaled(280))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert any("est/meas" in ln and "estimated MiB" in ln for ln in lines)
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["ddp"], ["zero2"])]
    assert [(r[0], r[1]) for r in rows] == [("ddp", "1"), ("ddp", "2"), ("zero2", "1"), ("zero2", "2")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
