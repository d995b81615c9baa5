"""benchmarks/bench_hetero.py: the interleaved rounds, the comparison it prints, and tiny end-to-end runs.

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
from lightning_hexiscale.planner import Plan, estimate
from lightning_hexiscale.profiling.check import cpu_workload
from lightning_hexiscale.profiling.rounds import PlanTimes, round_orders, slowest_rank

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "benchmarks" / "bench_hetero.py"
TINY_RUN = ["--hidden", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq", "16", "--global-batch", "8",
            "--micro-batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "2", "--iterations", "2", "--timeout",
            "200", "--load-window", "0.5"]


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


def _measured(medians: dict[str, float], rounds: int = 1) -> dict[str, dict]:
    return {n: PlanTimes([[m * 0.9, m, m * 1.2]] * rounds).to_dict() for n, m in medians.items()}


def test_compare_ratios_speedups_and_targets():
    bench = load_recipe()
    est = {"search": 1.0, "leave-out-search": 1.4, "megatron": 2.2, "held-out-fast-first": 1.9}
    res = bench.compare(est, _measured({"search": 1.0, "leave-out-search": 1.3, "megatron": 2.0,
                                        "held-out-fast-first": 2.0}, rounds=8), "emu_headroom",
                        held_out=("held-out-fast-first",))
    rows = res["rows"]
    assert rows["megatron"]["ratio"] == pytest.approx(1.1) and rows["megatron"]["speedup_of_search"] == pytest.approx(2.0)
    assert rows["held-out-fast-first"]["held_out"] and not rows["megatron"]["held_out"]
    assert res["order_by_estimate"] == ["search", "leave-out-search", "held-out-fast-first", "megatron"]
    t = res["targets"]
    assert t["worth_it_over_leave_out"]["value"] == pytest.approx(1.3) and t["worth_it_over_leave_out"]["pass"]
    assert t["estimates_within_15pct"]["pass"] and t["estimates_within_15pct"]["held_out_worst"] == pytest.approx(0.05)
    assert t["search_best_or_tied"]["pass"]
    text = bench.report(res, {})
    assert "PASS  worth_it_over_leave_out: 1.300" in text and "FAIL" not in text and "held out" in text
    # the checks can fail: the held-out plan priced 20 % low, the search slower than leave-out in every round
    bad = bench.compare({**est, "held-out-fast-first": 1.6},
                        _measured({"search": 1.5, "leave-out-search": 1.3, "megatron": 2.0,
                                   "held-out-fast-first": 2.0}, rounds=8), "emu_headroom",
                        held_out=("held-out-fast-first",))
    t = bad["targets"]
    assert not t["worth_it_over_leave_out"]["pass"] and not t["estimates_within_15pct"]["pass"]
    assert t["estimates_within_15pct"]["worst_plan"] == "search"
    assert not t["search_best_or_tied"]["pass"] and t["search_best_or_tied"]["beaten_by"] == ["leave-out-search"]
    assert "FAIL  search_best_or_tied" in bench.report(bad, {})


def test_worth_it_target_per_cluster_and_not_judged_without_leave_out():
    bench = load_recipe()
    meas = _measured({"search": 1.0, "leave-out-symmetric": 0.99, "leave-out-search": 1.2}, rounds=3)
    est = {"search": 1.0, "leave-out-symmetric": 1.0, "leave-out-search": 1.2}
    on_4to1 = bench.compare(est, meas, "emu_4to1")["targets"]["worth_it_over_leave_out"]
    assert on_4to1["against"] == "leave-out-symmetric" and on_4to1["value"] == pytest.approx(0.99)
    assert on_4to1["pass"] is True and on_4to1["target"] == ">= 0.98"  # 0.99: within issue 43's 2 % on emu_4to1
    below = bench.compare(est, _measured({"search": 1.0, "leave-out-symmetric": 0.97, "leave-out-search": 1.2}, rounds=3),
                          "emu_4to1")["targets"]["worth_it_over_leave_out"]
    assert below["pass"] is False and below["value"] == pytest.approx(0.97)
    head = bench.compare(est, _measured({"search": 1.0, "leave-out-symmetric": 1.19, "leave-out-search": 1.25}, rounds=3),
                         "emu_headroom")["targets"]["worth_it_over_leave_out"]
    assert head["pass"] is False and head["against"] == "leave-out-symmetric" and head["target"] == ">= 1.2"
    other = bench.compare(est, meas, "cpu_hetero4")["targets"]["worth_it_over_leave_out"]
    assert other["pass"] is None and "none for this cluster" in other["target"]
    missing = bench.compare({"search": 1.0}, _measured({"search": 1.0}), "emu_headroom")["targets"]
    assert missing["worth_it_over_leave_out"]["pass"] is None
    assert "NOT JUDGED  worth_it_over_leave_out" in bench.report(bench.compare({"search": 1.0}, _measured(
        {"search": 1.0}), "emu_headroom"), {})


def test_a_faster_plan_the_rounds_do_not_order_is_a_tie():
    bench = load_recipe()
    # b's median is lower, but the rounds order the pair both ways: a tie; c is slower in every round
    meas = {"search": PlanTimes([[1.0], [1.1], [1.0], [1.2], [1.0], [1.05]]).to_dict(),
            "b": PlanTimes([[1.05], [1.0], [0.95], [1.25], [0.97], [1.0]]).to_dict(),
            "c": PlanTimes([[2.0], [2.2], [2.1], [2.3], [2.0], [2.1]]).to_dict()}
    res = bench.compare({"search": 1.0, "b": 1.1, "c": 0.5}, meas, "emu_headroom")
    rank = res["targets"]["search_best_or_tied"]
    assert rank["pass"] and rank["tied_with"] == ["b"] and rank["beaten_by"] == []
    assert ("search", "b") in res["discordant_pairs"] and ("search", "b") in res["unsettled_pairs"]
    assert ("search", "c") in res["discordant_pairs"] and ("search", "c") not in res["unsettled_pairs"]


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


def test_plans_that_leave_devices_idle_are_measurable_when_launched_on_every_device():
    from lightning_hexiscale.bench.hetero_plans import not_measurable

    cluster = Cluster.load("cpu_hetero4")

    def plan(idle):
        return Plan.from_dict({"num_layers": 2, "idle_devices": idle, "pipelines": [
            {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [d], "layers": [0, 2]}]} for d in (0, 1)]})

    assert not_measurable(plan([2, 3]), cluster) is None  # the rounds run it on ranks 0 and 1
    why = not_measurable(plan([3]), cluster)  # device 2 neither used nor idle: no rank map to 4 ranks
    assert why is not None and "[0, 1, 3]" in why and "all 4 devices of cpu_hetero4" in why


def test_extra_measurements_may_not_take_a_plans_name():
    from lightning_hexiscale.profiling.rounds import measure_plans_rank

    with pytest.raises(ValueError, match="names of plans"):
        measure_plans_rank(0, 1, {"a": {}}, None, 1, 0, 1, extra={"a": lambda: [0.0]})


def _plans_and_extra_rank(rank, world, plan, config):
    from lightning_hexiscale.profiling.rounds import measure_plans_rank

    calls = []  # the extra returns how many times it ran so far
    return measure_plans_rank(rank, world, {"a": plan}, config, 1, 0, 3,
                              extra={"~x": lambda: (calls.append(1), [float(len(calls))])[1]})


@pytest.mark.slow
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
    res = bench.compare({"search": 1.0, "galvatron": 1.0, "megatron": 2.0},
                        _measured({"search": 1.1, "galvatron": 1.0, "megatron": 2.0}), "emu_4to1")
    assert res["estimated_ties"] == [("search", "galvatron")] and res["discordant_pairs"] == []
    assert "search = galvatron < megatron" in bench.report(res, {})


def test_bad_input_is_named_before_anything_starts():
    bench = load_recipe()
    with pytest.raises(SystemExit):
        bench.parse_args(["--plans", "search,nonsense"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--plans", "dp-equal"])  # no longer a compared plan


@pytest.mark.parametrize("sizes, says", [(["--global-batch", "9"], "multiple of --micro-batch"),
                                         (["--hidden", "100"], "model.num_heads")])
def test_bad_sizes_stop_before_any_process_starts(tmp_path, capsys, sizes, says):
    bench = load_recipe()
    rc = bench.main(["--launcher", "local", "--cluster", "cpu_hetero4", "--no-profile", "--out", str(tmp_path), *sizes])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err
    assert not (tmp_path / "logs").exists()  # no rank was launched


# ---- tiny runs -----------------------------------------------------------------------------------
def _check_results(out: Path, world: int, rounds: int, steps: int, cost: Cluster, stdout: str) -> dict:
    from lightning_hexiscale.bench.hetero_plans import COMPARED_NAMES, HELD_OUT

    doc = json.loads((out / "results.json").read_text())
    # every compared plan either ran or is named as unavailable, with the reason, in the output
    assert sorted(list(doc["rows"]) + doc["unavailable"]) == sorted(COMPARED_NAMES)
    for name in doc["unavailable"]:
        assert f"--- {name} (" in stdout and "NO PLAN, not measured" in stdout and doc["notes"][name]
    assert "pre-registered run: NO" in stdout and "not emulated (--launcher local)" in stdout
    per_rank = doc["per_rank_steps_s"]
    assert len(per_rank) == world
    config = LlamaConfig(**doc["model"])
    search_median = doc["rows"]["search"]["median_s"]
    for name, row in doc["rows"].items():
        # the table's numbers are the raw per-rank step times reduced as documented: the slowest of
        # the ranks that ran the plan (a rank whose device the plan leaves idle reports None)
        plan = Plan.from_dict(doc["plans"][name])
        ran = [r[name] for r in per_rank if r[name] is not None]
        assert len(ran) == plan.world_size and [r[name] is None for r in per_rank] == [
            d in plan.idle_devices for d in range(world)]
        slowest = [[max(t[k][j] for t in ran) for j in range(steps)] for k in range(rounds)]
        assert row["steps_s"] == slowest
        flat = [t for rnd in slowest for t in rnd]
        assert row["min_s"] == min(flat) and row["max_s"] == max(flat) and row["median_s"] == statistics.median(flat)
        assert row["ratio"] == pytest.approx(row["estimate_s"] / row["median_s"])
        assert row["speedup_of_search"] == pytest.approx(row["median_s"] / search_median)
        assert row["held_out"] == (name in HELD_OUT)
        # the estimate is the cost model's for the plan that ran, on the cluster the recipe planned with
        assert plan.launch_order == tuple(range(world))
        assert row["estimate_s"] == pytest.approx(estimate(plan, cost, cpu_workload(config)).iteration_time_s)
        assert Plan.load(out / "plans" / f"{name}.yaml") == plan
    for name in HELD_OUT:  # TP >= 2 and a pipeline hop across machines
        plan = Plan.from_dict(doc["plans"][name])
        assert max(s.tp for p in plan.pipelines for s in p.stages) >= 2
        assert len({cost.devices[s.devices[0]].machine for p in plan.pipelines for s in p.stages}) >= 2
    assert sorted(doc["order_by_measured"]) == sorted(doc["rows"])
    assert set(doc["targets"]) == {"worth_it_over_leave_out", "estimates_within_15pct", "search_best_or_tied"}
    assert doc["cost_model_form"]["sha256"] and "lightning_hexiscale/planner/cost/model.py" in doc["cost_model_form"]["files"]
    assert doc["load_before"]["cpus"] >= 1 and doc["rules"]["ranking_rounds"] >= 20
    return doc


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_local_run_of_every_compared_plan(tmp_path):
    """The smoke run: `--launcher local` on 4 ranks (2 machines of 2), the whole compared list."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(RECIPE), "--launcher", "local", "--cluster", "cpu_hetero4",
                        "--no-profile", "--out", str(out), *TINY_RUN],
                       capture_output=True, text=True, timeout=290, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "pre-registered rules" in p.stdout and "order by measured:" in p.stdout
    assert "fitted constants" in p.stdout and "host load before the run:" in p.stdout
    assert "host load during the run:" in p.stdout
    doc = _check_results(out, 4, 2, 1, Cluster.load("cpu_hetero4"), p.stdout)
    # the leave-out plans leave a machine idle and are measured in the same rounds
    assert {"leave-out-search", "leave-out-symmetric"} <= set(doc["rows"])
    assert any(Plan.from_dict(doc["plans"][n]).idle_devices for n in doc["rows"])


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


