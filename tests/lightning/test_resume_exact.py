"""Nothing is lost: a job killed after step k resumes from its last checkpoint and ends with exactly
the parameters of an uninterrupted run (data order mid-epoch, AdamW state and the warm-up schedule
included); a crash in the middle of a save leaves the previous checkpoint loadable and the partial
one refused, with synchronous and with asynchronous saves.

Plan A (4 ranks: a TP-2 pipeline next to a two-stage pipeline), float64, a shuffled loader of 5
global batches per epoch, 8 steps: the kill at step 3 is mid-epoch and the run crosses an epoch
boundary after the resume. Ranks are forked (strategy_helpers); a rank that calls ``os._exit``
takes the launcher down, as a killed job would.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategy_helpers import TINY, hexiscale_trainer, module, plan_of, read_ranks
from test_checkpoint import async_trainer
from torch.utils.data import DataLoader

from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.checkpoint_io import PieceSavePlanner

PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])])
G, STEPS, KILL_AT = 6, 8, 3


def shuffled_loader() -> DataLoader:
    return DataLoader(generated_corpus(G * 5, TINY.seq_len, seed=1), batch_size=G, shuffle=True)


class KillAt(Callback):
    """Every rank dies (``os._exit``, no cleanup) when batch ``step`` starts: after the checkpoint of
    step ``step`` was written, before anything of the next step."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            os._exit(17)


