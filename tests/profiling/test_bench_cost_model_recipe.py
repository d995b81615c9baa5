"""benchmarks/bench_cost_model.py: --help, its plan sets, its report and plot (the measured run itself
takes minutes and is run by hand; see docs/results/index.md, "Cost-model accuracy")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from run_script import run_script

from lightning_hexiscale.models.config import LlamaConfig

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cost_model.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("bench_cost_model", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_help(capsys):
    code, out, _ = run_script(RECIPE, ["--help"], capsys)
    assert code == 0 and "--ranks" in out and "Oversubscription" in out


@pytest.mark.parametrize("world", [2, 4])
def test_plan_sets_are_valid_and_cover_dp_pp_tp(world):
    bench = load_recipe()
    cfg = LlamaConfig(name="b", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                      vocab_size=64, seq_len=16)
    plans = bench.plans_for(world, cfg.num_layers, 2)
    assert len(plans) >= 3
    for plan in plans.values():
        plan.validate(model=cfg)
        assert plan.world_size == world and plan.global_batch == 8
    shapes = {(p.num_pipelines, max(len(pp.stages) for pp in p.pipelines), max(s.tp for pp in p.pipelines for s in pp.stages))
              for p in plans.values()}
    assert any(n == world and st == 1 and tp == 1 for n, st, tp in shapes)  # pure DP
    assert any(st == 2 for _, st, _ in shapes) and any(tp == 2 for _, _, tp in shapes)  # 2-stage PP, TP 2


def test_report_and_plot(tmp_path):
    bench = load_recipe()
    rows = [{"world": w, "plan": name, "measured_s": m, "measured_median_s": m * 1.05, "estimated_profile_only_s": m / 2,
             "estimated_calibrated_s": m * (1 + d), "deviation_profile_only": -0.5, "deviation_calibrated": d,
             "deviation_calibrated_vs_median": d - 0.05, "memory_deviation_max": 0.3}
            for w, name, m, d in [(2, "dp2", 0.25, 0.03), (2, "tp2", 0.35, -0.1), (4, "dp4", 0.5, 0.2)]]
    text = bench.report(rows)
    assert "2 ranks: max |deviation| after calibration 10.0 %" in text and "4 ranks: max" in text
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
