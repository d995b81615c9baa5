"""`hexiscale checkpoint consolidate CKPT OUT.pt` writes OUT.pt whole or not at all: a failure while
writing (a full disk, Ctrl-C) leaves neither OUT.pt nor its temporary file, and a file of the user's
that happens to be named like the temporary one is not touched. The checkpoint reading is stubbed:
this is about the output file only."""

from __future__ import annotations

import pytest
import torch

from lightning_hexiscale.runtime import checkpoint as ckpt

STATE = {"embed.weight": torch.ones(4, 2)}
META = {"global_step": 3, "epoch": 0, "hexiscale": {"model": {"name": "tiny"}}}


@pytest.fixture
def stub_checkpoint(monkeypatch):
    monkeypatch.setattr(ckpt, "load_llama_state_dict", lambda path: STATE)
    monkeypatch.setattr(ckpt, "read_meta", lambda path: META)


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, stub_checkpoint):
    def half_then_fail(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_fail)
    out = tmp_path / "llama.pt"
    with pytest.raises(OSError, match="No space"):
        ckpt.consolidate("ck", out)
    assert list(tmp_path.iterdir()) == []


def test_a_file_named_like_the_temporary_is_not_overwritten(tmp_path, stub_checkpoint):
    out = tmp_path / "llama.pt"
    mine = tmp_path / "llama.pt.tmp"
    mine.write_text("my notes")
    summary = ckpt.consolidate("ck", out)
    assert summary["tensors"] == 1 and torch.equal(torch.load(out)["embed.weight"], STATE["embed.weight"])
    assert mine.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.pt", "llama.pt.tmp"]
