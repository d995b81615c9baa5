"""A save replaces only what a save wrote: ``trainer.save_checkpoint(path)`` onto an existing
directory that is not a checkpoint (a typo, ``outputs`` for ``outputs/x.ckpt``) is refused before
anything is written, where it was moved aside and deleted whole; an earlier checkpoint at the path
(or an empty directory) is still replaced, as ModelCheckpoint's ``last.ckpt`` is every time."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import plan_of

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.engine import PipelineEngine

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