def _emulation_missing() -> list[str]:
    from lightning_hexiscale.emulate import missing_support

    return missing_support()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(bool(_emulation_missing()), reason="needs root, cgroups and network namespaces")
def test_tiny_emulated_run(tmp_path, two_machines):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(RECIPE), "--cluster", str(two_machines), "--no-profile", "--cores", "1.5",
                        "--plans", "search,megatron,galvatron", "--allow-load", "--out", str(out), *TINY_RUN],
                       capture_output=True, text=True, timeout=290, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "compute trimmed" in p.stdout and "CPU quota periods" in p.stdout
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["rows"]) == ["search", "megatron", "galvatron"] and doc["emulation"]["trim"]["cores"]
    assert any("--plans" in why for why in doc["not_preregistered_because"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(bool(_emulation_missing()), reason="needs root, cgroups and network namespaces")
def test_gloo_tp_allreduce_measured_inside_the_emulator(tmp_path, capsys):
    """The bench's TP-2 check through gloo: one machine of two ranks, 0.6 core each; the pair's cycle,
    its work at the quota (CPU seconds / quota) and the verdict line."""
    from lightning_hexiscale.emulate import EmulatedCluster

    yaml = tmp_path / "pair.yaml"
    yaml.write_text("defaults: [base_cluster, _self_]\nname: pair\n"
                    "gpu_types:\n  EMU-A: {flops: \"20 GFLOPS\", memory: \"2 GiB\"}\n"
                    "machines:\n  - {name: a, gpu: EMU-A, count: 2, intra_bandwidth: \"2 GB/s\", "
                    "intra_latency: \"50us\"}\n")
    bench = load_recipe()
    args = bench.parse_args(["--timeout", "200"])
    (tmp_path / "jobs").mkdir()
    with EmulatedCluster(str(yaml), cores=1.2) as emu:
        rows = bench.gloo_tp_check(emu, args, tmp_path)
    assert [r["ranks"] for r in rows] == [[0, 1]]
    r = rows[0]
    assert r["declared_latency_s"] == pytest.approx(50e-6) and 0 < r["fluid_s"] <= r["cycle_s"] * 1.2
    assert r["passes"] == (r["cycle_s"] - r["fluid_s"] <= 50e-6 + 1e-3)
    assert "TP-2 ranks 0-1 through gloo: cycle" in capsys.readouterr().out


def _busy(seconds: float = 3.0, ours=None):
    from lightning_hexiscale.emulate.hostload import LoadSample

    return LoadSample(seconds, others_cores=1.5, ours_cores=0.0, cpus=2, load_average=12.0)


@pytest.mark.slow
def test_busy_host_refused_unless_allow_load(tmp_path, monkeypatch, capsys):
    import os

    from lightning_hexiscale.emulate import hostload

    monkeypatch.setattr(hostload, "sample_load", _busy)
    bench = load_recipe()
    out = tmp_path / "out"
    assert bench.main(["--no-profile", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: other work used 1.50 of this host's 2 cores (75 %, limit 10 %")
    assert "Fix: " in err and "--allow-load" in err and "Traceback" not in err
    assert not (out / "logs").exists()  # nothing launched
    # --allow-load goes past the refusal (here to the next check: no root for the emulation)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--no-profile", "--allow-load", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "--allow-load: measuring anyway" in captured.out and "root privileges" in captured.err
    # the local launcher is not refused (no emulated ratios to distort): the load is printed only
    assert bench.load_before(bench.parse_args(["--launcher", "local"])).others_fraction == pytest.approx(0.75)


@pytest.mark.slow
def test_without_privileges_one_clear_error(tmp_path, monkeypatch, capsys):
    import os

    from lightning_hexiscale.emulate import hostload

    monkeypatch.setattr(hostload, "sample_load", lambda seconds=3.0, ours=None: hostload.LoadSample(
        seconds, 0.0, 0.0, 2, 0.1))  # a quiet host, so that the privileges are what stops the run
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what a normal user sees: no cgroups, no namespaces
    bench = load_recipe()
    assert bench.main(["--no-profile", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "root privileges" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, key", [
    (["--rounds", "0"], "--rounds"), (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"),
    (["--cores", "0"], "--cores"), (["--bw-scale", "-2"], "--bw-scale"), (["--timeout", "0"], "--timeout"),
    (["--micro-batch", "0"], "--micro-batch"), (["--load-window", "0"], "--load-window"),
    (["--global-batch", "7"], "--global-batch"),
])
def test_bad_counts_stop_before_any_process_starts(tmp_path, capsys, argv, key):
    out = tmp_path / "out"
    rc = load_recipe().main(argv + ["--launcher", "local", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {key} = ") and "Fix: " in err
    assert not out.exists()  # nothing written, nothing launched


@pytest.mark.slow
def test_plan_only_prices_the_compared_plans_and_the_fast_machine_alone(tmp_path, capsys):
    """emu_headroom has headroom: on its own figures the search beats the fast machine alone by 1.25x or
    more, and equal data parallelism over every rank is slower than the fast machine alone."""
    import re

    assert load_recipe().main(["--cluster", "emu_headroom", "--plan-only", "--iterations", "10",
                               "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compute ceiling over machine fast alone: 2.00x" in out
    t = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^  (\S.*?)\s+(\d+\.\d+) s", out, re.M)}
    assert t["(search on fast alone)"] / t["search"] >= 1.25
    assert t["(equal DP on all ranks)"] > t["(search on fast alone)"]
    assert {"held-out-fast-first", "held-out-slow-first", "megatron", "galvatron"} <= set(t)
    # leave-out (issue 43): the best plan on a strict subset; here the search on the fast machine and
    # one slow machine, faster than the fast machine alone, so its price is below the 1.31x above
    assert t["(search on fast alone)"] > t["leave-out-search"] >= t["search"]
    assert t["leave-out-search"] <= t["leave-out-symmetric"] and t["symmetric-best"] <= t["galvatron"] + 1e-9
    assert not (tmp_path / "logs").exists()  # no process was started
