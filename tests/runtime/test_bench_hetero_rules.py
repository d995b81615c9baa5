"""lightning_hexiscale/bench/hetero_rules.py and bench_hetero_plans.py: the pre-registered ranking test and its
rounds, the compared and calibration plans (pure parts, no processes)."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import random
from pathlib import Path

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner import Plan

REPO = Path(__file__).resolve().parents[2]


rules = importlib.import_module("lightning_hexiscale.bench.hetero_rules")
plans = importlib.import_module("lightning_hexiscale.bench.hetero_plans")


# ---- the ranking test -------------------------------------------------------------------------------
def brute_force_p(d: list[float]) -> float:
    """Reference: enumerate every sign assignment of the non-zero |d| (average ranks for ties)."""
    d = [x for x in d if x != 0]
    a = sorted(abs(x) for x in d)
    rank = {v: (a.index(v) + 1 + len(a) - a[::-1].index(v)) / 2 for v in a}  # average rank of each |d|
    w = sum(rank[abs(x)] for x in d if x > 0)
    sums = [sum(rank[abs(x)] for x, s in zip(d, signs) if s) for signs in itertools.product((0, 1), repeat=len(d))]
    low = sum(s <= w + 1e-9 for s in sums) / len(sums)
    high = sum(s >= w - 1e-9 for s in sums) / len(sums)
    return min(1.0, 2 * min(low, high))


def test_wilcoxon_p_is_the_exact_signed_rank_test():
    assert rules.wilcoxon_p([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)  # all positive: the two extreme of 32
    assert rules.wilcoxon_p([-1, 2, -3, 4, -5, 6]) > 0.5
    assert rules.wilcoxon_p([0.0, 0.0]) == 1.0
    rnd = random.Random(0)
    for n in (3, 6, 9, 11):
        for _ in range(5):
            d = [round(rnd.gauss(0.3, 1.0), 1) for _ in range(n)]  # rounded: ties and zeros happen
            assert rules.wilcoxon_p(d) == pytest.approx(brute_force_p(d)), d


def test_ranking_rounds_detect_5_percent_with_80_percent_power():
    """The rule's arithmetic (module docstring), checked by simulation: normal per-round log ratios
    with the prior sigma, a true 5 % difference."""
    n, text = rules.rounds_for_power()
    assert n == rules.RANKING_ROUNDS == 25 and "-> 25 rounds" in text
    delta, sigma = math.log(1.05), rules.PRIOR_ROUND_SIGMA
    rnd = random.Random(1)
    sims = 1500
    power = sum(rules.wilcoxon_p([rnd.gauss(delta, sigma) for _ in range(n)]) < rules.RANK_ALPHA
                for _ in range(sims)) / sims
    size = sum(rules.wilcoxon_p([rnd.gauss(0.0, sigma) for _ in range(n)]) < rules.RANK_ALPHA
               for _ in range(sims)) / sims
    assert power >= 0.78 and size <= 0.07
    short = sum(rules.wilcoxon_p([rnd.gauss(delta, sigma) for _ in range(7)]) < rules.RANK_ALPHA
                for _ in range(sims)) / sims
    assert short < 0.4  # the old 7 rounds: far below the pre-registered power
    assert rules.rounds_for_power(sigma=0.04)[0] < n < rules.rounds_for_power(sigma=0.16)[0]


def test_round_sigma_pools_the_pairs():
    from lightning_hexiscale.profiling.rounds import PlanTimes

    a = PlanTimes([[1.0], [1.0], [1.0]]).to_dict()
    b = PlanTimes([[2.0], [2.0], [2.0]]).to_dict()  # a constant ratio: no noise
    assert rules.round_sigma({"a": a, "b": b}) == pytest.approx(0.0)
    c = PlanTimes([[1.0], [math.e ** 0.1], [1.0]]).to_dict()
    assert rules.round_sigma({"a": a, "c": c}) == pytest.approx(math.sqrt(2 * (0.1 / 3) ** 2 + (0.2 / 3) ** 2) / math.sqrt(2))


# ---- the compared and calibration plans ---------------------------------------------------------------
def _config():
    from lightning_hexiscale.models.config import LlamaConfig

    return LlamaConfig(name="t", hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=2, ffn_hidden_size=192,
                       vocab_size=64, seq_len=16)


def test_structure_ignores_batches_and_leaders_only():
    from lightning_hexiscale.profiling.calibrate import pure_dp_plan, tp_pairs_plan

    cfg = _config()
    dp2, dp3 = pure_dp_plan(4, cfg, 2, 2, False), pure_dp_plan(4, cfg, 2, 3, False)
    assert plans.structure(dp2) == plans.structure(dp3)  # batch sizes aside
    assert plans.structure(dp2) != plans.structure(tp_pairs_plan(4, cfg, 2, 2, False))
    cal = plans.calibration_structures(4, cfg, 2, 2)
    assert set(cal) == {"compute alone", "data parallel", "TP-2 pairs"}
    three = Plan.from_dict({**dp2.to_dict(), "pipelines": dp2.to_dict()["pipelines"][:3]})
    flagged = plans.in_sample({"dp-equal": dp3, "search": tp_pairs_plan(4, cfg, 2, 5, False), "sub": three}, cal)
    assert flagged == {"dp-equal": "compute alone", "search": "TP-2 pairs"}  # three devices: not the same structure


@pytest.mark.parametrize("cluster", ["emu_4to1", "emu_headroom", "cpu_hetero4"])
def test_held_out_plans_have_tp_and_a_hop_across_machines(cluster):
    from lightning_hexiscale.profiling.check import cpu_workload

    c, cfg = Cluster.load(cluster), _config()
    fast_type = max(c.devices, key=lambda d: d.flops).gpu_type
    for fast_first in (True, False):
        plan, note = plans.held_out_plan(c, cfg, cpu_workload(cfg), 8, 2, fast_first)
        assert plan is not None, note
        stages = plan.pipelines[0].stages
        assert max(s.tp for s in stages) >= 2 and len({c.devices[s.devices[0]].machine for s in stages}) >= 2
        assert (c.devices[stages[0].devices[0]].gpu_type == fast_type) == fast_first
        assert stages[0].layers[0] == 0 and stages[-1].layers[1] == cfg.num_layers and plan.global_batch == 8
        assert sorted(plan.device_order) == list(range(c.num_devices))
        assert plans.structure(plan) not in plans.calibration_structures(c.num_devices, cfg, 2, 2).values()
    one_machine = c.subset(list(c.machines[0].devices))
    plan, note = plans.held_out_plan(one_machine, cfg, cpu_workload(cfg), 8, 2, True)
    assert plan is None and "two machines" in note


def test_a_plan_the_planner_cannot_make_is_named_unavailable(monkeypatch):
    from lightning_hexiscale.planner import baselines

    monkeypatch.delattr(baselines, "megatron")
    monkeypatch.setattr(baselines, "galvatron", lambda cluster, work, g, s: None)  # older signature: no aware=
    spec = importlib.util.spec_from_file_location("bench_hetero", REPO / "benchmarks" / "bench_hetero.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--iterations", "2"])
    out = plans.make_plans(Cluster.load("cpu_hetero4"), _config(), args, ("megatron", "galvatron", "held-out-fast-first"))
    assert out["megatron"][0] is None and out["megatron"][1].startswith(
        "UNAVAILABLE: lightning_hexiscale.planner.baselines has no `megatron`")
    assert out["galvatron"][0] is None and "UNAVAILABLE: baselines.galvatron(" in out["galvatron"][1]
    assert "aware=True" in out["galvatron"][1] and "unexpected keyword" in out["galvatron"][1]
    assert out["held-out-fast-first"][0] is not None


def test_compared_list_is_the_issues():
    names = plans.COMPARED_NAMES
    assert names[0] == "search" and set(rules.LEAVE_OUT) <= set(names) and "uniform-tp" in names
    assert "symmetric-best" in names and not [n for n in names if n.startswith("fast-only")]  # issue 43's names
    assert rules.WORTH_IT_TARGETS == {"emu_headroom": 1.20, "emu_4to1": 0.98}
    assert {"megatron", "galvatron"} <= set(names) and len(plans.HELD_OUT) >= 2
    assert plans.fitted_constants(Cluster.load("emu_4to1")) == ["efficiency EMU-FAST", "efficiency EMU-SLOW",
                                                                 "sync latency", "theta_ddp"]


@pytest.mark.slow
def test_cost_model_form_changes_with_the_pricing_source(monkeypatch, tmp_path):
    form = plans.cost_model_form()
    files = form["files"]
    assert {"lightning_hexiscale/planner/cost/model.py", "lightning_hexiscale/planner/cost/estimate.py",
            "lightning_hexiscale/profiling/calibrate.py"} <= set(files)
    assert "lightning_hexiscale/planner/search/two_phase.py" not in files  # the search is not the cost model
    assert plans.cost_model_form()["sha256"] == form["sha256"]
    copy = tmp_path / "lightning_hexiscale" / "planner" / "cost"
    copy.mkdir(parents=True)
    (copy / "estimate.py").write_text("x = 1\n")
    monkeypatch.setattr(plans, "REPO", tmp_path)
    monkeypatch.setattr(plans, "PRICING_ROOTS", ("lightning_hexiscale/planner/cost/estimate.py",))
    first = plans.cost_model_form()["sha256"]
    (copy / "estimate.py").write_text("x = 2\n")
    assert plans.cost_model_form()["sha256"] != first


@pytest.mark.slow  # runs git: a process
def test_cost_model_form_names_a_modified_file_whole(monkeypatch, tmp_path):
    """`git status --porcelain` starts a modified file's line with a space (" M path"); the form once
    stripped it and printed "ightning_hexiscale/..." (seen in a smoke run on 2026-11-28)."""
    import subprocess

    f = tmp_path / "lightning_hexiscale" / "planner" / "cost" / "estimate.py"
    f.parent.mkdir(parents=True)
    f.write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    f.write_text("x = 2\n")
    monkeypatch.setattr(plans, "REPO", tmp_path)
    monkeypatch.setattr(plans, "PRICING_ROOTS", ("lightning_hexiscale/planner/cost/estimate.py",))
    assert plans.cost_model_form()["modified"] == ["lightning_hexiscale/planner/cost/estimate.py"]
