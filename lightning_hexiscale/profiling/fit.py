"""Pure pieces of the profiler: the alpha-beta fit and the pair schedule. No torch, no I/O.

Link model (the paper's Appendix B notation): sending ``s`` bytes from device d to d' takes

    t(s) = alpha[d, d'] + s / beta[d, d']        (seconds; alpha in s, beta in bytes/s)

measured as half the round trip of a ping-pong (d sends s bytes, d' sends them back), at several
sizes, and fitted by least squares. Pairs are measured in rounds of a round-robin tournament:
N - 1 rounds of N/2 disjoint pairs cover all N(N-1)/2 pairs exactly once, so with every pair of a
round running at the same time 64 ranks need 63 rounds instead of 2016 sequential pair tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Pair = tuple[int, int]


@dataclass(frozen=True)
class LinkFit:
    """Result of :func:`fit_alpha_beta` for one pair."""

    alpha_s: float
    """Latency alpha in seconds (>= 0)."""
    beta_Bps: float
    """Bandwidth beta in bytes/s (> 0)."""
    rel_rms: float
    """Root-mean-square relative residual of the fit over the sizes, e.g. 0.03 = 3 %."""


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float], reduce: str = "median") -> LinkFit:
    """Least-squares fit of t = alpha + s / beta to (size, one-way time) samples.

    Samples of the same size are first reduced to one time: ``median`` (default: the typical time,
    robust to a stray slow sample; it keeps effects every message pays, such as a sleeping
    receiver's wake-up, which on a virtual machine can add milliseconds) or ``min`` (the link's
    best case, the classic micro-benchmark convention). The fit minimises RELATIVE residuals,

        min_{alpha, g}  sum_k ((alpha + s_k * g - t_k) / t_k)^2,   beta = 1 / g,

    because the times span orders of magnitude (0.1 ms at 1 KiB, 10 ms at 16 MiB): an absolute
    least-squares fit would let the large sizes swallow alpha entirely. A negative alpha (noise at
    the small sizes) is clamped to 0 and g refitted alone: g = sum(s/t) / sum((s/t)^2).

    Raises ValueError when fewer than two distinct sizes are given or when the time does not grow
    with the size: the fitted s_max / beta is under 5 % of the largest size's time (no bandwidth can
    be read from such data).
    """
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"sizes and times must be 1-D of equal length, got {s.shape} and {t.shape}")
    if not (np.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"times must be finite and > 0, got {t.tolist()}")
    if reduce not in ("median", "min"):
        raise ValueError(f"reduce must be 'median' or 'min', got {reduce!r}")
    uniq = np.unique(s)
    if len(uniq) < 2:
        raise ValueError(f"need at least two distinct message sizes to separate alpha from beta, got {uniq.tolist()}")
    agg = np.median if reduce == "median" else np.min
    med = np.array([agg(t[s == u]) for u in uniq])
    a = np.stack([1.0 / med, uniq / med], axis=1)
    (alpha, g), *_ = np.linalg.lstsq(a, np.ones_like(med), rcond=None)
    if alpha < 0:
        x = uniq / med
        alpha, g = 0.0, float(x.sum() / (x * x).sum())
    # the bandwidth term must be a readable part of the largest message's time: below 5 % it is
    # noise (flat times fit g ~ 1e-22, a link priced at 1e21 B/s), not a measurement
    if not g * uniq[-1] >= 0.05 * med[-1]:
        raise ValueError(f"the time does not grow with the message size (medians {med.tolist()} s for sizes "
                         f"{uniq.tolist()} B): use larger messages so that bandwidth dominates the largest")
    pred = alpha + uniq * g
    rel = float(np.sqrt(np.mean(((pred - med) / med) ** 2)))
    return LinkFit(float(alpha), float(1.0 / g), rel)


def fit_or_bound(sizes: Sequence[int], times: Sequence[float], reps: int, stat: str) -> tuple[float, float, float, str]:
    """(alpha s, beta B/s, relative residual, note) of one pair's ping-pong times. When the time does
    not grow with the size (a link so fast that scheduling noise hides it, e.g. loopback between
    throttled CPU ranks), beta is the lower bound largest size / its time, alpha 0, and the note
    says so (printed and written into the file)."""
    samples = [s for s in sizes for _ in range(reps)]
    try:
        f = fit_alpha_beta(samples, times, stat)
        return f.alpha_s, f.beta_Bps, f.rel_rms, ""
    except ValueError:
        top = max(sizes)
        t = sorted(times[i] for i, s in enumerate(samples) if s == top)[len([s for s in samples if s == top]) // 2]
        return 0.0, top / t, 0.0, (f"time did not grow with the size ({min(sizes)}-{top} B): written as the lower "
                                   f"bound {top} B / {t * 1e3:.2f} ms = {top / t / 1e6:.0f} MB/s")


def round_robin(n: int) -> list[list[Pair]]:
    """Round-robin tournament (circle method) over ranks 0..n-1: every pair exactly once, the pairs
    of one round disjoint. n - 1 rounds of n/2 pairs for even n; n rounds of (n-1)/2 pairs (one
    rank rests) for odd n. Pairs are (low, high).

    Circle method: keep rank 0 fixed, lay the others on a circle and rotate by one per round;
    in each round position i plays position n'-1-i (n' = n rounded up to even, the extra slot
    being a bye).
    """
    if n < 2:
        return []
    players: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = players[i], players[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def split_round(pairs: Sequence[Pair], hosts: Sequence[str], max_pairs: int | None = None,
                isolate_hosts: bool = True) -> list[list[Pair]]:
    """Split one round's disjoint pairs into sub-rounds that run one after the other.

    Concurrent pairs distort each other when they share a resource; two rules prevent the known
    cases, greedily in pair order (deterministic, so every rank computes the same schedule):

    - ``isolate_hosts``: at most one cross-host pair per host in a sub-round, because all cross-host
      pairs of a host share its network interface (8 GPUs of one host measured against 8 of another
      at once would each see 1/8 of the NIC). Pairs inside one host run concurrently.
    - ``max_pairs``: at most this many pairs at once (None: no limit), e.g. cores // 2 on a CPU
      host where each rank of a gloo pair keeps a core busy copying bytes.
    """
    if max_pairs is not None and max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1 or None, got {max_pairs}")
    subs: list[list[Pair]] = []
    busy: list[set[str]] = []  # hosts whose NIC a sub-round's cross-host pair already uses
    for a, b in pairs:
        cross = hosts[a] != hosts[b]
        for k, sub in enumerate(subs):
            if max_pairs is not None and len(sub) >= max_pairs:
                continue
            if cross and isolate_hosts and (hosts[a] in busy[k] or hosts[b] in busy[k]):
                continue
            sub.append((a, b))
            if cross:
                busy[k] |= {hosts[a], hosts[b]}
            break
        else:
            subs.append([(a, b)])
            busy.append({hosts[a], hosts[b]} if cross else set())
    return subs


def pair_schedule(n: int, hosts: Sequence[str], max_pairs: int | None = None,
                  isolate_hosts: bool = True) -> list[list[Pair]]:
    """All pairs of ``n`` ranks as a list of steps, each a list of disjoint pairs measured at once:
    the :func:`round_robin` rounds, each split by :func:`split_round`."""
    if len(hosts) != n:
        raise ValueError(f"need one host name per rank: {len(hosts)} names for {n} ranks")
    return [sub for rnd in round_robin(n) for sub in split_round(rnd, hosts, max_pairs, isolate_hosts)]


def default_sizes(cuda: bool) -> tuple[int, ...]:
    """Message sizes in bytes for the ping-pong: from latency-dominated to bandwidth-dominated.

    CPU/gloo: 1 KiB .. 4 MiB (loopback TCP reaches ~1-2 GB/s, so 4 MiB takes a few ms: bandwidth
    dominated, and a pair costs ~50 ms). GPU/NCCL: 4 KiB .. 64 MiB (NVLink at 200+ GB/s needs tens of
    MiB before bandwidth dominates the ~10 us launch latency).
    """
    if cuda:
        return (4 << 10, 256 << 10, 4 << 20, 16 << 20, 64 << 20)
    return (1 << 10, 64 << 10, 512 << 10, 2 << 20, 4 << 20)


@dataclass(frozen=True)
class NicFit:
    """Concurrent transfers leaving one machine (``profile_process_group`` step 5), fitted per flow."""

    flows: int
    """Transfers run at once, each from its own rank of the machine to a rank of another machine."""
    single_Bps: float
    """Bandwidth of the first of them run alone (bytes/s)."""
    per_flow_Bps: tuple[float, ...]
    """Bandwidth of each transfer while all ``flows`` ran at once (bytes/s)."""
    span_Bps: float | None = None
    """All ``flows`` transfers together over their common span (bytes/s): t = alpha + flows * s / beta
    fitted to span = latest end - earliest start of each round (:func:`common_spans`); None when the
    senders' clocks were not recorded."""

    @property
    def aggregate_Bps(self) -> float:
        """What the machine's network interface carried with ``flows`` transfers at once: the NIC
        figure written to the cluster file (``nics.bandwidth``). ``span_Bps`` where measured, else
        the sum of the per-flow bandwidths.

        Why the span: the sum assumes the transfers run side by side from start to end. A shared
        interface need not split itself fairly: with shares a > b (a + b = C) the first transfer
        ends at s / a and the second then runs alone at C, so its time is 2s / C and the fitted
        per-flow figures are a and C/2, whose sum a + C/2 exceeds C (an emulated 40 MB/s NIC read
        28.7 + 20.8 = 49.5 MB/s). The span carries 2s in 2s / C whatever the split, and a start
        skew between the senders that does not grow with s lands in alpha."""
        return float(self.span_Bps) if self.span_Bps is not None else float(sum(self.per_flow_Bps))

    @property
    def sharing(self) -> float:
        """single / mean concurrent per-flow bandwidth: ~1 when every transfer has a link of its own,
        ~flows when they share one interface."""
        return self.single_Bps * len(self.per_flow_Bps) / self.aggregate_Bps


