"""Shared NICs: the cluster description (schema, defaults, bad input, round trip) and the cost model's
division of a NIC among concurrent cross-machine transfers (planner/cost/nic.py), on hand-computed cases.

The cluster of most cases: two machines of 2 GPUs, one NIC each at B = 1 GB/s, links between the
machines at 1 GB/s (alpha 1 ms), inside them 100 GB/s (alpha 10 us). Every expected value is written
out from the formulas in planner/cost/nic.py's docstring, not taken from the code."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost import nic
from lightning_hexiscale.planner.cost.dp_comm import dp_comm_all, dp_comm_per_layer
from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate
from lightning_hexiscale.planner.cost.estimate import activation_message_bytes, hop_time
from lightning_hexiscale.planner.search.batching import BatchTimer

B = 1e9
A_INTER, A_INTRA, B_INTRA = 1e-3, 1e-5, 100e9


def two_by_two(nics_a=None, nics_b=None, gpus=2, machines=2) -> Cluster:
    ms = []
    for k in range(machines):
        m = {"name": f"m{k}", "gpu": "A100-80G", "count": gpus, "intra_bandwidth": "100 GB/s", "intra_latency": "10us"}
        decl = (nics_a, nics_b)[k] if k < 2 else nics_a
        if decl is not None:
            m["nics"] = decl
        ms.append(m)
    return Cluster.from_config({"name": "nic", "machines": ms, "inter_machine": {"bandwidth": "1 GB/s", "latency": "1ms"}})


def tiny() -> LlamaConfig:
    return LlamaConfig(name="t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=512,
                       vocab_size=1000, seq_len=128)


# ---- the cluster description ----------------------------------------------------------------

def test_default_is_one_nic_per_machine_at_the_inter_machine_bandwidth():
    c = two_by_two()
    assert len(c.nics) == 2 and [n.devices for n in c.nics] == [(0, 1), (2, 3)]
    assert c.nic_bandwidth.tolist() == [1e9, 1e9] and c.nics_shared
    assert c.bandwidth[0, 2] == 1e9  # one transfer alone: as before


def test_default_follows_the_fastest_link_of_the_machine():
    """A machine_links pair faster than inter_machine: the default NIC does not slow it down."""
    c = Cluster.from_config({"name": "x", "machines": [
        {"name": n, "gpu": "A100-80G", "count": 2, "intra_bandwidth": "100 GB/s"} for n in ("a", "b", "c")],
        "inter_machine": {"bandwidth": "1 GB/s"}, "machine_links": [{"machines": ["a", "b"], "bandwidth": "10 GB/s"}]})
    assert c.nic_bandwidth.tolist() == [10e9, 10e9, 1e9]
    assert c.bandwidth[0, 2] == 10e9 and c.bandwidth[0, 4] == 1e9


def test_declared_nics_count_bandwidth_and_gpu_mapping():
    c = two_by_two({"count": 2, "bandwidth": "100 Gbps", "gpus": [[1], [0]]}, {"bandwidth": "0.5 GB/s"})
    assert [(n.machine, n.bandwidth_Bps, n.devices) for n in c.nics] == [(0, 12.5e9, (1,)), (0, 12.5e9, (0,)),
                                                                          (1, 0.5e9, (2, 3))]
    assert c.nic_of.tolist() == [1, 0, 2, 2]
    assert c.bandwidth[0, 2] == 0.5e9  # capped by the slower NIC; the 1 GB/s link is not what limits it
    blocks = two_by_two({"count": 2}, None, gpus=4)  # default mapping: contiguous blocks
    assert [n.devices for n in blocks.nics[:2]] == [(0, 1), (2, 3)] and blocks.nics[0].bandwidth_Bps == 1e9


@pytest.mark.parametrize("value", [100, "100", 12.5, " 40 "])
def test_nic_bandwidth_without_a_unit_is_an_error_naming_key_value_rule_and_fix(value):
    with pytest.raises(ConfigError) as e:
        two_by_two(None, {"count": 1, "bandwidth": value})
    msg = str(e.value)
    assert e.value.key == "cluster.machines[1].nics.bandwidth"
    assert str(value).strip() in msg and "needs a unit" in msg and "100 Gbps" in msg and "Fix:" in msg


def test_nic_bandwidth_without_a_unit_in_a_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: c\nmachines:\n  - {gpu: A100-80G, count: 2, intra_bandwidth: 100 GB/s, nics: {bandwidth: 100}}\n"
                 "inter_machine: {bandwidth: 1 GB/s}\n")
    with pytest.raises(ConfigError, match=r"cluster.machines\[0\].nics.bandwidth = '100': a NIC bandwidth needs a unit"):
        Cluster.load(str(p))


@pytest.mark.parametrize("decl,key,rule", [
    ({"count": 3}, "nics.count", "from 1 to the machine's 2 GPU"),
    ({"count": 0}, "nics.count", "from 1 to"),
    ({"count": 2, "gpus": [[0, 1]]}, "nics.gpus", "one list per NIC"),
    ({"count": 2, "gpus": [[0], [0]]}, "nics.gpus", "each GPU uses one NIC"),
    ({"count": 2, "gpus": [[0], [5]]}, "nics.gpus[1]", "0 to 1"),
    ({"count": 1, "gpus": [[0]]}, "nics.gpus", "use no NIC"),
    ({"count": 1, "bandwidth": "fast"}, "nics.bandwidth", "not a bandwidth"),
])
def test_bad_nic_declarations(decl, key, rule):
    with pytest.raises(ConfigError) as e:
        two_by_two(decl)
    assert e.value.key == f"cluster.machines[0].{key}" and rule in str(e.value)


def test_misspelt_nic_key_fails_on_the_schema(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: c\nmachines:\n  - {gpu: A100-80G, count: 2, intra_bandwidth: 100 GB/s, nics: {bandwith: 1 GB/s}}\n")
    with pytest.raises(ConfigError, match="bandwith"):
        Cluster.load(str(p))


def test_nic_declarations_round_trip_through_yaml(tmp_path):
    """A cluster file with NICs, loaded through the Hydra schema, dumped and loaded again: same NICs."""
    from omegaconf import OmegaConf

    from lightning_hexiscale.config.schema import ClusterConfig, load_yaml_node

    doc = {"name": "rt", "machines": [
        {"name": "a", "gpu": "A100-80G", "count": 4, "intra_bandwidth": "100 GB/s",
         "nics": {"count": 2, "bandwidth": "100 Gbps", "gpus": [[0, 3], [1, 2]]}},
        {"name": "b", "gpu": "RTX4090", "count": 2, "repeat": 2, "intra_bandwidth": "32 GB/s",
         "nics": {"bandwidth": "12.5 GB/s"}}],
        "inter_machine": {"bandwidth": "400 Gbps"}}
    p = tmp_path / "rt.yaml"
    p.write_text(yaml.safe_dump(doc))
    node = load_yaml_node(p, ClusterConfig, "cluster")
    first = Cluster.from_config(node)
    q = tmp_path / "again.yaml"
    q.write_text(OmegaConf.to_yaml(node))
    again = Cluster.load(str(q))
    assert first.nics == again.nics
    assert [(n.bandwidth_Bps, n.devices) for n in again.nics] == [
        (12.5e9, (0, 3)), (12.5e9, (1, 2)), (12.5e9, (4, 5)), (12.5e9, (6, 7))]
    assert node.machines[1].nics.count == 1 and node.machines[0].nics.gpus == [[0, 3], [1, 2]]


def test_subset_and_replicate_keep_the_nics():
    c = two_by_two({"count": 2, "bandwidth": "2 GB/s"}, None)
    sub = c.subset([1, 2, 3])
    assert [(n.machine, n.bandwidth_Bps, n.devices) for n in sub.nics] == [(0, 2e9, (0,)), (1, 1e9, (1, 2))]
    rep = c.replicate(2)
    assert len(rep.nics) == 6 and rep.nics[3].devices == (4,) and rep.nics[5].devices == (6, 7)


def test_presets_load_and_h800_has_one_nic_per_gpu():
    c = Cluster.load("h800_h20_16")
    assert len(c.nics) == 32 and not c.nics_shared and set(c.nic_bandwidth) == {50e9}
    assert Cluster.load("emu_4to1").nics_shared


# ---- the cost model, hand-computed ------------------------------------------------------------

M = 4e6  # bytes of one activation in the hand-computed hops


def test_scatter_hop_between_two_machines_shares_one_nic():
    """TP-2 -> TP-2 across the machines: 2 flows of M/2 through each NIC, B/2 each, so the send takes
    alpha + (M/2)/(B/2) = alpha + M/B, not alpha + M/(2B); the receivers' all-gather is unchanged."""
    c = two_by_two()
    gather = A_INTRA + (M / 2) / B_INTRA
    caps = nic.hop_alone_caps(c, (0, 1), (2, 3), "1f1b")
    assert caps == (B / 2, B / 2)
    shared = cm.comm_pp_hop_scatter((0, 1), (2, 3), M, c.bandwidth, c.latency, caps)
    assert shared == pytest.approx(2 * (A_INTER + M / B + gather))
    own_links = cm.comm_pp_hop_scatter((0, 1), (2, 3), M, c.bandwidth, c.latency)
    assert own_links == pytest.approx(2 * (A_INTER + M / (2 * B) + gather))
    # one NIC per GPU: every flow has its interface to itself, the price is the per-pair one
    per_gpu = two_by_two({"count": 2}, {"count": 2})
    assert nic.hop_alone_caps(per_gpu, (0, 1), (2, 3), "1f1b") == ()


