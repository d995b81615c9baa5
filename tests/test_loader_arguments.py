"""The public loaders take a name or path (``Cluster.load``, ``LlamaConfig.load``, ``Plan.load``) or
a mapping (``Cluster.from_config``, ``LlamaConfig.from_config``); anything else is a ConfigError
naming the argument. None / a number / a list was a TypeError from pathlib ('expected str, bytes or
os.PathLike object') or from dict(); a name longer than the file system allows was OSError 'File name
too long' (pathlib's is_file raises there), from the Python API and from ``hexiscale plan
cluster=<name>.yaml``; LlamaConfig.from_config({}) was the constructor's TypeError ('missing 8
required positional arguments')."""

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan

LONG = "x" * 5000
NOT_A_NAME = [None, 7, 1.5, True, [], {}, [1], "", LONG, LONG + ".yaml"]


@pytest.mark.parametrize("load, key", [(Cluster.load, "cluster"), (LlamaConfig.load, "model"), (Plan.load, "plan")],
                         ids=["Cluster.load", "LlamaConfig.load", "Plan.load"])
@pytest.mark.parametrize("value", NOT_A_NAME, ids=lambda v: repr(v)[:12])
def test_a_loader_refuses_what_names_no_file(load, key, value):
    with pytest.raises(ConfigError) as e:
        load(value)
    assert e.value.key == key and e.value.fix


@pytest.mark.parametrize("load, reader", [(Cluster.load, "Cluster.from_config(mapping)"),
                                          (LlamaConfig.load, "LlamaConfig.from_config(mapping)"),
                                          (Plan.load, "Plan.from_dict(mapping)")],
                         ids=["Cluster.load", "LlamaConfig.load", "Plan.load"])
def test_a_loader_given_a_mapping_names_what_reads_one(load, reader):
    """``Cluster.load({...})`` said "pass e.g. 'cpu_hetero4'" only; the keys were there, the reader not."""
    with pytest.raises(ConfigError) as e:
        load({"name": "x"})
    assert e.value.fix.endswith(f", or {reader} for a mapping of the file's keys"), e.value


@pytest.mark.parametrize("build, key", [(Cluster.from_config, "cluster"), (LlamaConfig.from_config, "model")],
                         ids=["Cluster.from_config", "LlamaConfig.from_config"])
@pytest.mark.parametrize("value", [None, "abc", 7, [], [1], True], ids=repr)
def test_from_config_refuses_what_is_not_a_mapping(build, key, value):
    with pytest.raises(ConfigError) as e:
        build(value)
    assert e.value.key == key and e.value.fix


def test_llama_config_from_config_names_a_missing_key():
    with pytest.raises(ConfigError, match=r"model.hidden_size = None: a required key is missing") as e:
        LlamaConfig.from_config({"name": "m"})
    assert e.value.fix


@pytest.mark.parametrize("argv", [["plan", f"cluster={'x' * 300}.yaml", "planner.iterations=1"],
                                  ["plan", f"model={'x' * 300}.yaml", "planner.iterations=1"],
                                  ["estimate", "--plan", f"{'x' * 300}.yaml", "cluster=cpu_hetero4"]],
                         ids=["cluster", "model", "plan"])
