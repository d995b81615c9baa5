"""What a checkpoint command or save writes, it writes whole, and it replaces only what it wrote:

- `hexiscale checkpoint consolidate CKPT OUT.pt`: a failure while writing (a full disk, Ctrl-C)
  leaves neither OUT.pt nor its temporary file, and a file of the user's named like the temporary
  one is not touched (the checkpoint reading is stubbed: this is about the output file only);
- a save (``trainer.save_checkpoint(path)``) onto an existing directory that is not a checkpoint (a
  typo, ``outputs`` for ``outputs/x.ckpt``) is refused before anything is written, where it was
  moved aside and deleted whole; an earlier checkpoint at the path (or an empty directory) is
  still replaced, as ModelCheckpoint's ``last.ckpt`` is every time.
"""

from __future__ import annotations

import pytest
import torch
from test_equivalence import plan_of

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.engine import PipelineEngine


# ---- consolidate --------------------------------------------------------------------------------
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


def test_a_symlinked_output_is_written_where_it_points(tmp_path, stub_checkpoint):
    """OUT.pt a link to a file on another disk: the link was replaced by a file beside it."""
    (tmp_path / "big").mkdir()
    target = tmp_path / "big" / "llama.pt"
    target.write_bytes(b"old")
    link = tmp_path / "llama.pt"
    link.symlink_to(target)
    ckpt.consolidate("ck", link)
    assert link.is_symlink() and torch.equal(torch.load(target)["embed.weight"], STATE["embed.weight"])
    assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["llama.pt"]


# ---- the target of a save ------------------------------------------------------------------------
CONFIG = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=48,
                     vocab_size=64, seq_len=8)


def _save_worker(rank: int, world: int, plan_dict: dict, paths: list[str]) -> list[str]:
    from lightning_hexiscale.errors import ConfigError

    engine = PipelineEngine(Plan.from_dict(plan_dict), CONFIG, seed=0)
    out = []
    for path in paths:
        try:
            ckpt.save(path, engine, None, lightning_state={"global_step": len(out)})
            out.append("saved")
        except ConfigError as e:
            out.append(str(e))
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(run_ranks, tmp_path):
    mine = tmp_path / "project"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    good = tmp_path / "good.ckpt"
    plan = plan_of([(2, 1, [([0], (0, 2))]), (2, 1, [([1], (0, 2))])], 2)
    paths = [str(good), str(good), str(mine), str(empty)]  # the second save replaces the first
    results = run_ranks(plan.world_size, _save_worker, plan.to_dict(), paths)
    assert results[0] == results[1]  # every rank decides alike (no rank waits in a collective alone)
    saved, again, refused, into_empty = results[0]
    assert saved == again == into_empty == "saved"
    assert "not a checkpoint" in refused and "notes.txt" in refused
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "src").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.ckpt", "good.ckpt", "project"]  # no .tmp-/.old-
    assert ckpt.read_meta(good)["global_step"] == 1 and ckpt.read_meta(empty)["global_step"] == 3
    assert torch.is_tensor(ckpt.load_llama_state_dict(good)["embed.weight"])
