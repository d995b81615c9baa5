"""Helpers for the strategy tests: a tiny model, plans, a recording callback, Trainer factories.

Multi-process runs use the strategy's ``fork`` launcher (a forked child costs ~0.05 s; the heavy
modules are imported here, in the parent, so the children inherit them). Each rank writes what it
recorded to ``out_dir/rank{r}.pt``; the parent compares. Lightning's fork launcher joins its
children itself and a rank that raises takes the run down; the per-test pytest timeout and the
gloo timeout passed to the strategy bound every hang.

Every :func:`hexiscale_trainer` run is under the NCCL-semantics harness (``tests/nccl_semantics.py``):
the :class:`NcclTrace` callback installs the recorder in each rank once the process group exists
(p2p tags forced to 0: order-only matching) and writes the rank's communication trace to
``out_dir/trace{r}.pt`` (and per default process group to ``segments{r}.pt``) at teardown;
:func:`read_ranks` replays the traces under NCCL's rules and fails on anything that would hang or
mismatch on NCCL: Lightning's own collectives, setup, training, validation, checkpoint save and load
included.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed  # noqa: F401  (pre-import for the forked children)
import torch.utils.checkpoint  # noqa: F401
from torch.utils.data import DataLoader

import nccl_semantics

import lightning_hexiscale  # noqa: F401  (registers "hexiscale")
import lightning_hexiscale.runtime.engine  # noqa: F401
from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.lightning.pipeline_model import PipelineModel
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

TINY = LlamaConfig(name="tiny_test", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                   ffn_hidden_size=100, vocab_size=256, seq_len=16)
"""4 layers, width 64, GQA 4/2 heads, FFN 100 (uneven over TP 3), byte vocabulary, 16 tokens."""

PG_TIMEOUT = datetime.timedelta(seconds=45)


def plan_of(pipelines, num_layers: int = 4, schedule: str = "1f1b", recompute: bool = False, **meta) -> Plan:
    """Plan from [(batch, micro_batch, [(devices, (layer_start, layer_end)), ...]), ...]."""
    return Plan.from_dict({
        "num_layers": num_layers, "schedule": schedule, "recompute": recompute, "meta": meta,
        "pipelines": [{"batch_size": b, "micro_batch_size": mb,
                       "stages": [{"devices": d, "layers": list(lr)} for d, lr in stages]}
                      for b, mb, stages in pipelines]})


def loader(num_samples: int, batch: int, seed: int = 0) -> DataLoader:
    return DataLoader(generated_corpus(num_samples, TINY.seq_len, seed), batch_size=batch, shuffle=False)


class Recorder(pl.Callback):
    """Records the loss of every training batch and, at the end, this rank's parameters by global
    name as (tensor, shard dim, start, end), plus the validation loss; writes out_dir/rank{r}.pt."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, module):
        if isinstance(module.model, PipelineModel):
            shards = {k: (t.clone(), d, s, e) for k, (t, d, s, e) in module.model.engine.local_shards().items()}
        else:
            shards = {k: (v.detach().clone(), None, 0, 0) for k, v in module.model.state_dict().items()}
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save({"losses": self.losses, "shards": shards, "metrics": metrics},
                   self.out_dir / f"rank{trainer.global_rank}.pt")


class NcclTrace(pl.Callback):
    """Runs the rank under the NCCL-semantics recorder from ``setup`` (the process group exists, the
    engine does not yet) to ``teardown``, and writes its trace to ``out_dir/trace{rank}.pt``."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.recorder: nccl_semantics.Recorder | None = None

    def setup(self, trainer, pl_module, stage):
        if self.recorder is None and trainer.world_size > 1:
            self.recorder = nccl_semantics.Recorder().install()
            nccl_semantics.set_current(self.recorder)

    def teardown(self, trainer, pl_module, stage):
        if self.recorder is not None:
            self.recorder.uninstall()
            torch.save(self.recorder.steps, self.out_dir / f"trace{trainer.global_rank}.pt")
            torch.save(self.recorder.segments, self.out_dir / f"segments{trainer.global_rank}.pt")
            self.recorder = None


def read_ranks(out_dir: Path, world: int) -> list[dict]:
    """What every rank recorded; when the ranks left communication traces, they are replayed under
    NCCL's rules first (AssertionError with the report on a violation): every process's, default
    group by default group (a job launched on a plan's idle devices re-forms its default group:
    nccl_semantics.replay_segments)."""
    segments = sorted(Path(out_dir).glob("segments*.pt"))
    if segments:
        report = nccl_semantics.replay_segments([torch.load(f, weights_only=False) for f in segments])
        assert report.ok, str(report)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def hexiscale_trainer(plan: Plan, out_dir: Path, *, start_method: str = "fork", callbacks=(), strategy_kw=None,
                      **trainer_kw):
    strategy = HexiScaleStrategy(plan=plan, start_method=start_method, timeout=PG_TIMEOUT, **(strategy_kw or {}))
    kw = dict(accelerator="cpu", devices=plan.world_size, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    kw.update(trainer_kw)
    return pl.Trainer(strategy=strategy, callbacks=[NcclTrace(out_dir), Recorder(out_dir), *callbacks], **kw)


def single_trainer(out_dir: Path, callbacks=(), **trainer_kw):
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0)
    kw.update(trainer_kw)
    return pl.Trainer(callbacks=[Recorder(out_dir), *callbacks], **kw)


def module(**kw) -> LlamaLitModule:
    kw.setdefault("dtype", torch.float64)
    kw.setdefault("init_seed", 7)
    kw.setdefault("lr", 1e-2)
    return LlamaLitModule(TINY, **kw)


def assert_matches(results: list[dict], ref: dict, atol: float) -> None:
    """Every rank's losses equal the reference's, and every copy of every parameter element too."""
    ref_state = {k: t for k, (t, _, _, _) in ref["shards"].items()}
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref["losses"], abs=atol), f"rank {rank} losses"
        for name, (t, dim, start, end) in res["shards"].items():
            want = ref_state[name] if dim is None else ref_state[name].narrow(dim, start, end - start)
            err = (t - want).abs().max().item()
            assert err < atol, f"rank {rank}: {name}[{start}:{end} on dim {dim}] differs by {err:.3g}"
