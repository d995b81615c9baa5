"""oracle(cluster, workload, G, settings) called from Python with bad settings or arguments: one
ConfigError naming the key before any enumeration. micro_batch_size=0 / max_pipelines=0 read as
'none given', True as 1, a micro-batch not dividing G returned complete=True with no plan
('infeasible'), and a dict / a cluster name / a string time limit were AttributeErrors/TypeErrors."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload
from lightning_hexiscale.planner.oracle import OracleSettings, oracle


@pytest.mark.parametrize("kwargs,key", [
    ({"micro_batch_size": 0}, "train.micro_batch_size"),
    ({"micro_batch_size": True}, "train.micro_batch_size"),
    ({"max_pipelines": 0}, "planner.max_pipelines"),
    ({"max_pipelines": 1.5}, "planner.max_pipelines"),
    ({"use_all_devices": "yes"}, "planner.use_all_devices"),
])
def test_oracle_settings_of_the_wrong_kind_name_their_key(kwargs, key):
    with pytest.raises(ConfigError) as ei:
        OracleSettings(**kwargs)
    assert ei.value.key == key, ei.value


def test_oracle_arguments_are_checked_before_the_enumeration():
    cluster, workload = Cluster.load("cpu_hetero4"), Workload(LlamaConfig.load("llama_tiny"))
    for args, kwargs, key in (((cluster, workload, 8, OracleSettings(micro_batch_size=3)), {}, "train.micro_batch_size"),
                              (("cpu_hetero4", workload, 8), {}, "oracle(cluster)"),
                              ((cluster, workload.model, 8), {}, "oracle(workload)"),
                              ((cluster, workload, 8, {"recompute": True}), {}, "oracle(settings)"),
                              ((cluster, workload, 8), {"time_limit_s": "60"}, "time_limit_s")):
        with pytest.raises(ConfigError) as ei:
            oracle(*args, **kwargs)
        assert ei.value.key == key, ei.value


def test_a_global_batch_past_the_oracles_tables_is_refused():
    """G = 4,194,304 (a batch typed in tokens) ran past its 10 s time limit for minutes: the tables of
    every (micro-batch size, count) pair are built before the limit is first checked."""
    import signal

    def stop(*_):
        raise TimeoutError("the oracle did not answer within 30 s at a time limit of 1 s")

    cluster, workload = Cluster.load("cpu2"), Workload(LlamaConfig.load("llama_tiny"))
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(30)
    try:
        with pytest.raises(ConfigError) as ei:
            oracle(cluster, workload, 4_194_304, time_limit_s=1.0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert ei.value.key == "train.global_batch" and "at most 65,536 sequences" in str(ei.value), ei.value
