"""Phase 1/2 partitions and the top-tau stage order on hand-made graphs with known answers."""

import itertools

import numpy as np
import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.search.partition import (DeviceGraph, cut_weight, group_bandwidth, partition,
                                                          top_tau_order)


def _as_sets(parts):
    return sorted(tuple(sorted(p.tolist())) for p in parts)


def test_min_cut_keeps_nvlink_islands_whole(islands):
    g = DeviceGraph.from_cluster(islands)
    parts = partition(g, 2, "min")
    assert _as_sets(parts) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # Eq. 2: only the 4 x 4 Ethernet pairs cross the cut
    assert cut_weight(g, parts) == pytest.approx(16 * 1e9)


def test_max_cut_deals_each_machine_over_the_parts(islands):
    g = DeviceGraph.from_cluster(islands)
    lo, hi = partition(g, 2, "min"), partition(g, 2, "max")
    for p in hi:
        assert sum(d < 4 for d in p) == 2 and sum(d >= 4 for d in p) == 2
    assert cut_weight(g, hi) > cut_weight(g, lo)
    # the maximum over balanced bisections: 8 NVLink pairs + 8 Ethernet pairs cross
    assert cut_weight(g, hi) == pytest.approx(8 * 200e9 + 8 * 1e9)


def test_max_cut_is_the_maximum_on_a_small_graph(islands):
    """Brute force over every 4 + 4 bisection: dealing reaches the largest Eq. 2 cut."""
    g = DeviceGraph.from_cluster(islands)
    best = max(cut_weight(g, [np.array(a), np.array([d for d in range(8) if d not in a])])
               for a in itertools.combinations(range(8), 4))
    assert cut_weight(g, partition(g, 2, "max")) == pytest.approx(best)


@pytest.mark.parametrize("objective", ["min", "max"])
@pytest.mark.parametrize("name", ["case_study", "hetero2"])
def test_exactly_k_nonempty_parts_covering_every_device(name, objective):
    c = Cluster.load(name)
    g = DeviceGraph.from_cluster(c)
    for k in range(1, c.num_devices + 1):
        parts = partition(g, k, objective, seed=k)
        assert len(parts) == k and all(len(p) for p in parts)
        assert sorted(np.concatenate(parts).tolist()) == list(range(c.num_devices))


def test_min_cut_respects_the_compute_balance():
    c = Cluster.load("hetero2")  # 8 x (3080Ti, 3090, 4090, A800)
    g = DeviceGraph.from_cluster(c)
    for k in (2, 4):
        loads = [c.flops[p].sum() for p in partition(g, k, "min", balance=1.2)]
        assert max(loads) / np.mean(loads) <= 1.2 + 0.1  # METIS honours the bound up to coarse vertex weights


def test_partition_is_deterministic_for_a_seed():
    g = DeviceGraph.from_cluster(Cluster.load("hetero3"))
    assert _as_sets(partition(g, 5, "min", seed=3)) == _as_sets(partition(g, 5, "min", seed=3))


def test_bad_k_and_objective_are_config_errors(islands):
    g = DeviceGraph.from_cluster(islands)
    with pytest.raises(ConfigError, match="non-empty parts"):
        partition(g, 9)
    with pytest.raises(ConfigError, match="planner.cut"):
        partition(g, 2, "median")


def test_dense_csr_graph_has_every_pair_both_ways():
    g = DeviceGraph.from_cluster(Cluster.load("hetero2").replicate(2))
    xadj, adjncy, ew, vw = g.csr
    n = g.n
    assert len(xadj) == n + 1 and len(adjncy) == n * (n - 1) == len(ew)
    assert ew.min() >= 1 and vw.min() >= 1 and ew.sum() < 2**31


def test_top_tau_finds_the_maximum_bandwidth_path():
    # a chain 0 - 2 - 1 - 3 of 10 GB/s links; every other pair 1 GB/s. Greedy from 0 finds it; from
    # 1 or 2 the first step can go either way: the search must keep the best complete path.
    w = np.full((4, 4), 1.0)
    for a, b in ((0, 2), (2, 1), (1, 3)):
        w[a, b] = w[b, a] = 10.0
    order, cost = top_tau_order(w, tau=2)
    assert order in ([0, 2, 1, 3], [3, 1, 2, 0]) and cost == pytest.approx(0.3)


def test_top_tau_keeps_the_best_path_not_the_last():
    # from start 0 the widest first hop (0-1, 9) leads into a dead end of 1 GB/s links, while 0-2 (8)
    # continues over fast links: only the best-path bookkeeping recovers 1 - 0 - 2 - 3 - 4.
    w = np.full((5, 5), 1.0)
    for a, b, v in ((0, 1, 9.0), (0, 2, 8.0), (2, 3, 10.0), (3, 4, 10.0)):
        w[a, b] = w[b, a] = v
    order, cost = top_tau_order(w, tau=2)
    assert cost == pytest.approx(1 / 9 + 1 / 8 + 1 / 10 + 1 / 10)
    assert order in ([1, 0, 2, 3, 4], [4, 3, 2, 0, 1])


@pytest.mark.parametrize("seed", range(5))
def test_top_tau_with_full_width_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 6
    w = rng.uniform(1, 100, size=(n, n))
    w = (w + w.T) / 2
    brute = min(sum(1 / w[p[i], p[i + 1]] for i in range(n - 1)) for p in itertools.permutations(range(n)))
    assert top_tau_order(w, tau=n)[1] == pytest.approx(brute)


def test_group_bandwidth_takes_the_best_pair(islands):
    gb = group_bandwidth(islands.bandwidth, [(0, 1), (2, 3), (4, 5)])
    assert gb[0, 1] == pytest.approx(200e9) and gb[0, 2] == pytest.approx(1e9)