def common_spans(stamps: Sequence[Sequence[tuple[float, float]]]) -> list[float]:
    """Per round of concurrent transfers: the latest end minus the earliest start over the flows
    (``stamps[f][k]``: (start, end) of flow f's k-th transfer, seconds of one clock). The senders of a
    NIC measurement share their machine, hence ``time.perf_counter``'s clock (CLOCK_MONOTONIC)."""
    rounds = {len(s) for s in stamps}
    if len(rounds) != 1:
        raise ValueError(f"every flow must have the same rounds, got {sorted(len(s) for s in stamps)}")
    return [max(s[k][1] for s in stamps) - min(s[k][0] for s in stamps) for k in range(rounds.pop())]


def nic_pairs(hosts: Sequence[str]) -> list[tuple[str, list[Pair]]]:
    """Per host with two or more ranks and ranks elsewhere: the (sender, receiver) pairs whose
    transfers leave it at once: every rank of the host (at most as many as there are ranks
    elsewhere) sends to a rank of another host, the receivers dealt over the other hosts in turn
    (so that no single receiving interface is what limits them). Hosts in order of first rank;
    deterministic, so every rank computes the same list."""
    order = list(dict.fromkeys(hosts))
    by_host = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    out = []
    for h in order:
        senders = by_host[h]
        others = [by_host[o] for o in order if o != h]
        # receivers round-robin over the other hosts: first rank of each, then the second of each, ...
        receivers = [rs[k] for k in range(max((len(rs) for rs in others), default=0)) for rs in others if k < len(rs)]
        k = min(len(senders), len(receivers))
        if k >= 2:
            out.append((h, list(zip(senders[:k], receivers[:k]))))
    return out


def fit_nic(sizes_bytes: Sequence[float], single_times_s: Sequence[float],
            concurrent_times_s: Sequence[Sequence[float]], reduce: str = "median",
            concurrent_stamps: Sequence[Sequence[tuple[float, float]]] | None = None) -> NicFit:
    """:class:`NicFit` from the sender-side times of one transfer alone and of ``len(concurrent_times_s)``
    transfers at once (the same ``sizes_bytes`` samples for each), each fitted t = alpha + s / beta
    (:func:`fit_alpha_beta`); with ``concurrent_stamps`` (per flow, (start, end) of each of those
    transfers on the machine's clock) also all of them together over their common span
    (``NicFit.span_Bps``, the NIC figure)."""
    single = fit_alpha_beta(sizes_bytes, single_times_s, reduce).beta_Bps
    per_flow = tuple(fit_alpha_beta(sizes_bytes, t, reduce).beta_Bps for t in concurrent_times_s)
    span = None
    if concurrent_stamps is not None:
        n = len(concurrent_stamps)
        span = fit_alpha_beta([n * s for s in sizes_bytes], common_spans(concurrent_stamps), reduce).beta_Bps
    return NicFit(len(per_flow), single, per_flow, span)
