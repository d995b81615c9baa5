"""What the search takes and returns: :class:`SearchSettings` (from ``cfg.planner`` + ``cfg.train``),
one :class:`Iteration`'s choices, the search log and :class:`SearchResult`; and the D_dp ladder
the first pass enumerates. The search itself: :mod:`lightning_hexiscale.planner.search.entry`."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.cost.estimate import Estimate
from lightning_hexiscale.planner.plan import MAX_GLOBAL_BATCH, SCHEDULES, Plan, check_global_batch_bound
from lightning_hexiscale.planner.search.assemble import DP_OPTIONS

CUTS = ("auto", "min", "max")
MAX_ITERATIONS = 100_000
"""Most search iterations (``planner.iterations``): hours of search on a large cluster; 2**70 never ended."""
LARGE_FROM = 64
"""Beyond this many devices a cluster is large. The two-phase search (:mod:`planner.search.two_phase`)
then prunes layouts against the best plan so far (``two_phase._PRUNE``), sweeps the D_dp values coarse
to fine (``first_sweep``), drafts once per sharding and micro-batch size, takes DDP's layouts
from ZeRO-2's drafts and tries ZeRO-3 only when nothing else fits; the symmetric seeds
(:mod:`planner.search.symmetric_seeds`) are drafted once per layout."""


@dataclass(frozen=True)
class SearchSettings:
    """What the search may vary and for how long. Built from ``cfg.planner`` + ``cfg.train``."""

    iterations: int = 50
    seed: int = 0
    tau: int = 2
    """Top-tau width of the stage-order search."""
    balance: float = 1.2
    """Phase-1 bound: max set compute / mean set compute."""
    group_balance: float = 2.0
    """Phase-2 bound: groups may differ more (layers follow compute anyway)."""
    max_pipelines: int | None = None
    cut: str = "auto"
    """auto (moving averages, §4.4), min or max."""
    progress: bool = False
    schedule: str = "1f1b"
    recompute: bool | str = "auto"
    """Activation recomputation per layer: ``auto`` (the search tries the plan without and with it
    and keeps the faster one that fits: :func:`entry.search`), or True / False to pin it."""
    micro_batch_size: int | None = None
    """None: the batch split picks one per pipeline (``assemble.batch_micro_sizes``); else every
    pipeline uses this one (it must divide the global batch)."""
    dp_sharding: str | None = None
    """None: the search tries ddp, zero2 and zero3."""
    use_all_devices: bool = False
    """True: every device takes work (the search before subsets); False: the plan may leave devices
    idle where that is faster (:mod:`planner.search.subsets`), naming them in ``Plan.idle_devices``."""
    tp_degrees: tuple[int, ...] | None = None
    """The TP degrees a stage may have (None: any up to the KV heads). The ``uniform-tp`` baseline
    sets one; devices no allowed TP group covers stay idle."""

    def __post_init__(self) -> None:
        # whole numbers first: 2.5 / '3' / 'a' were TypeErrors from the comparisons below or from
        # numpy, and True ran as 1 (a bool is no count)
        for key, value, example in (("planner.iterations", self.iterations, 50), ("planner.seed", self.seed, 0),
                                    ("planner.tau", self.tau, 2), ("planner.max_pipelines", self.max_pipelines, "null")):
            if value is None and key == "planner.max_pipelines":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(key, value, "must be an integer", f"use e.g. {example}")
        for key, value, example in (("balance", self.balance, 1.2), ("group_balance", self.group_balance, 2.0)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"planner.{key}", value, "must be a number (max / mean compute)", f"use e.g. {example}")
        if not isinstance(self.progress, bool):
            raise ConfigError("planner.progress", self.progress, "must be true or false", "use false")
        if isinstance(self.tp_degrees, list):
            object.__setattr__(self, "tp_degrees", tuple(self.tp_degrees))
        if self.tp_degrees is not None and not isinstance(self.tp_degrees, tuple):
            raise ConfigError("tp_degrees", self.tp_degrees, "must be a tuple of TP degrees (or None)", "use e.g. (2,)")
        if not 1 <= self.iterations <= MAX_ITERATIONS:  # 2**70 was a search that never ended
            raise ConfigError("planner.iterations", self.iterations, f"must be between 1 and {MAX_ITERATIONS:,}",
                              "use e.g. 50 (the default; each iteration takes milliseconds to a second)")
        if self.tau < 1:
            raise ConfigError("planner.tau", self.tau, "must be at least 1", "use e.g. 2")
        if self.seed < 0:  # numpy's generators take none: it was their ValueError traceback
            raise ConfigError("planner.seed", self.seed, "must be a non-negative integer", "use e.g. 0")
        for key, value, example in (("balance", self.balance, 1.2), ("group_balance", self.group_balance, 2.0)):
            if not 1.0 <= value < math.inf:  # nan, 0 and inf passed here: the partitions took them as bounds
                raise ConfigError(f"planner.{key}", value,
                                  "a balance factor (max / mean compute) is a finite number of at least 1",
                                  f"use e.g. {example}")
        if self.cut not in CUTS:
            raise ConfigError("planner.cut", self.cut, f"must be one of {CUTS}", "use auto")
        if not (isinstance(self.recompute, bool) or self.recompute == "auto"):
            raise ConfigError("train.recompute", self.recompute, "must be auto, true or false",
                              "use auto (the planner prices both and keeps the faster plan that fits), or pin "
                              "true / false")
        if self.schedule not in SCHEDULES:
            raise ConfigError("train.schedule", self.schedule, f"must be one of {SCHEDULES}", "use 1f1b")
        if self.dp_sharding is not None and self.dp_sharding not in DP_OPTIONS:
            raise ConfigError("train.dp_sharding", self.dp_sharding, f"must be one of {DP_OPTIONS}", "use zero2")
        if self.max_pipelines is not None and self.max_pipelines < 1:
            raise ConfigError("planner.max_pipelines", self.max_pipelines, "must be at least 1 (or null)", "use null")
        if not isinstance(self.use_all_devices, bool):
            raise ConfigError("planner.use_all_devices", self.use_all_devices, "must be true or false",
                              "use false (the plan may leave slow devices idle) or true (every device takes work)")
        if self.micro_batch_size is not None and (
                isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, numbers.Integral)
                or not 1 <= self.micro_batch_size <= MAX_GLOBAL_BATCH):
            # 'abc', -1, nan and [] were taken at construction and failed (or split nothing) inside the search
            raise ConfigError("train.micro_batch_size", self.micro_batch_size,
                              "must be a positive integer that divides the global batch (or null)",
                              "use null (the batch split picks one per pipeline) or e.g. 1")
        if self.tp_degrees is not None and (not self.tp_degrees or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.tp_degrees)):
            raise ConfigError("tp_degrees", self.tp_degrees, "must be positive integers (or None)", "use e.g. (2,)")

    @classmethod
    def from_config(cls, cfg: Any, dp_sharding_explicit: bool = False, **changes: Any) -> SearchSettings:
        """From a composed root config; ``train.dp_sharding`` binds only when the user set it."""
        p, t = cfg.planner, cfg.train
        kw = dict(iterations=int(p.iterations), seed=int(p.seed), tau=int(p.tau), balance=float(p.balance),
                  max_pipelines=p.max_pipelines, progress=bool(p.progress), schedule=str(t.schedule),
                  recompute=recompute_setting(t.get("recompute", "auto")), micro_batch_size=t.micro_batch_size,
                  dp_sharding=str(t.dp_sharding) if dp_sharding_explicit else None)
        for key in ("cut", "group_balance", "use_all_devices"):
            if key in p:
                kw[key] = p[key]
        kw.update(changes)
        return cls(**kw)


@dataclass(frozen=True)
class Iteration:
    """What one iteration of the search tries."""

    dp: int
    """D_dp, the number of pipelines."""
    cut: str
    balance: float
    seed: int
    jitter: float = 0.0
    """Probability of varying k_i (the groups per pipeline) around the machine count."""
    peel: int = 0
    """The ``peel`` strongest replica units become replicas of their own (mixed structures)."""
    unit: int = 1
    """Devices per peeled replica: 1 (single devices) or 2 (same-machine TP-2 pairs); 0 peels columns
    instead, thin pipelines of one device per machine (``two_phase.COLUMN``)."""


@dataclass(frozen=True)
class LogEntry:
    iteration: int
    num_pipelines: int
    cut: str
    cost_s: float
    """Best cost of this iteration (inf: nothing fitted)."""
    best_s: float
    """Best cost so far."""


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    estimate: Estimate
    log: list[LogEntry] = field(default_factory=list)
    """The iterations of the search on every device (the subset trials are in ``subsets``)."""
    search_time_s: float = 0.0
    """Wall time of the whole search, subset trials included."""
    subsets: Any = None
    """:class:`~lightning_hexiscale.planner.search.subsets.SubsetReport`: which device subsets were
    searched, and what each machine is worth (None with ``use_all_devices``)."""
    sources: list = field(default_factory=list)
    """:class:`~lightning_hexiscale.planner.cost.sources.PriceSource` per device type the plan uses:
    what priced it (layer table, calibrated, datasheet, ...)."""


def global_batch_setting(value: Any, example: int = 32) -> int:
    """``train.global_batch`` as the search and the oracle take it: a positive whole number (a numpy
    integer too); a bool, a float (2.5, or 8.0 that hides a computed value) or a string is refused."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError("train.global_batch", value, "must be a positive integer (sequences per optimizer step)",
                          f"use e.g. {example}")
    check_global_batch_bound(value)  # search(.., 2**70) was an OverflowError from the batch split
    return int(value)


