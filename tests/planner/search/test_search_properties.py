"""The planner never crashes: property tests over random clusters and models.

Hypothesis draws clusters of 1-16 devices on 1-4 machines (any GPU type of the catalog, bandwidths
from 0.1 GB/s Ethernet to NVLink, optional per machine-pair links) and LLaMA shapes from 0.1 M to
~70 B parameters, with a global batch of 1-64. For every draw ``search`` either returns a plan that
validates against the cluster, the model and the batch and fits in memory by the cost model's own
estimate, or raises :class:`InfeasiblePlan` whose message says what is needed and what the cluster
has. Anything else (another exception, a plan that does not validate or does not fit) is a bug.
The same seed gives the same plan.

Kept bounded: few planner iterations per draw and 60 draws (80-150 s on a 2-core host since the
search also ranges over device subsets; the timeout is 300 s).
"""

from __future__ import annotations

import pytest

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hexiscale.config import catalog
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, estimate, search

GPU_TYPES = [n for n in catalog.known_names() if not n.startswith("CPU")]
ITERATIONS = 4


def _bandwidth(gbps: float) -> str:
    return f"{gbps:.3g} GB/s"


@st.composite
def clusters(draw) -> Cluster:
    num_machines = draw(st.integers(1, 4))
    machines = []
    for m in range(num_machines):
        machines.append({
            "name": f"m{m}", "gpu": draw(st.sampled_from(GPU_TYPES)), "count": draw(st.integers(1, 4)),
            "intra_bandwidth": _bandwidth(draw(st.floats(1.0, 900.0))),
            "intra_latency": f"{draw(st.integers(1, 20))}us"})
    links = []
    if num_machines > 1 and draw(st.booleans()):
        a, b = draw(st.lists(st.integers(0, num_machines - 1), min_size=2, max_size=2, unique=True))
        links.append({"machines": [f"m{a}", f"m{b}"], "bandwidth": _bandwidth(draw(st.floats(0.1, 50.0))),
                      "latency": "30us"})
    return Cluster.from_config({
        "name": "random", "machines": machines, "machine_links": links,
        "inter_machine": {"bandwidth": _bandwidth(draw(st.floats(0.1, 50.0))), "latency": "50us"}})


@st.composite
def models(draw) -> LlamaConfig:
    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    hidden = heads * head_dim
    return LlamaConfig(name="random", hidden_size=hidden, num_layers=draw(st.integers(1, 80)), num_heads=heads,
                       num_kv_heads=kv_heads, ffn_hidden_size=draw(st.integers(1, 4)) * hidden,
                       vocab_size=draw(st.sampled_from([256, 32000])), seq_len=draw(st.sampled_from([16, 256, 2048])))


def _plan_or_infeasible(cluster: Cluster, model: LlamaConfig, global_batch: int, seed: int):
    workload = Workload(model)
    try:
        result = search(cluster, workload, global_batch, SearchSettings(recompute=True, iterations=ITERATIONS, seed=seed))
    except InfeasiblePlan as e:
        msg = str(e)
        assert "Fix:" in msg, msg
        most = global_batch * model.num_layers * model.num_kv_heads
        if cluster.num_devices > most:  # more devices than the work can be cut into
            assert f"{cluster.num_devices} devices" in msg and f"at most {most}" in msg, msg
            return None
        assert re.search(r"needs [\d.]+ \w?i?B .* has [\d.]+ \w?i?B", msg), msg
        # Memory must be a credible reason: not when the whole training state (16 bytes per
        # parameter) is under 1% of the smallest device.
        smallest = min(d.memory_bytes for d in cluster.devices)
        assert model.total_params * 16 > 0.01 * smallest, f"{model.total_params} parameters: {msg}"
        return None
    plan = result.plan
    plan.validate(cluster, model, global_batch=global_batch)
    again = estimate(plan, cluster, workload)
    assert again.feasible, [o.message for o in again.out_of_memory]
    assert result.estimate.feasible and again.cost == result.estimate.cost
    return plan


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cluster=clusters(), model=models(), global_batch=st.integers(1, 64), seed=st.integers(0, 3))
def test_search_returns_a_valid_fitting_plan_or_says_what_is_missing(cluster, model, global_batch, seed):
    _plan_or_infeasible(cluster, model, global_batch, seed)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cluster=clusters(), model=models(), global_batch=st.integers(1, 32), seed=st.integers(0, 3))
def test_search_is_deterministic_for_a_seed(cluster, model, global_batch, seed):
    first = _plan_or_infeasible(cluster, model, global_batch, seed)
    second = _plan_or_infeasible(cluster, model, global_batch, seed)
    assert (first is None) == (second is None)
    if first is not None:
        assert first.to_dict() == second.to_dict()


def test_a_model_bigger_than_the_cluster_is_infeasible():
    """Property tests could miss the infeasible branch; this draw cannot: 70 B parameters x 16
    bytes of training state = 1.1 TB against 2 x 24 GB."""
    cluster = Cluster.from_config({"name": "two_4090", "machines": [{"gpu": "RTX4090", "count": 2,
                                                                     "intra_bandwidth": "32 GB/s"}],
                                   "inter_machine": {"bandwidth": "1 GB/s"}})
    assert _plan_or_infeasible(cluster, LlamaConfig.load("llama2_70b"), 8, 0) is None
