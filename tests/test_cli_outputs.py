"""The files a command writes are checked before its work, and a path it cannot write is a one-line
ConfigError naming the option, never a traceback from the last rename: prepare-data --out onto a
directory (IsADirectoryError) or below a file (FileExistsError), checkpoint consolidate and export
below a file (FileExistsError, NotADirectoryError)."""

from __future__ import annotations

import sys

import pytest

from lightning_hexiscale.cli.main import main

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "data"))
from test_prepare_data import make_tokenizer  # noqa: E402


@pytest.fixture
def workdir(tmp_path):
    make_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text("the cluster trains a small model\n")
    (tmp_path / "taken.bin").mkdir()
    return tmp_path


@pytest.mark.parametrize("argv, key", [
    (["prepare-data", "{d}/a.txt", "--tokenizer", "{d}/tokenizer.json", "--out", "{d}/taken.bin", "--no-progress"],
     "--out"),
    (["prepare-data", "{d}/a.txt", "--tokenizer", "{d}/tokenizer.json", "--out", "{d}/a.txt/x.bin", "--no-progress"],
     "--out"),
    (["checkpoint", "consolidate", "{d}/no.ckpt", "{d}/a.txt/llama.pt"], "OUT.pt"),
    (["export", "{d}/no.ckpt", "--hf", "{d}/a.txt/hf"], "--hf"),
])
def test_an_output_that_cannot_be_written_is_refused_first(workdir, argv, key, capsys):
    assert main([a.format(d=workdir) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {key} = " in err and "Traceback" not in err
    assert sorted(p.name for p in workdir.iterdir()) == ["a.txt", "taken.bin", "tokenizer.json"]
    assert list((workdir / "taken.bin").iterdir()) == []
