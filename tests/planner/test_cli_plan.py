"""`hexiscale plan` through lightning_hexiscale.cli.main: JSON, baselines, sweep, picture, errors."""

import csv
import json

import pytest

from plan_memo import memoised_planner

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.cli.picture import read_description

BASE = ["cluster=case_study", "model=llama2_13b", "train.global_batch=24", "planner.iterations=6"]


@pytest.fixture(scope="module", autouse=True)
def planned_once():
    """The tests here plan BASE (and the straggler cluster) several times over: each search and
    baseline runs once per module for equal arguments (tests/planner/plan_memo.py)."""
    with pytest.MonkeyPatch.context() as mp, memoised_planner(mp) as stats:
        yield stats


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
    # what priced each device type, and how recompute: auto decided (the written plan keeps the choice)
    assert [(s["gpu_type"], s["kind"]) for s in doc["estimate"]["price_sources"]] == [
        ("A800", "datasheet"), ("RTX4090", "datasheet"), ("RTX3090", "datasheet")]
    assert doc["estimate"]["recompute_choice"].startswith("auto: ")
    flags = doc["estimate"]["recompute_per_pipeline"]
    assert flags == [p.get("recompute", doc["plan"].get("recompute")) for p in doc["plan"]["pipelines"]]
    assert doc["estimate"]["recompute"] == (flags[0] if len(set(flags)) == 1 else None)
    assert again["price_sources"] == doc["estimate"]["price_sources"]


def test_plan_text_names_the_price_sources(capsys):
    assert main(["plan", *BASE]) == 0
    out = capsys.readouterr().out
    assert "priced by:\n  A800: datasheet (roofline: GEMMs at 70% of the dense peak" in out
    assert "\nrecompute: auto: " in out


@pytest.mark.slow
def test_plan_json_with_baselines(capsys):
    assert main(["plan", "--json", "--baselines", *BASE]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["baselines"]) == {"megatron", "galvatron", "metis", "random", "symmetric-best", "leave-out",
                                     "uniform-tp"}
    for row in doc["baselines"].values():
        assert {"iteration_time_s", "pflops", "feasible", "compute_ceiling", "idle_devices"} <= set(row)
    # symmetric-best: the best symmetric plan on any machine subset, the rest idle; its ceiling says how
    # much compute it leaves out (1.0: none)
    fast = doc["baselines"]["symmetric-best"]
    assert fast["feasible"] and fast["compute_ceiling"] >= 1.0
    assert fast["compute_ceiling"] == pytest.approx(1.0) or fast["idle_devices"]
    assert fast["iteration_time_s"] >= doc["estimate"]["iteration_time_s"] * (1 - 1e-9)
    out = doc["baselines"]["leave-out"]  # the best plan of any style that leaves a machine out
    assert out["idle_devices"] and out["compute_ceiling"] > 1
    assert out["iteration_time_s"] >= doc["estimate"]["iteration_time_s"] * (1 - 1e-9)
    # heterogeneity-unaware by default: galvatron believes 8 GPUs of 24 GiB (the smallest), where
    # Llama-2 13B's 208 GB of training state cannot fit; it reports its memory-blind time instead
    galv = doc["baselines"]["galvatron"]
    assert galv["feasible"] is False and galv["iteration_time_ignoring_memory_s"] > 0
    assert main(["plan", "--json", "--baselines", "--aware-baselines", *BASE]) == 0
    aware = json.loads(capsys.readouterr().out)["baselines"]
    assert aware["galvatron"]["feasible"] is True


