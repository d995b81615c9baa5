"""Hand-made clusters for the planner tests."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload
from planner_clusters import STRAGGLER, two_islands  # a module of its own: several conftest.py share the name


@pytest.fixture
def islands() -> Cluster:
    return two_islands()


@pytest.fixture(scope="session")
def tiny() -> Workload:
    return Workload(LlamaConfig.load("llama_tiny"))


@pytest.fixture(scope="session")
def llama7b() -> Workload:
    return Workload(LlamaConfig.load("llama2_7b"))


@pytest.fixture
def straggler() -> Cluster:
    return Cluster.from_config(STRAGGLER)


@pytest.fixture(scope="session")
def small7b() -> Workload:
    """Llama-2 7B's layer shape at 8 layers (fast to plan, the oracle's size)."""
    import dataclasses

    m = LlamaConfig.load("llama2_7b")
    return Workload(dataclasses.replace(m, name="llama2_7b_8l", num_layers=8))
