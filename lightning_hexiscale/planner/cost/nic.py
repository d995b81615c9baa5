"""Shared NICs: concurrent cross-machine transfers divide a NIC's bandwidth (named, pure terms).

The alpha-beta terms of :mod:`cost.model` price each transfer on its own link. A machine's GPUs
reach the other machines through its NICs (``config/nics.py``: GPU d uses NIC n(d) of bandwidth
B_n per direction; a single transfer is already capped at min(beta, B_n(a), B_n(b)) in the
cluster's bandwidth matrix). When several transfers cross one NIC at the same time they share it.
Three kinds of concurrency are priced:

1. **Stage boundaries** (:func:`hop_caps`). A hop from stage j to stage j+1 sends one flow per
   sending TP rank on the scatter/gather path (rank r to rank r, c = M/t bytes each) or one flow
   between the leaders. All flows of one *phase* run at once: the phase of a hop is its boundary
   index j, and every pipeline crosses its boundary j at about the same time (the pipelines
   advance in step). Fair share: a flow f from a to b on different machines runs at

       beta_f = min( beta[a, b],  B_n(a) / k_out[n(a)],  B_n(b) / k_in[n(b)] )

   with k_out[n] (k_in[n]) the phase's cross-machine flows leaving (entering) NIC n. GPipe moves
   one direction per phase; under 1F1B the runtime fuses the activation and its gradient into one
   exchange (``cost.model.hop_charges``), so each NIC carries in each direction the flows that
   leave it AND those that enter it: k_out = k_in = (leaving + entering). A TP-8 -> TP-8 boundary
   between two machines with one NIC each is thus 8 flows of M/8 at B/8 each: M/B, not (M/8)/B.
2. **Several pipelines' hops** in the same phase: the same flow counts, summed over the pipelines.
3. **Data-parallel collectives** (:func:`dp_ring_rates`). Each segment of a layer (the union of
   all pipelines' shard boundaries, ``runtime/grad_sync.py``) is all-reduced by a ring over its P
   holders, one per pipeline; the rings of one layer run at once. A ring that spans machines
   enters and leaves each of its machines once, so NIC n carries, per direction and per ring
   step, (P-1)/P of every crossing segment that has a holder behind it: U_n = the summed length
   (as a fraction of the layer) of those segments, and n needs (P-1)/P * U_n * bytes / B_n. A
   device holding a share s = 1/t of the layer, in cost.model's ``comm_dp`` form
   (share * bytes / (P * beta)), then runs its collectives at no more than

       rate(d) = s(d) * B_n(d) / U_n(d)           (inf when none of its segments crosses a machine)

   Two TP-8 stages of two pipelines on two machines with one NIC each: U = 1, rate = B/8 per
   device: the 8 rings share the NIC. A NIC used by one GPU has U_n <= s(d), so rate >= B_n: its
   own link already bounds it (the term binds only where GPUs share a NIC). Each device is priced
   at its own NIC, as ``comm_dp`` prices each device's own bytes; a ring partner behind a busier
   NIC pays that NIC in its own stage's time.

**Per destination** (``nics.to``, ``config/nics.py``): a NIC n may carry B_n(m) in traffic with
machine m instead of B_n. A flow then counts in its NIC's k like any other (they share one
interface) but gets the figure of its own destination: B_n(a)(M(b)) / k_out and B_n(b)(M(a)) / k_in.
A device's data-parallel rings take the smallest B_n(d)(m) over the machines m of the other holders
of its crossing segments (a ring is as fast as its slowest step).

Sharing never speeds anything up (every rate is at most what it was without the other flows), so
a term computed with fewer concurrent flows is a lower bound of one computed with more: the
planner's oracle prices a hop with its own flows only in its bounds (``planner.oracle.terms``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.planner.cost.cache import RING_RATE_ENTRIES, pricing_cache

Caps = tuple[float, ...]
"""Per flow of a hop, in :func:`hop_flows` order: the NIC fair share (bytes/s; inf: not limited)."""


def hop_flows(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """The send flows of one hop direction, as the runtime sends them (runtime/schedule.py): TP rank r
    to TP rank r between equal TP degrees t > 1 (scatter/gather), else leader to leader."""
    if len(src) == len(dst) > 1:
        return list(zip(src, dst))
    return [(src[0], dst[0])]


def fair_share(nic_bandwidth: np.ndarray, flows: np.ndarray) -> np.ndarray:
    """B_n / k_n per NIC (inf where no flow uses it): what each of k_n flows through NIC n gets."""
    with np.errstate(divide="ignore"):
        return np.where(flows > 0, nic_bandwidth / np.maximum(flows, 1), np.inf)


def flow_caps(src_nic: np.ndarray, dst_nic: np.ndarray, cross: np.ndarray, phase: np.ndarray,
              nic_bandwidth: np.ndarray, num_phases: int, schedule: str,
              src_bw: np.ndarray | None = None, dst_bw: np.ndarray | None = None) -> np.ndarray:
    """Per flow: min(B_n(a) / k_out[n(a)], B_n(b) / k_in[n(b)]) with the counts taken over the flows
    of the same phase (module docstring, point 1); inf for a flow inside one machine. Arrays are
    per flow: NIC of the sender, NIC of the receiver, crossing machines?, phase index; ``src_bw`` /
    ``dst_bw``: per flow, its NICs' figures toward its destination / source (default B_n)."""
    n = len(nic_bandwidth)
    caps = np.full(len(src_nic), np.inf)
    if not cross.any():
        return caps
    k_out = np.bincount(phase[cross] * n + src_nic[cross], minlength=num_phases * n).reshape(num_phases, n)
    k_in = np.bincount(phase[cross] * n + dst_nic[cross], minlength=num_phases * n).reshape(num_phases, n)
    if schedule != "gpipe":  # 1F1B: activation and gradient cross at once (fused exchange)
        k_out = k_in = k_out + k_in
    c = np.flatnonzero(cross)
    if src_bw is None and dst_bw is None:
        egress = fair_share(nic_bandwidth[None, :], k_out)
        ingress = fair_share(nic_bandwidth[None, :], k_in)
        caps[c] = np.minimum(egress[phase[c], src_nic[c]], ingress[phase[c], dst_nic[c]])
        return caps
    src_bw = nic_bandwidth[src_nic] if src_bw is None else src_bw
    dst_bw = nic_bandwidth[dst_nic] if dst_bw is None else dst_bw
    caps[c] = np.minimum(src_bw[c] / k_out[phase[c], src_nic[c]], dst_bw[c] / k_in[phase[c], dst_nic[c]])
    return caps


