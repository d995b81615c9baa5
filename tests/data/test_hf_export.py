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


def test_float16_refuses_weights_beyond_its_range(tmp_path):
    """A weight of 7e4 (float16's largest is 65,504) was written as inf with --dtype float16; bfloat16
    keeps float32's range, and in-range weights export to float16 as before."""
    big = state(0)
    big["layers.0.mlp.down_proj.weight"] = big["layers.0.mlp.down_proj.weight"].clone()
    big["layers.0.mlp.down_proj.weight"][0, 0] = 7e4
    with pytest.raises(ConfigError, match=r"--dtype.*layers.0.mlp.down_proj.weight has values up to 7e\+04.*bfloat16"):
        save_hf(big, CONFIG, tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()
    save_hf(big, CONFIG, tmp_path / "bf16", dtype="bfloat16")
    save_hf(state(0), CONFIG, tmp_path / "ok16", dtype="float16")
    assert json.loads((tmp_path / "ok16" / "config.json").read_text())["torch_dtype"] == "float16"


def test_an_export_without_token_ids_says_so(tmp_path):
    """Without --tokenizer config.json had no bos/eos ids, silently: transformers then assumes 1 and 2
    (Llama 2's), wrong for Llama 3. With a tokenizer directory whose config.json has them: no warning."""
    from lightning_hexiscale.data.hf_export import NoTokenIdsWarning

    with pytest.warns(NoTokenIdsWarning, match="no bos/eos token ids.*--tokenizer DIR"):
        save_hf(state(0), CONFIG, tmp_path / "bare")
    assert "eos_token_id" not in json.loads((tmp_path / "bare" / "config.json").read_text())
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "config.json").write_text(json.dumps({"bos_token_id": 60, "eos_token_id": 61}))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", NoTokenIdsWarning)
        save_hf(state(0), CONFIG, tmp_path / "with", tokenizer_dir=tok)
    assert json.loads((tmp_path / "with" / "config.json").read_text())["eos_token_id"] == 61


def test_an_empty_directory_is_taken_without_overwrite(tmp_path):
    """An empty directory made ahead (a job script's mkdir) was refused as 'the output directory exists'."""
    (tmp_path / "hf").mkdir()
    save_hf(state(0), CONFIG, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_symlinked_output_directory_receives_the_export(tmp_path):
    """--hf LINK (a link to a directory on another disk) replaced the link with a directory beside it,
    written on the link's file system, and left the link behind as LINK.old-*."""
    target = tmp_path / "big" / "out"
    target.mkdir(parents=True)
    (tmp_path / "small").mkdir()
    link = tmp_path / "small" / "out"
    link.symlink_to(target)
    for overwrite in (False, True):  # into the empty directory, then over that export
        save_hf(state(int(overwrite)), CONFIG, link, overwrite=overwrite)
        assert link.is_symlink() and (target / "model.safetensors").is_file()
        assert sorted(p.name for p in (tmp_path / "small").iterdir()) == ["out"]
        assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["out"]


def test_the_chat_template_goes_with_the_tokenizer(tmp_path):
    """transformers >= 4.50 saves an instruct model's chat template as chat_template.jinja (no longer
    in tokenizer_config.json); the export did not copy it, so the exported model had no template
    (apply_chat_template refused it). --overwrite also takes it as a file an export writes."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tok / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tok / "config.json").write_text(json.dumps({"bos_token_id": 60, "eos_token_id": 61}))
    out = save_hf(state(0), CONFIG, tmp_path / "hf", tokenizer_dir=tok)
    assert (out / "chat_template.jinja").read_text() == (tok / "chat_template.jinja").read_text()
    save_hf(state(1), CONFIG, out, tokenizer_dir=tok, overwrite=True)
    assert (out / "chat_template.jinja").is_file()


def test_a_tokenizer_file_is_refused_with_its_directory(tmp_path, capsys):
    """--tokenizer DIR/tokenizer.json (as prepare-data takes it) said "no tokenizer.json or
    tokenizer.model in this directory", of the tokenizer.json itself, and only after the checkpoint
    had been read."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"--tokenizer = .*is a file.*Fix: give the directory holding it: "
                                          f"--tokenizer {tmp_path / 'tok'}$"):
        save_hf(state(0), CONFIG, tmp_path / "hf", tokenizer_dir=tmp_path / "tok" / "tokenizer.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    # the command says so before reading the checkpoint (which may take minutes): here there is none
    assert main(["export", str(tmp_path / "no.ckpt"), "--hf", str(tmp_path / "hf"), "--tokenizer",
                 str(tmp_path / "tok" / "tokenizer.json")]) == 2
    assert "error: --tokenizer = " in capsys.readouterr().err


def test_a_hub_id_or_a_missing_directory_as_the_tokenizer_says_which(tmp_path, monkeypatch):
    """They said "no tokenizer.json or tokenizer.model in this directory" of a directory that does not exist."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--tokenizer = 'meta-llama/Llama-3\.2-1B': names nothing here; it looks "
                                          r"like a Hugging Face model id.*then --tokenizer DIR$"):
        save_hf(state(0), CONFIG, tmp_path / "hf", tokenizer_dir="meta-llama/Llama-3.2-1B")
    with pytest.raises(ConfigError, match=r"--tokenizer = '.*nowhere': no such directory\. Fix: point to the HF model "
                                          r"directory the checkpoint was trained from$"):
        save_hf(state(0), CONFIG, tmp_path / "hf", tokenizer_dir=tmp_path / "nowhere")
    assert not (tmp_path / "hf").exists()
