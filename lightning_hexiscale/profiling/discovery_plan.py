"""What discovery measures, decided from the ranks' reports alone. Pure: no torch, no I/O but the cache path.

Discovery (:mod:`lightning_hexiscale.profiling.discover`) measures per machine pair and per device
type instead of per device pair. From every rank's :class:`RankReport` (host, device type, memory,
capability) this module derives, identically on every rank:

- the **hosts** (machines) in order of first rank, and per host its ranks;
- the **inter-machine pairs**: one representative pair per (host, host), the first rank of each,
  scheduled as the rounds of a round-robin tournament over the hosts (H - 1 rounds for H even), so
  that a host takes part in at most one cross-host measurement at a time (its NIC is not shared);
- the **intra-machine pairs**: one pair per (device type, device type) that meets on some host;
- the **matrices** every rank pair gets: the figures of its host pair or of its type pair;
- the **fingerprint** the cluster file is cached under (:func:`fingerprint`, :func:`cache_path`).

Count of timed measurements (:func:`measurement_count`), for H hosts x G devices of T device types,
D TP degrees, M micro-batch sizes, against the full profile's N(N-1)/2 pairs (N = H G):

    flops T + layer cases T D M 3 + inter links H(H-1)/2 + NICs H K + intra links (type pairs met on a host)

(a NIC is measured per kind K of the other machines (their device types), on a host with two or more
ranks that can send to two or more ranks of that kind: :func:`nic_groups`; one kind: K = 1;
:func:`measurement_count` takes K = T, every host seeing every type elsewhere)

- 8 x 8, one type, TP 1/2/4/8, micro-batches 1/2/4: 1 + 36 + 28 + 8 + 1 = **74** (full profile: 2016 pairs)
- 128 x 8, same: 1 + 36 + 8128 + 128 + 1 = **8294** (full profile: 523776 pairs)

The FLOP/s and layer cases of one type run on all of its ranks at once (as they compute in
training), so their wall time does not grow with the device count; inter links run H/2 at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_hexiscale.config.file_errors import expand_user
from lightning_hexiscale.profiling.fit import Pair, round_robin, split_round

CACHE_ENV = "HEXISCALE_CACHE_DIR"
"""Environment variable naming the folder discovered cluster files are cached in (default
``~/.cache/lightning_hexiscale/clusters``)."""

PARTS_PER_CASE = 3
"""Layer-table parts timed per (type, TP degree, micro-batch): layer, head, embedding."""

FORMAT_VERSION = 2
"""Part of the fingerprint: a new discovery format never reuses an older file. 2: a NIC's figure is
read from its transfers' common span (``fit.NicFit.aggregate_Bps``); version 1 summed per-flow
figures, which read a shared NIC up to ~30 % high."""


@dataclass(frozen=True)
class RankReport:
    """What one rank says about itself before anything is measured. Units: bytes."""

    host: str
    """Its machine: the host name, or ``HEXISCALE_MACHINE`` (the emulator's machine, a node's name)."""
    device_type: str
    """``CPU``, the sanitised CUDA device name, or the emulator's ``HEXISCALE_DEVICE_TYPE``."""
    memory_bytes: float
    """Device memory (CUDA total), or on CPU the host's RAM share (or the rank's cgroup limit)."""
    capability: str
    """``sm_90``-style CUDA compute capability, or ``cpu``."""
    hopper: bool = False


@dataclass(frozen=True)
class MeasurementCount:
    """How many timed measurements discovery makes (module docstring for the formula)."""

    flops: int
    layer_cases: int
    inter_links: int
    nics: int
    intra_links: int
    full_profile_pairs: int
    """What the full profile (``hexiscale profile``) measures instead: every rank pair, N(N-1)/2."""

    @property
    def total(self) -> int:
        return self.flops + self.layer_cases + self.inter_links + self.nics + self.intra_links

    def describe(self) -> str:
        return (f"{self.total} measurements: FLOP/s {self.flops}, layer cases {self.layer_cases}, "
                f"machine-pair links {self.inter_links}, NICs {self.nics}, intra-machine links {self.intra_links} "
                f"(a full profile: {self.full_profile_pairs} rank pairs)")


