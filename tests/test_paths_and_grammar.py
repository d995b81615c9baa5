"""Paths and values that Python's pathlib or Hydra's override grammar trip on:

- ``~name`` of no such user: ``Path.expanduser`` raised RuntimeError ('Could not determine home
  directory'), a traceback from ``hexiscale plan cluster=~nouser/c.yaml``, ``prepare-data``, ``export``;
- a value with ``~``, ``#``, ``(`` or a quote: Hydra's lexer error named the whole command line
  (``overrides = 'cluster=cpu2 ... trainer.output_dir=/data/t~x': LexerNoViableAltException ...``);
- ``model=hf:DIR`` of a directory whose name holds such a character: the rewritten
  ``trainer.weights=DIR`` override was refused the same way, although the directory was fine.
"""

from __future__ import annotations

import json

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.file_errors import expand_user
from lightning_hexiscale.config.compose_errors import hydra_quoted
from lightning_hexiscale.config.overrides import hf_model_overrides
from lightning_hexiscale.config.schema import compose

NO_USER = "~no_such_user_of_this_machine"


def test_expand_user_leaves_a_tilde_of_no_user_as_written(monkeypatch, tmp_path):
    assert str(expand_user(f"{NO_USER}/c.yaml")) == f"{NO_USER}/c.yaml"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert expand_user("~/c.yaml") == tmp_path / "c.yaml"


@pytest.mark.parametrize("argv, message", [
    (["plan", f"cluster={NO_USER}/c.yaml"], f"cluster = '{NO_USER}/c.yaml': no such file"),
    (["plan", f"model=hf:{NO_USER}/m"], f"model = 'hf:{NO_USER}/m': no such local directory"),  # was keyed trainer.weights
    (["prepare-data", f"{NO_USER}/x.txt", "--tokenizer", f"{NO_USER}/t", "--out", f"{NO_USER}/o"],
     f"INPUT = '{NO_USER}/x.txt': no such file"),
    (["export", f"{NO_USER}/ck", "--hf", f"{NO_USER}/h"], f"ckpt_path = '{NO_USER}/ck': no such checkpoint"),
])
def test_a_tilde_of_no_user_is_a_missing_path_not_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "home directory" not in err, err


@pytest.mark.parametrize("value", ["plain/path-1.2_x:y@z%", "/data/t~x", "/data/a#b", "/data/a(b)", "/data/it's",
                                   "/data/a b", "/data/[1]"])
def test_a_quoted_value_reads_back_as_itself(value):
    quoted = hydra_quoted(value)
    (override,) = OverridesParser.create().parse_overrides([f"k={quoted}"])
    assert override.value() == value
    assert (quoted == value) == (value == "plain/path-1.2_x:y@z%")  # only what needs quotes is quoted


@pytest.mark.parametrize("value, reason", [("/data/t~x", "token recognition error at: '~'"),
                                           ("/data/a(b)", "mismatched input '('")])
def test_a_value_the_grammar_cannot_read_is_named_with_its_key_and_quoted_in_the_fix(value, reason, capsys):
    assert main(["plan", "cluster=cpu2", "model=llama_tiny", f"trainer.output_dir={value}"]) == 2
    err = capsys.readouterr().err
    assert (f"trainer.output_dir = '{value}': Hydra's override grammar cannot read this value ({reason}). "
            f"Fix: quote it if it is a literal: trainer.output_dir='{value}'") in err, err
    assert "overrides = " not in err


def test_a_hugging_face_directory_with_a_tilde_in_its_name_composes(tmp_path):
    d = tmp_path / "llama~v2#1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    overrides = hf_model_overrides([f"model=hf:{d}", "cluster=cpu2"])
    assert f"trainer.weights='{d}'" in overrides
    cfg = compose(overrides)
    assert cfg.trainer.weights == str(d) and cfg.model.num_layers == 2 and cfg.model.hidden_size == 64


LONG = "x" * 300  # one name longer than NAME_MAX (255 bytes): os.stat raises OSError 'File name too long'


@pytest.mark.parametrize("argv, shown", [
    (["prepare-data", LONG, "--tokenizer", LONG, "--out", "{tmp}/o"], f"'{LONG}'"),
    (["checkpoint", "info", LONG], f"'{LONG}'"),
    (["plan", "cluster=cpu2", "model=llama_tiny", "planner.iterations=1", "--out", LONG], f"'{LONG}'"),
    (["discover", "--model", "llama_tiny", "--local", "1", "--out", f"{LONG}.yaml"], f"'{LONG}.yaml'"),
])
def test_a_name_longer_than_the_os_allows_is_an_error_line_not_a_traceback(argv, shown, tmp_path, capsys):
    """Path.exists / is_dir / open raise OSError for such a name, wherever a command first touches it:
    each was a traceback. cli.main's net turns an OSError about a path into the path, the OS's reason
    and a fix."""
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {shown}: File name too long. Fix: shorten it: each name in a path may be at most 255 bytes" in err, err
    assert "Traceback" not in err


def test_the_checks_that_run_before_the_ranks_take_a_name_longer_than_the_os_allows():
    """trainer.resume and trainer.weights of that length: OSError in the launching process, reported as
    "rank 0 failed (traceback above)"; --config-dir: a traceback before Hydra started."""
    from lightning_hexiscale.cli.train import main as train_main
    from lightning_hexiscale.config.hf_model import read_hf_config
    from lightning_hexiscale.config.recipe import check_ckpt_path
    from lightning_hexiscale.errors import ConfigError

    with pytest.raises(ConfigError, match="no such checkpoint"):
        check_ckpt_path(LONG, "trainer.resume")
    with pytest.raises(ConfigError, match="no such local directory"):
        read_hf_config(LONG, "trainer.weights")
    assert train_main(["--config-dir", LONG]) == 2
