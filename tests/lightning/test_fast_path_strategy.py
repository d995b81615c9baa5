"""The fast path under the Lightning strategy: bf16-mixed with global-norm clipping and the default
fast path (main grads, fused AdamW, chunked loss) trains on 2 fork ranks, rank 0 prints what runs,
and ``HexiScaleStrategy(compile=..., fast_path=...)`` reaches every rank's engine."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import PG_TIMEOUT, NcclTrace, Recorder, loader, module, plan_of, read_ranks

from lightning_hexiscale.lightning.step_adapter import unwrap_optimizer
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

PLAN = plan_of([(2, 1, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])  # ddp over two one-stage pipelines


class FastProbe(pl.Callback):
    """Writes out_dir/fast{rank}.pt: the engine's fast path and whether each optimizer is fused."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer, module):
        fused = [bool(unwrap_optimizer(o).param_groups[0].get("fused")) for o in trainer.optimizers]
        torch.save({"fast": module.model.engine.fast_path, "fused": fused},
                   self.out_dir / f"fast{trainer.global_rank}.pt")


def _fit(tmp_path: Path, **strategy_kw) -> tuple[list[dict], list[dict]]:
    strategy = HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT, **strategy_kw)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision="bf16-mixed", max_steps=2,
                         gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[NcclTrace(tmp_path), Recorder(tmp_path), FastProbe(tmp_path)])
    trainer.fit(module(dtype=torch.float32), loader(16, 4))
    probes = [torch.load(tmp_path / f"fast{r}.pt", weights_only=False) for r in range(2)]
    return read_ranks(tmp_path, 2), probes


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_default_fast_path_trains_bf16_mixed_with_clipping(tmp_path, capfd):
    results, probes = _fit(tmp_path)
    assert all(p["fast"].main_grads and p["fast"].loss_chunk_tokens and p["fused"] == [True] for p in probes)
    assert all(len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]) for r in results)
    out = capfd.readouterr().out
    assert "hexiscale all ranks: fast path: compile off, fused RMSNorm, normed input cast once, main grads" in out
    assert out.count("fast path:") == 1  # rank 0 only, one line for identical ranks


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_strategy_switches_reach_every_rank(tmp_path):
    _, probes = _fit(tmp_path, compile=False, fast_path={"main_grads": False, "fused_adamw": False,
                                                         "chunked_loss": False, "attention": "sdpa_math"})
    for p in probes:
        assert p["fast"].compile == "off" and not p["fast"].main_grads and p["fast"].loss_chunk_tokens is None
        assert p["fast"].attention == "sdpa_math" and p["fused"] == [False]
