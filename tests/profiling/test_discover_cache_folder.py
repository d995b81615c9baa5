"""A discovery cache folder that cannot be written is refused before any local rank starts
(``hexiscale discover --local N``, ``hexiscale train`` with cluster=auto): it was found by rank 0 after
the ranks had started, and every rank's traceback followed the headline."""

from __future__ import annotations

import pytest

from lightning_hexiscale.profiling import discovery_plan as dp


@pytest.mark.parametrize("command", [["discover", "--local", "2", "--model", "llama_tiny"],
                                     ["train", "model=llama_tiny", "trainer.max_steps=1"]])
def test_an_unwritable_cache_folder_is_refused_before_any_rank_starts(command, tmp_path, monkeypatch, capsys):
    from lightning_hexiscale.cli.main import main
    from lightning_hexiscale.profiling import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(launch, "run_local", no_ranks)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path / "afile" / "sub"))
    args = [*command, f"trainer.output_dir={tmp_path / 'run'}"] if command[0] == "train" else command
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"$HEXISCALE_CACHE_DIR = '{tmp_path / 'afile' / 'sub'}': the cache folder cannot be written" in err, err
    assert "Fix: point HEXISCALE_CACHE_DIR at a writable folder" in err and "Traceback" not in err