def default_tp_count(gpus_per_host: int) -> int:
    """TP degrees a homogeneous machine of ``gpus_per_host`` devices is measured at: the powers of two
    up to it, plus the count itself when it is not one (as
    :func:`~lightning_hexiscale.profiling.layer_times.default_tp_degrees` with enough KV heads)."""
    degrees = {1 << k for k in range(gpus_per_host.bit_length()) if (1 << k) <= gpus_per_host} | {gpus_per_host}
    return len(degrees)


def measurement_count(hosts: int, gpus_per_host: int, device_types: int = 1, tp_degrees: int | None = None,
                      micro_batches: int = 3) -> MeasurementCount:
    """Measurements for ``hosts`` x ``gpus_per_host`` devices, each host of one of ``device_types``
    types (every type on at least one host, no host mixing types). ``tp_degrees``: how many TP
    degrees the layer tables hold (default :func:`default_tp_count`)."""
    if hosts < 1 or gpus_per_host < 1 or not 1 <= device_types <= hosts:
        raise ValueError(f"need hosts >= 1, gpus_per_host >= 1 and 1 <= device_types <= hosts, got "
                         f"{hosts}, {gpus_per_host}, {device_types}")
    d = tp_degrees if tp_degrees is not None else default_tp_count(gpus_per_host)
    n = hosts * gpus_per_host
    return MeasurementCount(flops=device_types, layer_cases=device_types * d * micro_batches * PARTS_PER_CASE,
                            inter_links=hosts * (hosts - 1) // 2,
                            nics=hosts * device_types if hosts > 1 and gpus_per_host > 1 else 0,
                            intra_links=device_types if gpus_per_host > 1 else 0,
                            full_profile_pairs=n * (n - 1) // 2)


def hosts_in_order(reports: Sequence[RankReport]) -> dict[str, list[int]]:
    """{host: its ranks}, hosts in order of first rank. Uneven hosts (1 rank here, 3 there) are fine."""
    out: dict[str, list[int]] = {}
    for r, rep in enumerate(reports):
        out.setdefault(rep.host, []).append(r)
    return out


def inter_steps(reports: Sequence[RankReport], max_pairs: int | None = None) -> list[list[Pair]]:
    """One representative rank pair per host pair (the first rank of each host), as steps of pairs
    measured at once: the round-robin rounds over the hosts, each split so that at most ``max_pairs``
    run together (each host is in at most one pair of a round already)."""
    hosts = hosts_in_order(reports)
    first = [ranks[0] for ranks in hosts.values()]
    names = [rep.host for rep in reports]
    steps = []
    for rnd in round_robin(len(first)):
        pairs = [(first[a], first[b]) for a, b in rnd]
        steps += split_round(pairs, names, max_pairs, isolate_hosts=True)
    return steps


def intra_pairs(reports: Sequence[RankReport]) -> dict[tuple[str, str], Pair]:
    """One rank pair per (type, type) (sorted names) that meets on a host: the first host where two
    distinct ranks of those types sit, its lowest such ranks."""
    out: dict[tuple[str, str], Pair] = {}
    for ranks in hosts_in_order(reports).values():
        for i, a in enumerate(ranks):
            for b in ranks[i + 1:]:
                key = tuple(sorted((reports[a].device_type, reports[b].device_type)))
                out.setdefault(key, (a, b))
    return out


def host_kind(reports: Sequence[RankReport], ranks: Sequence[int]) -> tuple[str, ...]:
    """A machine's kind: the sorted device types of its ranks."""
    return tuple(sorted({reports[r].device_type for r in ranks}))


def nic_groups(reports: Sequence[RankReport]) -> list[tuple[str, tuple[str, ...], list[Pair]]]:
    """Per host with two or more ranks and per kind of the other hosts (:func:`host_kind`, in order of
    first rank): (host, the hosts of that kind, the (sender, receiver) pairs whose transfers leave the
    host at once): every rank of the host, at most as many as the kind has ranks, sends to a rank of
    that kind, the receivers dealt over its hosts in turn. Kept when two or more transfers result.
    With one kind of other hosts this is :func:`~lightning_hexiscale.profiling.fit.nic_pairs`.
    Deterministic, so every rank computes the same list."""
    hosts = hosts_in_order(reports)
    out = []
    for h, senders in hosts.items():
        kinds: dict[tuple[str, ...], list[str]] = {}
        for o, ranks in hosts.items():
            if o != h:
                kinds.setdefault(host_kind(reports, ranks), []).append(o)
        for dest in kinds.values():
            groups = [hosts[o] for o in dest]
            receivers = [rs[k] for k in range(max(len(rs) for rs in groups)) for rs in groups if k < len(rs)]
            k = min(len(senders), len(receivers))
            if k >= 2:
                out.append((h, tuple(dest), list(zip(senders[:k], receivers[:k]))))
    return out


def disjoint_steps(pairs: Sequence[Pair], max_pairs: int | None = None) -> list[list[Pair]]:
    """Greedy steps of pairs that share no rank, at most ``max_pairs`` per step, in the given order."""
    steps: list[list[Pair]] = []
    for p in pairs:
        for s in steps:
            if (max_pairs is None or len(s) < max_pairs) and not set(p) & {r for q in s for r in q}:
                s.append(p)
                break
        else:
            steps.append([p])
    return steps


def count_for(reports: Sequence[RankReport], tp_degrees: int, micro_batches: int) -> MeasurementCount:
    """The :class:`MeasurementCount` of these ranks (any mix of hosts and types)."""
    types = {r.device_type for r in reports}
    hosts = hosts_in_order(reports)
    n = len(reports)
    return MeasurementCount(flops=len(types), layer_cases=len(types) * tp_degrees * micro_batches * PARTS_PER_CASE,
                            inter_links=len(hosts) * (len(hosts) - 1) // 2,
                            nics=len(nic_groups(reports)),
                            intra_links=len(intra_pairs(reports)), full_profile_pairs=n * (n - 1) // 2)


def fill_links(reports: Sequence[RankReport], inter: dict[tuple[str, str], tuple[float, float, float]],
               intra: dict[tuple[str, str], tuple[float, float, float]]):
    """N x N (bandwidth B/s, latency s, fit residual) from the representatives' (alpha, beta, rel):
    a cross-host pair gets its host pair's figures, a same-host pair its type pair's. Returns three
    nested lists (inf / 0 / 0 on the diagonal)."""
    n = len(reports)
    bw = [[float("inf")] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    err = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            ra, rb = reports[a], reports[b]
            if ra.host != rb.host:
                alpha, beta, rel = inter[tuple(sorted((ra.host, rb.host)))]
            else:
                alpha, beta, rel = intra[tuple(sorted((ra.device_type, rb.device_type)))]
            bw[a][b], lat[a][b], err[a][b] = beta, alpha, rel
    return bw, lat, err


def fingerprint(reports: Sequence[RankReport], model_shape: dict | None, precision: str, torch_version: str,
                settings: dict | None = None) -> str:
    """sha256 (first 20 hex digits) of what a discovered file depends on: per rank its host, device
    type, memory (MiB) and compute capability, the model's shape, the precision, the torch version and the discovery
    settings that shape the file (TP degrees, micro-batch sizes)."""
    doc = {"format": FORMAT_VERSION,
           "ranks": [[r.host, r.device_type, int(r.memory_bytes // 2**20), r.capability] for r in reports],
           "model": model_shape, "precision": precision, "torch": torch_version, "settings": settings or {}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """``$HEXISCALE_CACHE_DIR``, else ``~/.cache/lightning_hexiscale/clusters``."""
    env = os.environ.get(CACHE_ENV)
    return expand_user(env) if env else Path.home() / ".cache" / "lightning_hexiscale" / "clusters"


def cache_path(fp: str) -> Path:
    """Where the cluster file of fingerprint ``fp`` lives (its matrices beside it, ``.matrix.yaml``)."""
    return cache_dir() / f"{fp}.yaml"
