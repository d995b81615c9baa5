"""The gradient norm a run logs = one process's: ``trainer.strategy.grad_norm()`` in
``on_before_optimizer_step`` is the whole model's norm (every stage, TP shard and pipeline, each
element once) and equals the one-process norm at every step, under ddp and ZeRO-3; clipping by
that norm (active at every step) leaves every parameter equal to the one-process run's. Lightning's
``grad_norm(module)`` sees only the rank's own parameters under the strategy: its value on rank 0
differs (what the strategy's docstring says; it is not the norm to log).

Plan: a TP-2 pipeline (batch 4 in micro-batches of 2) next to a two-stage TP-1 pipeline (batch 2),
float64, gradient_clip_val=0.5."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from strategy_helpers import assert_matches, hexiscale_trainer, loader, module, plan_of, read_ranks, single_trainer

PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])])
G = PLAN.global_batch  # 6
KW = dict(max_steps=3, gradient_clip_val=0.5, max_epochs=1)


class Norms(pl.Callback):
    """Before each update: the strategy's norm (or, on one process, the norm of every gradient) and
    Lightning's grad_norm utility's total; writes out_dir/norms{rank}.pt."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.global_norms, self.lightning_norms = Path(out_dir), [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if hasattr(trainer.strategy, "grad_norm"):
            self.global_norms.append(trainer.strategy.grad_norm())
        else:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            self.global_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.lightning_norms.append(float(grad_norm(module, 2).get("grad_2.0_norm_total", 0.0)))

    def on_train_end(self, trainer, module):
        torch.save({"global": self.global_norms, "lightning": self.lightning_norms},
                   self.out_dir / f"norms{trainer.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sharding", ["ddp", "zero3"])
def test_the_logged_norm_is_the_one_process_norm_and_clips_alike(tmp_path, sharding):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    train = loader(G * 3, G)
    single_trainer(ref_dir, callbacks=[Norms(ref_dir)], **KW).fit(module(), train)
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    hexiscale_trainer(plan, run_dir, callbacks=[Norms(run_dir)], **KW).fit(module(), train)
    ref = torch.load(ref_dir / "norms0.pt")["global"]
    assert len(ref) == 3 and min(ref) > 0.5  # clipping is active at every step
    runs = [torch.load(run_dir / f"norms{r}.pt") for r in range(plan.world_size)]
    for rank, got in enumerate(runs):
        assert got["global"] == pytest.approx(ref, rel=1e-9, abs=1e-12), f"rank {rank}"
    # Lightning's utility: this rank's parameters only (rank 0: its TP half of the stage; ZeRO: no .grad)
    assert runs[0]["lightning"][0] < 0.99 * ref[0]
    assert_matches(read_ranks(run_dir, plan.world_size), read_ranks(ref_dir, 1)[0], atol=1e-6)
