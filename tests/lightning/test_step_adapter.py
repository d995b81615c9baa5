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
