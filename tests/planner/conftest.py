"""Hand-made clusters for the planner tests."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.estimate import Workload


def two_islands(gpu: str = "A800", per_machine: int = 4, nvlink: str = "200 GB/s", ethernet: str = "1 GB/s") -> Cluster:
    """Two machines of NVLinked GPUs joined by Ethernet: devices 0..n-1 and n..2n-1."""
    return Cluster.from_config({
        "name": "two_islands",
        "machines": [{"name": "left", "gpu": gpu, "count": per_machine, "intra_bandwidth": nvlink},
                     {"name": "right", "gpu": gpu, "count": per_machine, "intra_bandwidth": nvlink}],
        "inter_machine": {"bandwidth": ethernet, "latency": "50us"},
    })


@pytest.fixture
def islands() -> Cluster:
    return two_islands()


@pytest.fixture(scope="session")
def tiny() -> Workload:
    return Workload(LlamaConfig.load("llama_tiny"))


@pytest.fixture(scope="session")
def llama7b() -> Workload:
    return Workload(LlamaConfig.load("llama2_7b"))
