"""The recipe's progress bar: Lightning's tqdm bar without the logger version (``v_num``), and the
loss lines printed through the bar (Lightning's ``ProgressBar.print``) so that they do not break it."""

from types import SimpleNamespace

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

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
