"""The pricing cache is an explicit object (planner/cost/cache.py, issue 42 item 5): estimate() and
the search fill the cluster's :class:`PricingCache`, the cluster itself carries no memo entries,
a cleared or fresh cache prices alike, and the cache goes with its cluster."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, PricingCache, Workload, estimate, pricing_cache
from lightning_hexiscale.planner.cost import cache as pc
from lightning_hexiscale.planner.search.floors import link_ceiling

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # datasheet pricing

PLANNER = Path(__file__).resolve().parents[3] / "lightning_hexiscale" / "planner"


@pytest.fixture
def hetero3():
    return (Plan.load("conf/plans/hetero3_llama30b_tab7.yaml"), Cluster.load("hetero3"),
            Workload(LlamaConfig.load("llama_30b")))


def test_estimate_fills_the_clusters_pricing_cache_not_the_cluster(hetero3):
    plan, cluster, w = hetero3
    before = dict(vars(cluster))
    first = estimate(plan, cluster, w)
    cache = pricing_cache(cluster)
    assert isinstance(cache, PricingCache) and cache is pricing_cache(cluster)
    assert cache.dp_comm, "dp_comm_all memoises the layout's data-parallel terms"
    assert vars(cluster).keys() == before.keys(), "nothing stashed on the cluster"
    link_ceiling(cluster, 1)
    assert cache.link_ceiling is not None and vars(cluster).keys() == before.keys()
    n = len(cache)
    assert estimate(plan, cluster, w) == first and len(cache) == n  # a hit adds nothing
    cache.clear()
    assert len(cache) == 0 and estimate(plan, cluster, w) == first  # cleared: same figures


def test_each_cluster_has_its_own_cache_dropped_with_it(hetero3):
    plan, cluster, w = hetero3
    other = Cluster.load("hetero3")
    estimate(plan, cluster, w)
    assert pricing_cache(other) is not pricing_cache(cluster) and not pricing_cache(other).dp_comm
    # Judged by identity, not by the registry's size: other tests' clusters may be collected by the
    # same gc.collect() (the size check failed in CI when one was).
    gone, its_cache, kept = weakref.ref(other), pricing_cache(other), pricing_cache(cluster)
    del other
    gc.collect()
    assert gone() is None, "the registry must not keep a cluster alive"
    assert not any(c is its_cache for c in pc._CACHES.values()), "a collected cluster's cache is dropped"
    assert pc._CACHES.get(cluster) is kept, "a live cluster keeps its cache"


def test_no_planner_module_stashes_entries_on_an_object_dict():
    """The memo tables live in cost/cache.py; ``x.__dict__[...]`` / ``.__dict__.setdefault`` in the
    planner would be a cache hidden on the object again."""
    offenders = [f"{p.relative_to(PLANNER)}:{i}" for p in sorted(PLANNER.rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"__dict__\s*(\[|\.)", line)]
    assert not offenders, offenders