class CrashDuringSave(Callback):
    """At step ``step``, every rank writes one box of its part of the checkpoint and then dies
    (when DCP's writer asks for its second box)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        trainer.strategy.checkpointer.wait()  # async: the previous save completes untouched
        real = PieceSavePlanner.resolve_data
        served = []

        def write_one_then_die(planner, write_item):
            if served:
                os._exit(18)
            served.append(write_item)
            return real(planner, write_item)

        PieceSavePlanner.resolve_data = write_one_then_die


def every_step(dirpath) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(dirpath), save_last=True, save_top_k=0, every_n_train_steps=1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_job_resumes_exactly(tmp_path):
    ref_dir, run_dir, res_dir, ck = (tmp_path / d for d in ("ref", "run", "resumed", "ck"))
    for d in (ref_dir, run_dir, res_dir):
        d.mkdir()
    kw = dict(max_steps=STEPS, gradient_clip_val=0.5)
    hexiscale_trainer(PLAN, ref_dir, **kw).fit(module(warmup_steps=4), shuffled_loader())
    ref = read_ranks(ref_dir, PLAN.world_size)

    with pytest.raises(Exception):  # the launcher reports the exit of its children
        hexiscale_trainer(PLAN, run_dir, callbacks=[every_step(ck), KillAt(KILL_AT)], enable_checkpointing=True,
                          **kw).fit(module(warmup_steps=4), shuffled_loader())
    last = ck / "last.ckpt"
    meta = ckpt.read_meta(last)
    assert meta["global_step"] == KILL_AT
    # Lightning stored the loader's position: 3 of the epoch's 5 global batches were trained on.
    assert meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == KILL_AT

    hexiscale_trainer(PLAN, res_dir, **kw).fit(module(warmup_steps=4), shuffled_loader(), ckpt_path=str(last))
    resumed = read_ranks(res_dir, PLAN.world_size)
    for rank, (r, want) in enumerate(zip(resumed, ref)):
        assert r["losses"] == pytest.approx(want["losses"][KILL_AT:], abs=1e-12), f"rank {rank}: losses"
        for name, (t, *_rest) in r["shards"].items():
            err = (t - want["shards"][name][0]).abs().max().item()
            assert err < 1e-12, f"rank {rank}: {name} differs by {err:.3g} from the uninterrupted run"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path, asynchronous):
    run_dir, ck = tmp_path / "run", tmp_path / "ck"
    run_dir.mkdir()
    make = async_trainer if asynchronous else hexiscale_trainer
    with pytest.raises(Exception):  # async: the writer thread dies, mid-file, while training goes on
        make(PLAN, run_dir, callbacks=[every_step(ck), CrashDuringSave(2)], enable_checkpointing=True,
             max_steps=4).fit(module(), shuffled_loader())
    last = ck / "last.ckpt"
    assert ckpt.read_meta(last)["global_step"] == 1  # the save of step 2 never replaced it
    state = ckpt.load_llama_state_dict(last)
    assert all(torch.isfinite(v).all() for v in state.values())
    partial = list(ck.glob("last.ckpt.tmp-*"))
    assert len(partial) == 1, list(ck.iterdir())
    with pytest.raises(ConfigError, match="partial checkpoint: the COMPLETE marker is missing"):
        ckpt.read_meta(partial[0])


def test_sampler_position_is_plan_independent_and_checked():
    from lightning_hexiscale.data import PlanBatchSampler

    a = PlanBatchSampler(60, [4, 2], 0, shuffle=True, seed=3)
    a.set_epoch(1)
    a.consumed = 4
    state = a.state_dict()
    # Another plan with the same global batch continues at the same window of the same permutation.
    b = PlanBatchSampler(60, [3, 3], 1, shuffle=True, seed=3)
    b.set_epoch(1)
    b.load_state_dict(state)
    full = PlanBatchSampler(60, [6], 0, shuffle=True, seed=3)
    full.set_epoch(1)
    windows = list(full)
    assert list(b) == [w[3:6] for w in windows[4:]]
    assert len(list(b)) == len(windows)  # the skip applies to one epoch only
    with pytest.raises(ConfigError, match="global_batch"):
        PlanBatchSampler(60, [4, 4], 0, shuffle=True, seed=3).load_state_dict(state)
    # 8 batches into an epoch of 10: past the end of an epoch of 7 (global batch 8), but still mid-epoch
    a.consumed = 8
    with pytest.raises(ConfigError, match="global_batch = 8: the checkpoint was saved 8 global batches into an epoch"):
        PlanBatchSampler(60, [4, 4], 0, shuffle=True, seed=3).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="num_samples = 36"):  # the data shrank to 6 batches
        PlanBatchSampler(36, [4, 2], 0, shuffle=True, seed=3).load_state_dict(a.state_dict())
    a.consumed = 10  # saved as the epoch ended: the next one starts afresh on any data
    PlanBatchSampler(36, [4, 4], 0, shuffle=True, seed=3).load_state_dict(a.state_dict())


class CtrlCAt(Callback):
    """Rank 1 records a Ctrl-C (the GracefulInterrupt flag) as batch ``batch`` starts."""

    def __init__(self, interrupt, batch: int):
        self.interrupt, self.batch = interrupt, batch

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.batch and trainer.global_rank == 1:
            self.interrupt.requested = True


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_mid_accumulation_window_stops_at_its_end_and_resumes_exactly(tmp_path):
    """accumulate_grad_batches=2, Ctrl-C as batch 2 starts (the first of the window of optimizer step
    2): the stop and its save wait for the window's end (step 2), and the resumed run ends with the
    uninterrupted run's parameters. It used to save after batch 2, mid-window: step 1 with the
    loader 3 batches in, so the resumed step 2 had batch 3's gradient alone.

    Validation every 3 batches falls inside that window too: ModelCheckpoint(monitor="val_loss")
    saves there (step=1.ckpt, after batch 3 of 4). That checkpoint is rewound to the window's start
    (loader at 2 batches, the generator of batch 2) and resumes exactly; it used to record 3 batches,
    so its resumed step 2 also had batch 3's gradient alone (embed.weight 4e-2 off)."""
    from lightning_hexiscale.errors import TrainingInterrupted
    from lightning_hexiscale.lightning.launch.interrupt import GracefulInterrupt

    plan = plan_of([(3, 1, [([0], (0, 4))]), (3, 1, [([1], (0, 4))])])
    ref_dir, run_dir, res_dir, val_dir = (tmp_path / d for d in ("ref", "run", "resumed", "from_val"))
    for d in (ref_dir, run_dir, res_dir, val_dir):
        d.mkdir()
    kw = dict(max_steps=4, accumulate_grad_batches=2, val_check_interval=3, check_val_every_n_epoch=None,
              limit_val_batches=1)
    val = DataLoader(generated_corpus(G, TINY.seq_len, seed=5), batch_size=G)
    hexiscale_trainer(plan, ref_dir, **kw).fit(module(), shuffled_loader(), val)
    ref = read_ranks(ref_dir, plan.world_size)

    last = tmp_path / "last.ckpt"
    interrupt = GracefulInterrupt(save_to=last)
    by_val = ModelCheckpoint(dirpath=str(tmp_path / "val"), monitor="val_loss", save_top_k=-1, filename="{step}")
    # every rank raises it at the same step: rank 0's comes back to the caller, as it is (it used to
    # be torch's ProcessRaisedException carrying worker 1's traceback)
    with pytest.raises(TrainingInterrupted, match="after step 2; checkpoint of step 2"):
        hexiscale_trainer(plan, run_dir, callbacks=[interrupt, CtrlCAt(interrupt, 2), by_val],
                          enable_checkpointing=True, **kw).fit(module(), shuffled_loader(), val)
    meta = ckpt.read_meta(last)
    assert meta["global_step"] == 2
    assert meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 4
    mid = tmp_path / "val" / "step=1.ckpt"
    meta = ckpt.read_meta(mid)
    assert meta["global_step"] == 1
    assert meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 2

    for out, path in ((res_dir, last), (val_dir, mid)):
        hexiscale_trainer(plan, out, **kw).fit(module(), shuffled_loader(), val, ckpt_path=str(path))
        for rank, (r, want) in enumerate(zip(read_ranks(out, plan.world_size), ref)):
            for name, (t, *_rest) in r["shards"].items():
                err = (t - want["shards"][name][0]).abs().max().item()
                assert err < 1e-12, f"{path.name}, rank {rank}: {name} differs by {err:.3g} from the uninterrupted"
