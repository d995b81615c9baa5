"""A true/false key given a number is a ConfigError naming it, on the command line and in cluster and
model files: OmegaConf turns any number into a flag (planner.use_all_devices=-1 and
model.tie_word_embeddings=2 ran as true, planner.progress=0 as false). The file cases are in
tests/bad_configs/ (model/tie_word_embeddings_a_number.yaml, cluster/hopper_a_number.yaml)."""

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError


@pytest.mark.parametrize("override", ["planner.use_all_devices=-1", "planner.progress=0",
                                      "planner.allow_table_mismatch=2", "model.tie_word_embeddings=1180591620717411303424",
                                      "dry_run=1", "+planner.use_all_devices=abc"])
def test_a_number_for_a_flag_is_refused(override):
    key, _, value = override.lstrip("+").partition("=")
    with pytest.raises(ConfigError) as e:
        compose(["cluster=cpu_hetero4", "model=llama_tiny", override])
    assert e.value.key == key and "true or false" in str(e.value)


@pytest.mark.parametrize("override", ["planner.use_all_devices=true", "planner.progress=false", "dry_run=True"])
def test_true_and_false_are_still_flags(override):
    compose(["cluster=cpu_hetero4", "model=llama_tiny", override])


def test_hexiscale_plan_names_the_flag(capsys):
    assert main(["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1",
                 "planner.use_all_devices=-1"]) == 2
    err = capsys.readouterr().err
    assert "planner.use_all_devices = '-1': must be true or false" in err and "Traceback" not in err
