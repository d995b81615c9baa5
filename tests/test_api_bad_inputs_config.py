"""The config package's Python API called with wrong arguments, as a user's script would: each is a
ConfigError naming the argument, the value, the rule and the fix."""

from pathlib import Path

import pytest

from lightning_hexiscale.config import Cluster, compose
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig


def test_compose_refuses_a_string_of_overrides():
    # was read one character an override: Hydra's "Error parsing override 'c' missing EQUAL", keyed
    # overrides = 'c l u s t e r = c p u 2'
    with pytest.raises(ConfigError, match=r"compose\(overrides\) = 'cluster=cpu2 train.global_batch=8': must be a list "
                                          r"of key=value strings\. Fix: pass a list of overrides: "
                                          r"compose\(\['cluster=cpu2', 'train.global_batch=8'\]\)"):
        compose("cluster=cpu2 train.global_batch=8")


@pytest.mark.parametrize("overrides", [None, 3])
def test_compose_refuses_what_is_no_list(overrides):
    # was TypeError: 'NoneType' object is not iterable
    with pytest.raises(ConfigError, match=r"compose\(overrides\) = .*must be a list of key=value strings\. Fix: "):
        compose(overrides)


@pytest.mark.parametrize("entry", [3, Path("cluster=cpu2")])
def test_compose_refuses_an_override_that_is_no_string(entry):
    # was AttributeError: 'int' object has no attribute 'partition'
    with pytest.raises(ConfigError, match=r"compose\(overrides\)\[1\] = .*an override is a key=value string"):
        compose(["cluster=cpu2", entry])


def test_compose_refuses_a_config_name_that_is_no_string():
    # was keyed overrides = '': "'int' object has no attribute 'endswith'"
    with pytest.raises(ConfigError, match=r"compose\(config_name\) = 3: must be the name of a config"):
        compose(config_name=3)


@pytest.mark.parametrize("overrides", [(), ["cluster=cpu2"]])
def test_compose_names_a_config_name_that_names_no_config(overrides):
    # was keyed overrides = '': "Cannot find primary config 'nope'. Check that it's in your config search path"
    with pytest.raises(ConfigError, match=r"compose\(config_name\) = 'nope': names no config in .*conf\. "
                                          r"Fix: leave it out for config\.yaml, or pass one of: config"):
        compose(overrides, config_name="nope")


def test_a_cluster_directory_is_named_a_directory(tmp_path):
    # was "no such preset or file", of a directory that exists
    with pytest.raises(ConfigError, match=r"cluster = '.*': is a directory, not a cluster file\. Fix: give the path "
                                          r"of a cluster YAML file"):
        Cluster.load(tmp_path)


def test_a_hugging_face_model_directory_is_given_as_hf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model = '.*': is a directory, not a model file\. Fix: it holds a "
                                          r"config.json: for a Hugging Face model directory write 'hf:"):
        LlamaConfig.load(str(tmp_path))


@pytest.mark.parametrize("directory", [3, None, ["/models/x"]])
def test_from_hf_dir_names_a_directory_that_is_no_path(directory):
    # they were pathlib's TypeError ('' stays the working directory: model=hf: says it has no config.json)
    with pytest.raises(ConfigError, match=r"LlamaConfig\.from_hf_dir\(directory\) = .*must be the path of a local "
                                          r"Hugging Face model directory"):
        LlamaConfig.from_hf_dir(directory)