@pytest.mark.slow
def test_plan_text_report(capsys):
    assert main(["plan", "--baselines", *BASE, "planner.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "pipeline" in out and "PFLOPS" in out and "search:" in out and "galvatron" in out


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_picture_is_written(tmp_path, capsys, ext):
    pic = tmp_path / f"plan.{ext}"
    assert main(["plan", "--picture", str(pic), *BASE, "planner.progress=false", "planner.use_all_devices=true"]) == 0
    assert pic.stat().st_size > 1000
    if ext == "png":  # titled as the recipe's plan.png is (cli/picture.plan_title): "(estimated)" included
        title = read_description(pic)["title"]
        assert title.startswith("llama2_13b on case_study: ") and "/iteration (estimated), " in title and "FLOP" in title


def test_picture_with_a_bad_extension_is_a_config_error(tmp_path, capsys):
    assert main(["plan", "--picture", str(tmp_path / "plan.jpg"), *BASE]) == 2
    err = capsys.readouterr().err
    assert "--picture" in err and "search:" not in err  # refused before the search


@pytest.mark.parametrize("flag, path, rule", [("--out", "{tmp}", "is a directory"),
                                              ("--out", "{tmp}/a_file/plan.yaml", "a_file is a file, not a directory"),
                                              ("--picture", "{tmp}", "is a directory")])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_search(tmp_path, capsys, flag, path, rule):
    (tmp_path / "a_file").write_text("kept")
    path = path.format(tmp=tmp_path)
    assert main(["plan", flag, path, *BASE]) == 2  # was an IsADirectoryError / NotADirectoryError traceback
    err = capsys.readouterr().err
    assert f"{flag} = '{path}': " in err and rule in err and "Fix:" in err and "search:" not in err
    assert (tmp_path / "a_file").read_text() == "kept"


def test_out_and_picture_create_missing_folders(tmp_path, capsys):
    out, pic = tmp_path / "new" / "plan.yaml", tmp_path / "pics" / "deeper" / "plan.svg"
    assert main(["plan", "--out", str(out), "--picture", str(pic), *BASE, "planner.progress=false"]) == 0
    assert out.stat().st_size > 0 and pic.stat().st_size > 0


def test_a_sweep_refuses_out_and_picture(tmp_path, capsys):
    """They were silently ignored: a sweep writes its plans into --sweep-dir."""
    assert main(["plan", "-m", "--out", str(tmp_path / "p.yaml"), "cluster=cpu2,cpu_hetero4", "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert "--out = " in err and "--sweep-dir" in err and not list(tmp_path.iterdir())


@pytest.mark.slow
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


@pytest.mark.parametrize("sweep, message", [
    (["cluster=cpu2", "model=llama_tiny,llama_tny"],
     "model = 'llama_tny': In 'config': Could not find 'model/llama_tny'. Fix: did you mean model=llama_tiny?"),
    (["cluster=cpu2", "model=llama_tiny", "trainer.max_step=1,2"], "trainer.max_step = '1': no such key"),
    (["cluster=cpu2,cpu_hetero4", "model=llama_tiny", "train.global_batch=8,abc"],
     "train.global_batch = 'abc': must be an integer"),
])
def test_a_sweep_refuses_a_bad_value_before_the_first_search(sweep, message, tmp_path, monkeypatch, capsys):
    """A misspelled preset or key of a sweep was the error of its rows only, after the searches of the
    rows before it ran, and the sweep directory was written."""
    from lightning_hexiscale.cli import plan

    monkeypatch.setattr(plan, "plan_once", lambda *a, **k: pytest.fail("a search ran"))
    assert main(["plan", "-m", "--sweep-dir", str(tmp_path / "sweep"), *sweep]) == 2
    assert f"hexiscale plan: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_each_sweep_value_is_checked_once_not_the_product():
    from lightning_hexiscale.cli.common import axis_points

    axes = [["a=1", "a=2", "a=3"], ["b=1"], ["c=1", "c=2"]]
    assert axis_points(axes) == [["a=1", "b=1", "c=1"], ["a=2", "b=1", "c=1"], ["a=3", "b=1", "c=1"],
                                 ["a=1", "b=1", "c=2"]]
    assert axis_points([["a=1"]]) == [["a=1"]]


def test_infeasible_model_exits_2_with_the_reason(capsys):
    assert main(["plan", "cluster=cpu2", "model=llama2_70b", "planner.iterations=2", "planner.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "no plan fits in memory" in err and "Fix:" in err


@pytest.mark.slow
def test_plan_optimum_reports_the_oracle_beside_the_search(capsys):
    """--optimum: the oracle's optimum, independently re-scored here, and the search's fraction of it."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.planner import Plan, estimate, workload_from_config

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
    assert "true optimum (planner/oracle/exact.py" in capsys.readouterr().out


@pytest.mark.parametrize("extra, key", [(["cluster=hetero1", "model=llama2_7b"], "--optimum ="),
                                        (["cluster=cpu2", "model=llama_demo", "--optimum-time-limit", "0"],
                                         "--optimum-time-limit ="),
                                        (["-m", "cluster=cpu2,cpu_hetero4", "model=llama_demo"], "--optimum =")])
def test_plan_optimum_bad_input_is_refused_before_the_search(capsys, extra, key):
    assert main(["plan", "--optimum", *extra]) == 2
    err = capsys.readouterr().err
    assert key in err and "Fix:" in err and "search:" not in err


# ---- device subsets: idle devices, what each machine is worth ------------------------------------
@pytest.fixture
def straggler_args(tmp_path):
    import yaml
    from planner_clusters import STRAGGLER

    path = tmp_path / "straggler.yaml"
    path.write_text(yaml.safe_dump(STRAGGLER))
    return [f"cluster={path}", "model=llama2_7b", "model.num_layers=8", "train.global_batch=16",
            "planner.iterations=2", "planner.progress=false"]


def test_plan_says_which_devices_it_leaves_idle_and_what_each_machine_is_worth(capsys, tmp_path, straggler_args):
    out_file = tmp_path / "plan.yaml"
    assert main(["plan", *straggler_args, "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    banner = out.index("IDLE DEVICES")
    assert banner < out.index("pipeline  batch/mb")  # above the plan table
    assert "machine slow [2]" in out and "faster without them" in out and "planner.use_all_devices=true" in out
    assert "what each machine is worth" in out and "device subsets: exhaustive" in out
    worth = out[out.index("what each machine is worth"):].splitlines()[2:5]
    assert [line.split()[0] for line in worth] == ["fast", "slow", "fast2"]
    from lightning_hexiscale.planner import Plan

    written = Plan.load(out_file)
    assert 2 in written.idle_devices and "idle_reason" in written.meta and written.meta["all_devices_time_s"] > 0
    assert main(["plan", *straggler_args, "planner.use_all_devices=true"]) == 0
    every = capsys.readouterr().out
    assert "IDLE DEVICES" not in every and "what each machine is worth" not in every


def test_plan_json_reports_the_subsets(capsys, straggler_args):
    assert main(["plan", "--json", *straggler_args]) == 0
    doc = json.loads(capsys.readouterr().out)
    sub = doc["subsets"]
    assert sub["mode"] == "exhaustive" and 2 in sub["idle_devices"] == doc["plan"]["idle_devices"]
    assert sub["all_devices_time_s"] > doc["estimate"]["iteration_time_s"]
    by_name = {m["name"]: m for m in sub["machines"]}
    assert by_name["fast"]["best_without_s"] == by_name["fast2"]["best_without_s"]  # swappable machines
    assert by_name["slow"]["best_without_s"] == pytest.approx(doc["estimate"]["iteration_time_s"])
    assert {t["status"] for t in sub["trials"]} <= {"searched", "bounded", "no memory", "infeasible"}


def test_estimate_refuses_a_plan_that_names_an_idle_device_in_a_stage(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 4\nidle_devices: [2]\npipelines:\n"
                   "  - {batch_size: 4, micro_batch_size: 1, stages: [{devices: [0, 2], layers: [0, 4]}]}\n")
    assert main(["estimate", "--plan", str(bad), "cluster=cpu_hetero4", "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert "plan.idle_devices = [2]" in err and "device 2 is idle and also runs" in err and "Fix:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("mb, rule", [("0", "train.micro_batch_size = 0: must be a positive integer"),
                                      ("-2", "train.micro_batch_size = -2: must be a positive integer"),
                                      ("5", "train.micro_batch_size = 5: must divide train.global_batch=32")])
def test_a_bad_micro_batch_size_says_which_rule_it_breaks(capsys, mb, rule):
    """0 and -2 were refused with "must divide train.global_batch=32", as if they were a wrong divisor."""
    assert main(["plan", "cluster=cpu2", "model=llama_tiny", f"train.micro_batch_size={mb}",
                 "planner.iterations=1", "planner.progress=false"]) == 2
    err = capsys.readouterr().err
    assert rule in err and "Fix:" in err and "Traceback" not in err, err


def test_idle_devices_without_a_plan_on_all_of_them_do_not_offer_use_all_devices(capsys):
    """One layer with one KV head at batch 1 gives work to one device of four: the banner says why
    and that planner.use_all_devices=true would be refused, not that it "plans with every device"."""
    args = ["cluster=cpu_hetero4", "model=llama_tiny", "model.num_layers=1", "model.num_kv_heads=1",
            "model.num_heads=2", "train.global_batch=1", "planner.progress=false"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "has work for at most 1" in out and "planner.use_all_devices=true would be refused" in out, out
    assert "plans with every device" not in out, out
