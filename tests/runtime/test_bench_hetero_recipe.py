"""recipes/bench_hetero.py: the interleaved rounds, the comparison it prints, and tiny end-to-end runs.

The tiny runs check the structure of results.json and that its columns are consistent with its raw
per-rank step times and with the cost model (not timings: the machine is shared). The emulated run
needs root, cgroups and network namespaces and is skipped without them.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.estimate import estimate
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.profiling.check import cpu_workload
from lightning_hexiscale.profiling.rounds import PlanTimes, round_orders, slowest_rank

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "bench_hetero.py"
TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq", "16", "--global-batch", "8",
        "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--rounds", "2", "--iterations", "3", "--timeout", "120"]


def load_recipe():
    spec = importlib.util.spec_from_file_location("bench_hetero", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- pure parts ----------------------------------------------------------------------------------
def test_round_orders_rotate_so_every_plan_takes_every_position():
    orders = round_orders(["c", "a", "b"], 4)
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    for pos in range(3):
        assert {o[pos] for o in orders[:3]} == {"a", "b", "c"}
    with pytest.raises(ValueError, match="rounds"):
        round_orders(["a"], 0)


def test_slowest_rank_takes_the_max_per_step():
    per_rank = [{"p": [[1.0, 5.0], [2.0, 2.0]]}, {"p": [[3.0, 4.0], [1.0, 6.0]]}]
    t = slowest_rank(per_rank)["p"]
    assert t.per_round == [[3.0, 5.0], [2.0, 6.0]]
    assert (t.min_s, t.median_s, t.max_s) == (2.0, 4.0, 6.0)
    with pytest.raises(ValueError, match="different numbers of steps"):
        slowest_rank([{"p": [[1.0]]}, {"p": [[1.0, 2.0]]}])


def _measured(medians: dict[str, float]) -> dict[str, dict]:
    return {n: PlanTimes([[m * 0.9, m, m * 1.2]]).to_dict() for n, m in medians.items()}


def test_compare_ratios_speedups_and_ranking():
    bench = load_recipe()
    est = {"search": 1.0, "megatron": 2.2, "dp-equal": 2.6}
    res = bench.compare(est, _measured({"search": 1.0, "megatron": 2.0, "dp-equal": 2.5}))
    rows = res["rows"]
    assert rows["megatron"]["ratio"] == pytest.approx(1.1) and rows["megatron"]["speedup_of_search"] == pytest.approx(2.0)
    assert rows["dp-equal"]["estimated_speedup_of_search"] == pytest.approx(2.6)
    assert res["order_by_estimate"] == res["order_by_measured"] == ["search", "megatron", "dp-equal"]
    assert all(t["pass"] for t in res["targets"].values())
    text = bench.report(res, {})
    assert "PASS  speedup_over_megatron: 2.000" in text and "FAIL" not in text
    # the checks can fail: a swapped measurement, a slow search plan, an estimate 20 % off
    bad = bench.compare({**est, "megatron": 3.0}, _measured({"search": 1.5, "megatron": 2.0, "dp-equal": 2.5}))
    assert bad["discordant_pairs"] == [("megatron", "dp-equal")] and bad["unsettled_pairs"] == []
    assert not any(t["pass"] for t in bad["targets"].values())
    assert "FAIL  same_ranking" in bench.report(bad, {})


def test_disagreements_the_rounds_do_not_settle_are_named():
    bench = load_recipe()
    meas = {"a": PlanTimes([[1.0], [1.1]]).to_dict(), "b": PlanTimes([[1.2], [1.05]]).to_dict(),
            "c": PlanTimes([[2.0], [2.0]]).to_dict()}
    res = bench.compare({"a": 1.0, "b": 0.9, "c": 1.5}, meas)  # b estimated faster; round 0 says a, round 1 b
    assert res["discordant_pairs"] == [("a", "b")] and res["unsettled_pairs"] == [("a", "b")]
    text = bench.report(res, {})
    assert "differently from round to round" in text and "tie rule:" in text
    assert res["targets"]["same_ranking"]["pass"]  # the rounds leave (a, b) unordered: a measured tie
    res = bench.compare({"a": 1.0, "b": 0.9, "c": 0.8}, meas)  # c estimated fastest, measured slowest in every round
    assert ("a", "c") in res["discordant_pairs"] and ("a", "c") not in res["unsettled_pairs"]
    assert not res["targets"]["same_ranking"]["pass"]  # a pair every round orders is a real miss


def test_settled_needs_every_round_to_agree():
    bench = load_recipe()
    assert bench.settled([1.0, 1.1, 1.2], [1.2, 1.3, 1.25])
    assert not bench.settled([1.0, 1.1, 1.2], [1.2, 1.3, 1.15])


def test_calibration_in_the_rounds_is_split_from_the_plans():
    bench = load_recipe()
    per_rank = [{"p": [[1.0], [2.0]], bench.CAL_COMPUTE: [[0.1, 0.2], [0.3, 0.4]], bench.CAL_TP: [[1.0, 3.0], [2.0, 2.0]],
                 bench.CAL_DP: [[5.0, 5.0], [6.0, 4.0]]},
                {"p": [[1.5], [1.0]], bench.CAL_COMPUTE: [[0.5, 0.6], [0.7, 0.8]], bench.CAL_TP: [[2.0, 1.0], [1.0, 4.0]],
                 bench.CAL_DP: [[4.0, 7.0], [6.0, 5.0]]}]
    plans, cal = bench.split_calibration(per_rank)
    assert plans == [{"p": [[1.0], [2.0]]}, {"p": [[1.5], [1.0]]}]
    assert cal.compute_s == [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]  # per rank, every round
    assert cal.tp_steps_s == [2.0, 3.0, 2.0, 4.0] and cal.dp_steps_s == [5.0, 7.0, 6.0, 5.0]  # slowest rank per step
    assert bench.split_calibration([{"p": [[1.0]]}]) == ([{"p": [[1.0]]}], None)


def test_extra_measurements_may_not_take_a_plans_name():
    from lightning_hexiscale.profiling.rounds import measure_plans_rank

    with pytest.raises(ValueError, match="names of plans"):
        measure_plans_rank(0, 1, {"a": {}}, None, 1, 0, 1, extra={"a": lambda: [0.0]})


def _plans_and_extra_rank(rank, world, plan, config):
    from lightning_hexiscale.profiling.rounds import measure_plans_rank

    calls = []  # the extra returns how many times it ran so far
    return measure_plans_rank(rank, world, {"a": plan}, config, 1, 0, 3,
                              extra={"~x": lambda: (calls.append(1), [float(len(calls))])[1]})


@pytest.mark.timeout(60)
def test_extra_measurements_take_their_turn_in_every_round():
    from lightning_hexiscale.profiling.launch import run_local

    config = LlamaConfig(name="t", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden_size=32,
                         vocab_size=32, seq_len=4)
    plan = Plan.from_dict({"num_layers": 1, "schedule": "1f1b", "recompute": False, "pipelines": [
        {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [0], "layers": [0, 1]}]}]}).to_dict()
    times = run_local(1, _plans_and_extra_rank, plan, config, timeout_s=50)[0]
    assert times["~x"] == [[1.0], [2.0], [3.0]]  # once per round
    assert len(times["a"]) == 3 and all(len(r) == 1 and r[0] > 0 for r in times["a"])


def test_equal_estimates_are_ties_not_disagreements():
    bench = load_recipe()
    res = bench.compare({"search": 1.0, "metis": 1.0, "megatron": 2.0}, _measured({"search": 1.1, "metis": 1.0,
                                                                                  "megatron": 2.0}))
    assert res["estimated_ties"] == [("search", "metis")] and res["discordant_pairs"] == []
    assert "search = metis < megatron" in bench.report(res, {})


def test_bad_input_is_named_before_anything_starts():
    bench = load_recipe()
    with pytest.raises(SystemExit):
        bench.parse_args(["--plans", "search,nonsense"])
    args = bench.parse_args(["--global-batch", "6", "--micro-batch", "2"])
    with pytest.raises(Exception, match="--global-batch = 6"):
        bench.equal_dp_plan(Cluster.load("cpu_hetero4"), bench.model_config(args), 6, 2)


@pytest.mark.parametrize("sizes, says", [(["--global-batch", "6"], "multiple of devices x micro-batch"),
                                         (["--global-batch", "9"], "multiple of --micro-batch"),
                                         (["--hidden", "100"], "model.num_heads")])
def test_bad_sizes_stop_before_any_process_starts(tmp_path, capsys, sizes, says):
    bench = load_recipe()
    rc = bench.main(["--launcher", "local", "--cluster", "cpu_hetero4", "--no-profile", "--out", str(tmp_path), *sizes])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err
    assert not (tmp_path / "logs").exists()  # no rank was launched


# ---- tiny runs -----------------------------------------------------------------------------------
def _check_results(out: Path, plans: list[str], world: int, rounds: int, steps: int, cost: Cluster) -> dict:
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["rows"]) == plans
    per_rank = doc["per_rank_steps_s"]
    assert len(per_rank) == world
    config = LlamaConfig(**doc["model"])
    search_median = doc["rows"]["search"]["median_s"]
    for name, row in doc["rows"].items():
        # the table's numbers are the raw per-rank step times reduced as documented
        slowest = [[max(r[name][k][j] for r in per_rank) for j in range(steps)] for k in range(rounds)]
        assert row["steps_s"] == slowest
        flat = [t for rnd in slowest for t in rnd]
        assert row["min_s"] == min(flat) and row["max_s"] == max(flat) and row["median_s"] == statistics.median(flat)
        assert row["ratio"] == pytest.approx(row["estimate_s"] / row["median_s"])
        assert row["speedup_of_search"] == pytest.approx(row["median_s"] / search_median)
        # the estimate is the cost model's for the plan that ran, on the cluster the recipe planned with
        plan = Plan.from_dict(doc["plans"][name])
        assert plan.world_size == world
        assert row["estimate_s"] == pytest.approx(estimate(plan, cost, cpu_workload(config)).iteration_time_s)
        assert Plan.load(out / "plans" / f"{name}.yaml") == plan
    assert sorted(doc["order_by_measured"]) == sorted(plans)
    assert set(doc["targets"]) == {"speedup_over_megatron", "estimate_within_15pct", "same_ranking"}
    return doc


@pytest.fixture
def two_machines(tmp_path) -> Path:
    """2 ranks on 2 machines, 2:1 compute (under emulation even the slow rank imports torch quickly)."""
    yaml = tmp_path / "emu2.yaml"
    yaml.write_text("defaults: [base_cluster, _self_]\nname: emu2\n"
                    "gpu_types:\n  EMU-A: {flops: \"20 GFLOPS\", memory: \"2 GiB\"}\n"
                    "  EMU-B: {flops: \"10 GFLOPS\", memory: \"2 GiB\"}\n"
                    "machines:\n  - {name: a, gpu: EMU-A, count: 1, intra_bandwidth: \"2 GB/s\"}\n"
                    "  - {name: b, gpu: EMU-B, count: 1, intra_bandwidth: \"2 GB/s\"}\n"
                    "inter_machine: {bandwidth: \"100 MB/s\", latency: \"1ms\"}\n")
    return yaml


@pytest.mark.timeout(90)
def test_tiny_local_run(tmp_path, two_machines):
    plans = ["search", "megatron", "dp-equal"]
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(RECIPE), "--launcher", "local", "--cluster", str(two_machines),
                        "--no-profile", "--plans", ",".join(plans), "--out", str(out), *TINY],
                       capture_output=True, text=True, timeout=85, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "order by measured:" in p.stdout and "speedup_over_megatron" in p.stdout
    _check_results(out, plans, 2, 2, 2, Cluster.load(str(two_machines)))


def _emulation_missing() -> list[str]:
    from lightning_hexiscale.emulate import missing_support

    return missing_support()


@pytest.mark.timeout(120)
@pytest.mark.skipif(bool(_emulation_missing()), reason="needs root, cgroups and network namespaces")
def test_tiny_emulated_run(tmp_path, two_machines):
    plans = ["search", "megatron", "dp-equal"]
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(RECIPE), "--cluster", str(two_machines), "--no-profile", "--cores", "1.5",
                        "--plans", ",".join(plans), "--out", str(out), *TINY],
                       capture_output=True, text=True, timeout=115, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _check_results(out, plans, 2, 2, 2, Cluster.load(str(two_machines)))


def test_without_privileges_one_clear_error(tmp_path, monkeypatch, capsys):
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what a normal user sees: no cgroups, no namespaces
    bench = load_recipe()
    assert bench.main(["--no-profile", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "root privileges" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, key", [
    (["--rounds", "0"], "--rounds"), (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"),
    (["--cores", "0"], "--cores"), (["--bw-scale", "-2"], "--bw-scale"), (["--timeout", "0"], "--timeout"),
    (["--micro-batch", "0"], "--micro-batch"),
])
def test_bad_counts_stop_before_any_process_starts(tmp_path, capsys, argv, key):
    out = tmp_path / "out"
    rc = load_recipe().main(argv + ["--launcher", "local", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {key} = ") and "Fix: " in err
    assert not out.exists()  # nothing written, nothing launched
