"""A run started in an output directory that holds an earlier run's checkpoint: Lightning keeps that
``last.ckpt`` and saves the new run's as ``last-v1.ckpt``, but the run's last line named
``checkpoints/last.ckpt``, the earlier run's (another model, other steps), and nothing said that a
checkpoint was there. Now the run says so before training, and its last line names the newest."""

from __future__ import annotations

import os
import time

from lightning_hexiscale.cli.train_run import check_resume_alias, print_metrics
from lightning_hexiscale.config.schema import compose


def _checkpoints(tmp_path, *names):
    ck = tmp_path / "checkpoints"
    for age, name in enumerate(reversed(names)):  # the first name is the oldest
        (ck / name).mkdir(parents=True)
        then = time.time() - 100 * (age + 1)
        os.utime(ck / name, (then, then))
    return ck


def test_the_last_line_names_the_newest_checkpoint(tmp_path, capsys):
    ck = _checkpoints(tmp_path, "last.ckpt", "last-v1.ckpt")
    print_metrics({"train_loss": 1.0}, tmp_path)
    out = capsys.readouterr().out
    newest = ck / "last-v1.ckpt"
    assert f"checkpoint: {newest} (resume with trainer.resume={newest})" in out, out
    assert f"{ck / 'last.ckpt'} " not in out


def test_one_checkpoint_and_none_read_as_before(tmp_path, capsys):
    print_metrics({"train_loss": 1.0}, tmp_path)
    assert "no checkpoint" in capsys.readouterr().out
    ck = _checkpoints(tmp_path, "last.ckpt")
    print_metrics({"train_loss": 1.0}, tmp_path)
    assert f"checkpoint: {ck / 'last.ckpt'} (resume with" in capsys.readouterr().out


def test_a_fresh_run_into_a_directory_with_a_checkpoint_says_so_first(tmp_path, capsys):
    cfg = compose(["cluster=cpu_demo", f"trainer.output_dir={tmp_path}"])
    check_resume_alias(cfg)
    assert "earlier run" not in capsys.readouterr().out  # nothing there yet: nothing to say
    ck = _checkpoints(tmp_path, "last.ckpt")
    check_resume_alias(cfg)
    out = capsys.readouterr().out
    assert f"{ck} holds an earlier run's last.ckpt: this run starts from step 0" in out, out
    assert "trainer.resume=last continues the newest instead" in out


def test_resuming_or_a_dry_run_says_nothing_of_it(tmp_path, capsys):
    _checkpoints(tmp_path, "last.ckpt")
    check_resume_alias(compose(["cluster=cpu_demo", f"trainer.output_dir={tmp_path}", "trainer.resume=last"]))
    check_resume_alias(compose(["cluster=cpu_demo", f"trainer.output_dir={tmp_path}", "dry_run=true"]))
    assert "earlier run" not in capsys.readouterr().out
