"""A comma list (or range/choice/glob) given without ``-m`` is read as the sweep it is: ``hexiscale plan
cluster=cpu_hetero4,cpu2`` printed Hydra's "Ambiguous value ... To use it as a list, use
key=[value1,value2] ... quote the value" (a list no group takes) and "did you mean cluster=cpu_hetero4?".
The fix says how the command sweeps: ``-m`` for ``hexiscale plan`` and ``hexiscale train`` (recipes/train.py),
one run per value for the commands without it."""

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.cli.train import main as train_main
from lightning_hexiscale.cli.train_job import RECIPE, check_overrides
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError


def check(err: str, prog: str, key: str, value: str) -> None:
    assert err.startswith(f"{prog}: error: {key} = '{value}': one run takes one ") and "sweep" in err, err
    for raw in ("Ambiguous value", "key=[value1,value2]", "did you mean", "Traceback"):
        assert raw not in err, err


@pytest.mark.parametrize("override", ["cluster=cpu_hetero4,cpu2", "train.global_batch=8,16",
                                      "train.global_batch=range(8,17,8)", "model=glob(llama_t*)"])
def test_hexiscale_plan_says_to_add_m(override, capsys):
    assert main(["plan", "cluster=cpu_hetero4", "model=llama_tiny", override]) == 2
    err = capsys.readouterr().err
    key, _, value = override.partition("=")
    check(err, "hexiscale plan", key, value)
    assert "Fix: add -m to plan each value" in err


def test_a_command_without_m_says_to_run_once_per_value(capsys):
    assert main(["estimate", "--plan", "plan.yaml", "cluster=cpu_hetero4,cpu2", "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    check(err, "hexiscale estimate", "cluster", "cpu_hetero4,cpu2")
    assert "takes one value per run (no -m)" in err and "or one run: cluster=cpu_hetero4" in err


def test_hexiscale_train_and_the_recipe_say_to_add_m(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["cluster=cpu_hetero4,cpu2", "model=llama_tiny", "dry_run=true"]
    for run, prog in ((lambda a: main(["train", *a]), "hexiscale train"), (lambda a: train_main(a, RECIPE, ()), RECIPE.prog)):
        assert run(argv) == 2
        err = capsys.readouterr().err
        check(err, prog, "cluster", "cpu_hetero4,cpu2")
        assert "add -m (--multirun)" in err


def test_commas_of_one_text_value_may_be_quoted_and_a_sweep_with_m_still_checks():
    with pytest.raises(ConfigError) as e:
        compose(["cluster=cpu_hetero4", "data.path=a,b.txt"])
    assert e.value.key == "data.path" and "quote it: data.path='a,b.txt'" in e.value.fix
    compose(["cluster=cpu_hetero4", "data.path='a,b.txt'"])
    check_overrides(["-m", "cluster=cpu_hetero4,cpu2", "model=llama_tiny"])
