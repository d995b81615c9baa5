"""What the strategy keeps of a Trainer call's arguments (``keep_call_arguments``, called by the
launcher before processes start): the training DataLoader the global batch is read from is found where
Lightning's fit loop finds it (``plan_resolution.training_loader``), without consuming it. No processes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.plan_resolution import training_loader
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy


def _loader(batch: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(12, 4, dtype=torch.long)), batch_size=batch)


class _Plain(pl.LightningModule):
    pass


class _WithHook(pl.LightningModule):
    def train_dataloader(self):
        return _loader(3)


class _Data(pl.LightningDataModule):
    def train_dataloader(self):
        return _loader(4)


class _NeedsSetup(pl.LightningDataModule):
    def train_dataloader(self):
        return self.not_set_up_yet  # AttributeError: the hook needs setup that has not run


def test_the_loader_is_found_where_lightning_finds_it():
    given = _loader(6)
    assert training_loader({"train_dataloaders": given}, _WithHook()) is given  # the call's loader first
    assert training_loader({"datamodule": _Data()}, _WithHook()).batch_size == 4  # then the datamodule
    assert training_loader({"train_dataloaders": _Data()}, _Plain()).batch_size == 4  # a DataModule passed there
    assert training_loader({}, _WithHook()).batch_size == 3  # then the module's own hook
    assert training_loader({}, _Plain()) is None  # no hook defined: nothing to read
    assert training_loader({"datamodule": pl.LightningDataModule()}, _WithHook()) is None  # Lightning: the datamodule's
    assert training_loader({"datamodule": _NeedsSetup()}, _Plain()) is None  # a hook that fails: unknown, not a crash


def test_the_global_batch_comes_from_the_kept_arguments(monkeypatch):
    strategy = HexiScaleStrategy(cluster="cpu_hetero4")
    monkeypatch.setattr(HexiScaleStrategy, "lightning_module", property(lambda self: _Plain()))
    strategy.keep_call_arguments(None, True, {"model": _Plain(), "train_dataloaders": _loader(8), "ckpt_path": None})
    assert strategy._global_batch_for() == 8
    strategy.keep_call_arguments(None, False, {"model": _Plain(), "dataloaders": _loader(5)})  # validate: no train loader
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(global_batch\).*no training DataLoader"):
        strategy._global_batch_for()
    assert HexiScaleStrategy(cluster="cpu_hetero4", global_batch=12)._global_batch_for() == 12
