"""Trainer(strategy="hexiscale").fit on plans nobody picked == the same LightningModule on one process.

``test_strategy_equivalence.py`` checks one hand-written heterogeneous plan; here seeded random plans
(``tests/runtime/test_equivalence_random.random_plan``: 2-4 ranks with device ids in any order,
pipelines of their own batch and micro-batch sizes, TP degrees, uneven layers, either schedule,
recomputation, DDP / ZeRO-2 / ZeRO-3) train the tiny LLaMA in float64 with AdamW through the whole
Lightning path (loaders split over pipelines, accumulation, clipping by norm, a validation pass),
under the NCCL-semantics harness. Losses per batch, the validation loss and every copy of every
parameter element on every rank equal the one-process run to 1e-6.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from strategy_helpers import TINY, assert_matches, hexiscale_trainer, loader, module, read_ranks, single_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_equivalence_random import random_plan  # noqa: E402

SEEDS = range(4)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS)
def test_fit_of_a_random_plan_equals_single_process(tmp_path, seed):
    plan = random_plan(1000 + seed, TINY, max_world=4)
    rng = random.Random(seed)
    g = plan.global_batch
    kw = dict(max_steps=2, accumulate_grad_batches=rng.choice([1, 2]), gradient_clip_val=0.5, limit_val_batches=2,
              val_check_interval=None, check_val_every_n_epoch=1, max_epochs=1)
    # one epoch of exactly max_steps optimizer steps: the validation pass runs at its end
    train, val = loader(g * 2 * kw["accumulate_grad_batches"], g), loader(g * 2, g, seed=1)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    single_trainer(ref_dir, **kw).fit(module(), train, val)
    hexiscale_trainer(plan, run_dir, **kw).fit(module(), train, val)
    ref = read_ranks(ref_dir, 1)[0]
    results = read_ranks(run_dir, plan.world_size)
    assert len(ref["losses"]) == 2 * kw["accumulate_grad_batches"]
    assert_matches(results, ref, atol=1e-6)
    for res in results:
        assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_checkpoint_of_one_random_plan_resumes_under_another_as_one_process(tmp_path, seed):
    """Two steps under plan A with a checkpoint of each (Lightning's ModelCheckpoint, the strategy's
    sharded save), then ``fit(ckpt_path=last)`` under plan B of the same global batch to step 4:
    losses 3-4 and every parameter element equal four steps on one process (AdamW state, the
    loader's position and the step counter all carried across plans)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    a = random_plan(2000 + seed, TINY, max_world=4)
    b = next(p for k in range(1, 10_000) if (p := random_plan(3000 + 100 * seed + k, TINY, max_world=4)).global_batch
             == a.global_batch and p.to_dict()["pipelines"] != a.to_dict()["pipelines"])
    g = a.global_batch
    dirs = {d: tmp_path / d for d in ("ref", "a", "b", "ck")}
    for d in dirs.values():
        d.mkdir()
    single_trainer(dirs["ref"], max_steps=4).fit(module(), loader(g * 4, g))
    save = ModelCheckpoint(dirpath=str(dirs["ck"]), save_last=True, save_top_k=0, every_n_train_steps=1)
    hexiscale_trainer(a, dirs["a"], max_steps=2, callbacks=[save], enable_checkpointing=True).fit(
        module(), loader(g * 4, g))
    last = str(dirs["ck"] / "last.ckpt")
    hexiscale_trainer(b, dirs["b"], max_steps=4).fit(module(), loader(g * 4, g), ckpt_path=last)
    ref = read_ranks(dirs["ref"], 1)[0]
    ref["losses"] = ref["losses"][2:]
    assert_matches(read_ranks(dirs["b"], b.world_size), ref, atol=1e-6)
