"""Tied embeddings under Trainer(strategy="hexiscale"), against one process (float64, 1e-6):

- fit: a 2-stage pipeline whose embedding (TP-1 first stage) and tied head (TP-2 last stage,
  vocabulary-parallel loss) live on different stages, next to a one-stage pipeline; AdamW, gradient
  clipping by the global norm active on every step (the tied copy must be counted once);
- checkpoint: the tied matrix is saved once, as ``embed.weight`` (no ``lm_head.weight``), and a run
  resumed from it under ANOTHER plan with ZeRO-2 ends where the uninterrupted one-process run ends.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TINY, assert_matches, hexiscale_trainer, loader, plan_of, read_ranks, single_trainer

from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.runtime.checkpoint import load_llama_state_dict

TIED = dataclasses.replace(TINY, name="tiny_tied", tie_word_embeddings=True)
PLAN_A = plan_of([(4, 2, [([0], (0, 2)), ([1, 2], (2, 4))]), (2, 1, [([3], (0, 4))])], cluster="cpu_hetero4")
PLAN_B = plan_of([(3, 1, [([0], (0, 1)), ([1], (1, 4))]), (3, 3, [([2], (0, 4))])], cluster="cpu_hetero4")
G = 6
KW = dict(gradient_clip_val=0.05, limit_val_batches=0, max_epochs=-1)


def tied_module() -> LlamaLitModule:
    return LlamaLitModule(TIED, lr=1e-2, warmup_steps=0, dtype=torch.float64, init_seed=7)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tied_fit_checkpoint_and_resume_under_another_plan(tmp_path):
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    dirs = {k: tmp_path / k for k in ("ref3", "ref5", "a", "b", "ckpt")}
    for d in dirs.values():
        d.mkdir()
    train = loader(G * 5, G)
    single_trainer(dirs["ref3"], max_steps=3, **KW).fit(tied_module(), train)
    single_trainer(dirs["ref5"], max_steps=5, **KW).fit(tied_module(), train)
    ckpt = ModelCheckpoint(dirpath=str(dirs["ckpt"]), save_last=True, save_top_k=0)
    hexiscale_trainer(PLAN_A, dirs["a"], max_steps=3, callbacks=[ckpt], enable_checkpointing=True, **KW).fit(
        tied_module(), train)
    ref3 = read_ranks(dirs["ref3"], 1)[0]
    assert_matches(read_ranks(dirs["a"], PLAN_A.world_size), ref3, atol=1e-6)
    assert "lm_head.weight" not in ref3["shards"]

    saved = load_llama_state_dict(dirs["ckpt"] / "last.ckpt")
    assert "lm_head.weight" not in saved and "embed.weight" in saved
    assert (saved["embed.weight"] - ref3["shards"]["embed.weight"][0]).abs().max() < 1e-6

    strategy = HexiScaleStrategy(plan=PLAN_B, start_method="fork", dp_sharding="zero2")
    import lightning.pytorch as pl
    from strategy_helpers import Recorder

    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=PLAN_B.world_size, max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Recorder(dirs["b"])], **KW)
    trainer.fit(tied_module(), train, ckpt_path=str(dirs["ckpt"] / "last.ckpt"))
    ref5 = read_ranks(dirs["ref5"], 1)[0]
    ref5 = {**ref5, "losses": ref5["losses"][3:]}
    assert_matches(read_ranks(dirs["b"], PLAN_B.world_size), ref5, atol=1e-6)
