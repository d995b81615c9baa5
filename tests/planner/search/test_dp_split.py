"""planner/search/dp_split.py's per-layer data-parallel time of a stage (``stage_comm``): when the
stage's rings leave the machine through a shared NIC, the NIC's figure toward the peers' machine paces
them (``nics.to``, else its bandwidth), as ``estimate()`` prices it."""

from __future__ import annotations

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.search.assemble import Evaluator
from lightning_hexiscale.planner.search.dp_split import stage_comm


def _cluster(nics_a: dict) -> Cluster:
    """Machine a (2 GPUs behind one NIC) and machine b (2 GPUs), 10 GB/s paths between them."""
    machines = [{"name": "a", "gpu": "A100-80G", "count": 2, "intra_bandwidth": "100 GB/s", "nics": nics_a},
                {"name": "b", "gpu": "A100-80G", "count": 2, "intra_bandwidth": "100 GB/s"}]
    return Cluster.from_config({"name": "to", "machines": machines,
                                "inter_machine": {"bandwidth": "10 GB/s", "latency": "1ms"}})


def _workload() -> Workload:
    return Workload(LlamaConfig(name="t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                                ffn_hidden_size=512, vocab_size=1000, seq_len=128), dtype="fp32")


def test_a_nic_figure_toward_the_peers_machine_paces_the_stage():
    w = _workload()
    toward = Evaluator(_cluster({"bandwidth": "10 GB/s", "to": [{"machines": ["b"], "bandwidth": "1 GB/s"}]}), w)
    slow_nic = Evaluator(_cluster({"bandwidth": "1 GB/s"}), w)  # the same figure toward b, for every destination
    fast_nic = Evaluator(_cluster({"bandwidth": "10 GB/s"}), w)
    stage, others = (0, 1), [(2, 3)]
    got = stage_comm(toward, stage, others, 2)
    assert got == pytest.approx(stage_comm(slow_nic, stage, others, 2), rel=1e-12)
    # the two GPUs of the stage share the 1 GB/s toward b: 0.5 GB/s each; each sends 1/t of a layer
    alpha = float(toward.lat[0, 2])
    assert got == pytest.approx(alpha + E.dp_layer_bytes(w) / (2 * 2 * 0.5e9), rel=1e-9)
    assert got > stage_comm(fast_nic, stage, others, 2)  # the figure toward b, not the NIC's 10 GB/s
