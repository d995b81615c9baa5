import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main

PLANS = sorted(str(p) for p in Path("conf/plans").glob("*.yaml"))


@pytest.mark.parametrize("plan", PLANS)
def test_estimate_every_shipped_plan(plan, capsys):
    assert main(["estimate", "--plan", plan]) == 0
    out = capsys.readouterr().out
    assert "iteration" in out and "PFLOPS" in out and "pipeline 0" in out


def test_estimate_json_fields(capsys):
    assert main(["estimate", "--plan", "conf/plans/hetero3_llama30b_tab7.yaml", "--json", "trainer.precision=bf16-mixed"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"] == "hetero3" and doc["model"] == "llama_30b"
    # bf16-mixed keeps float32 parameters and gradients (16 bytes per parameter with AdamW) and a
    # bf16 cast of every weight per micro-batch in flight: the paper's plan does not fit any of its
    # RTX 4090 stages (devices 8-39); under bf16-true (bf16 parameters, gradients, AdamW states) it fits
    assert doc["feasible"] is False and {o["device"] for o in doc["out_of_memory"]} == set(range(8, 40))
    assert main(["estimate", "--plan", "conf/plans/hetero3_llama30b_tab7.yaml", "--json", "trainer.precision=bf16-true"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"] is True
    assert doc["iteration_time_s"] > 0 and doc["tokens_per_s"] > 0 and doc["pflops"] > 0
    assert [p["batch"] for p in doc["pipelines"]] == [80, 64, 64, 48]
    st = doc["pipelines"][3]["stages"][7]
    assert st["layers"] == [56, 60] and st["tp"] == 2 and st["devices"] == [54, 55]
    for key in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "peak_memory_bytes"):
        assert st[key] >= 0


def test_train_overrides_change_the_estimate(capsys):
    plan = "conf/plans/hetero3_llama30b_tab7.yaml"
    main(["estimate", "--plan", plan, "--json"])
    base = json.loads(capsys.readouterr().out)
    main(["estimate", "--plan", plan, "--json", "train.dp_sharding=zero3", "cluster.inter_machine.bandwidth=80 Gbps"])
    other = json.loads(capsys.readouterr().out)
    assert other["dp_sharding"] == "zero3" and other["iteration_time_s"] != base["iteration_time_s"]


@pytest.mark.parametrize("args,fragment", [
    (["cluster=hetero2"], "device 40 does not exist"),
    (["cluster=nope"], "available cluster presets"),
    (["cluster.inter_machine.bandwith=1 GB/s"], "bandwith"),
    (["cluster.inter_machine.bandwidth=3"], "needs a unit"),
    (["train.global_batch=100"], "sum to 256"),
    (["model=llama2_7b"], "has 32 layers"),
    (["trainer.precision=fp8"], "trainer.precision"),
    (["notanoverride"], "not KEY=VALUE"),
])
def test_errors_exit_2_with_message(args, fragment, capsys):
    assert main(["estimate", "--plan", "conf/plans/hetero3_llama30b_tab7.yaml", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_missing_plan_file(capsys):
    assert main(["estimate", "--plan", "nope.yaml"]) == 2
    assert "no such plan file" in capsys.readouterr().err


def test_the_plan_override_names_the_plan_as_hexiscale_train_reads_it(capsys):
    """`hexiscale train plan=FILE ...` and `hexiscale estimate plan=FILE ...`: one override list serves
    both. estimate refused plan= ("the following arguments are required: --plan")."""
    tab7 = "conf/plans/hetero3_llama30b_tab7.yaml"
    assert main(["estimate", "--plan", tab7, "--json"]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    assert main(["estimate", f"plan={tab7}", "--json"]) == 0
    by_key = json.loads(capsys.readouterr().out)
    assert by_key == by_flag and by_key["plan_file"] == tab7
    assert main(["estimate", "--plan", tab7, f"plan=./{tab7}", "--json"]) == 0  # the same file twice: fine
    assert json.loads(capsys.readouterr().out) == by_flag


def test_hexiscale_cluster_shows_the_cluster_of_a_plan_given_as_plan(capsys):
    """`hexiscale cluster plan=FILE` described the default preset (cpu_demo), not the plan's hetero3,
    where estimate and train run the plan on its meta's cluster."""
    assert main(["cluster", "plan=conf/plans/hetero3_llama30b_tab7.yaml"]) == 0
    assert capsys.readouterr().out.startswith("cluster hetero3:")
    assert main(["cluster", "plan=conf/plans/hetero3_llama30b_tab7.yaml", "cluster=hetero1"]) == 0  # cluster= wins
    assert capsys.readouterr().out.startswith("cluster hetero1:")
    assert main(["cluster", "plan=nope.yaml"]) == 2
    assert "plan = 'nope.yaml': no such plan file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["estimate", "check-estimate"])
@pytest.mark.parametrize("args, fragment", [
    ([], "--plan = None: hexiscale {command} needs a plan file, and none was given. Fix: pass --plan PLAN.yaml "
         "(or plan=PLAN.yaml)"),
    (["plan=null"], "--plan = None: hexiscale {command} needs a plan file"),
    (["--plan", "conf/plans/hetero3_llama30b_tab7.yaml", "plan=other.yaml"],
     "plan = 'other.yaml': names another file than --plan conf/plans/hetero3_llama30b_tab7.yaml"),
    (["plan=nope.yaml"], "plan = 'nope.yaml': no such plan file"),  # keyed as the user named it
])
def test_a_missing_or_doubled_plan_is_an_error_naming_both_ways(command, args, fragment, capsys):
    """check-estimate takes its plan as estimate does (the errors come before any rank starts)."""
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert fragment.format(command=command) in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, rule, fix", [
    (["plan"], "hexiscale plan searches a new plan", "hexiscale estimate plan="),
    (["plan", "-m", "cluster=cpu_demo,cpu2"], "hexiscale plan searches a new plan", "hexiscale estimate plan="),
    (["calibrate", "--local", "2"], "hexiscale calibrate fits the cluster file to training steps of its own",
     "hexiscale check-estimate plan="),
])
def test_commands_that_read_no_plan_refuse_one(argv, rule, fix, capsys):
    """`hexiscale plan plan=FILE` searched a new plan and never read the file, without a word; calibrate
    fitted its own steps. Both refuse it before any search or rank, and name the command that reads it."""
    assert main([*argv, "plan=conf/plans/hetero3_llama30b_tab7.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"plan = 'conf/plans/hetero3_llama30b_tab7.yaml': {rule}" in err, err
    assert f"{fix}conf/plans/hetero3_llama30b_tab7.yaml" in err, err


def test_list_refuses_overrides(capsys):
    """``hexiscale list foo.bar=1`` listed the presets and ignored the override."""
    assert main(["list", "foo.bar=1"]) == 2
    err = capsys.readouterr().err
    assert "hexiscale list = 'foo.bar=1': takes no overrides" in err and "Fix: drop them" in err
    assert main(["list"]) == 0 and "hetero3" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_help_and_list():
    exe = Path(sys.executable).parent / "hexiscale"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_hexiscale.cli"]
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, check=True).stdout
    assert "estimate" in out and "cluster=NAME" in out
    out = subprocess.run(cmd + ["list"], capture_output=True, text=True, check=True).stdout
    assert "hetero3" in out and "llama_30b" in out and "hetero3_llama30b_tab7.yaml" in out
    bad = subprocess.run(cmd + ["estimate", "--plan", "conf/plans/hetero3_llama30b_tab7.yaml", "cluster=zz"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_estimate_names_what_priced_each_type_and_refuses_a_mismatched_table(tmp_path, capsys, monkeypatch):
    """``hexiscale estimate`` prints and writes (``--json``: price_sources) the source of every device
    type; a layer table measured in another precision stops it with the key and the mismatch, and
    ``--allow-table-mismatch`` turns that into a warning naming what prices the type instead."""
    import yaml

    from lightning_hexiscale.config import layer_table
    from tests.planner.cost.test_layer_table import cluster_doc

    monkeypatch.setattr(layer_table, "_WARNED", set())  # said once per process: not by an earlier test

    cluster = tmp_path / "measured.yaml"
    doc = cluster_doc()
    doc["layer_times"][0]["note"] = "hexiscale profile 2026-11-28"
    cluster.write_text(yaml.safe_dump(doc))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"num_layers": 4, "recompute": False, "pipelines": [
        {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [0], "layers": [0, 4]}]}]}))
    base = ["estimate", "--plan", str(plan), f"cluster={cluster}", "model=llama_tiny"]
    assert main(base + ["trainer.precision=32-true", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (src,) = doc["price_sources"]
    assert src["gpu_type"] == "CPU-FAST" and src["kind"] == "layer table"
    assert "32-true" in src["detail"] and "2026-11-28" in src["detail"]
    assert main(base + ["trainer.precision=64-true"]) == 2
    err = capsys.readouterr().err
    assert "cluster.layer_times" in err and "precision 32-true vs 64-true" in err and "Traceback" not in err
    assert main(base + ["trainer.precision=64-true", "--allow-table-mismatch"]) == 0
    captured = capsys.readouterr()
    assert "priced by:\n  CPU-FAST: declared" in captured.out
    assert "priced from FLOP/s" in captured.out + captured.err


def test_train_micro_batch_size_overrides_the_plan_as_train_does(capsys):
    """`hexiscale train plan=F train.micro_batch_size=4` runs micro-batches of 4; estimate ignored the
    key and priced the plan's (2): the two commands disagreed on the same plan and overrides."""
    plan = "conf/plans/hetero3_llama30b_tab7.yaml"  # micro-batch 2 in every pipeline, batches 80/64/64/48
    assert main(["estimate", "--plan", plan, "--json", "train.micro_batch_size=4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {p["micro_batch"] for p in doc["pipelines"]} == {4}
    assert main(["estimate", "--plan", plan, "train.micro_batch_size=32"]) == 2  # 32 does not divide 80
    err = capsys.readouterr().err
    assert "train.micro_batch_size = 32" in err and "batch_size=80" in err and "Traceback" not in err


@pytest.mark.parametrize("meta,fragment", [
    ("{cluster: nonexistent_cluster, model: llama_tiny}", "meta.cluster = 'nonexistent_cluster': the plan file's meta"),
    ("{cluster: [1, 2], model: llama_tiny}", "meta.cluster = [1, 2]: names a preset or a file"),
])
def test_a_cluster_named_by_the_plan_meta_is_blamed_on_the_meta(tmp_path, capsys, meta, fragment):
    """It read 'cluster = ...' (a cluster= the user never typed) or 'overrides = model=... cluster=[1, 2]:
    Config group override must be a string'."""
    plan = tmp_path / "p.yaml"
    plan.write_text("num_layers: 4\npipelines:\n  - {batch_size: 2, micro_batch_size: 1, stages: [{devices: [0], "
                    f"layers: [0, 4]}}]}}\nmeta: {meta}\n")
    assert main(["estimate", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"{plan}: {fragment}" in err and "cluster=NAME" in err and "Traceback" not in err, err
    assert main(["estimate", "--plan", str(plan), "cluster=cpu_hetero4"]) == 0  # the command line's wins


def test_estimate_refuses_a_plan_made_for_another_model_of_the_same_depth(tmp_path, capsys):
    """The case-study plan is for llama2_13b (40 layers, hidden 5120); a 40-layer model of another
    width was priced silently with the 13B's layout."""
    import yaml

    model = tmp_path / "wide40.yaml"
    model.write_text(yaml.safe_dump({"name": "wide40", "hidden_size": 6144, "num_layers": 40, "num_heads": 48,
                                     "num_kv_heads": 48, "ffn_hidden_size": 16384, "vocab_size": 32000, "seq_len": 4096}))
    assert main(["estimate", "--plan", "conf/plans/case_study_llama2_13b.yaml", f"model={model}"]) == 2
    err = capsys.readouterr().err
    assert "plan.meta.model = 'llama2_13b'" in err and "hidden_size=5120" in err and "hidden_size=6144" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("override,fragment", [
    ("planner.cut=abc", "planner.cut = 'abc': must be one of"),
    ("planner.iterations=-1", "planner.iterations = -1: must be between 1 and"),
    ("planner.balance=nan", "planner.balance = nan"),
])
def test_estimate_checks_planner_overrides_as_plan_does_then_ignores_them(override, fragment, capsys):
    """planner.* prices nothing in estimate, but one override list may serve `plan` and `estimate`:
    a bad value there was accepted silently; it is `hexiscale plan`'s error now, and a good one
    leaves the estimate as it was, and one warning line names it (the --help says so)."""
    args = ["estimate", "--plan", "tests/bad_configs/good_tiny_plan.yaml", "cluster=cpu_hetero4", "model=llama_tiny",
            "--json"]
    assert main([*args, override]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Fix:" in err and "Traceback" not in err
    assert main(["plan", "cluster=cpu_hetero4", "model=llama_tiny", override]) == 2
    assert fragment in capsys.readouterr().err
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)
    assert main([*args, "planner.iterations=7", "planner.cut=max", "planner.progress=false"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == base
    # not silently: one line names them (they were dropped without a word); the progress bar's is not named
    assert captured.err.strip() == (
        "hexiscale estimate: warning: planner.iterations=7, planner.cut=max: set the planner's search, which a fixed "
        "plan skips: tests/bad_configs/good_tiny_plan.yaml is priced as written, so they change nothing here; to use "
        "them, re-plan (hexiscale plan ... planner.iterations=7 planner.cut=max --out PLAN.yaml) and estimate that plan")


@pytest.mark.slow
def test_a_plan_made_on_a_cluster_file_is_estimated_and_trained_without_cluster_again(tmp_path, capsys, monkeypatch):
    """The reference says a plan file that names its ``meta.cluster`` needs no ``cluster=``; but a plan
    made on a cluster FILE recorded only the cluster's name, which no preset has: ``hexiscale estimate
    --plan`` stopped ("meta.cluster = 'my_lab': ... Could not find 'cluster/my_lab'"), ``hexiscale
    train plan=`` discovered the local machine instead and ``HexiScaleStrategy(plan=...)`` could not
    load it. ``--out`` now records the file's absolute path as ``meta.cluster_file``, which all three
    load (from any working directory); a preset's plan records none."""
    import yaml

    from lightning_hexiscale.cli.train_job import plan_cluster
    from lightning_hexiscale.lightning.settings import StrategySettings

    made = tmp_path / "made"
    made.mkdir()
    (made / "my_lab.yaml").write_text(yaml.safe_dump({
        "name": "my_lab", "inter_machine": {"bandwidth": "1 Gbps"},
        "gpu_types": {"CPU-A": {"flops": "100 GFLOPS", "memory": "8 GiB"}},
        "machines": [{"name": "a", "gpu": "CPU-A", "count": 2, "intra_bandwidth": "10 GB/s"}]}))
    monkeypatch.chdir(made)
    assert main(["plan", "cluster=my_lab.yaml", "model=llama_tiny", "train.global_batch=4", "planner.iterations=2",
                 "planner.progress=false", "--out", "p.yaml"]) == 0
    meta = yaml.safe_load((made / "p.yaml").read_text())["meta"]
    assert meta["cluster"] == "my_lab" and meta["cluster_file"] == str(made / "my_lab.yaml")
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # elsewhere, without cluster=
    assert main(["estimate", "--plan", str(made / "p.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "my_lab"
    assert plan_cluster([f"plan={made / 'p.yaml'}"]) == str(made / "my_lab.yaml")
    assert StrategySettings(cluster=None, plan=str(made / "p.yaml")).cluster.name == "my_lab"
    # a preset's plan keeps loading the preset by name
    assert main(["plan", "cluster=cpu2", "model=llama_tiny", "train.global_batch=4", "planner.iterations=2",
                 "planner.progress=false", "--out", "q.yaml"]) == 0
    assert "cluster_file" not in yaml.safe_load((tmp_path / "q.yaml").read_text())["meta"]


def test_check_estimate_runs_the_plan_with_the_train_overrides(monkeypatch, capsys):
    """`hexiscale check-estimate --plan P train.schedule=gpipe train.recompute=false` ran and priced the
    plan as written (1f1b, recompute on) without a word, where estimate and train apply them; a
    train.global_batch the plan does not have ran the plan's. Now they change the plan, or are refused."""
    from lightning_hexiscale.profiling import check

    ran = []
    monkeypatch.setattr(check, "check", lambda plan, *a, **k: ran.append(plan))  # None: nothing to print
    plan = "conf/plans/hetero3_llama30b_tab7.yaml"
    assert main(["check-estimate", "--plan", plan, "train.schedule=gpipe", "train.recompute=false",
                 "train.micro_batch_size=4", "trainer.precision=bf16-true"]) == 0
    (run,) = ran
    assert run.schedule == "gpipe" and run.recompute is False and {p.micro_batch_size for p in run.pipelines} == {4}
    assert main(["check-estimate", "--plan", plan, "train.global_batch=8", "trainer.precision=bf16-true"]) == 2
    err = capsys.readouterr().err
    assert "train.global_batch = 8: the plan's pipeline batches" in err and "Fix:" in err and len(ran) == 1, err
