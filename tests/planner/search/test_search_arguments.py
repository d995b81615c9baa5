"""search(cluster, workload, global_batch, settings) called from Python with arguments of the wrong
type: one ConfigError naming the setting, before any search (they were TypeErrors from comparisons
or numpy, AttributeErrors from inside the search, or silently taken: iterations=True ran 1)."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search


@pytest.mark.parametrize("kwargs,key", [
    ({"iterations": 2.5}, "planner.iterations"),     # TypeError: 'float' object cannot be interpreted as an integer
    ({"iterations": "3"}, "planner.iterations"),     # TypeError: '<' not supported
    ({"iterations": True}, "planner.iterations"),    # ran one iteration
    ({"seed": "a"}, "planner.seed"),
    ({"seed": 1.5}, "planner.seed"),                 # numpy's SeedSequence TypeError
    ({"tau": 1.5}, "planner.tau"),                   # accepted
    ({"max_pipelines": 1.5}, "planner.max_pipelines"),
    ({"balance": "x"}, "planner.balance"),
    ({"progress": "no"}, "planner.progress"),        # drew a progress bar
    ({"tp_degrees": 2}, "tp_degrees"),               # TypeError: 'int' object is not iterable
    ({"tp_degrees": (True,)}, "tp_degrees"),         # ran TP 1
])
def test_settings_of_the_wrong_type_name_their_key(kwargs, key):
    with pytest.raises(ConfigError) as ei:
        SearchSettings(**kwargs)
    assert ei.value.key == key, ei.value


def test_search_arguments_of_the_wrong_type_are_named():
    cluster, workload = Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny"))
    for args, key in (((cluster, workload, 8, {"iterations": 2}), "search(settings)"),
                      (("cpu_hetero4", workload, 8, None), "search(cluster)"),
                      ((cluster, workload.model, 8, None), "search(workload)")):
        with pytest.raises(ConfigError) as ei:  # AttributeError: 'dict' object has no attribute 'recompute'
            search(*args)
        assert ei.value.key == key, ei.value
    assert SearchSettings(tp_degrees=[2]).tp_degrees == (2,)  # a list reads as the tuple (hashable)


def test_tp_degrees_no_group_can_have_are_refused_with_the_limits():
    """cpu2 has 2 devices and llama_tiny 2 KV heads: TP 3 or 16 forms no stage. The search said
    "no plan fits in memory ... the activations do not fit", which is not the reason."""
    cluster, workload = Cluster.load("cpu2"), Workload(LlamaConfig.load("llama_tiny"))
    for degrees in ((3,), (16, 4)):
        with pytest.raises(ConfigError) as ei:
            search(cluster, workload, 8, SearchSettings(progress=False, tp_degrees=degrees))
        assert ei.value.key == "tp_degrees" and "KV heads" in str(ei.value) and "from 1 to 2" in str(ei.value)
    assert search(cluster, workload, 8, SearchSettings(progress=False, tp_degrees=(2, 3))).plan.pipelines[0].stages[0].tp == 2


@pytest.mark.parametrize("kwargs,key", [
    ({"iterations": 2**70}, "planner.iterations"),             # a search that never ended
    ({"balance": float("inf")}, "planner.balance"),            # taken as a bound: any partition passed
    ({"group_balance": float("inf")}, "planner.group_balance"),
    ({"micro_batch_size": "abc"}, "train.micro_batch_size"),   # taken; a TypeError inside the search
    ({"micro_batch_size": -1}, "train.micro_batch_size"),
    ({"micro_batch_size": float("nan")}, "train.micro_batch_size"),
    ({"micro_batch_size": []}, "train.micro_batch_size"),
    ({"micro_batch_size": True}, "train.micro_batch_size"),
    ({"micro_batch_size": 2**70}, "train.micro_batch_size"),
])
def test_settings_out_of_range_name_their_key(kwargs, key):
    with pytest.raises(ConfigError) as ei:
        SearchSettings(**kwargs)
    assert ei.value.key == key, ei.value
    assert SearchSettings(iterations=100_000, micro_batch_size=4, balance=1.5).micro_batch_size == 4


def test_a_global_batch_beyond_the_bound_is_named_before_the_search():
    """search(.., 2**70) from Python was an OverflowError from the batch split (the command line,
    the strategy and hexiscale train already refused it before the search)."""
    cluster, workload = Cluster.load("cpu2"), Workload(LlamaConfig.load("llama_tiny"))
    with pytest.raises(ConfigError) as ei:
        search(cluster, workload, 2**70, SearchSettings(progress=False, iterations=1))
    assert ei.value.key == "train.global_batch" and "16,777,216" in str(ei.value), ei.value
