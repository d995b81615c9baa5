"""What ``dry_run=true`` checks of ``data.*`` (cli/train_fit.check_data): the settings everywhere, the
file where it is on this machine (as training reads it), and a note where it is not: a dry run plans
anywhere, also away from the data, but it said "planned only" whatever the file held."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lightning_hexiscale.cli.train_fit import check_data
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig

TINY = LlamaConfig.load("llama_tiny")


def _cfg(kind: str, path: str | None) -> object:
    return OmegaConf.create({"data": {"kind": kind, "path": path, "num_samples": 8, "seed": 0, "dtype": None}})


def test_a_file_here_is_read_as_training_reads_it(tmp_path):
    good = tmp_path / "book.txt"
    good.write_text("x" * (TINY.seq_len * 3 + 1))
    assert check_data(_cfg("text", str(good)), TINY) is None
    short = tmp_path / "short.txt"
    short.write_text("hello")
    with pytest.raises(ConfigError, match=r"^data.path = .*short.txt': holds 5 tokens, and one sample needs"):
        check_data(_cfg("text", str(short)), TINY)
    (tmp_path / "odd.bin").write_bytes(bytes(7))
    with pytest.raises(ConfigError, match="7 bytes is not a whole number of uint16 tokens"):
        check_data(_cfg("bin", str(tmp_path / "odd.bin")), TINY)


def test_a_file_elsewhere_is_named_as_not_checked():
    note = check_data(_cfg("bin", "/nowhere/on/this/machine/train.bin"), TINY)
    assert note.startswith("data.path /nowhere/on/this/machine/train.bin is not on this machine: its settings are "
                           "checked, not the file")
    with pytest.raises(ConfigError, match=r"'/nowhere/x.jsonl': is JSON \(.jsonl\); data.kind=text"):
        check_data(_cfg("text", "/nowhere/x.jsonl"), TINY)  # by its name: no file needed
    assert check_data(_cfg("generated", None), TINY) is None
