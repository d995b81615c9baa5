"""An output path in a folder where no file can be created is a ConfigError naming the option, before
the work that fills it. The permission bits do not say so for root (every folder looks writable), and
/proc, /sys or a read-only mount refuse only the write itself: `hexiscale plan --out /proc/plan.yaml`
searched, then failed; `hexiscale discover --out` measured first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.recipe import cannot_create_in, check_output_dir, check_output_file
from lightning_hexiscale.errors import ConfigError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self").exists(),
                                reason="needs /proc, where no file can be created")


@pytest.mark.parametrize("args,flag", [
    (["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1", "--out", "/proc/plan.yaml"], "--out"),
    (["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1", "--picture", "/proc/a/plan.png"],
     "--picture"),
    (["discover", "--local", "2", "--model", "llama_tiny", "--out", "/proc/cluster.yaml"], "--out"),
    (["profile", "--local", "2", "--out", "/proc/cluster.yaml"], "--out"),
])
def test_an_output_in_proc_is_refused_before_the_work(args, flag, capsys, monkeypatch):
    from lightning_hexiscale.cli import plan

    def no_search(*a, **k):
        raise AssertionError("searched before checking the output path")

    monkeypatch.setattr(plan, "plan_once", no_search)
    assert main(args) == 2
    captured = capsys.readouterr()
    path = args[args.index(flag) + 1]
    assert f"{flag} = '{path}': cannot " in captured.err and "/proc" in captured.err and "Fix:" in captured.err
    assert "measur" not in captured.out  # before the work (no_search above: before the search)


def test_the_check_leaves_nothing_behind(tmp_path):
    check_output_file("--out", str(tmp_path / "plan.yaml"), "plan.yaml")
    check_output_dir("trainer.output_dir", tmp_path / "run", "fix")
    assert cannot_create_in(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # no probe file, and not the file itself


def test_a_directory_for_checkpoints_in_proc_is_refused():
    with pytest.raises(ConfigError, match="cannot create a file in /proc"):
        check_output_dir("trainer.output_dir", "/proc/run", "give a writable directory")
