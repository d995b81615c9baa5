"""Hydra's flags may stand anywhere among ``hexiscale train``'s (and recipes/train.py's) overrides, as
they may among ``hexiscale plan``'s: ``train a=1 -m b=2`` ended in Hydra's argparse usage and
"unrecognized arguments: b=2", an error naming neither the flag nor the fix."""

from __future__ import annotations

import pytest

from lightning_hexiscale.cli.train_job import flags_first
from tests.test_bad_input_runs import run_recipe


@pytest.mark.parametrize("argv, expected", [
    (["a=1", "-m", "b=2"], ["-m", "a=1", "b=2"]),
    (["a=1", "--cfg", "job", "b=2"], ["--cfg", "job", "a=1", "b=2"]),
    (["a=1", "--cfg=job", "~c"], ["--cfg=job", "a=1", "~c"]),
    (["a=1", "--info", "defaults", "b=2"], ["--info", "defaults", "a=1", "b=2"]),
    (["a=1", "--info", "b=2"], ["--info", "a=1", "b=2"]),  # --info's value is optional
    (["-cn", "mine", "a=1", "--resolve", "-p", "train"], ["-cn", "mine", "--resolve", "-p", "train", "a=1"]),
    (["-m", "a=1"], ["-m", "a=1"]),
    (["a=-1", "b=2"], ["a=-1", "b=2"]),
])
def test_flags_go_first_with_their_values_and_overrides_keep_their_order(argv, expected):
    assert flags_first(argv) == expected


@pytest.mark.timeout(120)
def test_a_sweep_flag_after_the_overrides_sweeps(tmp_path, monkeypatch, capfd):
    code, out, err = run_recipe(["cluster=cpu_hetero4", "model=llama_tiny", "dry_run=true", "-m",
                                 "train.global_batch=8,16", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                                tmp_path, monkeypatch, capfd)
    assert code == 0, err[-2000:]
    assert "unrecognized arguments" not in err
    assert sorted(p.parent.name for p in (tmp_path / "sweep").glob("*/plan.yaml")) == ["0", "1"]