def recompute_setting(value: Any, key: str = "train.recompute") -> bool | str:
    """``auto`` (also null), True or False from a config value (YAML's true / false, or the strings
    "true" / "false" from a command line); anything else is a ConfigError."""
    if value is None or (isinstance(value, str) and value.lower() == "auto"):
        return "auto"
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(key, value, "must be auto, true or false",
                      "use auto (the planner decides by memory and time), or pin true / false")


def dp_candidates(num_devices: int, max_dp: int, num_machines: int) -> list[int]:
    """D_dp values the first pass enumerates: all of 1..16, then a x1.3 ladder, plus the machine
    count and its halves/doubles (pipelines that align with machines), capped at ``max_dp``."""
    vals = set(range(1, min(max_dp, 16) + 1))
    x = 16
    while x < max_dp:
        x = int(math.ceil(x * 1.3))
        vals.add(min(x, max_dp))
    for m in (num_machines // 2, num_machines, 2 * num_machines, 4 * num_machines):
        if 1 <= m <= max_dp:
            vals.add(m)
    return sorted(vals)


def first_sweep(n: int, iterations: int, coarse_first: bool) -> list[int]:
    """Indices of the D_dp candidates (ascending, ``n`` of them) the first iterations try, in order.

    Every candidate when the iterations allow, else an even subsample. ``coarse_first`` (large
    clusters, where layouts are pruned against the best plan so far): the middle one first, then
    the middles of the two halves, and so on (breadth first), so that a good plan is found early
    and the pruning skips the scoring of the hopeless D_dp values (the smallest ones, with
    pipelines of hundreds of devices, at 1,024 GPUs) instead of scoring them before any bound is
    known. The values tried are the same; only the order changes.
    """
    if n > iterations:
        idx = sorted({int(round(i * (n - 1) / max(iterations - 1, 1))) for i in range(iterations)})
    else:
        idx = list(range(n))
    if not coarse_first:
        return idx
    order, spans = [], [(0, len(idx) - 1)]
    while spans:
        lo, hi = spans.pop(0)
        if lo <= hi:
            mid = (lo + hi) // 2
            order.append(idx[mid])
            spans += [(lo, mid - 1), (mid + 1, hi)]
    return order
