"""A cluster file without ``inter_machine.bandwidth`` is priced at 1 GB/s between its machines, as
before, but no longer silently: the machine pairs so priced are recorded
(``Cluster.default_links``) and the planner names them once (``DefaultLinkWarning``), with the
commands that measure them. A bandwidth given, a ``machine_links`` entry or a matrix file is no
guess; a plan inside one machine crosses no such link."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lightning_hexiscale.config.cluster import DEFAULT_INTER_MACHINE, Cluster
from lightning_hexiscale.config.schema import compose, preset_names
from lightning_hexiscale.planner.cost import compute
from lightning_hexiscale.planner.cost.compute import DefaultLinkWarning, warn_default_links


def _cluster(**extra) -> Cluster:
    machines = [{"name": n, "gpu": g, "count": 2, "intra_bandwidth": "10 GB/s"}
                for n, g in (("a", "CPU-FAST"), ("b", "CPU-SLOW"), ("c", "CPU-SLOW"))]
    return Cluster.from_config({"name": "three", "machines": machines, **extra})


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(compute, "_LINKS_WARNED", set())  # said once per process: not by an earlier test


def test_pairs_without_a_given_link_are_recorded_and_priced_at_the_default():
    c = _cluster()
    assert c.default_links(limit=None) == ((("a", "b"), ("a", "c"), ("b", "c")), 3)
    assert c.default_links(limit=1) == ((("a", "b"),), 3)
    assert c.bandwidth[0, 2] == DEFAULT_INTER_MACHINE == 1e9
    linked = _cluster(machine_links=[{"machines": ["a", "b"], "bandwidth": "25 GB/s"}])
    assert linked.default_links() == ((("a", "c"), ("b", "c")), 2) and linked.bandwidth[0, 2] == 25e9
    assert linked.default_links({"a", "b"}) == ((), 0)
    assert _cluster(inter_machine={"bandwidth": "1 GB/s"}).default_links() == ((), 0)  # given, even at the default
    assert _cluster(inter_machine={"latency": "50us"}).default_links()[1] == 3  # a latency alone is no bandwidth
    assert c.subset([0, 1, 4]).default_links() == ((("a", "c"),), 1)
    one = Cluster.from_config({"name": "one", "machines": [{"gpu": "CPU-FAST", "count": 2, "intra_bandwidth": "1 GB/s"}]})
    assert one.default_links() == ((), 0)


def test_the_planner_names_the_guessed_links_once_and_only_for_machines_a_plan_uses():
    c = _cluster(machine_links=[{"machines": ["a", "b"], "bandwidth": "25 GB/s"}])
    with pytest.warns(DefaultLinkWarning, match=r"cluster three: the links between machines \(a-c, b-c\) are priced "
                                                r"at 1 GB/s, a guess: the cluster file gives no inter_machine.bandwidth. "
                                                r"Measure them \(`hexiscale discover`"):
        warn_default_links(c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_default_links(c) is None  # once per process
        assert warn_default_links(c, devices=[0, 1, 2, 3]) is None  # a and b: their link is given
        assert warn_default_links(_cluster(inter_machine={"bandwidth": "3 GB/s"})) is None


def test_a_search_on_such_a_cluster_says_so():
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import SearchSettings, Workload, search

    with pytest.warns(DefaultLinkWarning, match="cluster three"):
        search(_cluster(), Workload(LlamaConfig.load("llama_tiny"), device="cpu"), 6, SearchSettings(iterations=2))


@pytest.mark.parametrize("name", preset_names("cluster"))
def test_every_preset_gives_its_links(name):
    """The presets are no guesses (a guard for the rule, and for a preset that forgets its links)."""
    cluster = Cluster.from_config(compose([f"cluster={name}"]).cluster)
    assert cluster.default_links() == ((), 0), name
    assert np.all(np.isfinite(cluster.bandwidth[~np.eye(cluster.num_devices, dtype=bool)]))


def test_the_cluster_summary_says_which_links_are_the_default():
    assert "between machines: 1 GB/s, the default (no inter_machine.bandwidth given) for 3 machine pairs" in \
        _cluster().summary()
    assert "between machines" not in _cluster(inter_machine={"bandwidth": "2 GB/s"}).summary()


def test_a_large_cluster_counts_its_guessed_pairs_without_listing_them():
    """1,024 one-GPU machines: 523,776 pairs, counted, and the first three named (16,384 such machines
    have 134 million pairs: a tuple of them all took minutes and GBs)."""
    big = Cluster.from_config({"name": "big", "machines": [{"name": "m", "gpu": "CPU-FAST", "count": 1, "repeat": 1024}],
                               "machine_links": [{"machines": ["m.0", "m.1"], "bandwidth": "10 GB/s"}]})
    first, count = big.default_links()
    assert count == 1024 * 1023 // 2 - 1 and first == (("m.0", "m.2"), ("m.0", "m.3"), ("m.0", "m.4"))
    assert "(m.0-m.2, m.0-m.3, m.0-m.4 and 523772 more)" in warn_default_links(big)
