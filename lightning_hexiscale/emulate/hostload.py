"""How busy the host is with OTHER work, before and while an emulated cluster runs.

An emulated rank's speed is its CPU quota only while the host has CPU to spare: the cluster's group
has the largest CFS weight, so other jobs cannot take a rank's quota away, but they run on the same
cores between the ranks' bursts and leave cold caches behind; measured on this project's 2-core
machine, a quarter-core rank then does 25-45 % less work per CPU-second than a rank that holds its
core, and the emulated ratios drift with the load. So the load is measured and printed, and a
benchmark refuses to run above :data:`LOAD_LIMIT` (:func:`load_refusal`).

Units: cores (CPU-seconds per second). Busy time comes from ``/proc/stat`` (all CPUs, user + nice +
system + irq + softirq + steal), the cluster's own from ``/proc/PID/stat`` of every process in its
cgroups (utime + stime of the whole process, threads included) and of its quota clock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOAD_LIMIT = 0.10
"""The largest share of the host's CPUs other work may use (mean over a window) for emulated
timings to count: 0.2 of a core on 2 cores. The same 10 % as :func:`wait_for_quiet_host` of the
profiler's checks."""


def _busy_s() -> tuple[float, float] | None:
    """(busy, total) CPU-seconds of all CPUs since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return (total - v[3] - v[4]) / hz, total / hz


def _load_average() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of process ``pid`` (all its threads) in seconds, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class LoadSample:
    """One window: ``others_cores`` CPU-seconds per second used by other work, ``ours_cores`` by the
    cluster, out of ``cpus``; ``load_average`` the kernel's 1-minute figure at its end."""

    seconds: float
    others_cores: float
    ours_cores: float
    cpus: int
    load_average: float

    @property
    def others_fraction(self) -> float:
        """Other work's share of the host's CPU capacity (0..1)."""
        return self.others_cores / self.cpus

    def text(self) -> str:
        return (f"other work {self.others_cores:.2f} of {self.cpus} cores ({self.others_fraction * 100:.0f} %), "
                f"this cluster {self.ours_cores:.2f}, load average {self.load_average:.1f} "
                f"(over {self.seconds:.0f} s)")


class _OursTracker:
    """CPU-seconds used by the processes ``pids()`` names, summed over samples; a process gone
    between two samples loses its last interval (under a second of a sampler's period)."""

    def __init__(self, pids: Callable[[], list[int]]):
        self.pids, self.seen = pids, {}

    def advance(self) -> float:
        used = 0.0
        now = {}
        for pid in self.pids():
            t = process_cpu_s(pid)
            if t is None:
                continue
            now[pid] = t
            used += t - self.seen.get(pid, 0.0)  # a new process: all its time is in this interval
        self.seen = now
        return used


def sample_load(seconds: float = 3.0, ours: Callable[[], list[int]] | None = None) -> LoadSample:
    """Measure one window of ``seconds``; ``ours`` lists the cluster's pids (their time is not others')."""
    tracker = _OursTracker(ours or (lambda: []))
    tracker.advance()
    a, t0 = _busy_s(), time.monotonic()
    time.sleep(seconds)
    b, wall = _busy_s(), time.monotonic() - t0
    mine = tracker.advance()
    busy = 0.0 if a is None or b is None else b[0] - a[0]
    return LoadSample(wall, max(0.0, busy - mine) / wall, mine / wall, os.cpu_count() or 1, _load_average())


class LoadMonitor:
    """Samples the load in a background thread every ``every_s`` while open (``with`` block); the
    samples, their mean and maximum of other work's share. ``ours`` as for :func:`sample_load`."""

    def __init__(self, ours: Callable[[], list[int]] | None = None, every_s: float = 2.0):
        self.ours, self.every_s = ours, every_s
        self.samples: list[LoadSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LoadMonitor:
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        tracker = _OursTracker(self.ours or (lambda: []))
        tracker.advance()
        a, t0 = _busy_s(), time.monotonic()
        while not self._stop.wait(self.every_s):
            b, t1 = _busy_s(), time.monotonic()
            mine = tracker.advance()
            if a is not None and b is not None and t1 > t0:
                cpus = os.cpu_count() or 1
                self.samples.append(LoadSample(t1 - t0, max(0.0, b[0] - a[0] - mine) / (t1 - t0), mine / (t1 - t0),
                                               cpus, _load_average()))
            a, t0 = b, t1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> LoadSample | None:
        """The whole span as one sample (time-weighted mean), None before the first sample."""
        if not self.samples:
            return None
        wall = sum(s.seconds for s in self.samples)
        return LoadSample(wall, sum(s.others_cores * s.seconds for s in self.samples) / wall,
                          sum(s.ours_cores * s.seconds for s in self.samples) / wall, self.samples[-1].cpus,
                          self.samples[-1].load_average)

    @property
    def worst_fraction(self) -> float:
        return max((s.others_fraction for s in self.samples), default=0.0)


def load_refusal(sample: LoadSample, limit: float = LOAD_LIMIT) -> str | None:
    """Why emulated timings would not count under ``sample`` (None: they would)."""
    if sample.others_fraction <= limit:
        return None
    return (f"other work used {sample.others_cores:.2f} of this host's {sample.cpus} cores "
            f"({sample.others_fraction * 100:.0f} %, limit {limit * 100:.0f} %; load average "
            f"{sample.load_average:.1f}) while nothing of this run was running: it would run on the ranks' cores "
            "between their quota bursts and distort the emulated compute ratios")
