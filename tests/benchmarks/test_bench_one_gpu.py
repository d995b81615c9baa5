"""benchmarks/bench_one_gpu.py: its CPU smoke mode runs both sides end to end (the strategy with its
defaults and the plain loops), writes the report a GPU run writes, and shows both sides doing the
same work: the strategy's losses equal the plain Llama loop's step by step. The timing target
itself is for a GPU (``n/a`` here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_one_gpu.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_runs_both_sides_on_the_same_work(tmp_path):
    out = tmp_path / "one_gpu.json"
    p = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], capture_output=True, text=True,
                       timeout=290, env={**__import__("os").environ, "HEXISCALE_CACHE_DIR": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and r["verdict"] == "n/a" and r["target"] == 1.05
    assert {"strategy", "plain/hexiscale"} <= set(r["seconds_per_step"])
    assert all(t > 0 for t in r["seconds_per_step"].values())
    assert r["best_plain"].startswith("plain/")
    assert r["ratio"] == pytest.approx(r["seconds_per_step"]["strategy"] / r["seconds_per_step"][r["best_plain"]])
    steps = r["steps"] + r["warmup"]
    assert len(r["losses"]["strategy"]) == len(r["losses"]["plain/hexiscale"]) == steps
    assert r["max_loss_gap_strategy_vs_plain"] < 1e-4  # fp32 on the CPU: rounding only
    assert "strategy / plain/" in p.stdout


@pytest.mark.slow
def test_no_gpu_without_smoke_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full benchmark would run")
    p = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--smoke" in p.stderr
