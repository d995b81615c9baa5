"""The Lightning layer's Python API called with wrong arguments, as a Lightning user's script would:
each is a ConfigError from the constructor, naming the argument, the value, the rule and the fix
(no process is started: the constructors only)."""

import pytest

from lightning_hexiscale.errors import ConfigError


@pytest.mark.parametrize("name, value, rule", [
    # cluster_environment='slurm' was AttributeError "'str' object has no attribute 'set_global_rank'" when
    # the Trainer was built; parallel_devices=3 a TypeError there; the others were taken without a word
    ("cluster_environment", "slurm", r"is of type str; it must be a ClusterEnvironment or None"),
    ("checkpoint_io", "x", r"is of type str; it must be a CheckpointIO or None"),
    ("precision_plugin", "bf16-mixed", r"is of type str; it must be a Precision or None"),
    ("accelerator", "cpu", r"is of type str; it must be an Accelerator or None"),
    ("parallel_devices", 3, r"must be None or a list of torch.device"),
    ("parallel_devices", ["cpu", "cpu"], r"must be None or a list of torch.device"),
])
def test_ddp_plugins_are_lightning_objects(name, value, rule):
    from lightning_hexiscale.lightning import HexiScaleStrategy

    with pytest.raises(ConfigError, match=rf"HexiScaleStrategy\({name}\) = .*: {rule}\. Fix: "):
        HexiScaleStrategy(cluster="cpu_hetero4", **{name: value})


def test_ddp_plugins_of_lightning_are_passed_on():
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_hexiscale.lightning import HexiScaleStrategy

    s = HexiScaleStrategy(cluster="cpu_hetero4", cluster_environment=LightningEnvironment(),
                          parallel_devices=[torch.device("cpu")] * 4)
    assert isinstance(s.cluster_environment, LightningEnvironment)


@pytest.mark.parametrize("elastic", ["", "  ", "FILE"])
def test_elastic_checkpoint_dir_is_a_directory_path(elastic, tmp_path, monkeypatch):
    # '' was the working directory without a word; a file failed at setup, in every rank
    from lightning_hexiscale.lightning import HexiScaleStrategy

    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x")
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(elastic\)\.checkpoint_dir = .*(must be the path of a "
                                          r"directory|is a file; it must be a directory).*\. Fix: "):
        HexiScaleStrategy(cluster="cpu_hetero4", elastic=elastic)


@pytest.mark.parametrize("config", ["llama_tiny", None, {"hidden_size": 8}])
def test_llama_takes_a_llama_config(config):
    # was AttributeError: 'str' object has no attribute 'vocab_size'
    from lightning_hexiscale.models.llama import Llama

    with pytest.raises(ConfigError, match=r"Llama\(config\) = .*it must be a LlamaConfig\. Fix: pass "
                                          r"Llama\(LlamaConfig.load\(name_or_path\)\)"):
        Llama(config)


def test_llama_lit_module_takes_a_model_file_as_a_path(tmp_path):
    # a str path worked and a pathlib.Path was refused ("is of type PosixPath"), while the strategy takes Paths
    import shutil
    from pathlib import Path

    from lightning_hexiscale.config.schema import conf_dir
    from lightning_hexiscale.lightning.example import LlamaLitModule

    shutil.copy(conf_dir() / "model" / "llama_tiny.yaml", tmp_path / "mine.yaml")
    module = LlamaLitModule(Path(tmp_path / "mine.yaml"))
    assert module.config == LlamaLitModule(str(tmp_path / "mine.yaml")).config
    assert module.config.hidden_size == LlamaLitModule("llama_tiny").config.hidden_size
    with pytest.raises(ConfigError, match="is a directory"):
        LlamaLitModule(Path(tmp_path))
