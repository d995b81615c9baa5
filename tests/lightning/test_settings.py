"""StrategySettings: the strategy's keyword arguments, checked once into one frozen value (issue 42, item 6)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import re
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.launch.elastic import ElasticSettings
from lightning_hexiscale.lightning.plan_check import DEFAULT_WARMUP
from lightning_hexiscale.lightning.plan_resolution import AUTO
from lightning_hexiscale.lightning.settings import StrategySettings
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from strategy_helpers import plan_of

DDP_ARGUMENTS = {"self", "process_group_backend", "accelerator", "parallel_devices", "cluster_environment",
                 "checkpoint_io", "precision_plugin"}
"""The constructor's arguments that go to DDPStrategy as they are."""


def test_the_constructor_takes_every_setting_with_the_same_default():
    """A setting added to the dataclass but not to the constructor (or with another default) fails here."""
    params = {n: p.default for n, p in inspect.signature(HexiScaleStrategy.__init__).parameters.items()
              if n not in DDP_ARGUMENTS}
    fields = {f.name: f.default for f in dataclasses.fields(StrategySettings)}
    assert params == fields


def test_the_strategy_stores_the_settings_it_built():
    strategy = HexiScaleStrategy(nonfinite="skip", timeout=30, plan_check=True, seed=3, schedule="gpipe",
                                 micro_batch_size=2, compile=False)
    s = strategy.settings
    assert s == StrategySettings(nonfinite="skip", timeout=30, plan_check=True, seed=3, schedule="gpipe",
                                 micro_batch_size=2, compile=False)
    assert s.timeout == timedelta(seconds=30) and strategy._timeout == timedelta(seconds=30)
    assert s.plan_check == DEFAULT_WARMUP and strategy.plan_check == DEFAULT_WARMUP
    assert s.seed == 3 and s.cluster == AUTO and strategy.cluster is None and strategy.plan is None
    assert isinstance(s.fast_path, FastPath) and s.fast_path.compile is False and strategy.fast_path is s.fast_path
    assert strategy.nonfinite == "skip" and strategy.watchdog_grace_s == 5.0
    assert s.overrides == {"micro_batch_size": 2, "schedule": "gpipe", "recompute": None, "dp_sharding": None}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.nonfinite = "stop"


