"""Commands that read no configuration refuse KEY=VALUE overrides instead of ignoring them, and their
--help does not offer them (`hexiscale export CKPT --hf OUT model=llama_tiny` exported with the
checkpoint's own model and said nothing about the override)."""

from __future__ import annotations

import pytest

from lightning_hexiscale.cli import common
from lightning_hexiscale.cli.main import build_parser, main

NO_CONFIG = {  # command -> arguments that parse (the command itself is replaced below and must not run)
    "export": ["ckpt", "--hf", "out"],
    "prepare-data": ["a.txt", "--tokenizer", "tok.json", "--out", "a.bin"],
    "profile": ["--local", "2"],
    "discover": ["--local", "2", "--model", "llama_tiny"],
    "rendezvous-store": [],
    "checkpoint": ["consolidate", "ckpt", "out.pt"],
    "list": [],
}


@pytest.mark.parametrize("command", list(NO_CONFIG))
def test_overrides_are_refused_before_the_command_runs(command, monkeypatch, capsys):
    build_parser()  # registers every command
    ran = []
    help_, configure, _fn = common.SUBCOMMANDS[command]
    monkeypatch.setitem(common.SUBCOMMANDS, command, (help_, configure, lambda args: ran.append(args) or 0))
    assert main([command, *NO_CONFIG[command], "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert f"hexiscale {command} = 'model=llama_tiny': takes no overrides" in err and "Fix: drop them" in err
    assert not ran


@pytest.mark.parametrize("command", list(NO_CONFIG))
def test_help_offers_no_overrides_to_a_command_that_reads_none(command):
    sub = next(a for a in build_parser()._subparsers._group_actions).choices[command]
    text = sub.format_help()
    assert "KEY=VALUE" not in text and "Hydra" not in text


def test_a_command_that_composes_the_config_still_offers_them():
    sub = next(a for a in build_parser()._subparsers._group_actions).choices["estimate"]
    assert "KEY=VALUE" in sub.format_help() and "cluster=NAME" in sub.format_help()


def test_checkpoint_info_refuses_an_output_file(tmp_path, capsys):
    """`checkpoint info CKPT X` took X as OUT.pt and ignored it (so `info CKPT model=...` said nothing)."""
    assert main(["checkpoint", "info", str(tmp_path / "ckpt"), "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert "OUT.pt = 'model=llama_tiny'" in err and "info writes nothing" in err
