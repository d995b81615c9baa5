"""Random small heterogeneous clusters, to hold the search against the oracle (tests, bench_planner).

:func:`random_case` draws, from one seed: 2-8 GPUs on 1-4 machines of catalog types (including
the 12 and 24 GiB cards, where memory binds), intra-machine links of 16-400 GB/s, inter-machine
links of 0.5-25 GB/s (sometimes one machine pair with its own link), an 8-layer Llama-2 7B or 13B
shape and a global batch of 8-32. Pure Python, no randomness outside the seed.
"""

from __future__ import annotations

import dataclasses
import random

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost.estimate import Workload

GPU_TYPES = ("A100-40G", "A800", "H100", "H20", "L40S", "RTX4090", "RTX3090", "RTX3080Ti")
MODELS = ("llama2_7b", "llama2_13b")
BATCHES = (8, 12, 16, 24, 32)


def random_case(seed: int) -> tuple[Cluster, Workload, int]:
    """(cluster, workload, global batch) drawn from ``seed``."""
    r = random.Random(seed)
    n_machines = r.randint(1, 4)
    total = r.randint(max(2, n_machines), 8)
    counts = [1] * n_machines
    for _ in range(total - n_machines):
        counts[r.randrange(n_machines)] += 1
    machines = [{"name": f"m{i}", "gpu": r.choice(GPU_TYPES), "count": k,
                 "intra_bandwidth": f"{r.uniform(16, 400):.0f} GB/s"} for i, k in enumerate(counts)]
    links = []
    if n_machines > 2 and r.random() < 0.5:
        a, b = r.sample(range(n_machines), 2)
        links.append({"machines": [f"m{a}", f"m{b}"], "bandwidth": f"{r.uniform(0.5, 25):.2f} GB/s",
                      "latency": "20us"})
    cluster = Cluster.from_config({"name": f"random{seed}", "machines": machines, "machine_links": links,
                                   "inter_machine": {"bandwidth": f"{r.uniform(0.5, 25):.2f} GB/s",
                                                     "latency": "30us"}})
    base = LlamaConfig.load(r.choice(MODELS))
    model = dataclasses.replace(base, name=base.name + "_8l", num_layers=8)
    return cluster, Workload(model), r.choice(BATCHES)
