"""The oracle's space and what it returns: its settings (the knobs a user pins in ``train.*``), its
result, and the pure enumerations it walks (device symmetry classes, partitions of count vectors,
layer splits, distinct rank orders). See :mod:`lightning_hexiscale.planner.oracle.exact`."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.cost.estimate import Estimate
from lightning_hexiscale.planner.plan import DP_SHARDINGS, SCHEDULES, Plan

@dataclass(frozen=True)
class OracleSettings:
    """What the oracle may vary (the same knobs a user pins in ``train.*``)."""

    schedule: str = "1f1b"
    recompute: bool | str = True
    """True / False: every pipeline alike; ``"auto"``: each pipeline recomputes or not, whichever
    its plan is faster with (the space ``recompute: auto`` searches)."""
    micro_batch_size: int | None = None
    """None: any micro-batch size per pipeline; else every pipeline uses this one."""
    dp_sharding: str | None = None
    """None: ddp, zero2 and zero3."""
    max_pipelines: int | None = None
    use_all_devices: bool = False
    """True: only plans that give every device work (the space before idle devices); False: also
    plans on any subset of the devices, the others named in ``Plan.idle_devices``."""

    def __post_init__(self) -> None:
        if not (isinstance(self.recompute, bool) or self.recompute == "auto"):
            raise ConfigError("train.recompute", self.recompute, "must be true, false or auto",
                              "pass recompute=True, False or 'auto' (each pipeline its own)")
        if self.schedule not in SCHEDULES:
            raise ConfigError("train.schedule", self.schedule, f"must be one of {SCHEDULES}", "use 1f1b")
        if self.dp_sharding is not None and self.dp_sharding not in DP_SHARDINGS:
            raise ConfigError("train.dp_sharding", self.dp_sharding, f"must be one of {DP_SHARDINGS}", "use zero2")
        for key, value, fix in (("train.micro_batch_size", self.micro_batch_size, "use e.g. 1, or None (any per pipeline)"),
                                ("planner.max_pipelines", self.max_pipelines, "use e.g. 2, or None (no limit)")):
            # 0 read as None (any size / no limit), True as 1, 1.5 was taken
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(key, value, "must be a positive integer or None", fix)
        if not isinstance(self.use_all_devices, bool):
            raise ConfigError("planner.use_all_devices", self.use_all_devices, "must be True or False",
                              "use False (plans may leave devices idle) or True (every device takes work)")

    @property
    def flags(self) -> tuple[bool, ...]:
        """The recompute flags a pipeline may take."""
        return (False, True) if self.recompute == "auto" else (self.recompute,)

    @classmethod
    def of(cls, settings) -> OracleSettings:
        """From a :class:`~lightning_hexiscale.planner.search.two_phase.SearchSettings` (or None)."""
        if settings is None:
            return cls()
        if isinstance(settings, cls):
            return settings
        return cls(settings.schedule, settings.recompute, settings.micro_batch_size, settings.dp_sharding,
                   settings.max_pipelines, bool(getattr(settings, "use_all_devices", False)))


@dataclass(frozen=True)
class OracleResult:
    plan: Plan | None
    """The optimal plan (the best found when incomplete); None when nothing fits."""
    estimate: Estimate | None
    complete: bool
    """True: the whole space was covered, the plan is optimal (or nothing fits)."""
    status: str
    """``optimal``, ``infeasible`` (complete, nothing fits) or ``incomplete`` (time limit)."""
    lower_bound_s: float
    """Proven lower bound of the optimal iteration time (equals the plan's when complete)."""
    time_s: float
    stats: dict = field(default_factory=dict)
    """Counts: partitions bounded / visited, structures kept, combinations evaluated exactly."""

    @property
    def cost(self) -> float:
        return self.estimate.cost if self.estimate is not None else math.inf


def device_classes(cluster: Cluster) -> list[list[int]]:
    """Classes of pairwise interchangeable devices, in device order: d joins a class when swapping
    it with every member leaves FLOP/s, memory, all links to third devices and the NICs unchanged
    (both use one NIC, or each is the only user of a NIC with the same figures, its bandwidth and
    its ``nics.to`` toward every machine: which transfers share a NIC, at what rate, is then the
    same after the swap)."""
    bw, lat = cluster.bandwidth, cluster.latency
    n = cluster.num_devices
    nic_of, nic_bw, nic_to = cluster.nic_of, cluster.nic_bandwidth, cluster.nic_to
    users = np.bincount(nic_of, minlength=len(nic_bw))

    def same_nic(a: int, b: int) -> bool:
        na, nb = nic_of[a], nic_of[b]
        return bool(na == nb or (users[na] == users[nb] == 1 and nic_bw[na] == nic_bw[nb]
                                 and np.array_equal(nic_to[na], nic_to[nb])))

    classes: list[list[int]] = []
    for d in range(n):
        dev = cluster.devices[d]
        for cl in classes:
            ok = True
            for r in cl:
                rv = cluster.devices[r]
                if (rv.flops, rv.memory_bytes, rv.gpu_type) != (dev.flops, dev.memory_bytes, dev.gpu_type) \
                        or not same_nic(d, r):
                    ok = False
                    break
                others = [x for x in range(n) if x not in (d, r)]
                if not (np.array_equal(bw[d, others], bw[r, others]) and np.array_equal(lat[d, others], lat[r, others])):
                    ok = False
                    break
            if ok:
                cl.append(d)
                break
        else:
            classes.append([d])
    return classes


def sub_vectors(counts: tuple[int, ...], all_devices: bool = False):
    """The device-count vectors a plan may use: every non-zero vector at most ``counts``, the
    largest first (only ``counts`` itself when ``all_devices``). Devices of one class are
    interchangeable, so which of them stay idle does not matter."""
    if all_devices:
        yield counts
        return
    for vec in itertools.product(*(range(c, -1, -1) for c in counts)):
        if any(vec):
            yield vec


def vector_partitions(remaining: tuple[int, ...], upper: tuple[int, ...] | None = None):
    """Multisets of non-zero count vectors summing to ``remaining``, each listed once (vectors in
    non-increasing lexicographic order, the first at most ``upper``)."""
    upper = remaining if upper is None else upper
    if not any(remaining):
        yield []
        return
    for vec in itertools.product(*(range(r, -1, -1) for r in remaining)):
        if not any(vec) or vec > upper:
            continue
        rest = tuple(r - v for r, v in zip(remaining, vec))
        for tail in vector_partitions(rest, vec):
            yield [vec] + tail


def compositions(total: int, parts: int) -> np.ndarray:
    """Every way to write ``total`` as ``parts`` positive integers in order, one row each."""
    rows = [np.diff((0,) + cuts + (total,)) for cuts in itertools.combinations(range(1, total), parts - 1)]
    return np.array(rows, dtype=np.int64).reshape(len(rows), parts)


def multiset_permutations(items: list) -> list[tuple]:
    """Distinct orderings of ``items`` (equal items are not swapped)."""
    out: list[tuple] = []
    counts: dict = {}
    order: list = []
    for x in items:
        if x not in counts:
            order.append(x)
        counts[x] = counts.get(x, 0) + 1

    def rec(prefix: list) -> None:
        if len(prefix) == len(items):
            out.append(tuple(prefix))
            return
        for x in order:
            if counts[x]:
                counts[x] -= 1
                prefix.append(x)
                rec(prefix)
                prefix.pop()
                counts[x] += 1

    rec([])
    return out


def generous_room(terms: E.MemoryTerms, cap: float) -> float:
    """The most layers fitting ``cap`` in every phase, rounded up by a hair (see :meth:`.terms.OracleTerms.room_pos`)."""
    most = math.inf
    for f, p in terms.phases:
        if f > cap * (1 + 1e-12):
            return -1.0
        if p > 0:
            most = min(most, math.floor((cap - f) / p * (1 + 1e-9) + 1e-9))
    return float(min(most, 1 << 30))


def contexts(vecs: tuple) -> list[tuple]:
    """Per pipeline of a partition: (its device counts, the sorted device counts of the others)."""
    return [(v, tuple(sorted(vecs[:i] + vecs[i + 1:]))) for i, v in enumerate(vecs)]


def rest_of(stage: tuple[int, ...], leader: int) -> tuple[int, ...]:
    """The stage's class labels without one ``leader``, sorted (the canonical rank order)."""
    rest = list(stage)
    rest.remove(leader)
    return tuple(sorted(rest))
