"""A root value, section or config group given the wrong kind of value names that key, the rule and a
fix: ``dry_run=maybe`` was "overrides = 'cluster=... dry_run=maybe': Error merging override dry_run=maybe:
Value 'maybe' is not a valid bool. Fix: check key names against conf/ ...", under the whole command line
(``dry_run=1`` and every trainer.* / planner.* flag had their own message already); ``plan=[1,2]``,
``trainer=5`` and ``planner=5`` likewise. In compose (``hexiscale plan`` and the others), ``hexiscale train``
and recipes/train.py."""

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.cli.train import main as train_main
from lightning_hexiscale.cli.train_job import RECIPE
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError

BASE = ["cluster=cpu_hetero4", "model=llama_tiny"]

CASES = {
    "dry_run=maybe": ("dry_run", "must be true or false"),
    "dry_run=1.5": ("dry_run", "must be true or false"),
    "dry_run=[1]": ("dry_run", "must be true or false, not a list"),
    "dry_run=null": ("dry_run", "must be true or false"),
    "plan=[1,2]": ("plan", "must be a string, not a list"),
    "trainer=5": ("trainer", "is a section of keys (TrainerConfig), not a single value"),
    "trainer=[1]": ("trainer", "is a section of keys (TrainerConfig), not a list"),
    "trainer=null": ("trainer", "not null"),
    "data=5": ("data", "is a section of keys (DataConfig)"),
    "trainer.fast_path=5": ("trainer.fast_path", "is a section of keys (FastPathConfig)"),
    "cluster.machines=5": ("cluster.machines", "is a list, not a single value"),
    "trainer.max_steps=[1]": ("trainer.max_steps", "must be an integer, not a list"),
    "planner=5": ("planner", "a config group takes one preset's name, not a number"),
    "cluster=5": ("cluster", "a config group takes one preset's name, not a number"),
    "train=[1]": ("train", "not a list"),
    "cluster=[cpu2]": ("cluster", "not a list"),
    "model=[llama_tiny,llama_demo]": ("model", "not a list"),
}


@pytest.mark.parametrize("override", list(CASES))
def test_the_wrong_kind_of_value_names_its_key(override):
    key, rule = CASES[override]
    with pytest.raises(ConfigError) as e:
        compose([*BASE, override])
    assert e.value.key == key and rule in e.value.rule, str(e.value)
    assert e.value.value == override.partition("=")[2] and e.value.fix


@pytest.mark.parametrize("override", ["dry_run=true", "dry_run=False", "plan=null", "trainer={max_steps: 3}",
                                      "trainer.fast_path={compile: false}", "planner=default"])
def test_values_of_the_right_kind_still_compose(override):
    compose([*BASE, override])


@pytest.mark.parametrize("override", ["dry_run=maybe", "dry_run=1.5", "dry_run=[1]", "plan=[1,2]", "trainer=5",
                                      "planner=5"])
def test_hexiscale_train_and_the_recipe_name_the_key(override, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    key, rule = CASES[override]
    for run, prog in ((lambda a: main(["train", *a]), "hexiscale train"), (lambda a: train_main(a, RECIPE, ()), RECIPE.prog)):
        assert run([*BASE, override]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{prog}: error: {key} = '{override.partition('=')[2]}': ") and rule in err, err
        assert "Fix: " in err and "overrides =" not in err and "check key names" not in err and "Traceback" not in err
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run directory


def test_the_config_groups_are_the_root_configs_defaults():
    import yaml

    from lightning_hexiscale.config.schema import conf_dir
    from lightning_hexiscale.config.values import CONFIG_GROUPS

    defaults = yaml.safe_load((conf_dir() / "config.yaml").read_text())["defaults"]
    assert set(CONFIG_GROUPS) == {k for d in defaults if isinstance(d, dict) for k in d}
