"""Hand-made clusters of the planner tests, importable by name (``conftest`` is ambiguous: the
suite has several)."""

from lightning_hexiscale.config.cluster import Cluster


def two_islands(gpu: str = "A800", per_machine: int = 4, nvlink: str = "200 GB/s", ethernet: str = "1 GB/s") -> Cluster:
    """Two machines of NVLinked GPUs joined by Ethernet: devices 0..n-1 and n..2n-1."""
    return Cluster.from_config({
        "name": "two_islands",
        "machines": [{"name": "left", "gpu": gpu, "count": per_machine, "intra_bandwidth": nvlink},
                     {"name": "right", "gpu": gpu, "count": per_machine, "intra_bandwidth": nvlink}],
        "inter_machine": {"bandwidth": ethernet, "latency": "50us"},
    })


STRAGGLER = {
    "name": "straggler",
    "machines": [{"name": "fast", "gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"},
                 {"name": "slow", "gpu": "RTX3080Ti", "count": 1, "intra_bandwidth": "16 GB/s"},
                 {"name": "fast2", "gpu": "A800", "count": 2, "intra_bandwidth": "200 GB/s"}],
    "machine_links": [{"machines": ["fast", "fast2"], "bandwidth": "25 GB/s"}],
    "inter_machine": {"bandwidth": "0.2 GB/s", "latency": "50us"},
}
"""Two fast GPUs on each of two machines, one slow GPU on a third behind a 0.2 GB/s link: a plan on
every device waits for the straggler, the best plan leaves it idle."""
