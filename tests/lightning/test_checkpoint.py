"""Plan-independent checkpoints: saved by ModelCheckpoint under plan A (4 ranks: TP-2 pipeline next
to a two-stage pipeline), resumed with ``trainer.fit(ckpt_path=...)`` under plan B (3 ranks, one
pipeline of a TP-1 stage and a TP-2 stage). The continued run equals an uninterrupted one-process
run (losses, every parameter copy, AdamW state and the warm-up schedule across the split), and the
checkpoint loads into the plain single-device Llama. With ``async_checkpoint=True`` the saves
overlap training, hold the values of their step, and "last" is never half-written; top-k removal
works meanwhile, and the writer thread's collectives pass the NCCL-semantics replay next to the
training thread's. Partial, foreign and previous-format directories are refused with clear errors.
"""

from __future__ import annotations

import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategy_helpers import (PG_TIMEOUT, NcclTrace, Recorder, assert_matches, hexiscale_trainer, loader, module, plan_of,
                              read_ranks, single_trainer)

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.checkpoint_io import PieceSavePlanner

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


@pytest.mark.slow
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


def test_a_checkpoint_resumes_at_another_sequence_length(tmp_path):
    """Continued pre-training at a longer context (seq_len 16 -> 32, same weights) was refused:
    "model.seq_len = 32: the checkpoint was saved for seq_len=16. Fix: resume with the model it was
    trained with", though the weights do not depend on it (a real resume then trains: probed under
    a 2-stage plan). The weights' own context still bounds it, and the shape is still checked."""
    import dataclasses

    from strategy_helpers import TINY

    saved = tmp_path / "last.ckpt"  # what check_model reads: the marker, DCP's index and meta.pt
    saved.mkdir()
    (saved / ckpt.COMPLETE).write_text(ckpt.FORMAT)
    (saved / ".metadata").write_bytes(b"")
    torch.save({"hexiscale": {"format": ckpt.FORMAT, "model": TINY.to_dict()}}, saved / ckpt.META)
    ckpt.check_model(saved, dataclasses.replace(TINY, seq_len=32), key="trainer.resume")
    with pytest.raises(ConfigError, match="model.num_layers = 3"):
        ckpt.check_model(saved, dataclasses.replace(TINY, num_layers=3))
    bounded = dataclasses.replace(TINY, max_position_embeddings=24)
    torch.save({"hexiscale": {"format": ckpt.FORMAT, "model": bounded.to_dict()}}, saved / ckpt.META)
    with pytest.raises(ConfigError, match="model.seq_len = 32: .* at most 24 positions.*seq_len <= 24"):
        ckpt.check_model(saved, dataclasses.replace(TINY, seq_len=32))


def test_a_folder_of_checkpoints_or_an_hf_directory_is_not_called_a_partial_save(tmp_path, capsys):
    """`hexiscale checkpoint info outputs/run/checkpoints` (the folder, not last.ckpt in it) and a
    Hugging Face directory were both refused as "partial checkpoint ... the save was interrupted",
    which sends the user looking for a crash that never happened."""
    from lightning_hexiscale.cli.main import main

    folder = tmp_path / "checkpoints"
    for name in ("last.ckpt", "epoch=0-step=4.ckpt"):
        (folder / name).mkdir(parents=True)
        (folder / name / ckpt.COMPLETE).write_text(ckpt.FORMAT)
    with pytest.raises(ConfigError, match="a folder of checkpoints.*give one of them.*last.ckpt"):
        ckpt.read_meta(folder)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert main(["checkpoint", "info", str(hf)]) == 2
    err = capsys.readouterr().err
    assert "a Hugging Face model directory" in err and "partial" not in err and "model=hf:" in err


def test_previous_format_is_refused_with_the_way_out(tmp_path):
    old = tmp_path / "last.ckpt"
    (old / "model").mkdir(parents=True)
    torch.save({"embed.weight": torch.zeros(2, 2)}, old / "model" / "embed.pt")
    torch.save({"hexiscale": {"format": "hexiscale-checkpoint/1"}}, old / "meta.pt")
    (old / "COMPLETE").write_text("hexiscale-checkpoint/1\n")
    with pytest.raises(ConfigError, match="previous format 'hexiscale-checkpoint/1'.*Fix: its weights are plain"):
        ckpt.read_meta(old)
    with pytest.raises(ConfigError, match="previous format"):
        ckpt.load_llama_state_dict(old)


