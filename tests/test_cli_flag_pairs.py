"""A flag that only modifies another one did nothing without it, silently: `hexiscale plan
--aware-baselines` (or ``--like-for-like``) without ``--baselines`` ran no baselines, ``--optimum-time-limit
5`` (or -1) without ``--optimum`` searched no optimum, ``checkpoint info --force`` and ``prepare-data
--field body`` over text files changed nothing, all with exit 0. Refused before any work, naming the
flag and the fix."""

from __future__ import annotations

import pytest

from lightning_hexiscale.cli.main import main

PLAN = ["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1", "planner.progress=false"]


@pytest.mark.parametrize("flags, said", [
    (["--aware-baselines"], "--aware-baselines = 'without --baselines': "),
    (["--like-for-like"], "--like-for-like = 'without --baselines': "),
    (["-m", "--aware-baselines"], "--aware-baselines = 'without --baselines': "),
    (["--optimum-time-limit", "5"], "--optimum-time-limit = 5.0: "),
    (["--optimum-time-limit", "-1"], "--optimum-time-limit = -1.0: must be a positive number of seconds"),
    (["--optimum", "--optimum-time-limit", "nan"], "--optimum-time-limit = nan: must be a positive number of seconds"),
])
def test_plan_modifier_without_its_flag_is_refused_before_the_search(flags, said, capsys, searches):
    assert main([*PLAN, *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix:" in err and "Traceback" not in err
    if "without" in said:
        parent = said.split("without ")[1].split("'")[0]
        assert f"add {parent}, or drop {flags[-1]}" in err
    assert not searches


def test_plan_modifiers_with_their_flags_still_run(capsys):
    assert main([*PLAN, "--json", "--baselines", "--like-for-like", "--aware-baselines"]) == 0
    assert main([*PLAN, "--json", "--optimum", "--optimum-time-limit", "30"]) == 0
    assert '"optimum"' in capsys.readouterr().out


def test_checkpoint_info_refuses_force(tmp_path, capsys):
    assert main(["checkpoint", "info", str(tmp_path), "--force"]) == 2
    err = capsys.readouterr().err
    assert "--force = 'with info': " in err and "Fix: drop --force" in err


def test_prepare_data_refuses_a_field_for_text_inputs(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one document\n")
    out = tmp_path / "a.bin"
    assert main(["prepare-data", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "no_tokenizer"),
                 "--out", str(out), "--field", "body"]) == 2
    err = capsys.readouterr().err
    assert "--field = 'body': " in err and "no input is JSONL" in err and "Fix: drop --field" in err
    assert not out.exists()


@pytest.mark.parametrize("given, said", [
    (["train.recompute=true"], "train.recompute = True: calibrate times steps of its own, with recomputation off"),
    (["train.recompute=false", "--recompute"], "train.recompute = False: calibrate times steps of its own, with "
                                               "recomputation on"),
    (["train.micro_batch_size=4"], "train.micro_batch_size = 4: calibrate times steps of its own, of --micro-batch 2"),
    (["train.micro_batch_size=4", "--micro-batch", "3"], "Fix: pass --micro-batch 4"),
    # agreeing with calibrate's own flags (one override list for plan and calibrate): the next check speaks
    (["train.recompute=true", "--recompute", "train.micro_batch_size=2", "train.global_batch=8"],
     "calibrate stores its fit in a profiled cluster file"),
])
def test_calibrate_refuses_train_settings_its_steps_do_not_follow(given, said, tmp_path, capsys, no_measuring):
    """`hexiscale calibrate train.recompute=true` (or train.micro_batch_size=4) fitted steps without
    recomputation (of micro-batch 2) without a word; calibrate's steps follow --recompute and --micro-batch."""
    from pathlib import Path

    cluster = tmp_path / "c.yaml"
    cluster.write_text((Path(__file__).resolve().parents[1] / "conf" / "cluster" / "cpu2.yaml").read_text())
    assert main(["calibrate", "--local", "2", f"cluster={cluster}", "model=llama_tiny", *given]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("error:") == 1 and "Fix:" in err, err
