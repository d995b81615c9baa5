"""`hexiscale export --hf OUT` never destroys what it did not write: an existing file, or a directory
holding anything but a previous export, is refused (with or without --overwrite) before the
checkpoint is read; --overwrite replaces a previous export whole, leaving no temporary directory."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.data.hf_export import save_hf
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama

CONFIG = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_hidden_size=64,
                     vocab_size=64, seq_len=8)


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Llama(CONFIG).state_dict()


def test_an_existing_file_is_refused_with_or_without_overwrite(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="--hf.*notes.txt.*is a file"):
            save_hf(state(0), CONFIG, target, overwrite=overwrite)
        assert target.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_overwrite_replaces_only_a_previous_export(tmp_path):
    out = tmp_path / "hf"
    save_hf(state(0), CONFIG, out, max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    save_hf(state(1), CONFIG, out, overwrite=True)  # one shard now: the old shards and index are gone
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or set-aside directory left

    (out / "train.log").write_text("keep me")  # something an export does not write
    with pytest.raises(ConfigError, match="--hf.*train.log.*--overwrite"):
        save_hf(state(2), CONFIG, out, overwrite=True)
    assert (out / "train.log").read_text() == "keep me" and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32


def test_the_cli_checks_the_output_before_reading_the_checkpoint(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    assert main(["export", str(tmp_path / "no_such.ckpt"), "--hf", str(target), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--hf" in err and "is a file" in err and "Traceback" not in err
    assert target.read_text() == "mine"
