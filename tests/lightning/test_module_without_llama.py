"""A LightningModule that holds no Llama and has no hook that could build one is refused before any
process starts, in the words of the contract (it was each rank's error after the launch and, with
``cluster=auto``, after the discovery). Modules that may build it later (configure_model, the older
configure_sharded_model, setup, a ``llama()`` method) or hold one are left to the ranks."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import PG_TIMEOUT, TINY, loader

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.plan_resolution import check_module_before_launch
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.models.llama import Llama


class NoLlama(pl.LightningModule):
    """An ordinary one-device module: a linear layer, no Llama anywhere."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.float()[:, :4]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OtherModel(NoLlama):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(4, 4)


@pytest.mark.parametrize("cluster", ["cpu2", "auto"])
@pytest.mark.parametrize("kind, shown", [(NoLlama, "NoneType"), (OtherModel, "Linear")])
def test_a_module_without_a_llama_is_refused_before_launch(kind, shown, cluster, monkeypatch):
    trainer = pl.Trainer(strategy=HexiScaleStrategy(cluster=cluster, start_method="fork", timeout=PG_TIMEOUT),
                         accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    def no_fork():
        raise AssertionError("a rank was started: the module was not checked before the launch")

    monkeypatch.setattr(os, "fork", no_fork)
    with pytest.raises(ConfigError, match=rf"{kind.__name__}.model = '{shown}': the hexiscale strategy turns the "
                                          r"module's Llama into .*Fix: build it in configure_model: self.model = Llama"):
        trainer.fit(kind(), loader(8, 4))


def _with_hook(name):
    def hook(self, *args):
        self.model = Llama(TINY)
    return type(f"Builds{name}", (NoLlama,), {name: hook})


@pytest.mark.parametrize("module", [
    _with_hook("configure_model")(), _with_hook("configure_sharded_model")(), _with_hook("setup")(),
    type("HandsOut", (NoLlama,), {"llama": lambda self: Llama(TINY)})(),
])
def test_a_module_that_may_build_its_llama_later_is_left_to_the_ranks(module):
    check_module_before_launch(None, module)


def test_a_module_holding_a_llama_passes():
    module = NoLlama()
    module.model = Llama(TINY)
    check_module_before_launch(None, module)


class HoldsItElsewhere(NoLlama):
    def __init__(self):
        super().__init__()
        self.net = Llama(TINY)


def test_a_llama_under_another_name_is_pointed_at():
    # the fix said "build it in configure_model" to a module that had built it, as self.net
    with pytest.raises(ConfigError, match=r"HoldsItElsewhere.model = 'NoneType': .*Fix: the module holds its Llama "
                                          r"as self.net: name it self.model, or return it from a llama\(\) method"):
        check_module_before_launch(None, HoldsItElsewhere())
