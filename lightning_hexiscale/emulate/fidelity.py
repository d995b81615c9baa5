"""Is the emulated cluster the declared one? Its compute ratios (trimmed to fit) and its TP waits.

**Compute ratios.** A rank's quota is exact in CPU time (measured here: 0.149-0.150 of a core for
0.15-core quotas, 0.59-0.60 for 0.6) but not in work: a rank that runs in short bursts between
throttled stretches does less work per CPU-second than one that keeps its core, because other
ranks and other jobs run on the core in between and it starts every burst on cold caches. On this
project's 2-core machine float32 matmuls ran at 56-61 GFLOP per CPU-second at 0.15 core, 70-78 at
0.6 and 82 at a whole core, whatever the matrix size (128-1024) and the period (10-100 ms), so a
declared 4:1 came out as 4.6-6.8:1. :func:`trim` therefore measures what every rank delivers, all
at once (:mod:`lightning_hexiscale.emulate.probe` ``rate``), and corrects the quotas until the
measured rates stand in the declared ratio:

    q_r' = s * F_r / e_t(r),   with s such that sum_r q_r' = sum_r q_r (or max_r q_r' = 1 core)

(``F_r`` the declared FLOP/s, ``e_t`` the measured FLOP/s per core of quota of the rank's device
type, averaged over the type's ranks and every measurement so far). It repeats until every rank's
``(m_r / F_r) / median_s(m_s / F_s)`` is within :data:`TRIM_TOLERANCE` of 1, at most
:data:`TRIM_ROUNDS` times. :func:`rate_check` is the same comparison for any measured rates (e.g.
``hexiscale profile``'s FLOP/s afterwards), judged at :data:`RATE_TOLERANCE`.

**TP waits.** :func:`check_exchange` runs the probe's ``exchange``: the ranks of each machine in
pairs (TP-2 groups), the same fixed work on both, then a small all-reduce, many times. A device of
the declared speed would take ``work / speed + latency`` per repetition; the emulated pair takes its
cycle (wall time per repetition), and ``cycle - CPU time per repetition / quota`` is what the
all-reduce costs on top of the work: the latency, the software, and any wait for a peer the quota
throttled (up to ``(1 - q)`` of a period: 4 ms for a 0.6-core rank at the old 10 ms periods). The
check passes when that is at most the declared latency plus :data:`TP_WAIT_LIMIT_S`. The early
member of a pair idles in every exchange until the late one arrives (its ``exchange_s`` are long);
that is not a cost, the pair's cycle is. Periods cannot be shorter than ``1 ms / q`` (the kernel's
smallest quota is 1 ms): 6.7 ms for a 0.15-core rank.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

RATE_TOLERANCE = 0.10
"""A rank's measured share of the compute may differ from its declared share by this much (10 %)."""
TRIM_TOLERANCE = 0.03
""":func:`trim` stops once every rank is this close (3 %): margin under :data:`RATE_TOLERANCE` for
the noise between two measurements."""
TRIM_ROUNDS = 4
"""At most this many measurements (each corrects the quotas once)."""
TP_WAIT_LIMIT_S = 1e-3
"""The mean wait of a TP-2 exchange beyond the declared link latency may be this long (1 ms)."""
PROBE_PORT = 29500
"""MASTER_PORT of the probes: the exchange pairs listen on ports above it inside their machine's
network namespace, where no other cluster's processes run."""
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RateCheck:
    """Declared and measured compute of every rank (FLOP/s) under quotas ``cores`` (cores)."""

    declared_flops: tuple[float, ...]
    measured_flops: tuple[float, ...]
    cores: tuple[float, ...]
    gpu_types: tuple[str, ...]

    @property
    def errors(self) -> list[float]:
        """Per rank: ``(m_r / F_r) / median_s(m_s / F_s) - 1``, its share of the compute against the
        declared one (0: as declared; the median rank is the reference, so one outlier shows as one)."""
        rel = [m / f for m, f in zip(self.measured_flops, self.declared_flops)]
        mid = statistics.median(rel)
        return [x / mid - 1.0 for x in rel]

    @property
    def worst(self) -> float:
        return max(abs(e) for e in self.errors)

    def type_ratio(self) -> tuple[float, float, str] | None:
        """(measured, declared, "FAST/SLOW") ratio of the fastest to the slowest device type (mean over
        each type's ranks), None with one type."""
        types = list(dict.fromkeys(self.gpu_types))
        if len(types) < 2:
            return None

        def mean(values, t):
            return statistics.mean(v for v, tt in zip(values, self.gpu_types) if tt == t)

        fast = max(types, key=lambda t: mean(self.declared_flops, t))
        slow = min(types, key=lambda t: mean(self.declared_flops, t))
        return (mean(self.measured_flops, fast) / mean(self.measured_flops, slow),
                mean(self.declared_flops, fast) / mean(self.declared_flops, slow), f"{fast}/{slow}")

    def passes(self, tolerance: float = RATE_TOLERANCE) -> bool:
        return self.worst <= tolerance

    def text(self, tolerance: float = RATE_TOLERANCE) -> str:
        ranks = ", ".join(f"{m / 1e9:.1f}" for m in self.measured_flops)
        r = self.type_ratio()
        ratio = f"; {r[2]} {r[0]:.2f}:1 (declared {r[1]:.2f}:1)" if r else ""
        return (f"GFLOP/s per rank {ranks}{ratio}; worst rank {self.worst * 100:.1f} % off its declared share "
                f"({'within' if self.passes(tolerance) else 'BEYOND'} {tolerance * 100:.0f} %)")


