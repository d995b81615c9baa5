"""The oracle under ``recompute: auto`` is the optimum over a recompute flag per pipeline, the space
the search plans in (planner/search/recompute.py): it equals the brute force with every flag of
every pipeline, and where one pipeline fits only with recomputation and another runs faster
without it, it finds the mixed plan, strictly faster than both plans of one flag for all."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, estimate, search
from lightning_hexiscale.planner.oracle.exact import OracleSettings, oracle
from oracle_reference import brute_force
from test_oracle import tiny_case


@pytest.mark.parametrize("seed", range(12))
def test_auto_equals_the_brute_force_over_every_flag_per_pipeline(seed):
    cluster, workload, batch, settings = tiny_case(seed)
    best, _, _ = brute_force(cluster, workload, batch, settings.schedule, "auto")
    res = oracle(cluster, workload, batch, replace(settings, recompute="auto"))
    assert res.complete
    if math.isinf(best):
        assert res.status == "infeasible"
        return
    assert res.status == "optimal"
    assert res.estimate.cost == pytest.approx(best, rel=1e-9)
    assert estimate(res.plan, cluster, workload).cost == res.estimate.cost


def roomy_and_tight():
    """A roomy fast device beside a slow one whose 2.5 MiB hold the 2-layer model only when it
    recomputes: the best plan is two pipelines, the roomy one without recomputation."""
    model = LlamaConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                        vocab_size=128, seq_len=256)
    workload = Workload(model, reserve_bytes=0.0, device="cpu", comm_buffer_bytes=32 * 1024)
    cluster = Cluster.from_config({
        "name": "roomy_and_tight",
        "gpu_types": {"BIG": {"flops": "2 TFLOPS", "memory": "100 MiB"}, "TIGHT": {"flops": "1 TFLOPS", "memory": "2.5 MiB"}},
        "machines": [{"name": "a", "gpu": "BIG", "count": 1, "intra_bandwidth": "20 GB/s"},
                     {"name": "b", "gpu": "TIGHT", "count": 1, "intra_bandwidth": "20 GB/s"}],
        "inter_machine": {"bandwidth": "3 GB/s", "latency": "20us"}})
    return cluster, workload, 4


def test_auto_finds_the_mixed_plan_that_beats_one_flag_for_all():
    cluster, workload, batch = roomy_and_tight()
    off = oracle(cluster, workload, batch, OracleSettings(recompute=False))
    on = oracle(cluster, workload, batch, OracleSettings(recompute=True))
    auto = oracle(cluster, workload, batch, SearchSettings(recompute="auto"))  # as `hexiscale plan --optimum` asks
    assert off.complete and on.complete and auto.complete
    assert auto.plan.recomputes in ((False, True), (True, False))
    assert auto.cost < min(off.cost, on.cost) * (1 - 0.05)  # 0.385 ms against 0.453 ms (off) and 0.492 ms (on)
    assert auto.cost == pytest.approx(brute_force(cluster, workload, batch, "1f1b", "auto")[0], rel=1e-9)
    # the search plans in the same space and cannot beat the optimum
    found = search(cluster, workload, batch, SearchSettings(recompute="auto", progress=False))
    assert found.estimate.cost >= auto.cost * (1 - 1e-9)


def test_an_incumbent_outside_the_flags_asked_for_is_not_taken():
    """An incumbent only prunes: one with recomputation off must not become the answer of a
    recompute-on oracle."""
    cluster, workload, batch = roomy_and_tight()
    mixed = oracle(cluster, workload, batch, OracleSettings(recompute="auto")).plan
    on = oracle(cluster, workload, batch, OracleSettings(recompute=True), incumbent=mixed)
    assert on.plan.recomputes == (True,) * on.plan.num_pipelines
    assert on.cost == oracle(cluster, workload, batch, OracleSettings(recompute=True)).cost


def test_recompute_must_be_a_flag_or_auto():
    with pytest.raises(ConfigError, match="train.recompute.*true, false or auto"):
        OracleSettings(recompute="sometimes")
