"""A "did you mean" proposes a value the key it names takes: ``planner.recompute=maybe`` said "did you mean
train.recompute? (e.g. train.recompute=maybe)", which is refused in turn. The value typed is kept when the
proposed key takes it; else the fix says the key's rule (from its type or the checks its section passes)
and a value it takes."""

import re

import pytest

from lightning_hexiscale.cli.train import main as train_main
from lightning_hexiscale.cli.train_job import RECIPE
from lightning_hexiscale.config.recipe import check_values
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner import SearchSettings

BASE = ["cluster=cpu_hetero4", "model=llama_tiny"]

REFUSED = {  # override -> (the key proposed, the rule the fix states)
    "planner.recompute=maybe": ("train.recompute", "must be auto, true or false"),
    "recompute=maybe": ("train.recompute", "must be auto, true or false"),
    "train.recompte=yes": ("train.recompute", "must be auto, true or false"),
    "planner.global_batch=abc": ("train.global_batch", "must be an integer"),
    "train.schedle=foo": ("train.schedule", "must be one of"),
    "planner.iteration=0": ("planner.iterations", "must be between 1 and"),
    "trainer.lr2=-1": ("trainer.lr", "must be a positive number"),
}


def proposed(fix: str) -> tuple[str, str]:
    found = re.search(r"e\.g\. ([\w.]+)=(\S+?)\)", fix)
    assert found, fix
    return found[1], found[2]


@pytest.mark.parametrize("override", list(REFUSED))
def test_the_proposed_value_is_one_the_key_takes(override):
    key, rule = REFUSED[override]
    with pytest.raises(ConfigError) as e:
        compose([*BASE, override])
    fix = e.value.fix
    assert fix.startswith(f"did you mean {key}?") and rule in fix, fix
    name, value = proposed(fix)
    assert name == key and value != override.partition("=")[2], fix
    cfg = compose([*BASE, f"{name}={value}"])  # the fix, followed, composes and passes the sections' checks
    SearchSettings.from_config(cfg, dp_sharding_explicit=True)
    check_values(cfg)


@pytest.mark.parametrize("override, example", [("train.recompte=true", "train.recompute=true"),
                                               ("planner.global_batch=64", "train.global_batch=64"),
                                               ("trainer.max_step=3", "trainer.max_steps=3")])
def test_a_value_the_key_takes_is_kept(override, example):
    with pytest.raises(ConfigError) as e:
        compose([*BASE, override])
    assert f"(e.g. {example})" in e.value.fix


def test_the_recipe_proposes_a_valid_recompute(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train_main([*BASE, "dry_run=true", "planner.recompute=maybe"], RECIPE, ()) == 2
    err = capsys.readouterr().err
    assert "did you mean train.recompute?" in err and "train.recompute=auto" in err
    assert "train.recompute=maybe" not in err
