"""``LlamaLitModule.load_from_checkpoint`` on a checkpoint directory of the hexiscale strategy: it
failed inside Lightning's ``torch.load`` (a directory); it now gives the module with the
checkpoint's shape and full weights (gathered from a TP-2 plan's shards), equal to ``load_llama``."""

from __future__ import annotations

import pytest
import torch

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime import PipelineEngine
from lightning_hexiscale.runtime import checkpoint as ckpt

CONFIG = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=48,
                     vocab_size=64, seq_len=8)
PLAN = {"num_layers": 2, "schedule": "1f1b", "recompute": False, "pipelines": [
    {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [0, 1], "layers": [0, 2]}]}]}


def _save(rank: int, world: int, path: str) -> None:
    engine = PipelineEngine(Plan.from_dict(PLAN), CONFIG, seed=7)
    ckpt.save(path, engine, None, lightning_state={"global_step": 3})


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_checkpoint_directory_loads_as_the_module(run_ranks, tmp_path):
    path = tmp_path / "last.ckpt"
    run_ranks(2, _save, str(path))
    module = LlamaLitModule.load_from_checkpoint(str(path), lr=1e-4)
    assert module.config == CONFIG and module.lr == 1e-4
    want = ckpt.load_llama(path).state_dict()
    got = module.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ConfigError, match="config.*the checkpoint defines the model's shape"):
        LlamaLitModule.load_from_checkpoint(path, config="llama_tiny")
    with pytest.raises(ConfigError, match="ckpt_path.*a folder of checkpoints"):
        LlamaLitModule.load_from_checkpoint(tmp_path)


def _save_as(rank: int, world: int, path: str, dtype: torch.dtype) -> None:
    engine = PipelineEngine(Plan.from_dict(PLAN), CONFIG, seed=7, dtype=dtype)
    ckpt.save(path, engine, None, lightning_state={"global_step": 3})


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_module_keeps_the_dtype_its_checkpoint_was_saved_in(run_ranks, tmp_path):
    """A float64 run's checkpoint loaded as float32 (the constructor's default), rounding its weights
    without a word, while load_llama gave float64; now the saved dtype, and dtype= still casts."""
    path = tmp_path / "last.ckpt"
    run_ranks(2, _save_as, str(path), torch.float64)
    module = LlamaLitModule.load_from_checkpoint(str(path))
    want = ckpt.load_llama(path).state_dict()
    got = module.model.state_dict()
    assert module.param_dtype == torch.float64 and {t.dtype for t in got.values()} == {torch.float64}
    assert all(torch.equal(got[k], want[k]) for k in want)
    cast = LlamaLitModule.load_from_checkpoint(str(path), dtype=torch.float32)
    assert {p.dtype for p in cast.parameters()} == {torch.float32}
