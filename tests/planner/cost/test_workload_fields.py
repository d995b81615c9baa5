"""Workload checks every field where it is built: a ConfigError naming it. dtype='abc' was KeyError
'abc' from inside estimate(), reserve_bytes='1 GiB' a TypeError in the memory terms, fast_path=None an
AttributeError, memory_headroom=None a TypeError from the comparison; reserve_bytes=nan or a negative
optimizer state were priced silently."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload, estimate

TINY = LlamaConfig.load("llama_tiny")


@pytest.mark.parametrize("kwargs, key", [
    ({"dtype": "abc"}, "Workload(dtype)"),
    ({"dtype": None}, "Workload(dtype)"),
    ({"param_dtype": "fp8"}, "Workload(param_dtype)"),
    ({"param_dtype": ["fp32"]}, "Workload(param_dtype)"),
    ({"optimizer_bytes_per_param": -1}, "Workload(optimizer_bytes_per_param)"),
    ({"optimizer_bytes_per_param": float("nan")}, "Workload(optimizer_bytes_per_param)"),
    ({"optimizer_bytes_per_param": "12"}, "Workload(optimizer_bytes_per_param)"),
    ({"reserve_bytes": "1 GiB"}, "Workload(reserve_bytes)"),
    ({"reserve_bytes": float("inf")}, "Workload(reserve_bytes)"),
    ({"reserve_bytes": True}, "Workload(reserve_bytes)"),
    ({"comm_buffer_bytes": None}, "Workload(comm_buffer_bytes)"),
    ({"comm_buffer_bytes": -1.0}, "Workload(comm_buffer_bytes)"),
    ({"memory_headroom": None}, "train.memory_headroom"),
    ({"memory_headroom": "0.1"}, "train.memory_headroom"),
    ({"fast_path": None}, "Workload(fast_path)"),
    ({"fast_path": "on"}, "Workload(fast_path)"),
    ({"allow_tf32": "yes"}, "Workload(allow_tf32)"),
    ({"allow_table_mismatch": 1}, "Workload(allow_table_mismatch)"),
])
def test_a_bad_workload_field_is_a_config_error(kwargs, key):
    with pytest.raises(ConfigError) as e:
        Workload(TINY, **kwargs)
    assert e.value.key == key and e.value.fix, e.value


def test_a_workload_of_no_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"Workload\(model\) = 'llama_tiny': is of type str; it must be a LlamaConfig"):
        Workload("llama_tiny")


def test_good_fields_still_price():
    import numpy as np

    w = Workload(TINY, dtype="fp32", param_dtype=None, optimizer_bytes_per_param=np.float64(8), reserve_bytes=0,
                 comm_buffer_bytes=0.0, memory_headroom=0.1)
    est = estimate(Plan.load("tests/bad_configs/good_tiny_plan.yaml"), Cluster.load("cpu_hetero4"), w)
    assert est.iteration_time_s > 0