def hop_caps(cluster: Cluster, chains: Sequence[Sequence[Sequence[int]]], schedule: str) -> dict[tuple[int, int], Caps]:
    """The NIC fair share of every flow of every hop of the pipelines ``chains`` (per pipeline, its
    stages' devices, leader first), the phases formed by boundary index: {(i, j): caps of the hop
    from stage j to j+1 of pipeline i}. Empty when no NIC serves two GPUs (then no flow is ever
    limited beyond its own link, ``config.nics.nics_can_bind``)."""
    if not cluster.nics_shared:
        return {}
    src, dst, phase, spans = [], [], [], []
    for i, stages in enumerate(chains):
        for j in range(len(stages) - 1):
            flows = hop_flows(stages[j], stages[j + 1])
            spans.append((i, j, len(src), len(flows)))
            for a, b in flows:
                src.append(a)
                dst.append(b)
                phase.append(j)
    if not src:
        return {}
    s, d, ph = np.array(src), np.array(dst), np.array(phase)
    cross = cluster.machine_of[s] != cluster.machine_of[d]
    per_dest = getattr(cluster, "nics_per_destination", False)
    caps = flow_caps(cluster.nic_of[s], cluster.nic_of[d], cross, ph, cluster.nic_bandwidth,
                     int(ph.max()) + 1, schedule,
                     cluster.nic_to[cluster.nic_of[s], cluster.machine_of[d]] if per_dest else None,
                     cluster.nic_to[cluster.nic_of[d], cluster.machine_of[s]] if per_dest else None).tolist()
    return {(i, j): tuple(caps[a:a + k]) for i, j, a, k in spans}


