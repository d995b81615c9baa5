"""`hexiscale plan model=hf:/nonexistent` said ``trainer.weights = '/nonexistent': no such local
directory``, a key the user never set: ``model=hf:DIR`` is rewritten into ``model=_hf
trainer.weights=DIR`` before composing, and the directory was read under the rewritten key. The error
is now ``model = 'hf:DIR'`` (a missing directory, one without config.json, a broken config.json), for
`hexiscale plan` and `hexiscale train` alike; a ``trainer.weights=/bad`` given explicitly stays keyed
``trainer.weights``."""

from __future__ import annotations

import pytest

from lightning_hexiscale.cli.main import main


def _bad_dirs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{bad")
    return {"missing": (str(tmp_path / "missing"), f"model = 'hf:{tmp_path / 'missing'}': no such local directory"),
            "empty": (str(tmp_path / "empty"), f"model = 'hf:{tmp_path / 'empty'}': the directory has no config.json"),
            "broken": (str(tmp_path / "broken"), f"model = '{tmp_path / 'broken' / 'config.json'}': not valid JSON")}


@pytest.mark.parametrize("case", ["missing", "empty", "broken"])
@pytest.mark.parametrize("command", [["plan", "cluster=cpu_hetero4"], ["train", "cluster=cpu2", "dry_run=true"]])
def test_a_bad_hf_directory_is_the_error_of_model(case, command, tmp_path, capsys):
    directory, said = _bad_dirs(tmp_path)[case]
    assert main([*command, f"model=hf:{directory}"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix:" in err and "trainer.weights" not in err and "Traceback" not in err


def test_an_explicit_trainer_weights_stays_its_own_key(tmp_path, capsys):
    assert main(["plan", "cluster=cpu_hetero4", "model=_hf", f"trainer.weights={tmp_path / 'missing'}"]) == 2
    assert f"trainer.weights = '{tmp_path / 'missing'}': no such local directory" in capsys.readouterr().err
