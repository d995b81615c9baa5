"""lightning/step_adapter.py's ``engine_optimizers``: under ZeRO the optimizer Lightning holds is the
one that steps (the engine's), and the user's LR schedulers are re-pointed at it; under ddp the
user's stays. An engine stand-in: the real sharded optimizer needs process groups (the Lightning
runs of tests/lightning/test_strategy_zero.py cover it)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.step_adapter import StepAdapter, state_to_device


class _Sharded:
    """What ShardedOptimizer promises: the user's param_groups, its own step."""

    def __init__(self, user):
        self.user, self.steps, self.lrs = user, 0, []

    @property
    def param_groups(self):
        return self.user.param_groups

    @property
    def state(self):
        return {}

    def step(self, closure=None):
        self.steps += 1
        self.lrs.append(self.param_groups[0]["lr"])


def _adapter(replaces: bool) -> StepAdapter:
    engine = SimpleNamespace(step=None, sharding="zero2" if replaces else "ddp",
                             wrap_optimizer=_Sharded if replaces else lambda user: user)
    return StepAdapter(engine)


def _user():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)


def test_zero_hands_lightning_the_sharded_optimizer_and_repoints_the_scheduler():
    user, sched = _user()
    user_step = user.step  # torch's scheduler wrapper: left alone
    adapter = _adapter(True)
    held = adapter.engine_optimizers([user], [LRSchedulerConfig(sched)])
    assert len(held) == 1 and isinstance(held[0], _Sharded) and held[0].user is user
    assert adapter.configured == [user]  # what eps_underflow reads: the user's class and groups
    assert sched.optimizer is held[0]
    assert user.step is user_step
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when the scheduler believes the step did not run
        for _ in range(3):
            held[0].step()
            sched.step()
    assert held[0].lrs == [0.25, 0.5, 0.75]  # the scheduler's lr reaches the optimizer that steps
    assert held[0].param_groups[0]["lr"] == 1.0


def test_ddp_keeps_the_users_optimizer():
    user, sched = _user()
    assert _adapter(False).engine_optimizers([user], [LRSchedulerConfig(sched)]) == [user]
    assert sched.optimizer is user


def test_zero_refuses_two_optimizers():
    (a, _), (b, _) = _user(), _user()
    with pytest.raises(ConfigError, match="configure_optimizers.*2 optimizers"):
        _adapter(True).engine_optimizers([a, b], [])


def test_state_to_device_moves_all_but_step():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p])
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, dtype=torch.float64)}
    sentinel = opt.state[p]["step"]
    state_to_device([opt], torch.device("meta"))
    assert opt.state[p]["exp_avg"].is_meta and opt.state[p]["step"] is sentinel


# ---- when the window closes: Lightning's rule, from its public counters -------------------------------
class _Agreement:
    """A Lightning callback: at each training batch, the restated rule next to Lightning's own
    (``_should_accumulate``, private: read here, in a test, to hold the package to it)."""

    def __init__(self):
        self.rows: list[tuple[int, bool, bool]] = []

    def __call__(self, trainer, batch_idx: int) -> None:
        from lightning_hexiscale.lightning.step_adapter import steps_after_this_batch

        self.rows.append((batch_idx, steps_after_this_batch(trainer), not trainer.fit_loop._should_accumulate()))


class _Stream(torch.utils.data.IterableDataset):
    """No ``__len__``: Lightning learns the epoch's last batch only from its fetcher."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter([torch.ones(2) * i for i in range(self.n)])


@pytest.mark.parametrize("data, k, limit, epochs", [
    ("sized", 3, None, 2),     # 7 batches, windows 3-3-1: the epoch's end closes the last one
    ("sized", 4, 6, 1),        # limit_train_batches cuts the epoch inside a window
    ("stream", 3, None, 2),    # no len(): the fetcher's look-ahead says the epoch ends
    ("sized", 1, None, 1),     # no accumulation: every batch steps
])
def test_steps_after_this_batch_is_lightnings_rule(data, k, limit, epochs):
    import lightning.pytorch as pl

    agreement = _Agreement()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

        def training_step(self, batch, batch_idx):
            return (self.w * (batch[0] if isinstance(batch, list) else batch)).sum()

        def on_train_batch_start(self, batch, batch_idx):
            agreement(self.trainer, batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dataset = _Stream(7) if data == "stream" else torch.utils.data.TensorDataset(torch.ones(7, 2))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None if data == "stream" else 1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, accumulate_grad_batches=k,
                         limit_train_batches=limit, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), loader)
    n = limit or 7
    assert len(agreement.rows) == n * epochs
    assert [ours for _, ours, _ in agreement.rows] == [theirs for _, _, theirs in agreement.rows], agreement.rows
    # the cases exercise each clause: a window still open, and (n % k != 0 in the first three) an
    # epoch's end that closes a window early
    assert any(not ours for _, ours, _ in agreement.rows) == (k > 1)
    assert agreement.rows[n - 1][1], "the epoch's last batch steps"
