"""The layer-time options (``--layer-tp``, ``--layer-micro-batches``, ``--layer-reps``, profile's
``--seq-len``) act only beside the flag that turns the measurement on (``profile --model``,
``calibrate --layer-times``). Without it they were ignored: a full profile or calibration ran and
wrote a file without layer times, silently. Now refused before anything is measured."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag,value,shown", [("--layer-tp", "2", "2"), ("--layer-micro-batches", "4,1", "1,4"),
                                              ("--layer-reps", "5", "5"), ("--seq-len", "64", "64")])
def test_profile_refuses_layer_options_without_a_model(flag, value, shown, tmp_path, capsys, no_measuring):
    out = tmp_path / "c.yaml"
    assert main(["profile", "--local", "2", flag, value, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} = " in err and shown in err.split(f"{flag} = ")[1].split(":")[0], err
    assert "sets the layer-time measurement, which runs only with --model NAME" in err
    assert f"Fix: add --model NAME, or drop {flag}" in err and not out.exists()


@pytest.mark.parametrize("flag,value", [("--layer-tp", "2"), ("--layer-micro-batches", "1,2"), ("--layer-reps", "2")])
def test_calibrate_refuses_layer_options_without_layer_times(flag, value, tmp_path, capsys, no_measuring):
    cluster = tmp_path / "c.yaml"
    shutil.copy(ROOT / "conf" / "cluster" / "cpu2.yaml", cluster)
    before = cluster.read_bytes()
    assert main(["calibrate", "--local", "2", flag, value, f"cluster={cluster}", "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} = " in err and "which runs only with --layer-times" in err, err
    assert f"Fix: add --layer-times, or drop {flag}" in err and cluster.read_bytes() == before


def test_the_options_pass_beside_the_flag_that_reads_them():
    """The check refuses only what nothing reads (a guard that the rule is not 'refuse the options')."""
    import argparse

    from lightning_hexiscale.cli.profile import check_layer_time_flags

    given = argparse.Namespace(layer_tp=[2], layer_micro_batches=[1, 2], layer_reps=4, seq_len=64)
    check_layer_time_flags(given, "--model NAME", on=True)
    check_layer_time_flags(argparse.Namespace(layer_tp=None, layer_micro_batches=None, layer_reps=None),
                           "--layer-times", on=False)


def test_a_seq_len_beyond_the_bound_is_keyed_by_the_flag_typed():
    """--seq-len 100000000 was refused as model.seq_len with a fix about the model file."""
    from lightning_hexiscale.cli.profile import layer_time_model
    from lightning_hexiscale.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--seq-len = 100000000: must be at most .*Fix: give a smaller --seq-len "
                                          r"\(the model's own is 128\)"):
        layer_time_model("llama_tiny", 100_000_000, None)
    assert layer_time_model("llama_tiny", 64, None).seq_len == 64
