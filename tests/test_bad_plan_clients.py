"""A bad plan file is refused the same way by every client that reads one, not only by ``hexiscale
estimate --plan`` (test_bad_configs.py): each file under tests/bad_configs/plan/ goes through

- ``hexiscale train`` (recipes/train.py) ``plan=FILE ARGS dry_run=false``: exit status 2, one message that
  contains the file's ``# expect:`` line and a fix, no traceback, and no rank started;
- the Python API: ``HexiScaleStrategy(cluster=..., plan=FILE, global_batch=...)``, then ``estimate()`` of
  the plan it read on the ``model=`` of ``# args:`` (the checks the strategy can only make once the module
  has built its model, at setup): a ConfigError whose message contains ``# expect:`` and a fix.

Then the paths that are no plan file (a directory, nothing), and the files a plan is written to: what is
already there (a cluster file, notes, a FIFO, a hand-edited plan in the run's own directory) is not lost.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_bad_configs import _cases, _header
from test_bad_input_runs import run_recipe

from lightning_hexiscale import HexiScaleStrategy
from lightning_hexiscale.cli.main import main as cli_main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload, estimate

ROOT = Path(__file__).resolve().parents[1]
GOOD = ROOT / "tests" / "bad_configs" / "tiny_plan_for_cpu_hetero4.yaml"


def _args(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for a in _header(path, "args").split())


def _train(argv: list[str], tmp_path: Path, monkeypatch, capfd) -> str:
    """``recipes/train.py ARGV dry_run=false`` in this process: it must stop with status 2 before any rank
    starts (the launching process's one message); returns that message. Training and discovery, the two
    ways ranks start, fail the test instead of running (a plan accepted by mistake trained in this
    process, and its launcher's exit ended the test session)."""
    from lightning_hexiscale.cli import train_discover, train_run

    def no_ranks(*_args, **_kwargs):
        raise AssertionError("the job reached the launch of its ranks")

    monkeypatch.setattr(train_run, "fit", no_ranks)
    monkeypatch.setattr(train_discover, "discover_for_train", no_ranks)
    code, out, err = run_recipe([*argv, "dry_run=false", "trainer.max_steps=1", f"hydra.run.dir={tmp_path}/run"],
                                tmp_path, monkeypatch, capfd)
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and "Initializing distributed" not in out + err, err[-2000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    message = err[err.index(errors[0]):] if len(errors) == 1 else ""  # YAML's own report spans lines
    assert "Fix:" in message, err[-2000:]
    return message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _cases("plan"), ids=lambda p: p.stem)
def test_train_refuses_a_bad_plan_before_starting_ranks(path, tmp_path, monkeypatch, capfd):
    args = _args(path)
    argv = [f"plan={path}", *(f"{k}={v}" for k, v in args.items())]
    assert _header(path, "expect") in _train(argv, tmp_path, monkeypatch, capfd)


@pytest.mark.parametrize("path", _cases("plan"), ids=lambda p: p.stem)
def test_the_python_api_refuses_a_bad_plan(path):
    args = _args(path)
    expect = _header(path, "expect")
    with pytest.raises(ConfigError) as caught:
        gb = int(args["train.global_batch"]) if "train.global_batch" in args else None
        strategy = HexiScaleStrategy(cluster=args.get("cluster"), plan=str(path), global_batch=gb)
        estimate(strategy.plan, strategy.cluster, Workload(LlamaConfig.load(args["model"])))
    assert expect in str(caught.value) and "Fix:" in str(caught.value)


def test_a_train_override_of_the_wrong_type_beside_a_plan_names_the_type(capsys):
    """``train.micro_batch_size`` is null unless given: 'abc' was "must be the field's type. Fix: see the
    configuration reference"."""
    assert cli_main(["estimate", "--plan", str(GOOD), "train.micro_batch_size=abc"]) == 2
    assert ("train.micro_batch_size = 'abc': must be an integer. Fix: give an integer, or null to leave it unset"
            in capsys.readouterr().err)


# ---- paths that are no plan file, through the three clients --------------------------------------------
NOT_A_FILE = {
    "a_directory": (lambda tmp: (tmp / "plan.yaml").mkdir(), "is a directory, not a plan file"),
    "nothing_there": (lambda tmp: None, "no such plan file"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(NOT_A_FILE))
def test_a_plan_path_that_is_no_file_is_refused_by_every_client(case, tmp_path, monkeypatch, capfd):
    make, rule = NOT_A_FILE[case]
    make(tmp_path)
    plan = str(tmp_path / "plan.yaml")
    assert cli_main(["estimate", "--plan", plan, "cluster=cpu_hetero4", "model=llama_tiny"]) == 2
    assert f"--plan = '{plan}': {rule}" in capfd.readouterr().err
    assert f"plan = '{plan}': {rule}" in _train([f"plan={plan}", "cluster=cpu_hetero4", "model=llama_tiny"],
                                                tmp_path, monkeypatch, capfd)
    with pytest.raises(ConfigError, match=rf"^HexiScaleStrategy\(plan\) = '{plan}': {rule}"):
        HexiScaleStrategy(cluster="cpu_hetero4", plan=plan)


def test_the_strategy_checks_a_plan_without_a_cluster_before_the_launch(tmp_path):
    """``HexiScaleStrategy(plan=FILE)`` with no cluster (the local devices, described at setup) read the
    file and checked nothing: ``pipelines: []`` and ``num_layers: NaN`` were found by every rank after the
    launch. The plan's own rules are checked in the constructor; its global batch too."""
    (tmp_path / "p.json").write_text('{"num_layers": NaN, "pipelines": []}')
    with pytest.raises(ConfigError, match=r"^plan\.num_layers = 'NaN': must be a positive integer"):
        HexiScaleStrategy(cluster=None, plan=str(tmp_path / "p.json"))
    with pytest.raises(ConfigError, match=r"^HexiScaleStrategy\(global_batch\) = 6: .*sum to 4"):
        HexiScaleStrategy(cluster="cpu_hetero4", plan=str(GOOD), global_batch=6)
    assert HexiScaleStrategy(cluster=None, plan=str(GOOD), global_batch=4).plan.global_batch == 4


# ---- what --out and the run's plan.yaml would have replaced -------------------------------------------
def _cluster_file(tmp_path: Path) -> Path:
    text = (ROOT / "conf" / "cluster" / "cpu_hetero4.yaml").read_text()
    path = tmp_path / "my_lab.yaml"
    path.write_text(text.replace("defaults:\n  - base_cluster\n  - _self_\n", "").replace("cpu_hetero4", "my_lab"))
    return path


OUT_CASES = {  # --out (or --picture) PATH -> what the message says; the file there is kept as it was
    "the_cluster_file": (lambda tmp: ["--out", str(tmp / "my_lab.yaml")], "is the cluster file this plan is made from"),
    "notes": (lambda tmp: ["--out", str(tmp / "notes.yaml")], "exists and is not a plan file"),
    "a_fifo": (lambda tmp: ["--out", str(tmp / "fifo.yaml")], "exists and is not a regular file"),
    "the_picture_path": (lambda tmp: ["--out", str(tmp / "p.svg"), "--picture", str(tmp / "p.svg")],
                         "is also the --picture path"),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
def test_plan_out_keeps_what_is_already_written(case, tmp_path, capsys, searches):
    """``hexiscale plan --out PATH`` replaced whatever PATH held: the cluster file it planned on (then gone),
    a notes file, a FIFO (the rename put a file in its place). Refused before the search; a previous plan
    file is still replaced (re-planning)."""
    cluster = _cluster_file(tmp_path)
    (tmp_path / "notes.yaml").write_text("# my notes\ntodo: [measure the links]\n")
    os.mkfifo(tmp_path / "fifo.yaml")
    before = {p.name: (p.stat().st_mode, p.read_text() if p.is_file() else None) for p in tmp_path.iterdir()}
    flags, rule = OUT_CASES[case]
    argv = ["plan", f"cluster={cluster}", "model=llama_tiny", "planner.iterations=1", "planner.progress=false"]
    assert cli_main([*argv, *flags(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert rule in captured.err and "Fix:" in captured.err and "Traceback" not in captured.err
    assert not searches  # before the search
    assert {p.name: (p.stat().st_mode, p.read_text() if p.is_file() else None) for p in tmp_path.iterdir()} == before
    (tmp_path / "old_plan.yaml").write_text(GOOD.read_text())
    assert cli_main([*argv, "--out", str(tmp_path / "old_plan.yaml")]) == 0  # a plan is replaced by the new one
    assert len(searches) == 1


@pytest.mark.parametrize("command", [["profile", "--local", "2"], ["discover", "--local", "2", "--model", "llama_tiny"]])
def test_a_cluster_out_that_is_a_fifo_is_refused_before_measuring(command, tmp_path, capsys):
    """``hexiscale profile --out FIFO`` measured, then its write's rename put the cluster file in the
    FIFO's place (exit 0). Refused before any rank starts, as a directory is."""
    os.mkfifo(tmp_path / "fifo.yaml")
    assert cli_main([*command, "--out", str(tmp_path / "fifo.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--out = " in err and "exists and is not a regular file" in err and "Fix:" in err
    assert not (tmp_path / "fifo.yaml").is_file() and list(tmp_path.iterdir()) == [tmp_path / "fifo.yaml"]


@pytest.mark.timeout(60)
def test_a_plan_in_the_runs_own_directory_is_not_rewritten(tmp_path, monkeypatch, capfd):
    """``plan=DIR/plan.yaml hydra.run.dir=DIR`` (a run re-run where it ran, the plan edited by hand) rewrote
    the file with the plan it ran: its comments went, and with ``train.schedule=gpipe`` its content too. The
    same plan is left as written; a different one is refused before the launch."""
    run = tmp_path / "run"
    run.mkdir()
    text = "# tuned by hand: keep\n" + GOOD.read_text()
    (run / "plan.yaml").write_text(text)
    args = [f"plan={run / 'plan.yaml'}", "cluster=cpu_hetero4", "model=llama_tiny", f"hydra.run.dir={run}"]
    code, _, err = run_recipe([*args, "dry_run=true"], tmp_path, monkeypatch, capfd)
    assert code == 0, err[-2000:]
    assert (run / "plan.yaml").read_text() == text
    message = _train([*args, "train.schedule=gpipe"], tmp_path, monkeypatch, capfd)
    assert "is the plan.yaml of this run's directory" in message and "hydra.run.dir=DIR" in message
    assert (run / "plan.yaml").read_text() == text


def test_a_cluster_given_beside_a_plan_whose_cluster_file_is_gone_runs_on_it(tmp_path, capsys):
    """The plan's ``meta.cluster_file`` is consulted only when no cluster is given: given one, a plan
    made on a file that has since moved runs on the one given (the error's fix)."""
    cluster = _cluster_file(tmp_path)
    plan = ROOT / "tests" / "bad_configs" / "plan" / "cluster_file_gone.yaml"
    assert cli_main(["estimate", "--plan", str(plan), f"cluster={cluster}"]) == 0
    assert HexiScaleStrategy(cluster=str(cluster), plan=str(plan)).cluster.name == "my_lab"
    assert Cluster.load(str(cluster)).name == "my_lab"


def test_plan_save_replaces_a_file_and_nothing_else(tmp_path):
    """``Plan.save`` renamed its temporary file over whatever the path named: a link to a directory (a
    checkout's ``conf``) became a plan file, a link to a plan became a plain file beside a stale target, a
    directory or a path below a file was a raw OSError traceback from the Python API."""
    plan = Plan.load(GOOD)
    (tmp_path / "dir").mkdir()
    (tmp_path / "target.yaml").write_text("num_layers: 4\npipelines: []\n")
    os.symlink(tmp_path / "dir", tmp_path / "conf")
    os.symlink(tmp_path / "target.yaml", tmp_path / "link.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    for name, rule in (("conf", "is a directory"), ("dir", "is a directory"),
                       ("fifo.yaml", "is not a regular file"), ("target.yaml/p.yaml", "cannot be written")):
        with pytest.raises(ConfigError, match=rf"^Plan\.save\(path\) = '{tmp_path / name}': {rule}"):
            plan.save(tmp_path / name)
    assert (tmp_path / "conf").is_symlink() and (tmp_path / "dir").is_dir() and not list((tmp_path / "dir").iterdir())
    plan.save(tmp_path / "link.yaml")  # the link is kept, the file it names replaced
    assert (tmp_path / "link.yaml").is_symlink() and Plan.load(tmp_path / "target.yaml") == plan
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf", "dir", "fifo.yaml", "link.yaml", "target.yaml"]
