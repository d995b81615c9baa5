"""benchmarks/bench_planner.py: --help works and each section runs on a tiny subset."""

import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_planner.py"


@pytest.mark.slow
def test_help():
    out = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "--sections" in out.stdout


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import bench_planner
    finally:
        sys.path.remove(str(RECIPE.parent))
    return bench_planner


@pytest.mark.slow
def test_sections_on_tiny_inputs(bench, tmp_path, capsys):
    assert len(bench.small_clusters()) >= 10
    speed = bench.bench_speed([32], iterations=3)
    assert speed[0]["gpus"] == 32 and speed[0]["search_time_s"] > 0
    quality = bench.bench_quality(bench.small_clusters()[2:4], iterations=10, random_seeds=[1])
    assert len(quality) == 3 and all(r["ratio"] >= 0.97 and r["optimum_complete"] for r in quality)
    rows = bench.bench_baselines([("cpu_hetero4", "llama_tiny", 8)], iterations=4)
    assert rows[0]["galvatron"]["unaware"]["speedup"] > 0 and rows[0]["galvatron"]["aware"]["speedup"] > 0
    assert rows[0]["metis"]["own"]["speedup"] > 0
    # the baselines a user would compare with: symmetric-best, leave-out and uniform-tp, with their compute ceilings
    for name in ("symmetric-best", "leave-out", "uniform-tp"):
        assert rows[0][name]["own"]["speedup"] >= 1 - 1e-9 and rows[0][name]["own"]["compute_ceiling"] >= 1.0
    assert rows[0]["search_ceiling"] >= 1.0
    out = capsys.readouterr().out
    assert "search time" in out and "true optimum" in out and "galvatron" in out
    assert "symmetric-best" in out and "leave-out" in out and "uniform-tp" in out
    assert "at least as fast as symmetric-best on every row: met" in out


def test_unknown_section_is_an_error(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--sections", "nope", "--out", str(tmp_path)])