def rate_check(emu, measured_flops: list[float]) -> RateCheck:
    """The emulated cluster's declared compute against ``measured_flops`` (one per rank)."""
    return RateCheck(tuple(r.flops for r in emu.ranks), tuple(float(m) for m in measured_flops),
                     tuple(r.cores for r in emu.ranks), tuple(r.gpu_type for r in emu.ranks))


def trimmed_cores(cores: list[float], declared: list[float], rate_per_core: list[float],
                  max_per_rank: float = 1.0) -> list[float]:
    """The corrected quotas (module docstring): ``declared / rate_per_core`` (the cores each rank needs
    for its declared share, at the work per CPU-second measured), scaled to the same total as ``cores``,
    none above ``max_per_rank`` (then all scaled down together)."""
    raw = [f / e for f, e in zip(declared, rate_per_core)]
    scale = sum(cores) / sum(raw)
    new = [x * scale for x in raw]
    top = max(new)
    return [x * max_per_rank / top for x in new] if top > max_per_rank else new


def type_rate_per_core(checks: list[RateCheck]) -> list[float]:
    """Per rank: the work per CPU-second (FLOP/s per core of quota) of its device type, averaged over
    the type's ranks and over ``checks`` (every measurement so far: the noise of one shrinks with each)."""
    types = checks[0].gpu_types
    per_type = {t: statistics.mean(m / q for c in checks for m, q, tt in zip(c.measured_flops, c.cores, c.gpu_types)
                                   if tt == t) for t in set(types)}
    return [per_type[t] for t in types]


def run_probe(emu, mode: str, args: list[str], timeout_s: float = 120.0) -> list[dict]:
    """Run the probe's ``mode`` once per rank of the entered ``emu``; the ranks' documents in rank order."""
    out = Path(tempfile.mkdtemp(prefix="hexiscale-probe-"))
    try:
        procs = emu.launch([sys.executable, "-m", "lightning_hexiscale.emulate.probe", mode, "--out", str(out), *args],
                           env={"PYTHONPATH": str(REPO)}, master_port=PROBE_PORT)
        emu.wait(procs, timeout_s)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]
    finally:
        shutil.rmtree(out, ignore_errors=True)


@dataclass(frozen=True)
class TrimResult:
    checks: tuple[RateCheck, ...]
    """Every measurement, in order; the quotas in force are those of :attr:`final`."""
    final: RateCheck

    @property
    def converged(self) -> bool:
        return self.final.worst <= TRIM_TOLERANCE

    def text(self) -> str:
        first = self.checks[0]
        cores = ", ".join(f"{q:.3f}" for q in self.final.cores)
        return (f"compute trimmed in {len(self.checks)} measurement(s): before {first.text()}\n"
                f"  quotas now {cores} cores: {self.final.text()}")


