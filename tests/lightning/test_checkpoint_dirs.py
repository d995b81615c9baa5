"""A checkpoint folder that cannot be created (it lies below a regular file) is refused before any process
starts, naming the Trainer argument; it was rank 0's raw ``NotADirectoryError`` from ``mkdir`` at the first
save, after the training, while the other ranks waited."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import PG_TIMEOUT, loader, module, plan_of

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

PLAN = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])


@pytest.mark.parametrize("where", ["default_root_dir", "dirpath", "logger"])
def test_a_checkpoint_folder_below_a_file_is_refused_before_launch(where, tmp_path, capfd):
    (tmp_path / "some_file").write_text("not a folder")
    below = str(tmp_path / "some_file" / "run")
    kwargs = {"default_root_dir": dict(default_root_dir=below, logger=False),
              "dirpath": dict(callbacks=[ModelCheckpoint(dirpath=below)], logger=False),
              "logger": dict(logger=CSVLogger(save_dir=below))}[where]
    trainer = pl.Trainer(strategy=HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT),
                         accelerator="cpu", devices=2, max_steps=2, enable_progress_bar=False,
                         enable_model_summary=False, **kwargs)
    key = {"default_root_dir": "Trainer(default_root_dir)", "dirpath": "ModelCheckpoint(dirpath)",
           "logger": "CSVLogger(save_dir)"}[where]
    with pytest.raises(ConfigError) as info:
        trainer.fit(module(), loader(12, 6))
    assert str(info.value) == (f"{key} = {below!r}: lies below {tmp_path / 'some_file'}, which is a file, so no "
                               f"directory can be created there. Fix: pass {key} a directory, or a path where one "
                               "can be created")
    assert "Initializing distributed" not in capfd.readouterr().err  # no process was started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["some_file"]


def test_a_save_below_a_file_is_the_same_error_on_every_rank(tmp_path):
    """trainer.save_checkpoint(path) in a callback: known only on the ranks, which all check the same path."""
    from lightning_hexiscale.runtime.checkpoint import check_save_target

    (tmp_path / "some_file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^checkpoint path = '.*some_file/deeper/x.ckpt': lies below .*some_file, "
                                          r"which is a file, so its directory cannot be created"):
        check_save_target(Path(tmp_path / "some_file" / "deeper" / "x.ckpt"))
    check_save_target(Path(tmp_path / "new" / "x.ckpt"))  # a folder that can be created: fine
