"""``hydra.*`` overrides of ``hexiscale train`` / recipes/train.py are checked before Hydra reads them: the
run's directory (``hydra.run.dir``; ``hydra.sweep.dir`` under -m) that is a file, lies below a file or
cannot be created was a FileExistsError / NotADirectoryError traceback from Hydra's mkdir and exit status 1;
a misspelt key (``hydra.run.dri``), a non-flag for a flag (``hydra.job.chdir=maybe``) and a new key of a
mapping without '+' were Hydra's text with no fix."""

import os

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.cli.train import main as train_main
from lightning_hexiscale.cli.train_job import RECIPE

BASE = ["cluster=cpu_hetero4", "model=llama_tiny", "dry_run=true"]


def refused(argv, prog_run, capsys) -> str:
    try:
        code = prog_run(argv)
    except SystemExit as e:  # Hydra's own error handling exits with 1
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err
    return err


CASES = {
    "file": (["hydra.run.dir={tmp}/keep.yaml"], "hydra.run.dir = '{tmp}/keep.yaml': is a file, not a directory"),
    "below_a_file": (["hydra.run.dir={tmp}/keep.yaml/sub"], "hydra.run.dir = '{tmp}/keep.yaml/sub': lies below"),
    "below_a_file_resolved": (["hydra.run.dir={tmp}/keep.yaml/${{now:%Y}}"], "lies below"),
    "empty": (["hydra.run.dir="], "hydra.run.dir = '': is empty"),
    "sweep_dir": (["-m", "hydra.sweep.dir={tmp}/keep.yaml"], "hydra.sweep.dir = '{tmp}/keep.yaml': is a file"),
    "not_a_flag": (["hydra.job.chdir=maybe"], "hydra.job.chdir = 'maybe': must be true or false"),
    "typo": (["hydra.run.dri=x"], "hydra.run.dri = 'x': no such key in RunDir. Fix: did you mean hydra.run.dir?"),
    "new_key_without_plus": (["hydra.job.env_set.FOO=1"], "Fix: write +hydra.job.env_set.FOO=1"),
}
if os.path.isdir("/proc/self"):
    CASES["cannot_create"] = (["hydra.run.dir=/proc/hx"], "hydra.run.dir = '/proc/hx': cannot create a file in /proc")


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_hydra_override_is_one_error_line(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.yaml").write_text("kept: true\n")
    extra, want = CASES[case]
    extra = [a.format(tmp=tmp_path) for a in extra]
    argv = [*(a for a in extra if a.startswith("-")), *BASE, *(a for a in extra if not a.startswith("-"))]
    err = refused(argv, lambda a: main(["train", *a]), capsys)
    assert err.startswith("hexiscale train: error: ") and want.format(tmp=tmp_path) in err and "Fix: " in err, err
    err = refused(argv, lambda a: train_main(a, RECIPE, ()), capsys)
    assert err.startswith("recipes/train.py: error: ") and want.format(tmp=tmp_path) in err, err
    assert (tmp_path / "keep.yaml").read_text() == "kept: true\n" and not (tmp_path / "outputs").exists()


def test_good_hydra_overrides_pass_and_create_nothing(tmp_path, monkeypatch):
    from lightning_hexiscale.cli.train_hydra import check_hydra_overrides

    monkeypatch.chdir(tmp_path)
    check_hydra_overrides([*BASE, f"hydra.run.dir={tmp_path}/run", "hydra.job.chdir=false",
                           "+hydra.job.env_set.FOO=1", "hydra.job_logging.handlers.file.delay=false"])
    check_hydra_overrides(["--cfg", "job", *BASE, f"hydra.run.dir={tmp_path}/keep.yaml"])  # no job runs: no directory
    assert list(tmp_path.iterdir()) == []