def hop_alone_caps(cluster: Cluster, src: Sequence[int], dst: Sequence[int], schedule: str) -> Caps:
    """:func:`hop_caps` of one hop with no other flow in its phase (its own flows still share their
    NICs): what a pipeline drafted on its own pays, and a lower bound of its price in any plan."""
    return hop_caps(cluster, [[tuple(src), tuple(dst)]], schedule).get((0, 0), ())


def dp_ring_rates(cluster: Cluster, dev: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per device slot (a device holding the layer fraction [lo, hi) in one pipeline; every
    pipeline's holder of the layer is given, so the slots covering a segment are its ring): the
    rate its data-parallel rings get from its NIC (module docstring, point 3),

        rate(d) = (hi - lo) * B_n(d) / U_n(d),
        U_n = summed length of the segments that span two machines and have a holder behind NIC n,

    inf when none of the slot's segments spans two machines, or no NIC serves two GPUs (then the
    term never binds). Compare with ``comm_dp``'s slowest partner link: the device's collectives
    run at the smaller of the two."""
    out = np.full(len(dev), np.inf)
    if len(dev) < 2 or not cluster.nics_shared:
        return out
    # memoised per cluster (cache.PricingCache): the search meets the same holders (layer intervals,
    # embedding) again and again
    cache = pricing_cache(cluster).ring_rates
    key = (np.asarray(dev, dtype=np.int64).tobytes(), np.asarray(lo, dtype=float).tobytes(),
           np.asarray(hi, dtype=float).tobytes())
    if key not in cache:
        if len(cache) >= RING_RATE_ENTRIES:
            cache.clear()
        cache[key] = _ring_rates(cluster, dev, lo, hi, out)
        cache[key].setflags(write=False)
    return cache[key].copy()



def _ring_rates(cluster: Cluster, dev: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`dp_ring_rates` computed (``out``: all inf, filled where a rate binds)."""
    mach, nic_of = cluster.machine_of[dev], cluster.nic_of[dev]
    # a NIC with one holder behind it has U <= its share: rate >= B_n, never below its own link
    if mach.min() == mach.max() or np.bincount(nic_of).max() < 2:
        return out
    bounds = np.array(sorted(set(lo.tolist()) | set(hi.tolist())))
    seg_lo, seg_hi = bounds[:-1], bounds[1:]
    cover = (lo[:, None] <= seg_lo[None, :]) & (seg_hi[None, :] <= hi[:, None])  # (slots, segments)
    top = np.where(cover, mach[:, None], -1).max(axis=0)
    bottom = np.where(cover, mach[:, None], np.iinfo(np.int64).max).min(axis=0)
    live = cover & (top != bottom)[None, :]  # the slot's segments whose ring spans two machines
    if not live.any():
        return out
    E = len(seg_lo)
    rows, cols = np.nonzero(live)
    touched = np.bincount(nic_of[rows] * E + cols, minlength=len(cluster.nic_bandwidth) * E).reshape(-1, E) > 0
    U = touched @ (seg_hi - seg_lo)  # per NIC of the cluster
    crossing = live.any(axis=1)
    n = nic_of[crossing]
    bw = cluster.nic_bandwidth[n]
    if getattr(cluster, "nics_per_destination", False):
        # per slot: the smallest figure of its NIC toward the machines of its crossing segments' other holders
        peers = (live.astype(float) @ cover.T.astype(float)) > 0  # (slots, slots): share a crossing segment
        bw = np.array([min((cluster.nic_to[nic_of[i], mach[j]] for j in np.flatnonzero(peers[i])
                            if mach[j] != mach[i]), default=cluster.nic_bandwidth[nic_of[i]])
                       for i in np.flatnonzero(crossing)])
    out[crossing] = (hi - lo)[crossing] * bw / U[n]
    return out


def holder_rates(cluster: Cluster, holders: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """:func:`dp_ring_rates` when every pipeline's holder of the synchronised tensor is one stage
    (devices in TP rank order, rank r of t holding [r/t, (r+1)/t)), per holder."""
    dev = np.array([d for h in holders for d in h], dtype=np.int64)
    lo = np.array([r / len(h) for h in holders for r in range(len(h))])
    hi = np.array([(r + 1) / len(h) for h in holders for r in range(len(h))])
    rates = dp_ring_rates(cluster, dev, lo, hi)
    cuts = np.cumsum([len(h) for h in holders])[:-1]
    return np.split(rates, cuts)