def test_several_pipelines_hops_in_the_same_phase_share_the_nic():
    """Two pipelines, each a leader hop from machine 0 to machine 1 at boundary 0: 2 flows through each
    NIC, M/(B/2) each. A third pipeline's hop at boundary 1 is another phase and does not count."""
    c = two_by_two(gpus=4)
    chains = [[(0,), (4,)], [(1,), (5,)], [(2,), (6,), (3,)]]  # the third: boundary 0 too, then back
    caps = nic.hop_caps(c, chains, "gpipe")
    assert caps[(0, 0)] == caps[(1, 0)] == caps[(2, 0)] == (B / 3,)
    assert caps[(2, 1)] == (B,)  # boundary 1: alone in its phase
    two = nic.hop_caps(c, chains[:2], "gpipe")
    assert two[(0, 0)] == (B / 2,)
    w = Workload(tiny())
    m = activation_message_bytes(w, 1)
    assert hop_time(c, w, (0,), (4,), 1, two[(0, 0)]) == pytest.approx(2 * (A_INTER + m / (B / 2)))
    assert hop_time(c, w, (0,), (4,), 1, ()) == pytest.approx(2 * (A_INTER + m / B))


def test_opposite_directions_share_only_under_1f1b():
    """Pipeline 0 sends 0 -> 2, pipeline 1 sends 3 -> 1 at the same boundary. GPipe moves one direction
    per phase: each NIC carries one flow per direction (B each). 1F1B fuses activation and gradient:
    each NIC carries both flows in each direction (B/2 each)."""
    c = two_by_two()
    chains = [[(0,), (2,)], [(3,), (1,)]]
    assert nic.hop_caps(c, chains, "gpipe") == {(0, 0): (B,), (1, 0): (B,)}
    assert nic.hop_caps(c, chains, "1f1b") == {(0, 0): (B / 2,), (1, 0): (B / 2,)}


