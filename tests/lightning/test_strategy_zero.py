"""The Lightning path under ZeRO: ``Trainer.fit`` with ``dp_sharding`` zero2 / zero3 on 4 CPU ranks
equals one process (float64, AdamW, global-norm clipping active, accumulation, validation), and
checkpoints of sharded runs stay plan-independent: saved under zero2 / plan A and resumed under
ddp / plan B, and saved under ddp / plan A and resumed under zero3 / plan B, both equal to an
uninterrupted one-process run; and zero3 -> zero2."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import (TINY, assert_matches, hexiscale_trainer, loader, module, plan_of, read_ranks,
                              single_trainer)
from test_checkpoint import PLAN_A, PLAN_B, Snapshot

from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.runtime import checkpoint as ckpt

PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], cluster="cpu_hetero4")
G = PLAN.global_batch  # 6
TRAIN_KW = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5, limit_val_batches=2,
                val_check_interval=None, check_val_every_n_epoch=1, max_epochs=1)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_fit_zero_equals_single_process(tmp_path, sharding):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    train, val = loader(G * 6, G), loader(G * 2, G, seed=1)
    single_trainer(ref_dir, **TRAIN_KW).fit(module(warmup_steps=2), train, val)
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    hexiscale_trainer(plan, run_dir, **TRAIN_KW).fit(module(warmup_steps=2), train, val)
    ref = read_ranks(ref_dir, 1)[0]
    results = read_ranks(run_dir, plan.world_size)
    assert len(ref["losses"]) == 6
    assert_matches(results, ref, atol=1e-6)
    for res in results:
        assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("save_as,resume_as", [("zero2", "ddp"), ("ddp", "zero3"), ("zero3", "zero2")])
def test_checkpoint_across_sharding_and_plans(tmp_path, save_as, resume_as):
    dirs = {k: tmp_path / k for k in ("ref", "a", "b", "ckpt")}
    for d in dirs.values():
        d.mkdir()
    g, kw = 6, dict(gradient_clip_val=0.5)
    train = loader(g * 3, g)
    snap = Snapshot(3)
    single_trainer(dirs["ref"], callbacks=[snap], max_epochs=2, **kw).fit(module(warmup_steps=4), train)
    ref = read_ranks(dirs["ref"], 1)[0]

    saver = ModelCheckpoint(dirpath=str(dirs["ckpt"]), save_last=True, save_top_k=0)
    plan_a = dataclasses.replace(PLAN_A, dp_sharding=save_as)
    hexiscale_trainer(plan_a, dirs["a"], callbacks=[saver], enable_checkpointing=True, max_epochs=1, **kw).fit(
        module(warmup_steps=4), train)
    last = dirs["ckpt"] / "last.ckpt"
    full = ckpt.load_llama_state_dict(last)
    for name, t in full.items():
        assert (t - snap.state[name]).abs().max().item() < 1e-6, name

    # Plan B is one pipeline; give it two so that ZeRO really shards on resume.
    plan_b = plan_of([(4, 2, [([0], (0, 1)), ([1, 2], (1, 4))]), (2, 1, [([3], (0, 4))])], schedule="gpipe")
    plan_b = dataclasses.replace(plan_b if resume_as != "ddp" else PLAN_B, dp_sharding=resume_as)
    hexiscale_trainer(plan_b, dirs["b"], max_epochs=2, **kw).fit(module(warmup_steps=4), train, ckpt_path=str(last))
    resumed = read_ranks(dirs["b"], plan_b.world_size)
    assert_matches(resumed, {"losses": ref["losses"][3:], "shards": ref["shards"]}, atol=1e-6)


class _StepWatch(pl.Callback):
    """Records, per rank, which optimizer Lightning holds and steps, what its LR scheduler points at,
    and the warnings of the run (torch's LR scheduler warns when it believes the optimizer did not
    step before it)."""

    def __init__(self, out_dir: Path):
        self.out_dir, self._catch, self._seen = Path(out_dir), None, None

    def on_train_start(self, trainer, module):
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, module):
        self._catch.__exit__(None, None, None)
        held = trainer.optimizers[0]
        engine = trainer.strategy.pipeline_model.engine
        user_step = vars(held.user).get("step") if hasattr(held, "user") else None
        torch.save({"sharded": held is engine.sharded_optimizer and held is not None,
                    "scheduler_points_at_it": trainer.lr_scheduler_configs[0].scheduler.optimizer is held,
                    "user_state": len(held.user.state) if hasattr(held, "user") else None,
                    "state": len(held.state),
                    "user_step_is_ours": getattr(user_step, "__module__", "").startswith("lightning_hexiscale"),
                    "warnings": [str(w.message) for w in self._seen],
                    "lr": held.param_groups[0]["lr"]}, self.out_dir / f"steps{trainer.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lightning_holds_and_steps_the_sharded_optimizer(tmp_path):
    """Under zero2 the optimizer Lightning holds (``trainer.optimizers``) is the engine's sharded one,
    its LR scheduler points at it and sees every step (no "before optimizer.step" warning, the warmup
    LR reached), the user's optimizer is left as it was (no state, no step of ours), and the run
    still equals one process."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    kw = dict(max_steps=2, max_epochs=1)
    train = loader(G * 2, G)
    single_trainer(ref_dir, **kw).fit(module(warmup_steps=4), train)
    plan = dataclasses.replace(PLAN, dp_sharding="zero2")
    hexiscale_trainer(plan, run_dir, callbacks=[_StepWatch(run_dir)], **kw).fit(module(warmup_steps=4), train)
    assert_matches(read_ranks(run_dir, plan.world_size), read_ranks(ref_dir, 1)[0], atol=1e-6)
    for r in range(plan.world_size):
        seen = torch.load(run_dir / f"steps{r}.pt", weights_only=False)
        assert seen["sharded"] and seen["scheduler_points_at_it"], f"rank {r}: {seen}"
        assert seen["user_state"] == 0 and seen["state"] > 0 and not seen["user_step_is_ours"], f"rank {r}: {seen}"
        assert not [w for w in seen["warnings"] if "optimizer.step()" in w], seen["warnings"]
        assert seen["lr"] == pytest.approx(1e-2 * 3 / 4), seen  # LambdaLR warmup after 2 steps: (2 + 1) / 4


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_value_clipping_under_zero_is_refused_once(tmp_path, capfd):
    """Under ZeRO the reduced gradients are the rank's chunks, not ``p.grad``: value clipping is a
    ConfigError naming the fix (it was torch's 'Expected !nested_tensorlist[0].empty()' from every rank)."""
    from lightning_hexiscale.errors import ConfigError

    plan = dataclasses.replace(plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])]), dp_sharding="zero2")
    trainer = hexiscale_trainer(plan, tmp_path, max_steps=2, gradient_clip_val=0.5, gradient_clip_algorithm="value")

    class MarksItsSteps(type(module())):
        def training_step(self, batch, batch_idx):
            (tmp_path / f"stepped{self.global_rank}").touch()
            return super().training_step(batch, batch_idx)

    with pytest.raises(ConfigError, match=r"gradient_clip_algorithm\) = 'value'.*dp_sharding=zero2.*'norm'"):
        trainer.fit(MarksItsSteps(module().config, dtype=module().param_dtype), loader(12, 6))
    assert "Traceback" not in capfd.readouterr().err
    assert not list(tmp_path.glob("stepped*"))  # refused in setup, before a step ran (it was at the first clip)


class _GroupsByShape(LlamaLitModule):
    """nanoGPT's / LitGPT's rule: weight decay on the matrices only, chosen by ``p.dim()``."""

    def configure_optimizers(self):
        params = list(self.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-2}],
                                 lr=1e-2)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_configure_optimizers_sees_the_local_shapes_under_zero3(tmp_path):
    """ZeRO-3 keeps a block's parameters as empty tensors between uses: ``configure_optimizers`` saw
    them all with ``dim() == 1`` and put the blocks' matrices in the no-decay group at lr 5e-2
    (losses 5.5684, 5.4955, 5.0442 where one process gives 5.5684, 5.4003, 4.3795). It now runs
    with every local parameter whole."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    kw = dict(max_steps=3, max_epochs=1)
    train = loader(G * 3, G)
    new = lambda: _GroupsByShape(TINY, dtype=torch.float64, init_seed=7)  # noqa: E731
    single_trainer(ref_dir, **kw).fit(new(), train)
    plan = dataclasses.replace(PLAN, dp_sharding="zero3")
    hexiscale_trainer(plan, run_dir, **kw).fit(new(), train)
    assert_matches(read_ranks(run_dir, plan.world_size), read_ranks(ref_dir, 1)[0], atol=1e-6)
