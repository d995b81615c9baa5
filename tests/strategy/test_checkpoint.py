"""Plan-independent checkpoints: saved by ModelCheckpoint under plan A (4 ranks: TP-2 pipeline next
to a two-stage pipeline), resumed with ``trainer.fit(ckpt_path=...)`` under plan B (3 ranks, one
pipeline of a TP-1 stage and a TP-2 stage). The continued run equals an uninterrupted one-process
run (losses, every parameter copy, AdamW state and the warm-up schedule across the split), and the
checkpoint loads into the plain single-device Llama."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategy_helpers import assert_matches, hexiscale_trainer, loader, module, plan_of, read_ranks, single_trainer

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.runtime import checkpoint as ckpt

PLAN_A = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])])
PLAN_B = plan_of([(6, 3, [([0], (0, 1)), ([1, 2], (1, 4))])], schedule="gpipe")
G = 6
KW = dict(gradient_clip_val=0.5)


class Snapshot(Callback):
    """One-process reference: the full state dict after optimizer step ``step``."""

    def __init__(self, step: int):
        self.step, self.state = step, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.state is None:
            self.state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}


@pytest.mark.timeout(90)
def test_save_under_plan_a_resume_under_plan_b(tmp_path):
    dirs = {k: tmp_path / k for k in ("ref", "a", "b", "ckpt")}
    for d in dirs.values():
        d.mkdir()
    # One epoch = 3 optimizer steps; the split is at an epoch end, because Lightning resumes a
    # non-stateful DataLoader saved mid-epoch (e.g. at max_steps) from its first batch.
    train = loader(G * 3, G)
    snap = Snapshot(3)
    single_trainer(dirs["ref"], callbacks=[snap], max_epochs=2, **KW).fit(module(warmup_steps=4), train)
    ref = read_ranks(dirs["ref"], 1)[0]

    saver = ModelCheckpoint(dirpath=str(dirs["ckpt"]), save_last=True, save_top_k=0)
    hexiscale_trainer(PLAN_A, dirs["a"], callbacks=[saver], enable_checkpointing=True, max_epochs=1, **KW).fit(
        module(warmup_steps=4), train)
    last = dirs["ckpt"] / "last.ckpt"
    assert (last / ckpt.COMPLETE).is_file() and not list(dirs["ckpt"].glob("*.tmp-*"))

    # The checkpoint is the plain Llama's state after 3 steps, whatever plan wrote it.
    full = ckpt.load_llama_state_dict(last)
    assert set(full) == set(snap.state)
    for name, t in full.items():
        assert (t - snap.state[name]).abs().max().item() < 1e-6, name
    assert ckpt.load_llama(last).lm_head.weight.shape == snap.state["lm_head.weight"].shape

    hexiscale_trainer(PLAN_B, dirs["b"], max_epochs=2, **KW).fit(module(warmup_steps=4), train, ckpt_path=str(last))
    resumed = read_ranks(dirs["b"], PLAN_B.world_size)
    assert_matches(resumed, {"losses": ref["losses"][3:], "shards": ref["shards"]}, atol=1e-6)


def test_partial_or_foreign_checkpoint_is_refused(tmp_path):
    partial = tmp_path / "last.ckpt"
    (partial / "model").mkdir(parents=True)
    with pytest.raises(ConfigError, match="partial checkpoint"):
        ckpt.read_meta(partial)
    single_file = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}}, single_file)
    with pytest.raises(ConfigError, match="not a hexiscale checkpoint"):
        ckpt.read_meta(single_file)