def trim(emu, tolerance: float = TRIM_TOLERANCE, rounds: int = TRIM_ROUNDS, seconds: float = 3.0,
         timeout_s: float = 120.0) -> TrimResult:
    """Correct the entered cluster's quotas until the measured rates stand in the declared ratio
    (module docstring). Ranks of one device type keep equal quotas: each correction uses the type's
    work per CPU-second, averaged over its ranks and over every measurement so far. The quotas left
    in force are those of the last measurement, which :attr:`TrimResult.final` reports."""
    from lightning_hexiscale.emulate.emulated import MAX_CORES_PER_RANK

    checks: list[RateCheck] = []
    for k in range(rounds):
        docs = run_probe(emu, "rate", ["--seconds", str(seconds)], timeout_s)
        checks.append(rate_check(emu, [d["flops"] for d in docs]))
        if checks[-1].worst <= tolerance or k == rounds - 1:
            break
        c = checks[-1]
        emu.set_cores(trimmed_cores(list(c.cores), list(c.declared_flops), type_rate_per_core(checks),
                                    MAX_CORES_PER_RANK))
    return TrimResult(tuple(checks), checks[-1])


@dataclass(frozen=True)
class PairSync:
    """One TP-2 pair's exchanges: ranks, machine, quota (cores) and period (s) of its first rank, the
    declared latency between them (s); per repetition the wall time of the pair's cycle (work +
    all-reduce, the slower member's, s) and its fluid time: what the work takes at the quota,
    ``max over the pair of (CPU seconds per repetition / quota)``."""

    ranks: tuple[int, int]
    machine: str
    cores: float
    period_s: float
    declared_latency_s: float
    cycle_s: float
    fluid_s: float
    exchange_s: tuple[float, ...]
    """Per repetition, the slower member's time from its send to the peer's data (includes the
    early member's idle wait: not itself a cost)."""

    @property
    def overhead_s(self) -> float:
        """What a TP all-reduce costs the pair beyond its work at the quota (s): cycle - fluid."""
        return self.cycle_s - self.fluid_s

    @property
    def passes(self) -> bool:
        return self.overhead_s <= self.declared_latency_s + TP_WAIT_LIMIT_S

    def text(self) -> str:
        return (f"TP-2 ranks {self.ranks[0]}-{self.ranks[1]} ({self.machine}, {self.cores:.3f} cores, period "
                f"{self.period_s * 1e3:.1f} ms): cycle {self.cycle_s * 1e3:.2f} ms, work at the quota "
                f"{self.fluid_s * 1e3:.2f} ms, so {self.overhead_s * 1e3:.2f} ms per all-reduce against the declared "
                f"latency {self.declared_latency_s * 1e6:.0f} us: {'PASS' if self.passes else 'FAIL'} (limit latency + "
                f"{TP_WAIT_LIMIT_S * 1e3:g} ms)")


def check_exchange(emu, reps: int = 100, work_mflop: float = 60.0, timeout_s: float = 120.0) -> list[PairSync]:
    """TP-2 exchanges of the entered cluster's machine-local rank pairs (module docstring)."""
    docs = run_probe(emu, "exchange", ["--reps", str(reps), "--work-mflop", str(work_mflop)], timeout_s)
    by_pair: dict[int, list[dict]] = {}
    for d in docs:
        if d["pair"] is not None:
            by_pair.setdefault(d["pair"], []).append(d)
    out = []
    for pair in sorted(by_pair):
        a, b = sorted(by_pair[pair], key=lambda d: d["rank"])
        ra, rb = emu.ranks[a["rank"]], emu.ranks[b["rank"]]
        n = len(a["exchange_s"])
        cycle = max(a["wall_s"], b["wall_s"]) / n
        fluid = max(a["cpu_s_loop"] / ra.cores, b["cpu_s_loop"] / rb.cores) / n
        out.append(PairSync((ra.rank, rb.rank), ra.machine_name, ra.cores, emu.cgroups.periods_us[ra.rank] / 1e6,
                            float(emu.cluster.latency[ra.rank, rb.rank]), cycle, fluid,
                            tuple(max(x, y) for x, y in zip(a["exchange_s"], b["exchange_s"]))))
    return out
