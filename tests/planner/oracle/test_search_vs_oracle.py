"""The default search against the true optimum (planner/oracle/exact.py) on 40 random heterogeneous
clusters (planner/oracle/cases.py: 2-8 GPUs on 1-4 machines, 12-96 GiB catalog GPUs, 16-400 GB/s inside
machines, 0.5-25 GB/s between, 8-layer 7B / 13B shapes, batches 8-32): at least 0.97 of the
optimum's throughput on every case, and infeasible exactly when the oracle proves nothing fits.

The optimum is over every subset of the devices (the rest idle), so this is also the property of
subset-aware planning: the search's plan for a cluster never loses to the best plan of any subset of
it by more than the 3 % tolerance. (With ``use_all_devices=True`` the search loses on the cases whose
optimum leaves devices idle, e.g. seed 5: 0.89 of the optimum.)

The oracle starts from the search's plan (an incumbent only prunes; the optimum is proven either
way) and must complete within its time limit: a case it cannot finish would prove nothing.
The 40 cases took 133 s in one process on 2 cores on 2026-12-03 (`pytest -n 0 -k default_search`;
the 50 s written here earlier no longer holds; the cause was not looked into)."""

from __future__ import annotations

import pytest

from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.planner.oracle.cases import random_case
from lightning_hexiscale.planner.oracle.exact import oracle
from lightning_hexiscale.planner import SearchSettings, search

SEEDS = range(40)
TARGET = 0.97


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_default_search_reaches_97_percent_of_the_oracle(seed):
    search_vs_oracle(seed, True)


AUTO_SEEDS = [14, 23, 25, 30]
"""Under ``recompute: auto`` (the default): the four of the 40 cases where the search's plan is not
the optimum's, seed 25 with mixed flags ([off, on, off, on]; the optimum [off, off, on], 0.996).
All 40 pass too (>= 0.984, 160 s on 2 cores): these four keep the suite short."""


@pytest.mark.slow
@pytest.mark.parametrize("seed", AUTO_SEEDS)
def test_auto_search_reaches_97_percent_of_the_per_pipeline_oracle(seed):
    search_vs_oracle(seed, "auto")


def search_vs_oracle(seed: int, recompute) -> None:
    cluster, workload, batch = random_case(seed)
    try:
        found = search(cluster, workload, batch, SearchSettings(recompute=recompute, progress=False))
    except InfeasiblePlan:
        found = None
    best = oracle(cluster, workload, batch, SearchSettings(recompute=recompute), time_limit_s=120.0,
                  incumbent=found.plan if found else None)
    assert best.complete, f"the oracle did not finish seed {seed}: {best.stats}"
    if found is None:
        assert best.status == "infeasible", f"the search found nothing, the oracle {best.estimate.cost:.4f} s"
        return
    found.plan.validate(cluster, workload.model, global_batch=batch)
    ratio = best.estimate.cost / found.estimate.cost
    assert ratio >= TARGET, (f"seed {seed}: search {found.estimate.cost:.4f} s, optimum {best.estimate.cost:.4f} s "
                             f"({ratio:.3f}; the optimum leaves {list(best.plan.idle_devices)} idle)\n"
                             f"{found.plan.table(cluster)}\n{best.plan.table(cluster)}")
    assert found.plan.launch_order == tuple(range(cluster.num_devices))  # every idle device named


def test_a_device_goes_idle_under_another_sharding():
    """Four identical 2 MiB devices on one machine, a 2-layer model at global batch 2, no
    recomputation: the optimum runs the whole model on one device under ZeRO-2 (0.160 ms). The
    search's best layout, a two-stage pipeline under ZeRO-3 (0.192 ms, 0.83 of the optimum), was a
    local optimum: one device alone does not fit under ZeRO-3, and the climb never scored the
    device-idle move under another sharding."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Workload

    cluster = Cluster.from_config({
        "name": "four_tiny", "gpu_types": {"T": {"flops": "0.5 TFLOPS", "memory": "2 MiB"}},
        "machines": [{"name": "m0", "gpu": "T", "count": 4, "intra_bandwidth": "2 GB/s", "intra_latency": "20us"}],
        "calibration": {"theta_ddp": 1.3, "theta_zero2": 1.2, "theta_zero3_fwd": 1.1, "theta_zero3_bwd": 1.0}})
    model = LlamaConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                        vocab_size=128, seq_len=64)
    workload = Workload(model, reserve_bytes=0.0, device="cpu", comm_buffer_bytes=32 * 1024)
    settings = SearchSettings(recompute=False)
    found = search(cluster, workload, 2, settings)
    best = oracle(cluster, workload, 2, settings)
    assert best.complete and best.plan.world_size == 1
    assert best.estimate.cost / found.estimate.cost >= TARGET, (found.plan.table(cluster), best.plan.table(cluster))


SMALL_BATCH_CASES = {
    # 1F1B, global batch 1: one micro-batch in flight, but the drafts assumed one per stage
    "1f1b": ({"T": {"flops": "4 TFLOPS", "memory": "2 MiB"}}, [("m0", 2)], "2 GB/s", "1us",
             dict(num_layers=2, num_kv_heads=1, seq_len=256), "cuda", 1, "1f1b"),
    # GPipe, global batch 4: four micro-batches in flight, but the drafts assumed eight
    "gpipe": ({"S": {"flops": "0.5 TFLOPS", "memory": "2 MiB"}, "F": {"flops": "2 TFLOPS", "memory": "1.5 MiB"}},
              [("m0", 2, "S"), ("m1", 1, "F")], "2 GB/s", "20us",
              dict(num_layers=3, num_kv_heads=4, seq_len=64), "cpu", 4, "gpipe"),
}


@pytest.mark.parametrize("case", sorted(SMALL_BATCH_CASES))
def test_a_small_batch_finds_the_pipelines_that_fit_only_with_few_micro_batches(case):
    """Memory-tight stage chains that fit with the pipeline's own few micro-batches in flight, but
    not with the drafts' assumption (1F1B: one per stage; GPipe: twice the pipeline's share): the
    search said "no plan fits in memory" where the oracle's optimum is a plain pipeline of
    single-device stages (8.98e-05 s and 3.12e-04 s)."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Workload

    types, machines, bw, lat, shape, device, batch, schedule = SMALL_BATCH_CASES[case]
    cluster = Cluster.from_config({
        "name": f"small_batch_{case}", "gpu_types": types,
        "machines": [{"name": m[0], "gpu": m[2] if len(m) > 2 else next(iter(types)), "count": m[1],
                      "intra_bandwidth": bw, "intra_latency": lat} for m in machines],
        "inter_machine": {"bandwidth": "3 GB/s", "latency": "20us"}})
    model = LlamaConfig(name="t", hidden_size=64, num_heads=4, ffn_hidden_size=128, vocab_size=128, **shape)
    workload = Workload(model, reserve_bytes=0.0, device=device, comm_buffer_bytes=32 * 1024)
    settings = SearchSettings(recompute=False, schedule=schedule)
    best = oracle(cluster, workload, batch, settings)
    assert best.status == "optimal"
    found = search(cluster, workload, batch, settings)  # raised InfeasiblePlan
    found.plan.validate(cluster, model, global_batch=batch)
    assert best.estimate.cost / found.estimate.cost >= TARGET, (found.plan.table(cluster), best.plan.table(cluster))