# ---- asynchronous saves ---------------------------------------------------------------------------
class GateAsyncWrites(Callback):
    """A save made at the end of step s (ModelCheckpoint makes two: top-k and "last") may write its
    first box only once the main thread has finished step s + 1: it completes only if training goes
    on while it is in flight (a save that blocked training would deadlock here and fail on the 60 s
    wait). At the start of every step, "last" must be absent or complete (rank 0 reads it)."""

    def __init__(self, last: Path, out_dir: Path):
        self.last, self.out_dir = last, out_dir
        self.gates: dict[int, threading.Event] = {}
        self.lock = threading.Lock()
        self.step = 0
        self.released: list[tuple[int, int]] = []  # (step of the saves, step that released them)
        self.last_steps: list[tuple[int, int | None]] = []  # (training step, global_step of "last")

    def gate(self, step: int) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(step, threading.Event())

    def on_fit_start(self, trainer, module):
        init, resolve = PieceSavePlanner.__init__, PieceSavePlanner.resolve_data

        def made_now(planner, pieces):  # main thread, inside ModelCheckpoint's save of step self.step
            init(planner, pieces)
            planner.made_at = self.step

        def gated(planner, write_item):  # the writer thread
            if not self.gate(planner.made_at).wait(timeout=60):
                raise RuntimeError(f"the save of step {planner.made_at} was not overlapped by a training step")
            return resolve(planner, write_item)

        PieceSavePlanner.__init__, PieceSavePlanner.resolve_data = made_now, gated

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.is_global_zero:
            step = ckpt.read_meta(self.last)["global_step"] if self.last.exists() else None
            self.last_steps.append((trainer.global_step, step))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.step = trainer.global_step  # ModelCheckpoint saves after this hook (callbacks run first)
        if self.step >= 2:
            assert trainer.strategy.checkpointer.pending  # the saves of the previous step are in flight
            self.gate(self.step - 1).set()
            self.released.append((self.step - 1, self.step))

    def on_train_end(self, trainer, module):
        for step in range(trainer.global_step + 1):
            self.gate(step).set()

    def on_fit_end(self, trainer, module):
        torch.save({"released": self.released, "last_steps": self.last_steps},
                   self.out_dir / f"gate{trainer.global_rank}.pt")


def async_trainer(plan, out_dir: Path, callbacks=(), **kw) -> pl.Trainer:
    strategy = HexiScaleStrategy(plan=plan, start_method="fork", timeout=PG_TIMEOUT, async_checkpoint=True)
    return pl.Trainer(strategy=strategy, callbacks=[NcclTrace(out_dir), Recorder(out_dir), *callbacks], accelerator="cpu",
                      devices=plan.world_size, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **kw)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_async_saves_overlap_training_and_stay_atomic(tmp_path):
    ref_dir, run_dir, ck = tmp_path / "ref", tmp_path / "run", tmp_path / "ck"
    ref_dir.mkdir(), run_dir.mkdir()
    steps, train = 4, loader(G * 4, G)
    snap = Snapshot(steps - 1)
    single_trainer(ref_dir, callbacks=[snap], max_steps=steps, **KW).fit(module(warmup_steps=4), train)

    last = ck / "last.ckpt"
    # The two newest step checkpoints are kept: older ones are removed while later saves are in flight.
    saver = ModelCheckpoint(dirpath=str(ck), save_last=True, save_top_k=2, monitor="step", mode="max",
                            every_n_train_steps=1)
    gate = GateAsyncWrites(last, run_dir)
    async_trainer(PLAN_A, run_dir, callbacks=[gate, saver], max_steps=steps, **KW).fit(module(warmup_steps=4), train)

    g = torch.load(run_dir / "gate0.pt")
    assert g["released"] == [(s, s + 1) for s in range(1, steps)]  # every save overlapped the next step
    assert all(last_step is None or last_step < step for step, last_step in g["last_steps"])
    assert ckpt.read_meta(last)["global_step"] == steps
    kept = sorted(p.name for p in ck.iterdir())
    assert kept == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], kept
    # Staged at save time: the step-3 checkpoint holds step 3's weights although step 4 ran meanwhile.
    at3 = ckpt.load_llama_state_dict(ck / "epoch=0-step=3.ckpt")
    for name, t in at3.items():
        assert (t - snap.state[name]).abs().max().item() < 1e-6, name
    final = ckpt.load_llama_state_dict(last)
    for rank, res in enumerate(read_ranks(run_dir, PLAN_A.world_size)):
        for name, (t, dim, start, end) in res["shards"].items():
            want = final[name] if dim is None else final[name].narrow(dim, start, end - start)
            assert torch.equal(t, want), f"rank {rank}: {name}"
