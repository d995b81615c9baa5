"""The pricing cache: memo tables of pricing work that depends on the cluster and the plan layout
only (not on batches, micro-batch sizes or sharding), so the search, which prices the same layouts
and data-parallel rings thousands of times, computes each once.

One :class:`PricingCache` per :class:`~lightning_hexiscale.config.cluster.Cluster`, reached through
:func:`pricing_cache` -- the one place it is attached. The cluster itself holds nothing (a Cluster
is a value read by the whole package; memo tables stashed on it were invisible, survived copies
and could not be cleared as a whole). The registry keys on the cluster's identity and lets go of a
cache when its cluster is collected; a cluster built anew (``Cluster.load``, a sub-cluster, the
search's effective cluster) starts with an empty cache, as it did before.

Who fills which table (sizes bound the memory a long search may hold):

- ``dp_comm``:      :func:`.dp_comm.dp_comm_all`, (layer bytes, layout) -> per-stage T_comm,
                    first in first out beyond :data:`DP_COMM_ENTRIES`
- ``ring_rates``:   :func:`.nic.dp_ring_rates`, (devices, fractions) -> NIC rate per slot (read-only
                    arrays), emptied when it reaches :data:`RING_RATE_ENTRIES`
- ``link_ceiling``: ``search.floors.link_ceiling``'s table of each device's distinct link
                    bandwidths and their cumulative counts (one per cluster)
"""

from __future__ import annotations

import weakref
from typing import Any

DP_COMM_ENTRIES = 256
"""Layouts whose data-parallel T_comm :func:`.dp_comm.dp_comm_all` keeps (per layer-byte size)."""
RING_RATE_ENTRIES = 100_000
"""Ring holders whose NIC rates :func:`.nic.dp_ring_rates` keeps before it starts afresh."""


class PricingCache:
    """The memo tables of one cluster's pricing (module docstring says who fills each)."""

    __slots__ = ("dp_comm", "ring_rates", "link_ceiling")

    def __init__(self) -> None:
        self.dp_comm: dict[tuple, dict] = {}
        self.ring_rates: dict[tuple[bytes, bytes, bytes], Any] = {}
        self.link_ceiling: tuple[Any, Any] | None = None

    def clear(self) -> None:
        """Forget everything (the next pricing computes afresh; results are the same)."""
        self.dp_comm.clear()
        self.ring_rates.clear()
        self.link_ceiling = None

    def __len__(self) -> int:
        """Entries held, all tables together."""
        return len(self.dp_comm) + len(self.ring_rates) + (self.link_ceiling is not None)


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pricing_cache(cluster: Any) -> PricingCache:
    """The :class:`PricingCache` of ``cluster`` (created empty on first use; dropped with the cluster)."""
    cache = _CACHES.get(cluster)
    if cache is None:
        cache = _CACHES[cluster] = PricingCache()
    return cache
