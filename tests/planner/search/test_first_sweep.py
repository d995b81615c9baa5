"""The first sweep of D_dp values (planner/search/settings.py first_sweep): the same values as the plain
ascending sweep, coarse to fine on large clusters (so that the pruning against the best plan so far
has a good plan early), ascending on small ones."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload
from lightning_hexiscale.planner.search.settings import first_sweep
from lightning_hexiscale.planner.search.two_phase import SearchRun


def _plain(n: int, iterations: int) -> list[int]:
    """The ascending sweep the search made before the coarse-to-fine order (an even subsample when
    the candidates outnumber the iterations), written out independently."""
    if n <= iterations:
        return list(range(n))
    return [int(round(i * (n - 1) / (iterations - 1))) for i in range(iterations)]


@pytest.mark.parametrize("n,iterations", [(1, 50), (2, 50), (7, 50), (35, 50), (35, 10), (100, 50), (16, 16)])
def test_same_values_as_the_ascending_sweep(n, iterations):
    plain = _plain(n, iterations)
    assert first_sweep(n, iterations, coarse_first=False) == plain
    coarse = first_sweep(n, iterations, coarse_first=True)
    assert sorted(coarse) == plain and len(coarse) == len(set(coarse))


def test_coarse_first_order_halves_the_gaps():
    """Middle first, then the middles of both halves, ...: after 2^k - 1 values no run of untried
    candidates is longer than about n / 2^k."""
    n = 35
    order = first_sweep(n, 50, coarse_first=True)
    assert order[0] == 17 and set(order[1:3]) == {8, 26}
    for k in range(1, 6):
        tried = sorted(order[:2 ** k - 1])
        gaps = [b - a - 1 for a, b in zip([-1] + tried, tried + [n])]
        assert max(gaps) <= -(-n // 2 ** k), (k, tried)


def test_the_search_sweeps_coarse_first_only_where_it_prunes():
    w = Workload(LlamaConfig.load("llama2_7b"))
    s = SearchSettings(recompute=True, iterations=50, progress=False)
    small = SearchRun(Cluster.load("hetero2"), w, 128, s)  # 32 devices: no pruning, ascending
    assert small.sweep == sorted(small.sweep)
    large = SearchRun(Cluster.load("hetero2").replicate(4), w, 512, s)  # 128 devices
    assert large.sweep != sorted(large.sweep) and sorted(large.sweep) == list(range(len(large.dps)))
    assert large.dps[large.sweep[0]] == large.dps[(len(large.dps) - 1) // 2]  # the middle value first
