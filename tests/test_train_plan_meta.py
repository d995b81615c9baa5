"""``hexiscale train plan=FILE`` takes the cluster and the model the plan names in its ``meta`` when the
command line gives neither (the configuration reference: "a plan file that names its ``meta.cluster``
and ``meta.model`` needs neither on the command line"). Before, the model default (llama_demo) was
composed beside a plan made for llama_tiny and the run refused the plan for its shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_bad_input_runs import run_recipe


GOOD = Path(__file__).resolve().parent / "bad_configs" / "tiny_plan_for_cpu_hetero4.yaml"


def _plan(tmp_path: Path, model: str) -> Path:
    """A plan of cpu_hetero4's four devices for llama_tiny's shape whose meta names ``model``."""
    data = yaml.safe_load(GOOD.read_text())
    data["meta"]["model"] = model
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_take_plan_model_adds_the_plans_model_preset_unless_the_command_line_names_one(tmp_path):
    from lightning_hexiscale.cli.train_job import take_plan_model

    path = _plan(tmp_path, "llama_tiny")
    assert take_plan_model([f"plan={path}", "dry_run=true"]) == [f"plan={path}", "dry_run=true", "model=llama_tiny"]
    given = [f"plan={path}", "model=llama_demo"]
    assert take_plan_model(given) == given  # the command line's model wins, as for the cluster
    assert take_plan_model(["+model=llama_demo", f"plan={path}"]) == ["+model=llama_demo", f"plan={path}"]
    assert take_plan_model(["dry_run=true"]) == ["dry_run=true"]
    other = _plan(tmp_path, "my_model")
    assert take_plan_model([f"plan={other}"]) == [f"plan={other}"]  # a model file's name is no preset
    broken = tmp_path / "broken.yaml"
    broken.write_text("pipelines: [")
    assert take_plan_model([f"plan={broken}"]) == [f"plan={broken}"]  # the run's own loading says what is wrong


@pytest.mark.timeout(120)
def test_train_runs_a_plan_for_its_meta_model_with_no_model_given(tmp_path, monkeypatch, capfd):
    path = _plan(tmp_path, "llama_tiny")
    code, out, err = run_recipe([f"plan={path}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
                                tmp_path, monkeypatch, capfd)
    assert code == 0, err[-2000:]
    assert "model=llama_tiny: the model the plan was made for" in out + err


def test_a_plan_that_names_no_model_is_refused_unless_the_command_line_names_one(tmp_path):
    """A plan without meta.model and meta.model_shape trained the default model (llama_demo) on a layout
    made for another, without a word; it is refused naming ``model`` and the fix, as estimate refuses it."""
    from lightning_hexiscale.cli.train_job import take_plan_model
    from lightning_hexiscale.errors import ConfigError

    data = yaml.safe_load(GOOD.read_text())
    data["meta"] = {k: v for k, v in data["meta"].items() if k not in ("model", "model_shape")}
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(data))
    no_meta = tmp_path / "no_meta.yaml"
    no_meta.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != "meta"}))
    for path in (bare, no_meta):
        with pytest.raises(ConfigError) as e:
            take_plan_model([f"plan={path}", "dry_run=true"])
        assert e.value.key == "model" and "names no model" in e.value.rule and "model=NAME" in e.value.fix
    for given in (["model=llama_tiny"], ["+model=llama_tiny"], ["model.hidden_size=64"], ["-cn", "mine"]):
        assert take_plan_model([f"plan={bare}", *given]) == [f"plan={bare}", *given]
    shaped = _plan(tmp_path, "my_model")  # a model file's name and the model's shape: the shape check judges
    assert take_plan_model([f"plan={shaped}"]) == [f"plan={shaped}"]
    odd = tmp_path / "odd.yaml"
    odd.write_text(yaml.safe_dump({**data, "meta": 5}))  # the plan's own loading says what is wrong with it
    assert take_plan_model([f"plan={odd}"]) == [f"plan={odd}"]