def test_settings_survive_pickling_and_rebuilding(monkeypatch):
    """The strategy travels to spawned ranks by pickle: the built (normalised) values come back as
    they are, and building again from them gives the same settings."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    s = StrategySettings(cluster="cpu2", timeout=12.5, elastic="ckpt", plan_check=None, fast_path=False)
    assert s.seed == 11 and s.elastic == ElasticSettings(checkpoint_dir="ckpt") and s.cluster.name == "cpu2"
    for again in (pickle.loads(pickle.dumps(s)),
                  StrategySettings(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})):
        assert again.cluster.name == "cpu2"  # a Cluster compares by identity
        assert dataclasses.replace(again, cluster=s.cluster) == s


PLAN = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])

BAD = {  # case: (arguments, the argument named, a piece of the rule)
    "timeout": ({"timeout": 0}, "timeout", "positive number of seconds"),
    # each reached torch.distributed unchecked, or was an OverflowError/ValueError traceback
    "timeout_string": ({"timeout": "600"}, "timeout", "positive number of seconds"),
    "timeout_inf": ({"timeout": float("inf")}, "timeout", "positive number of seconds"),
    "timeout_nan": ({"timeout": float("nan")}, "timeout", "positive number of seconds"),
    "timeout_negative_timedelta": ({"timeout": timedelta(seconds=-1)}, "timeout", "positive timedelta"),
    "watchdog_grace_s_nan": ({"watchdog_grace_s": float("nan")}, "watchdog_grace_s", "positive number of seconds"),
    "async_checkpoint": ({"async_checkpoint": "yes"}, "async_checkpoint", "True or False"),
    "nonfinite": ({"nonfinite": "ignore"}, "nonfinite", "must be one of"),
    "schedule": ({"schedule": "zigzag"}, "schedule", "must be one of"),
    "dp_sharding": ({"dp_sharding": "zero4"}, "dp_sharding", "must be one of"),
    "global_batch": ({"global_batch": 0}, "global_batch", "positive integer"),
    "micro_batch_size": ({"micro_batch_size": 1.5}, "micro_batch_size", "positive integer"),
    "micro_batch_size_zero": ({"micro_batch_size": 0}, "micro_batch_size", "positive integer"),
    # the search refused it only after the launch, in every rank (the recipe's "must divide" rule)
    "micro_batch_size_not_dividing": ({"cluster": "cpu2", "global_batch": 8, "micro_batch_size": 3},
                                      "micro_batch_size", "must divide global_batch=8"),
    "num_threads": ({"num_threads": 0}, "num_threads", "'auto' or an integer"),
    "use_all_devices": ({"use_all_devices": "yes"}, "use_all_devices", "True or False"),
    "cluster_type": ({"cluster": 123}, "cluster", "is of type int; it must be a preset name, a cluster YAML path"),
    "cluster_missing": ({"cluster": "nonexistent"}, "cluster", "no such preset"),
    "plan_type": ({"plan": 1.5}, "plan", "is of type float; it must be a plan file path"),
    "plan_check": ({"plan_check": -1}, "plan_check", "warm-up steps"),
    "compile": ({"compile": "yes"}, "compile", "True, False or None"),
    "elastic_with_plan": ({"cluster": "cpu2", "plan": PLAN, "elastic": "ckpt"}, "plan", "a fixed plan cannot"),
    "elastic_without_cluster": ({"elastic": "ckpt"}, "cluster", "needs one"),
    # checks the constructor did not make before the settings (each was a later failure, or none)
    "start_method": ({"start_method": "thread"}, "start_method", "must be one of"),
    "planner_iterations": ({"planner_iterations": 0}, "planner_iterations", "integer from 1 to 100,000"),
    "seed": ({"seed": "1"}, "seed", "a non-negative integer or None"),
    # the plan search's generators take none: the search's 'planner.seed' error, after the ranks started
    "seed_negative": ({"seed": -1}, "seed", "a non-negative integer or None"),
    "elastic_type": ({"elastic": 7}, "elastic", "is of type int; it must be None, a checkpoint directory"),
    "watchdog_grace_s": ({"watchdog_grace_s": 0}, "watchdog_grace_s", "positive number of seconds"),
    "check_devices": ({"check_devices": "no"}, "check_devices", "True or False"),
    "watchdog": ({"watchdog": 1}, "watchdog", "True or False"),
    "recompute": ({"recompute": "sometimes"}, "recompute", "True, False, 'auto' or None"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_setting_names_its_argument(case):
    kwargs, key, rule = BAD[case]
    pattern = rf"^HexiScaleStrategy\({key}\) = .*: .*{re.escape(rule)}.*Fix: "
    with pytest.raises(ConfigError, match=pattern):
        StrategySettings(**kwargs)
    with pytest.raises(ConfigError, match=pattern) as e:  # the same error from the constructor users call
        HexiScaleStrategy(**kwargs)
    assert e.value.fix and e.value.fix.lower() not in ("fix it", "fix it."), e.value  # a real fix, not a placeholder


@pytest.mark.parametrize("text", ["abc", "-3", "1.5"])
def test_a_bad_global_seed_in_the_environment_is_named(monkeypatch, text):
    """``seed=None`` takes Lightning's PL_GLOBAL_SEED: one that is no seed was int()'s ValueError
    traceback (or, negative, the search's error once the ranks had started)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", text)
    with pytest.raises(ConfigError, match=rf"^PL_GLOBAL_SEED = '{re.escape(text)}': must be a non-negative "
                                          r"integer .* Fix: unset it, or pass seed=0"):
        HexiScaleStrategy()
    assert HexiScaleStrategy(seed=4).settings.seed == 4  # an explicit seed does not read it
    monkeypatch.setenv("PL_GLOBAL_SEED", " ")
    assert HexiScaleStrategy().settings.seed == 0


def test_a_misspelled_preset_names_the_closest_one():
    """The API's loaders listed every preset; the commands already said "did you mean"."""
    from lightning_hexiscale import Cluster
    from lightning_hexiscale.models.config import LlamaConfig

    for load, wrong, meant in ((lambda v: HexiScaleStrategy(cluster=v), "hetro3", "HexiScaleStrategy(cluster='hetero3')"),
                               (Cluster.load, "cpu_hetro4", "'cpu_hetero4'"), (LlamaConfig.load, "lama_tiny", "'llama_tiny'")):
        with pytest.raises(ConfigError) as ei:
            load(wrong)
        assert ei.value.fix.startswith(f"did you mean {meant}? (or use a path or one of: "), ei.value
    with pytest.raises(ConfigError) as ei:
        Cluster.load("zzz")
    assert ei.value.fix.startswith("use a path or one of: ") and "did you mean" not in ei.value.fix, ei.value


def test_an_objects_long_repr_is_not_the_value_shown():
    with pytest.raises(ConfigError, match=r"^HexiScaleStrategy\(cluster\) = 'Path_': is of type Path_"):
        HexiScaleStrategy(cluster=type("Path_", (), {"__repr__": lambda self: "x" * 500})())


def test_a_mapping_of_a_files_keys_is_read_as_the_file(tmp_path):
    """``HexiScaleStrategy(cluster=cfg.cluster)`` in a Hydra app (a DictConfig), or a dict: it was
    refused as "= 'DictConfig': must be a preset name, a cluster YAML path, a Cluster or None"."""
    from omegaconf import OmegaConf

    from lightning_hexiscale import Cluster, Plan

    keys = {"name": "two_a100", "machines": [{"gpu": "A100", "count": 2, "intra_bandwidth": "100 GB/s"}],
            "inter_machine": {"bandwidth": "1 GB/s"}}
    (tmp_path / "two.yaml").write_text(OmegaConf.to_yaml(keys))
    from_file = Cluster.load(str(tmp_path / "two.yaml"))
    for given in (keys, OmegaConf.create(keys)):
        cluster = HexiScaleStrategy(cluster=given).cluster
        assert isinstance(cluster, Cluster) and cluster.name == "two_a100"
        assert [d.gpu_type for d in cluster.devices] == [d.gpu_type for d in from_file.devices]
    plan_file = Path(__file__).resolve().parents[2] / "conf" / "plans" / "hetero3_llama30b_tab7.yaml"
    keys = OmegaConf.to_container(OmegaConf.load(plan_file))
    for given in (keys, OmegaConf.create(keys)):
        strategy = HexiScaleStrategy(plan=given)
        assert strategy.plan == Plan.load(plan_file) and strategy.cluster.name == "hetero3"


@pytest.mark.parametrize("kwargs, message", [
    ({"cluster": {"machines": [{"gpu": "A100", "count": 0}]}}, r"^cluster\.machines\[0\]\.count = 0: .*1 to 1024"),
    ({"plan": {"num_layers": 4}}, r"^plan\.pipelines = None: required key is missing"),
])
def test_a_mappings_faults_are_named_as_a_files_are(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HexiScaleStrategy(**kwargs)


def test_micro_batch_size_not_dividing_says_which_divisors_would():
    with pytest.raises(ConfigError, match=r"global_batch=8\. Fix: choose a divisor .*\(e\.g\. 1, 2, 4, 8\)"):
        HexiScaleStrategy(cluster="cpu2", global_batch=8, micro_batch_size=3)
    assert HexiScaleStrategy(cluster="cpu2", global_batch=8, micro_batch_size=4).settings.micro_batch_size == 4


def test_micro_batch_size_not_dividing_a_pipeline_batch_of_the_plan_is_refused_at_construction():
    """The plan's pipelines have batches 3 and 1: every rank refused micro_batch_size=3 at setup."""
    plan = Path(__file__).resolve().parents[1] / "bad_configs" / "good_tiny_plan.yaml"
    with pytest.raises(ConfigError, match=r"^HexiScaleStrategy\(micro_batch_size\) = 3: must divide every pipeline's "
                                          r"batch of the plan: pipeline 1's batch_size is 1\. Fix: .*\(1\)"):
        HexiScaleStrategy(cluster="cpu_hetero4", plan=str(plan), micro_batch_size=3)
    assert HexiScaleStrategy(cluster="cpu_hetero4", plan=str(plan), micro_batch_size=1).settings.micro_batch_size == 1


def test_search_settings_beside_a_plan_are_named_as_ignored():
    """planner_iterations / use_all_devices set the search, which a given plan skips: they were dropped
    without a word; now a UserWarning names them. Their defaults beside a plan say nothing (a default
    cannot be told from no value)."""
    import warnings

    plan = Path(__file__).resolve().parents[1] / "bad_configs" / "good_tiny_plan.yaml"
    for kwargs in ({"planner_iterations": 5}, {"use_all_devices": True}):
        (name, value), = kwargs.items()
        with pytest.warns(UserWarning, match=rf"^HexiScaleStrategy\({name}\) = {value} is ignored: it sets the "
                                             r"planner's search, which a given plan skips.*or pass plan=None"):
            assert HexiScaleStrategy(cluster="cpu_hetero4", plan=str(plan), **kwargs).settings.plan is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert HexiScaleStrategy(cluster="cpu_hetero4", **kwargs).settings.plan is None  # no plan: the search's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HexiScaleStrategy(cluster="cpu_hetero4", plan=str(plan), planner_iterations=20).settings.plan is not None


@pytest.mark.parametrize("backend", ["mpi2", "", "cpu:gloo,cpu:mpi", "cpu-gloo:x", 3])
def test_an_unknown_process_group_backend_is_refused_at_construction(backend):
    """torch.distributed takes any backend name with a warning, and every rank then failed in
    init_process_group after the launch."""
    with pytest.raises(ConfigError, match=r"^HexiScaleStrategy\(process_group_backend\) = .*: must be None, one of "
                                          r"gloo, .*'cpu:gloo,cuda:nccl'.*Fix: "):
        HexiScaleStrategy(cluster="cpu2", process_group_backend=backend)


@pytest.mark.parametrize("backend", [None, "gloo", "GLOO", "nccl", "mpi", "ucc", "cpu:gloo,cuda:nccl", "cpu:gloo"])
def test_the_backends_torch_knows_are_accepted(backend):
    assert HexiScaleStrategy(cluster="cpu2", process_group_backend=backend)._process_group_backend == backend