def test_data_parallel_rings_share_the_nic():
    """Two pipelines of one TP-2 stage each, on the two machines: the 2 rings (one per TP rank) cross
    the same NICs, U = 1, rate = (1/2) B / 1 = B/2 per device. T_comm of a layer
    = alpha + (P-1)/t * bytes / (P * B/2) with P = t = 2."""
    c = two_by_two()
    plan = Plan((Pipeline(4, 1, (Stage((0, 1), (0, 4)),)), Pipeline(4, 1, (Stage((2, 3), (0, 4)),))), 4)
    layer_bytes = 8e6
    want = A_INTER + 0.5 * layer_bytes / (2 * B / 2)
    got = dp_comm_all(plan, c, layer_bytes)
    assert got[(0, 0)] == [(4, pytest.approx(want))] and got[(1, 0)] == [(4, pytest.approx(want))]
    assert dp_comm_per_layer(plan, 0, plan.pipelines[0].stages[0], c, layer_bytes) == [(4, pytest.approx(want))]
    rates = nic.dp_ring_rates(c, np.array([0, 1, 2, 3]), np.array([0, .5, 0, .5]), np.array([.5, 1, .5, 1]))
    assert rates.tolist() == [B / 2] * 4
    per_gpu = two_by_two({"count": 2}, {"count": 2})  # one NIC per GPU: the link's own price
    assert dp_comm_all(plan, per_gpu, layer_bytes)[(0, 0)] == [(4, pytest.approx(A_INTER + 0.5 * layer_bytes / (2 * B)))]


def test_rings_inside_one_machine_use_no_nic():
    c = two_by_two(gpus=4)
    plan = Plan((Pipeline(4, 1, (Stage((0, 1), (0, 4)),)), Pipeline(4, 1, (Stage((2, 3), (0, 4)),))), 4)
    got = dp_comm_all(plan, c, 8e6)[(0, 0)][0][1]
    assert got == pytest.approx(A_INTRA + 0.5 * 8e6 / (2 * B_INTRA))


def test_estimate_and_the_batch_timer_price_the_shared_nic_alike():
    """A two-pipeline, two-stage plan whose hops and DP rings cross the machines: estimate() and the
    search's exact batch timer give the same time, and it is above the per-pair price."""
    c, w = two_by_two(), Workload(tiny())
    plan = Plan((Pipeline(4, 2, (Stage((0,), (0, 2)), Stage((2,), (2, 4)))),
                 Pipeline(4, 2, (Stage((1,), (0, 2)), Stage((3,), (2, 4))))), 4)
    est = estimate(plan, c, w)
    timer = BatchTimer(c, w, plan.global_batch)
    cost, best = timer.best(plan)
    assert cost <= est.iteration_time_s * (1 + 1e-9)
    assert estimate(best, c, w).iteration_time_s == pytest.approx(cost, rel=1e-9)
    hop = 2 * (A_INTER + activation_message_bytes(w, 2) / (B / 2))
    assert est.pipelines[0].stages[0].pp_comm_s == pytest.approx(2 * hop / 2)  # 2 micro-batches, half each (1F1B)
    alone = two_by_two({"count": 2}, {"count": 2})
    assert estimate(plan, alone, w).iteration_time_s < est.iteration_time_s
