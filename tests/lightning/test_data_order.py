"""shuffle=True under the strategy trains on exactly the batches one device would: the pipelines cut the
permutation the one-device DataLoader draws (from torch's global generator under seed_everything, or
from the loader's own generator), epoch after epoch, and every rank takes rank 0's draw.

The pure tests replay each pipeline as a separate process would (same seed, its own generator
state) against one DataLoader; the Trainer test compares the losses of 4 forked ranks (a TP-2
pipeline next to a two-stage pipeline) with one process, float64, over three epochs with validation.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import TINY, hexiscale_trainer, module, plan_of, read_ranks, single_trainer
from torch.utils.data import DataLoader

from lightning_hexiscale.data import PlanBatchSampler, generated_corpus, plan_dataloader

SIZES = [3, 1, 2]  # pipeline batches; G = 6


def _one_device(make_loader, seed: int, epochs: int) -> list[list[torch.Tensor]]:
    pl.seed_everything(seed, verbose=False)
    dl = make_loader()
    return [list(dl) for _ in range(epochs)]


def _pipeline(make_loader, seed: int, epochs: int, i: int) -> list[list[torch.Tensor]]:
    pl.seed_everything(seed, verbose=False)  # a separate process: same seed, its own generator state
    dl = plan_dataloader(make_loader(), SIZES, i, drop_last=True)
    out = []
    for e in range(epochs):
        dl.batch_sampler.set_epoch(e)
        out.append(list(dl))
    return out


@pytest.mark.parametrize("generator", [None, 11], ids=["global_generator", "loader_generator"])
def test_pipelines_cut_the_one_device_permutation(generator):
    ds = torch.arange(30 * 2).view(30, 2)

    def make_loader():
        g = None if generator is None else torch.Generator().manual_seed(generator)
        return DataLoader(ds, batch_size=6, shuffle=True, drop_last=True, generator=g)

    ref = _one_device(make_loader, 3, epochs=3)
    pipes = [_pipeline(make_loader, 3, 3, i) for i in range(len(SIZES))]
    for e in range(3):
        got = [torch.cat([pipes[i][e][k] for i in range(len(SIZES))]) for k in range(5)]
        assert all(torch.equal(a, b) for a, b in zip(got, ref[e])), f"epoch {e}"
    assert not torch.equal(torch.cat(ref[0]), torch.cat(ref[1]))  # shuffled, and anew each epoch
    assert not torch.equal(torch.cat(ref[0]), ds[:30])


def test_ranks_take_rank_zeros_draw():
    # Two "ranks" whose global generators differ: with agree (rank 0's value) they cut one permutation.
    drawn = {}

    def rank(r):
        torch.manual_seed(100 + r)
        agree = (lambda v: drawn.setdefault("rank0", v))
        s = PlanBatchSampler(24, SIZES, r, shuffle=True, agree=agree)
        return list(s)

    a, b = rank(0), rank(1)
    full = PlanBatchSampler(24, [6], 0, shuffle=True, agree=lambda v: drawn["rank0"])
    windows = list(full)
    assert [w[0:3] for w in windows] == a and [w[3:4] for w in windows] == b


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_shuffled_fit_equals_single_process(tmp_path):
    plan = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])])
    g = plan.global_batch
    train = DataLoader(generated_corpus(g * 3, TINY.seq_len, seed=2), batch_size=g, shuffle=True)
    val = DataLoader(generated_corpus(g, TINY.seq_len, seed=3), batch_size=g)
    kw = dict(max_epochs=3, limit_val_batches=1, check_val_every_n_epoch=1)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    trainer = single_trainer(ref_dir, **kw)
    pl.seed_everything(5, verbose=False)
    trainer.fit(module(), train, val)
    trainer = hexiscale_trainer(plan, run_dir, **kw)
    pl.seed_everything(5, verbose=False)  # the forked ranks inherit this state
    trainer.fit(module(), train, val)
    ref = read_ranks(ref_dir, 1)[0]["losses"]
    assert len(ref) == 9
    for rank, res in enumerate(read_ranks(run_dir, plan.world_size)):
        assert res["losses"] == pytest.approx(ref, abs=1e-9), f"rank {rank}"
