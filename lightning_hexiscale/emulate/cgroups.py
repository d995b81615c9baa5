"""Per-rank cgroups: a CPU quota (cgroup v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``) and an optional
memory limit (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``).

A quota of ``q`` cores is ``q * period`` microseconds of CPU time per ``period`` microseconds. A rank
whose peer in a collective is throttled waits up to ``(1 - q) * period`` for it, so periods are as
short as the kernel allows: each rank's own period is ``max(base, 1 ms / q)`` (the kernel's smallest
quota is 1 ms: :func:`quota_period_us`), with ``base`` 2 ms when the emulator's quota clock runs
(:mod:`lightning_hexiscale.emulate.clock`: without it the kernel enforces a quota only at its
scheduler tick, 4 ms here, and periods below the tick lose CPU time) and 10 ms without. With v1
the groups are created below the cgroup this process already belongs to (per controller), so an
outer limit still applies; with v2 below the root (:meth:`CgroupLayout.parent_dir`).
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CFS_PERIOD_US = 10_000
"""Base CPU bandwidth period in microseconds without the quota clock (a rank's period is longer
when its quota would be below the kernel's 1 ms minimum: :func:`quota_period_us`)."""
CLOCKED_PERIOD_US = 2_000
"""Base period with the quota clock running (4 ticks of its 0.5 ms)."""
MIN_QUOTA_US = 1_000
"""The kernel's smallest accepted quota (1 ms)."""
MAX_PERIOD_US = 1_000_000
"""The kernel's longest accepted period (1 s)."""


def quota_period_us(cores: float, base_us: int = CFS_PERIOD_US) -> int:
    """The period of a quota of ``cores``: ``base_us``, or longer when the quota would be below the
    kernel's 1 ms minimum (``period = 1 ms / cores``); a quota below 0.001 core (1 ms per 1 s)
    cannot be set and raises ValueError."""
    period = max(base_us, math.ceil(MIN_QUOTA_US / cores)) if cores > 0 else MAX_PERIOD_US + 1
    if period > MAX_PERIOD_US:
        raise ValueError(f"a CPU quota of {cores:.4f} cores is below the kernel's minimum of "
                         f"{MIN_QUOTA_US / MAX_PERIOD_US} core")
    return period


def cfs_period_us(cores: list[float], base_us: int = CFS_PERIOD_US) -> int:
    """The longest of the ranks' periods (:func:`quota_period_us`); raises ValueError like it."""
    return max(quota_period_us(c, base_us) for c in cores)


CPU_SHARES_V1 = 262_144
CPU_WEIGHT_V2 = 10_000
"""The largest CFS weight (v1 ``cpu.shares``, v2 ``cpu.weight``) for the cluster's parent group: on a
shared machine the ranks then get their quotas first (a quota is only a ceiling; without the
weight, other busy processes would push every rank below it, the fast ones most, and the emulated
ratio would drift toward 1). The quotas still cap what the cluster takes, ``cores`` in all."""


@dataclass(frozen=True)
class CgroupLayout:
    """Where the controllers live: ``version`` 1 (one hierarchy per controller under ``root``) or 2
    (one unified hierarchy at ``root``)."""

    root: Path
    version: int

    @classmethod
    def detect(cls, root: str | Path = "/sys/fs/cgroup") -> CgroupLayout | None:
        """The layout of this machine, or None when no CPU controller is mounted."""
        root = Path(root)
        if (root / "cpu" / "cpu.cfs_quota_us").exists():
            return cls(root, 1)
        ctrl = root / "cgroup.controllers"
        if ctrl.exists() and "cpu" in ctrl.read_text().split():
            return cls(root, 2)
        return None

    def has_memory(self) -> bool:
        if self.version == 1:
            return (self.root / "memory" / "memory.limit_in_bytes").exists()
        return "memory" in (self.root / "cgroup.controllers").read_text().split()

    def own_path(self, controller: str) -> str:
        """This process's cgroup path for ``controller`` (v1) or in the unified tree (v2), from /proc/self/cgroup."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return "/"
        for line in lines:
            _, ctrls, path = line.split(":", 2)
            if (self.version == 2 and ctrls == "") or (self.version == 1 and controller in ctrls.split(",")):
                return path
        return "/"

    def parent_dir(self, controller: str) -> Path:
        """v1: this process's own group of that controller (an outer limit keeps applying). v2: the
        root of the tree: v2 forbids processes in a group that hands controllers to children, and
        this process sits in its own group, so that group cannot be the parent."""
        if self.version == 2:
            return self.root
        base = self.root / controller
        own = base / self.own_path(controller).lstrip("/")
        return own if own.is_dir() else base


class RankCgroups:
    """The cgroups of one emulated cluster: ``<parent>/<name>/rank<r>`` per rank and controller.

    ``cpu_cores[r]`` is rank r's quota in cores; ``memory_bytes[r]`` its limit (None: no limit);
    ``base_period_us`` the shortest period (:func:`quota_period_us`).
    """

    def __init__(self, layout: CgroupLayout, name: str, cpu_cores: list[float], memory_bytes: list[float] | None,
                 base_period_us: int = CFS_PERIOD_US):
        self.layout, self.name = layout, name
        self.cpu_cores, self.memory_bytes = list(cpu_cores), memory_bytes
        self.base_period_us = base_period_us
        self.controllers = ["cpu"] + (["memory"] if memory_bytes is not None else [])
        self.created: list[Path] = []  # every directory made, parents first
        self.periods_us = [quota_period_us(c, base_period_us) for c in self.cpu_cores]

    # ---- paths ---------------------------------------------------------------------------------
    def group_dir(self, controller: str) -> Path:
        return self.layout.parent_dir(controller) / self.name

    def rank_dirs(self, rank: int) -> list[Path]:
        """The directories rank ``rank``'s pid is written into (one per v1 controller, one in v2)."""
        ctrls = self.controllers if self.layout.version == 1 else ["cpu"]
        return [self.group_dir(c) / f"rank{rank}" for c in ctrls]

    # ---- lifecycle -----------------------------------------------------------------------------
    def create(self) -> None:
        """Make the groups and write the limits; on failure removes what it made and re-raises."""
        try:
            for c in (self.controllers if self.layout.version == 1 else ["cpu"]):
                self._mkdir(self.group_dir(c))
                if c == "cpu":
                    if self.layout.version == 1:
                        _write(self.group_dir(c) / "cpu.shares", CPU_SHARES_V1)
                    elif (self.group_dir(c) / "cpu.weight").exists():
                        _write(self.group_dir(c) / "cpu.weight", CPU_WEIGHT_V2)
                if self.layout.version == 2:
                    # v2: a group's children get a controller only when the group enables it
                    _enable_v2(self.group_dir(c).parent, self.controllers)
                    _enable_v2(self.group_dir(c), self.controllers)
                for r in range(len(self.cpu_cores)):
                    self._mkdir(self.group_dir(c) / f"rank{r}")
            for r, cores in enumerate(self.cpu_cores):
                self.set_cores(r, cores)
                if self.memory_bytes is not None:
                    limit = int(self.memory_bytes[r])
                    if self.layout.version == 1:
                        _write(self.group_dir("memory") / f"rank{r}" / "memory.limit_in_bytes", limit)
                    else:
                        _write(self.group_dir("cpu") / f"rank{r}" / "memory.max", limit)
        except BaseException:
            self.remove()
            raise

    def set_cores(self, rank: int, cores: float) -> None:
        """Give rank ``rank`` a quota of ``cores`` (also while it runs), at its period
        :func:`quota_period_us`; raises ValueError below the kernel's minimum."""
        period = quota_period_us(cores, self.base_period_us)
        quota = max(MIN_QUOTA_US, round(cores * period))
        d = self.group_dir("cpu") / f"rank{rank}"
        if self.layout.version == 1:
            # period, then quota: the state in between is valid too (any quota of at least 1 ms is,
            # even one longer than its period) and lasts microseconds
            _write(d / "cpu.cfs_period_us", period)
            _write(d / "cpu.cfs_quota_us", quota)
        else:
            _write(d / "cpu.max", f"{quota} {period}")
        self.cpu_cores[rank], self.periods_us[rank] = cores, period

    def cpu_stat(self, rank: int) -> dict[str, int]:
        """The kernel's ``cpu.stat`` of rank ``rank``'s group (v1: nr_periods, nr_throttled,
        throttled_time in ns; v2: also usage_usec, throttled_usec), {} when unreadable."""
        try:
            text = (self.group_dir("cpu") / f"rank{rank}" / "cpu.stat").read_text()
        except OSError:
            return {}
        return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}

    def oom_kills(self, rank: int) -> int:
        """Processes of rank ``rank`` the kernel's OOM killer ended at its memory limit (v1
        ``memory.oom_control``, v2 ``memory.events``: the ``oom_kill N`` line); 0 without a limit or
        when unreadable. A rank killed so dies by SIGKILL and prints nothing."""
        if self.memory_bytes is None:
            return 0
        d = self.group_dir("memory" if self.layout.version == 1 else "cpu") / f"rank{rank}"
        try:
            text = (d / ("memory.oom_control" if self.layout.version == 1 else "memory.events")).read_text()
        except OSError:
            return 0
        counts = dict(line.split(None, 1) for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def _mkdir(self, d: Path) -> None:
        d.mkdir(exist_ok=False)
        self.created.append(d)

    def join(self, rank: int, pid: int | None = None) -> None:
        """Move ``pid`` (default: the calling process) into rank ``rank``'s groups."""
        pid = os.getpid() if pid is None else pid
        for d in self.rank_dirs(rank):
            _write(d / "cgroup.procs", pid)

    def pids(self) -> list[int]:
        """Every process still in one of the groups."""
        out: set[int] = set()
        for d in self.created:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill what is left inside, then remove the directories (children first). Idempotent."""
        deadline = time.monotonic() + wait_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for d in reversed(self.created):
            for _ in range(100):  # a killed process leaves its group a moment after it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        self.created = [d for d in self.created if d.exists()]


def _enable_v2(group: Path, controllers: list[str]) -> None:
    ctl = group / "cgroup.subtree_control"
    if ctl.exists():
        have = ctl.read_text().split()
        missing = [f"+{c}" for c in controllers if c not in have]
        if missing:
            _write(ctl, " ".join(missing))


def _write(path: Path, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def own_cpu_limit(layout: CgroupLayout | None) -> float | None:
    """The CPU quota (cores) of the cgroup this process is in, or None when it has none."""
    if layout is None:
        return None
    try:
        if layout.version == 1:
            d = layout.parent_dir("cpu")
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
            return quota / period if quota > 0 else None
        q, p = (layout.parent_dir("cpu") / "cpu.max").read_text().split()
        return None if q == "max" else int(q) / int(p)
    except (OSError, ValueError):
        return None
