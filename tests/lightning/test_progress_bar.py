"""The recipe's progress bar: Lightning's tqdm bar without the logger version (``v_num``), and the
loss lines printed through the bar (Lightning's ``ProgressBar.print``) so that they do not break it."""

from types import SimpleNamespace

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import loader, module

from lightning_hexiscale.lightning.example import LossPrinter, StepProgressBar


def test_step_progress_bar_drops_only_the_version(tmp_path):
    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path, version=7)], progress_bar_metrics={"train_loss": 1.5})
    assert TQDMProgressBar().get_metrics(trainer, None) == {"v_num": 7, "train_loss": 1.5}  # what it removes
    assert StepProgressBar().get_metrics(trainer, None) == {"train_loss": 1.5}


class _Bar:
    is_enabled = True

    def __init__(self):
        self.lines = []

    def print(self, line):
        self.lines.append(line)


def _trainer(bar):
    return SimpleNamespace(accumulate_grad_batches=1, global_step=1, is_global_zero=True, log_every_n_steps=5,
                           progress_bar_callback=bar, callback_metrics={"train_loss": 2.0})


def test_loss_lines_go_through_the_progress_bar(capsys):
    bar = _Bar()
    printer = LossPrinter()
    printer.on_train_batch_end(_trainer(bar), None, {"loss": 3.0}, None, 0)
    printer.on_train_end(_trainer(bar), None)
    assert bar.lines == ["step     1  loss 3.0000", "training loss: first 3.0000 -> last 2.0000 after 1 step"]
    assert capsys.readouterr().out == ""
    printer = LossPrinter()  # no bar (trainer.progress_bar=false): plain prints
    printer.on_train_batch_end(_trainer(None), None, {"loss": 3.0}, None, 0)
    assert capsys.readouterr().out == "step     1  loss 3.0000\n"


def test_the_steps_of_a_short_last_window_are_counted(capsys):
    """One device, 5 batches per epoch in windows of 2: each epoch ends with a step of one batch
    (steps 3 and 6 of 6), which the printer took for an unfinished window: with log_every_n_steps=3
    it printed step 1 only, and 'after 4 steps'."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[LossPrinter()])
    trainer.fit(module(), loader(30, 6))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("step", "training loss"))]
    assert trainer.global_step == 6
    assert [ln.split("  loss")[0] for ln in lines[:3]] == ["step     1", "step     3", "step     6"]
    assert lines[3].startswith("training loss: first ") and lines[3].endswith(" after 6 steps")