def test_the_cli_names_a_too_long_file_name(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no such" in err and "Fix:" in err and "Traceback" not in err


FILES = {"cluster": "conf/cluster/cpu2.yaml", "model": "conf/model/llama_tiny.yaml",
         "plan": "conf/plans/hetero3_llama30b_tab7.yaml"}
MARKERS = {"cluster": "machines", "model": "hidden_size", "plan": "pipelines"}


@pytest.mark.parametrize("wanted, load", [("cluster", Cluster.load), ("model", LlamaConfig.load), ("plan", Plan.load)],
                         ids=["Cluster.load", "LlamaConfig.load", "Plan.load"])
@pytest.mark.parametrize("given", sorted(FILES))
def test_a_file_of_another_kind_is_named_as_that_kind(wanted, load, given):
    """A plan file given as the cluster was "cluster.num_layers = 60: no such key in ClusterConfig", the
    first key the schema did not know; it is now named for what it is, with where it belongs."""
    if given == wanted:
        load(FILES[given])  # the right kind still loads
        return
    with pytest.raises(ConfigError) as e:
        load(FILES[given])
    assert (e.value.key, e.value.value) == (wanted, FILES[given])
    assert e.value.rule == f"is a {given} file (it has {MARKERS[given]}:), not a {wanted} file", e.value
    assert e.value.fix == f"give it as the {given} ({given}={FILES[given]}), and a {wanted} file here"


@pytest.mark.parametrize("argv, said", [
    (["plan", f"cluster={FILES['plan']}"], f"cluster = '{FILES['plan']}': is a plan file"),
    (["plan", f"model={FILES['cluster']}"], f"model = '{FILES['cluster']}': is a cluster file"),
    (["estimate", "--plan", FILES["model"]], f"--plan = '{FILES['model']}': is a model file"),
], ids=["plan-cluster", "plan-model", "estimate-plan"])
def test_the_cli_names_a_file_of_another_kind(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_a_missing_path_object_is_shown_as_its_text():
    """It was shown as PosixPath('nope.yaml')."""
    from pathlib import Path

    with pytest.raises(ConfigError, match=r"^cluster = 'nope\.yaml': no such preset or file"):
        Cluster.load(Path("nope.yaml"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["discover", "profile"])
def test_the_model_flag_is_named_as_typed_with_the_closest_preset(command, capsys):
    """It was keyed 'model' and said did you mean 'llama_tiny'? (the recipe's key, the API's form)."""
    assert main([command, "--local", "2", "--model", "lama_tiny"]) == 2
    err = capsys.readouterr().err
    assert ("--model = 'lama_tiny': no such preset or file. Fix: did you mean --model llama_tiny? (or use a path "
            "or one of: ") in err, err


@pytest.mark.parametrize("key, written_as", [
    ("--model", "--model llama_tiny"), ("model", "model=llama_tiny"),
    ("LlamaLitModule(config)", "LlamaLitModule(config='llama_tiny')"),
])
def test_a_value_is_written_as_its_key_takes_it(key, written_as):
    from lightning_hexiscale.config.suggest import written

    assert written(key, "llama_tiny") == written_as


@pytest.mark.parametrize("key, load, fix", [
    ("--model", lambda v: LlamaConfig.load(v, key="--model"), "did you mean --model llama_tiny?"),
    ("LlamaLitModule(config)", lambda v: _lit(v), "did you mean LlamaLitModule(config='llama_tiny')?"),
], ids=["flag", "LlamaLitModule"])
def test_a_misspelled_model_is_keyed_by_what_named_it(key, load, fix):
    """LlamaLitModule('lama_tiny') was keyed 'model' (the recipe's key); discover's --model was re-keyed
    by rewriting the API's fix text with a regex."""
    with pytest.raises(ConfigError) as e:
        load("lama_tiny")
    assert (e.value.key, e.value.value) == (key, "lama_tiny") and e.value.fix.startswith(fix), e.value


def test_a_plan_file_given_to_the_model_flag_is_keyed_by_the_flag():
    with pytest.raises(ConfigError) as e:
        LlamaConfig.load(FILES["plan"], key="--model")
    assert (e.value.key, e.value.rule) == ("--model", "is a plan file (it has pipelines:), not a model file")


def _lit(value):
    from lightning_hexiscale.lightning.example import LlamaLitModule

    return LlamaLitModule(value)


@pytest.mark.parametrize("key, load, resume, use", [
    ("model", lambda v: LlamaConfig.load(v), "resume it with trainer.resume=", "use model=hf:OUT"),
    ("--model", lambda v: LlamaConfig.load(v, key="--model"), None, "use --model hf:OUT"),
    ("LlamaLitModule(config)", lambda v: _lit(v), "resume it with trainer.fit(..., ckpt_path=",
     "use LlamaLitModule(config='hf:OUT')"),
], ids=["recipe", "flag", "LlamaLitModule"])
def test_a_checkpoint_given_as_a_hugging_face_model_is_answered_in_the_callers_words(tmp_path, key, load, resume, use):
    """The fixes said model=hf:OUT and trainer.resume= whoever had called (LlamaLitModule, discover --model)."""
    (tmp_path / "COMPLETE").write_text("")
    with pytest.raises(ConfigError) as e:
        load(f"hf:{tmp_path}")
    assert e.value.key == key and e.value.fix.endswith(use), e.value
    assert e.value.fix.startswith(resume) if resume else e.value.fix.startswith("turn it into one"), e.value


@pytest.mark.parametrize("key, fix", [("trainer.weights", "give the directory: trainer.weights={d}"),
                                      ("model", "give the directory: model=hf:{d}"),
                                      ("LlamaLitModule(config)", "give the directory: LlamaLitModule(config='hf:{d}')")])
def test_a_weights_file_given_as_the_directory_names_the_directory_as_the_key_takes_it(tmp_path, key, fix):
    from lightning_hexiscale.config.hf_model import read_hf_config

    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(ConfigError) as e:
        read_hf_config(tmp_path / "model.safetensors", key)
    assert e.value.key == key and e.value.fix == fix.format(d=tmp_path), e.value


def _strategy(**kwargs):
    from lightning_hexiscale.lightning import HexiScaleStrategy

    return HexiScaleStrategy(**kwargs)


@pytest.mark.parametrize("load, given, key, fix", [
    (lambda v: LlamaConfig.load(v, key="--model"), "plan", "--model",
     "give it as the plan (hexiscale train plan={f}), and a model file here"),
    (lambda v: Plan.load(v, "--plan"), "cluster", "--plan", "give it as the cluster (cluster={f}), and a plan file here"),
    (lambda v: _strategy(cluster=v), "plan", "HexiScaleStrategy(cluster)",
     "give it as the plan (HexiScaleStrategy(plan='{f}')), and a cluster file here"),
    (lambda v: _strategy(plan=v), "model", "HexiScaleStrategy(plan)",
     "give it as the model (LlamaLitModule(config='{f}')), and a plan file here"),
    (_lit, "cluster", "LlamaLitModule(config)",
     "give it as the cluster (HexiScaleStrategy(cluster='{f}')), and a model file here"),
], ids=["discover-model-flag", "estimate-plan-flag", "strategy-cluster", "strategy-plan", "LlamaLitModule"])
def test_a_file_of_another_kind_is_sent_where_it_belongs_in_the_callers_words(load, given, key, fix):
    """The fix said plan=p.yaml (the recipe's override) to discover's --model, which has no plan, and
    to HexiScaleStrategy(cluster=...), whose sibling is HexiScaleStrategy(plan=...)."""
    with pytest.raises(ConfigError) as e:
        load(FILES[given])
    assert (e.value.key, e.value.fix) == (key, fix.format(f=FILES[given])), e.value


def test_a_misspelled_cluster_preset_is_written_as_the_strategy_takes_it():
    with pytest.raises(ConfigError) as e:
        _strategy(cluster="hetro3")
    assert e.value.key == "HexiScaleStrategy(cluster)", e.value
    assert e.value.fix.startswith("did you mean HexiScaleStrategy(cluster='hetero3')?"), e.value
