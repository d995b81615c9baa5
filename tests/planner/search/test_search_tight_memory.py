"""The search against the true optimum (planner/oracle/exact.py) where memory binds: devices of
2-6 MiB and a llama_tiny shape of 1-4 layers, on machines of uneven device counts, so that a device
alone holds no layer and the plan must pair devices (TP 2), across machines where a machine has an
odd one, and leave the rest idle. Each case was found by a sweep of random such clusters; before its
fix the search raised InfeasiblePlan ("no plan fits in memory") or stopped far from the optimum."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search
from lightning_hexiscale.planner.oracle.exact import oracle

TARGET = 0.97
"""As tests/planner/oracle/test_search_vs_oracle.py: the search's plan at least 0.97 of the optimum."""


def machine(name: str, gpu: str, count: int, intra: str = "64 GB/s", nics: dict | None = None) -> dict:
    m = {"name": name, "gpu": gpu, "count": count, "intra_latency": "10us", "nics": nics or {"count": 1}}
    if count > 1:
        m["intra_bandwidth"] = intra
    return m


CASES = {
    # 3 V100s of 3 MiB: a pair holds the 2 layers, a lone V100 nothing; the drafts gave every
    # device of a machine work (a pair and a lone device, or three stages for two layers), so
    # nothing fitted. Optimum: 3 pipelines under ZeRO-2, [4090] [4090] | [T4 V100] | [V100 V100]
    "a_remainder_goes_idle": (
        [machine("m0", "RTX4090", 2), machine("m1", "T4", 1),
         machine("m2", "V100", 3, nics={"count": 1, "bandwidth": "12.5 GB/s"})],
        [{"machines": ["m0", "m2"], "bandwidth": "10 GB/s", "latency": "20us"}],
        {"RTX4090": ("2 TFLOPS", "4 MiB"), "T4": ("2 TFLOPS", "3 MiB"), "V100": ("1 TFLOPS", "3 MiB")},
        "3 GB/s", 2, 32, True),
    # the only plan pairs the odd V100 with the RTX3090 of the other machine: [V100 3090] [V100 V100];
    # the drafts formed TP groups across machines only per GPU type or of the whole group
    "odd_devices_pair_across_machines": (
        [machine("m0", "V100", 3), machine("m1", "RTX3090", 1)], [],
        {"V100": ("2 TFLOPS", "3 MiB"), "RTX3090": ("4 TFLOPS", "3 MiB")}, "0.7 GB/s", 2, 24, False),
    # the three 3 MiB RTX3090s went idle and never came back (0.85 of the optimum): the optimum runs
    # a pair of them as the first stage of a pipeline of the RTX4090s, beside the A100 pair
    "an_idle_pair_comes_back": (
        [machine("m0", "RTX3090", 1), machine("m1", "RTX4090", 2, "32 GB/s", {"count": 2}),
         machine("m2", "RTX3090", 2, "32 GB/s", {"count": 2}), machine("m3", "A100-40G", 2)],
        [{"machines": ["m1", "m2"], "bandwidth": "10 GB/s", "latency": "20us"}],
        {"RTX4090": ("4 TFLOPS", "6 MiB"), "A100-40G": ("2 TFLOPS", "6 MiB"), "RTX3090": ("4 TFLOPS", "3 MiB")},
        "12.5 GB/s", 4, 8, "auto"),
    # a subset's plan won (the T4 machine idle: three V100 pairs) and the whole cluster's climb never
    # started from it; the optimum splits the middle pair into two stages and pairs one V100 with the
    # idle T4 ([V100] then [V100 T4]), two steps of which the first alone does not fit (0.910 before)
    "a_subset_plan_takes_an_idle_device_back": (
        [machine("m0", "V100", 3), machine("m1", "T4", 1), machine("m2", "V100", 2, "16 GB/s"),
         machine("m3", "V100", 1)],
        [{"machines": ["m0", "m1"], "bandwidth": "11.71 GB/s", "latency": "20us"}],
        {"V100": ("2 TFLOPS", "4 MiB"), "T4": ("4 TFLOPS", "3 MiB")}, "7.57 GB/s", 3, 24, False),
    # one 4-stage DDP pipeline of RTX4090s (0.746 of the optimum): the optimum splits it into two
    # pipelines under ZeRO-2 and adds a third of the idle RTX4090 and V100 pair; every single step
    # there does not fit (search/regroup.py deals the TP groups into 3 pipelines)
    "a_pipeline_splits_into_three": (
        [machine("m0", "RTX4090", 3, "16 GB/s", {"count": 2}), machine("m1", "V100", 2, "128 GB/s"),
         machine("m2", "RTX4090", 2, "128 GB/s")],
        [{"machines": ["m0", "m1"], "bandwidth": "1.55 GB/s", "latency": "20us"}],
        {"RTX4090": ("2 TFLOPS", "6 MiB"), "V100": ("4 TFLOPS", "3 MiB")}, "9.84 GB/s", 4, 16, True),
    # the only plan: one DDP pipeline [3090 pair] [3090 of m0 + 3090 of m2] [T4] [3090 pair], the T4
    # (alone it holds one layer) in a middle stage; the search raised "no plan fits in memory"
    "nothing_fitted_until_one_pipeline_in_another_order": (
        [machine("m0", "RTX3090", 3, "16 GB/s"), machine("m1", "RTX3090", 2), machine("m2", "RTX3090", 1),
         machine("m3", "T4", 1)], [],
        {"RTX3090": ("4 TFLOPS", "3 MiB"), "T4": ("4 TFLOPS", "4 MiB")}, "3.35 GB/s", 4, 8, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_search_reaches_the_optimum_where_memory_binds(name):
    machines, links, types, between, layers, batch, recompute = CASES[name]
    cluster = Cluster.from_config({
        "name": name, "machines": machines, "machine_links": links,
        "gpu_types": {t: {"flops": f, "memory": m} for t, (f, m) in types.items()},
        "inter_machine": {"bandwidth": between, "latency": "30us"}})
    model = dataclasses.replace(LlamaConfig.load("llama_tiny"), name=f"llama_tiny_{layers}l", num_layers=layers)
    workload = Workload(model, reserve_bytes=0.0, device="cpu", comm_buffer_bytes=32 * 1024)
    settings = SearchSettings(recompute=recompute)
    found = search(cluster, workload, batch, settings)  # two of them raised InfeasiblePlan
    found.plan.validate(cluster, model, global_batch=batch)
    assert found.estimate.feasible and found.plan.launch_order == tuple(range(cluster.num_devices))
    best = oracle(cluster, workload, batch, settings, time_limit_s=60.0, incumbent=found.plan)
    assert best.complete
    ratio = best.estimate.cost / found.estimate.cost
    assert ratio >= TARGET, (f"{name}: search {found.estimate.cost:.6f} s, optimum {best.estimate.cost:.6f} s "
                             f"({ratio:.3f})\n{found.plan.table(cluster)}\n{best.plan.table(cluster)}")
