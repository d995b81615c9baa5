"""`hexiscale plan` through lightning_hexiscale.cli.main: JSON, baselines, sweep, picture, errors."""

import csv
import json

import pytest

from lightning_hexiscale.cli.main import main

BASE = ["cluster=case_study", "model=llama2_13b", "train.global_batch=24", "planner.iterations=6"]


def test_plan_json_has_plan_estimate_and_search_time(capsys, tmp_path):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--json", "--out", str(out), *BASE]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"plan", "estimate", "search_time_s", "log"} <= set(doc)
    assert doc["plan"]["num_layers"] == 40 and sum(p["batch_size"] for p in doc["plan"]["pipelines"]) == 24
    assert doc["estimate"]["feasible"] is True and doc["estimate"]["cluster"] == "case_study"
    # the estimate document is the one `hexiscale estimate --json` prints for the written plan
    assert main(["estimate", "--plan", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["iteration_time_s"] == pytest.approx(doc["estimate"]["iteration_time_s"])
    assert set(again) == set(doc["estimate"])


def test_plan_json_with_baselines(capsys):
    assert main(["plan", "--json", "--baselines", *BASE]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["baselines"]) == {"megatron", "galvatron", "metis", "random"}
    for row in doc["baselines"].values():
        assert {"iteration_time_s", "pflops", "feasible"} <= set(row)
    # heterogeneity-unaware by default: galvatron believes 8 GPUs of 24 GiB (the smallest), where
    # Llama-2 13B's 208 GB of training state cannot fit; it reports its memory-blind time instead
    galv = doc["baselines"]["galvatron"]
    assert galv["feasible"] is False and galv["iteration_time_ignoring_memory_s"] > 0
    assert main(["plan", "--json", "--baselines", "--aware-baselines", *BASE]) == 0
    aware = json.loads(capsys.readouterr().out)["baselines"]
    assert aware["galvatron"]["feasible"] is True


def test_plan_text_report(capsys):
    assert main(["plan", "--baselines", *BASE, "planner.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "pipeline" in out and "PFLOPS" in out and "search:" in out and "galvatron" in out


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_picture_is_written(tmp_path, capsys, ext):
    pic = tmp_path / f"plan.{ext}"
    assert main(["plan", "--picture", str(pic), *BASE, "planner.progress=false"]) == 0
    assert pic.stat().st_size > 1000


def test_picture_with_a_bad_extension_is_a_config_error(tmp_path, capsys):
    assert main(["plan", "--picture", str(tmp_path / "plan.jpg"), *BASE, "planner.progress=false"]) == 2
    assert "--picture" in capsys.readouterr().err


def test_sweep_writes_csv_and_markdown(tmp_path, capsys):
    args = ["plan", "-m", "--baselines", "--sweep-dir", str(tmp_path), "cluster=cpu_hetero4,cpu2", "model=llama_tiny",
            "train.global_batch=8", "planner.iterations=4"]
    assert main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["cluster"] for r in rows] == ["cpu_hetero4", "cpu2"]
    assert all(float(r["iteration_time_s"]) > 0 and r["megatron_time_s"] for r in rows)
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith("| overrides") and "cpu_hetero4" in md and "cpu_hetero4" in capsys.readouterr().out
    assert len(list(tmp_path.glob("plan-*.yaml"))) == 2


def test_infeasible_model_exits_2_with_the_reason(capsys):
    assert main(["plan", "cluster=cpu2", "model=llama2_70b", "planner.iterations=2", "planner.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "no plan fits in memory" in err and "Fix:" in err


def test_plan_optimum_reports_the_oracle_beside_the_search(capsys):
    """--optimum: the oracle's optimum, independently re-scored here, and the search's fraction of it."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.planner.estimate import estimate, workload_from_config
    from lightning_hexiscale.planner.plan import Plan

    args = ["cluster=cpu_hetero4", "model=llama_demo", "planner.iterations=4"]
    assert main(["plan", "--json", "--optimum", *args]) == 0
    doc = json.loads(capsys.readouterr().out)
    opt = doc["optimum"]
    assert opt["status"] == "optimal" and opt["complete"] is True
    cfg = compose(args)
    cluster, workload = Cluster.from_config(cfg.cluster), workload_from_config(cfg)
    best = estimate(Plan.from_dict(opt["plan"]), cluster, workload)
    assert best.iteration_time_s == pytest.approx(opt["iteration_time_s"], rel=1e-9)
    assert best.iteration_time_s <= doc["estimate"]["iteration_time_s"] * (1 + 1e-9)
    assert opt["search_fraction_of_optimum"] == pytest.approx(opt["iteration_time_s"] / doc["estimate"]["iteration_time_s"])
    assert main(["plan", "--optimum", *args, "planner.progress=false"]) == 0
    assert "true optimum (planner/oracle.py" in capsys.readouterr().out


@pytest.mark.parametrize("extra, key", [(["cluster=hetero1", "model=llama2_7b"], "--optimum ="),
                                        (["cluster=cpu2", "model=llama_demo", "--optimum-time-limit", "0"],
                                         "--optimum-time-limit ="),
                                        (["-m", "cluster=cpu2,cpu_hetero4", "model=llama_demo"], "--optimum =")])
def test_plan_optimum_bad_input_is_refused_before_the_search(capsys, extra, key):
    assert main(["plan", "--optimum", *extra]) == 2
    err = capsys.readouterr().err
    assert key in err and "Fix:" in err and "search:" not in err
