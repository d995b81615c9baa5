"""NIC bandwidth per destination (``nics.to``): a fast network among machines of one kind beside a slow
path between kinds, written down and priced. Cluster of most cases: machines f0, f1 (kind F, 2 GPUs, one
NIC of 10 GB/s, 1 Gbps = 0.125 GB/s in traffic with the slow kind) and s0, s1 (kind S, the same NIC
figures the other way round), links 10 GB/s everywhere. Expected values are written out from the
formulas of config/nics.py and planner/cost/nic.py, not taken from the code."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.cost import nic

FAST, SLOW = 10e9, 0.125e9


def mixed(to_fast=({"machines": ["s"], "bandwidth": "1 Gbps"},), to_slow=({"machines": ["f"], "bandwidth": "1 Gbps"},),
          extra: dict | None = None) -> Cluster:
    def entry(name, to):
        nics = {"count": 1, "bandwidth": "10 GB/s"}
        if to is not None:
            nics["to"] = [dict(t) for t in to]
        return {"name": name, "gpu": "A100-80G", "count": 2, "repeat": 2, "intra_bandwidth": "100 GB/s", "nics": nics}
    cfg = {"name": "mixed", "machines": [entry("f", to_fast), entry("s", to_slow)],
           "inter_machine": {"bandwidth": "10 GB/s", "latency": "10us"}}
    cfg.update(extra or {})
    return Cluster.from_config(cfg)


def test_one_transfer_is_capped_by_the_figure_toward_its_destination():
    c = mixed()
    assert [m.name for m in c.machines] == ["f.0", "f.1", "s.0", "s.1"]
    assert c.bandwidth[0, 2] == FAST  # f.0 -> f.1: the fast network
    assert c.bandwidth[0, 4] == SLOW and c.bandwidth[4, 0] == SLOW  # f.0 <-> s.0: the slow path
    assert c.bandwidth[4, 6] == FAST
    assert "to s.0 125 MB/s" in c.summary() or "to s.0 125" in c.summary()
    # backwards compatible: without `to` every destination gets the NIC's one figure
    plain = mixed(None, None)
    assert plain.bandwidth[0, 4] == FAST and not plain.nics_per_destination


def test_one_side_declared_is_enough_for_the_cap():
    c = mixed(to_slow=None)  # only the fast machines know their slow path
    assert c.bandwidth[0, 4] == SLOW and c.bandwidth[4, 0] == SLOW


def test_concurrent_flows_share_the_nic_at_their_own_destinations_figure():
    c = mixed()
    # a TP-2 stage on f.0 feeding a TP-2 stage on s.0 (scatter path: 2 flows leaving f.0's NIC at once)
    caps = nic.hop_caps(c, [[(0, 1), (4, 5)]], "gpipe")[(0, 0)]
    assert caps == pytest.approx((SLOW / 2, SLOW / 2))
    caps = nic.hop_caps(c, [[(0, 1), (2, 3)]], "gpipe")[(0, 0)]  # the same towards f.1
    assert caps == pytest.approx((FAST / 2, FAST / 2))
    # one pipeline to each kind in the same phase: the NIC carries 4 flows, each at its own figure / 4
    both = nic.hop_caps(c, [[(0, 1), (4, 5)], [(0, 1), (2, 3)]], "gpipe")
    assert both[(0, 0)] == pytest.approx((SLOW / 4,) * 2) and both[(1, 0)] == pytest.approx((FAST / 4,) * 2)
    plain = mixed(None, None)
    assert nic.hop_caps(plain, [[(0, 1), (4, 5)]], "gpipe")[(0, 0)] == pytest.approx((FAST / 2, FAST / 2))


def test_data_parallel_rings_take_the_slowest_destination():
    c = mixed()
    # two pipelines, each a TP-2 stage: on f.0 (devices 0, 1) and on s.0 (4, 5); both segments cross
    dev = np.array([0, 1, 4, 5])
    lo, hi = np.array([0, .5, 0, .5]), np.array([.5, 1, .5, 1])
    # rate = share * B_n(toward s.0) / U, U = 1 (both segments have a holder behind f.0's NIC)
    assert nic.dp_ring_rates(c, dev, lo, hi) == pytest.approx([.5 * SLOW] * 4)
    assert nic.dp_ring_rates(mixed(None, None), dev, lo, hi) == pytest.approx([.5 * FAST] * 4)
    # between machines of one kind the fast figure stays
    assert nic.dp_ring_rates(c, np.array([0, 1, 2, 3]), lo, hi) == pytest.approx([.5 * FAST] * 4)


def test_the_estimate_prices_the_slow_path():
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate

    model = LlamaConfig(name="t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=512,
                        vocab_size=1000, seq_len=256)
    across = Plan((Pipeline(8, 1, (Stage((0, 1), (0, 2)), Stage((4, 5), (2, 4)))),), 4)
    within = Plan((Pipeline(8, 1, (Stage((0, 1), (0, 2)), Stage((2, 3), (2, 4)))),), 4)
    c, plain = mixed(), mixed(None, None)
    w = Workload.for_cluster(model, c)
    assert estimate(across, c, w).iteration_time_s > estimate(across, plain, w).iteration_time_s
    assert estimate(within, c, w).iteration_time_s == pytest.approx(estimate(within, plain, w).iteration_time_s)


def test_subset_and_replicate_keep_the_destinations():
    c = mixed()
    sub = c.subset([0, 1, 4, 5])  # f.0 and s.0
    assert sub.bandwidth[0, 2] == SLOW and sub.nics[0].toward == ((1, SLOW),)
    rep = c.replicate(2)
    assert rep.bandwidth[0, 4] == SLOW and rep.bandwidth[8, 12] == SLOW


@pytest.mark.parametrize("to,key,rule", [
    ([{"machines": ["s"], "bandwidth": 125}], "cluster.machines[0].nics.to[0].bandwidth", "needs a unit"),
    ([{"machines": ["nowhere"], "bandwidth": "1 Gbps"}], "cluster.machines[0].nics.to", "names no machine"),
    ([{"machines": ["f"], "bandwidth": "1 Gbps"}], "cluster.machines[0].nics.to", "own machine"),
    ([{"machines": ["s"]}], "cluster.machines[0].nics.to[0]", "must be {machines"),
    ([{"machines": ["s"], "bandwidth": "1 Gbps", "latency": "1ms"}], "cluster.machines[0].nics.to[0]", "must be {machines"),
    ([{"machines": ["s"], "bandwidth": "1 Gbps"}, {"machines": ["s"], "bandwidth": "2 Gbps"}],
     "cluster.machines[0].nics.to[1].machines", "listed twice"),
])
def test_bad_destinations_are_config_errors(to, key, rule):
    with pytest.raises(ConfigError) as e:
        mixed(to_fast=to, to_slow=None)
    assert e.value.key == key and rule in e.value.rule and e.value.fix
