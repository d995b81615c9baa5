"""A short strategy run that starts from a Hugging Face directory and leaves a checkpoint (used by the
export test). Fork launcher: the heavy modules are imported here, in the parent."""

from __future__ import annotations

import datetime
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed  # noqa: F401  (pre-import for the forked children)
import torch.utils.checkpoint  # noqa: F401
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_hexiscale  # noqa: F401  (registers "hexiscale")
import lightning_hexiscale.runtime.engine  # noqa: F401
from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.planner import Plan

# Embedding on a TP-1 first stage, the tied head on a TP-2 last stage (vocabulary-parallel loss).
PLAN = {"num_layers": 2, "schedule": "1f1b", "recompute": False, "pipelines": [
    {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [0], "layers": [0, 1]},
                                                        {"devices": [1, 2], "layers": [1, 2]}]}]}


def train_and_save(tmp_path: Path, model: str, steps: int = 2) -> Path:
    """Fit ``LlamaLitModule(model)`` (e.g. ``"hf:/dir"``) for ``steps`` steps in float64 under PLAN;
    returns the ``last.ckpt`` checkpoint directory."""
    module = LlamaLitModule(model, lr=1e-2, warmup_steps=0, dtype=torch.float64)
    plan = Plan.from_dict(PLAN)
    data = DataLoader(generated_corpus(16, module.config.seq_len), batch_size=plan.global_batch)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, save_top_k=0)
    strategy = HexiScaleStrategy(plan=plan, start_method="fork", timeout=datetime.timedelta(seconds=45))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=plan.world_size, max_steps=steps,
                         precision="64-true", logger=False, callbacks=[ckpt], enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, data)
    return tmp_path / "ckpt" / "last.ckpt"
