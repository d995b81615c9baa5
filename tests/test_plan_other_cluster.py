"""A plan beside an explicit ``cluster=`` that is not the cluster the plan was made for: the explicit
choice wins (tests/test_cli_estimate.py), but `hexiscale estimate`, `hexiscale train` and
``HexiScaleStrategy(plan, cluster)`` say so in one line, with the fix (`hexiscale plan cluster=Y`). They
priced and ran the plan there without a word. Nothing is said for the same cluster: the same preset,
the same file, or a file with the same content."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.planner.plan import OtherClusterWarning

CONF = Path(__file__).resolve().parents[1] / "lightning_hexiscale" / "conf" / "cluster"
NOTE = ("hexiscale estimate: warning: the plan was made for cluster cpu2 (meta.cluster) and is priced on cluster "
        "cpu_hetero4, the cluster= given; `hexiscale plan cluster=cpu_hetero4` makes a plan for cpu_hetero4")


@pytest.fixture(scope="module")
def cpu2_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "cpu2_plan.yaml"
    assert main(["plan", "cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "planner.iterations=1",
                 "--out", str(path)]) == 0
    return path


def test_estimate_on_another_cluster_says_so(cpu2_plan, capsys):
    assert main(["estimate", "--plan", str(cpu2_plan), "cluster=cpu_hetero4"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[0] == NOTE
    assert captured.out.startswith("cluster cpu_hetero4:")  # the explicit cluster still wins


@pytest.mark.parametrize("cluster", [None, "cpu2", "copy"])
def test_estimate_on_the_same_cluster_says_nothing(cluster, cpu2_plan, tmp_path, capsys):
    if cluster == "copy":  # the same content in a file of its own
        cluster = str(shutil.copy(CONF / "cpu2.yaml", tmp_path / "my_cluster.yaml"))
    assert main(["estimate", "--plan", str(cpu2_plan), *([f"cluster={cluster}"] if cluster else [])]) == 0
    assert "was made for cluster" not in capsys.readouterr().err


def test_a_plan_made_on_a_file_names_the_file(tmp_path, capsys):
    mine = shutil.copy(CONF / "cpu2.yaml", tmp_path / "lab.yaml")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", f"cluster={mine}", "model=llama_tiny", "train.global_batch=8", "planner.iterations=1",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["estimate", "--plan", str(plan), f"cluster={mine}"]) == 0
    assert "was made for cluster" not in capsys.readouterr().err
    assert main(["estimate", "--plan", str(plan), "cluster=cpu_hetero4"]) == 0
    assert f"(meta.cluster_file: {Path(mine).resolve()}) and is priced on cluster cpu_hetero4" in capsys.readouterr().err


def test_the_strategy_with_plan_and_another_cluster_warns(cpu2_plan):
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    with pytest.warns(OtherClusterWarning, match=r"HexiScaleStrategy\(plan, cluster\): the plan was made for cluster "
                      r"cpu2 \(meta.cluster\) and is run on cluster cpu_hetero4"):
        HexiScaleStrategy(plan=str(cpu2_plan), cluster="cpu_hetero4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", OtherClusterWarning)
        HexiScaleStrategy(plan=str(cpu2_plan), cluster="cpu2")
        HexiScaleStrategy(plan=str(cpu2_plan))


@pytest.mark.timeout(120)
def test_train_on_another_cluster_says_so_once(cpu2_plan, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"plan={cpu2_plan}", "cluster=cpu_hetero4", "dry_run=true",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    err = capfd.readouterr().err
    assert err.count("was made for cluster cpu2") == 1, err[-3000:]
    assert ("hexiscale train: warning: the plan was made for cluster cpu2 (meta.cluster) and is run on cluster "
            "cpu_hetero4, the cluster= given; `hexiscale plan cluster=cpu_hetero4` makes a plan for cpu_hetero4") in err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_training_run_on_another_cluster_says_so_once(cpu2_plan, tmp_path):
    """The strategy the run builds (in the launching process and in each rank it starts) would say it
    again: three lines for one run on cpu_hetero4 before the run's own line filtered the strategy's."""
    import os
    import subprocess
    import sys

    script = Path(sys.executable).parent / "hexiscale"
    if not script.is_file():
        pytest.skip(f"no console script at {script}")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([str(script), "train", f"plan={cpu2_plan}", "cluster=cpu_hetero4", "trainer.max_steps=1",
                          "trainer.progress_bar=false", "data.num_samples=64", "trainer.val_every=0",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("was made for cluster cpu2") == 1, out.stderr[-3000:]
    assert "final metrics:" in out.stdout
