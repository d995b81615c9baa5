"""A command's ``--out`` replaces an existing file only with one of the same kind: `hexiscale profile
--out p.yaml` (and discover's, calibrate's) replaced a plan file, a model file or notes with a cluster
file without a word, where `hexiscale plan --out` refused a file that is no plan. Refused before
the measurement, with the file left as it was; an existing cluster file (a re-profile) or an empty
one is replaced as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.recipe import check_output_file
from lightning_hexiscale.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "bad_configs" / "good_tiny_plan.yaml"

CONTENTS = {  # what is at --out, and what the refusal must say of it
    "plan": (lambda: PLAN.read_text(), "exists and is a plan file (it has pipelines:)"),
    "model": (lambda: (ROOT / "conf" / "model" / "llama_tiny.yaml").read_text(), "exists and is a model file"),
    "notes": (lambda: "my notes on the cluster\n", "exists and is not a cluster file (it has no machines: key)"),
    "list": (lambda: "- 1\n- 2\n", "exists and is not a cluster file"),
}


def _commands(tmp: Path, out: Path) -> dict[str, list[str]]:
    cluster = tmp / "c.yaml"
    shutil.copy(ROOT / "conf" / "cluster" / "cpu2.yaml", cluster)
    return {"profile": ["profile", "--local", "2", "--out", str(out)],
            "discover": ["discover", "--local", "2", "--model", "llama_tiny", "--out", str(out)],
            "calibrate": ["calibrate", "--local", "2", "--out", str(out), f"cluster={cluster}", "model=llama_tiny"]}


@pytest.mark.parametrize("content", sorted(CONTENTS))
@pytest.mark.parametrize("command", ["profile", "discover", "calibrate"])
def test_out_refuses_to_replace_a_file_of_another_kind(command, content, tmp_path, capsys, no_measuring):
    out = tmp_path / "p.yaml"
    text, said = CONTENTS[content]
    out.write_text(text())
    before = out.read_bytes()
    assert main(_commands(tmp_path, out)[command]) == 2
    err = capsys.readouterr().err
    assert f"--out = '{out}': {said}" in err, err
    assert "writing the cluster file there would replace what it holds" in err and "Fix: give a new path" in err
    assert "Traceback" not in err
    assert out.read_bytes() == before
    assert not out.with_name("p.matrix.yaml").exists()


@pytest.mark.parametrize("text", ["", "\n", None])
def test_an_existing_cluster_file_or_an_empty_one_may_be_replaced(text, tmp_path):
    out = tmp_path / "c.yaml"
    if text is None:
        shutil.copy(ROOT / "conf" / "cluster" / "cpu_hetero4.yaml", out)
    else:
        out.write_text(text)
    check_output_file("--out", str(out), "cluster.yaml", kind="cluster")  # passes: nothing of another kind is lost
    check_output_file("--out", str(tmp_path / "new.yaml"), "cluster.yaml", kind="cluster")


def test_without_a_kind_any_regular_file_may_be_replaced(tmp_path):
    """``kind`` is what the new check adds: the commands that write files of no such kind keep the old rule."""
    out = tmp_path / "p.yaml"
    shutil.copy(PLAN, out)
    check_output_file("--out", str(out), "train.bin")
    with pytest.raises(ConfigError, match="is a plan file"):
        check_output_file("--out", str(out), "cluster.yaml", kind="cluster")
    check_output_file("--out", str(out), "plan.yaml", kind="plan")
