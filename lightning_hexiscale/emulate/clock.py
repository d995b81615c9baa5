"""A fine clock for CPU quotas: one real-time sleeper per CPU, so that a quota is enforced within
:data:`TICK_S` rather than within the kernel's scheduler tick.

Why: the kernel checks a cgroup's CPU quota when it accounts the running task's time, which for a
task that only computes happens at the scheduler tick (4 ms at CONFIG_HZ=250, this project's
machine). A rank therefore runs until the tick after its quota is spent and then sleeps its debt
off: with a 10 ms period a 0.6-core rank alternates ~6 ms of running with ~4 ms throttled, a
0.15-core rank ~1.5 ms with ~8.5 ms, and a period shorter than the tick does not help (a 2 ms
period gave 0.42 of a core to a 0.6-core quota, the rest lost to the debt arithmetic). A TP
collective whose peer is throttled waits out the peer's stall: measured here as a 1-7 ms median
wait for a small TP-2 exchange, the ~11 ms "sync latency" that bench_hetero used to fit.

The sleeper wakes every :data:`TICK_S`, which preempts the task running on its CPU (SCHED_FIFO
beats every normal task), which makes the kernel account that task's time and throttle it if its
quota is spent; then it sleeps again. Cost: a wake-up of ~15-20 us per tick, 3-4 % of each CPU at
0.5 ms. With it, a 2 ms period enforces a 0.6-core quota within 0.5 ms (0.58 of a core measured
on this loaded machine, stalls of 0.6 ms instead of 3.8 ms at 10 ms periods).

Where SCHED_FIFO is refused (no privilege, or a cgroup without real-time runtime under
CONFIG_RT_GROUP_SCHED) the clock does not start and :attr:`QuotaClock.running` says so; the
emulator then keeps the kernel's default-length periods (:func:`~lightning_hexiscale.emulate.cgroups.quota_period_us`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

TICK_S = 0.0005
"""Seconds between two wake-ups of a sleeper (0.5 ms)."""
START_TIMEOUT_S = 5.0

# The sleeper: pinned to one CPU, SCHED_FIFO priority 1, prints "ok" once it runs so, then sleeps
# TICK_S in a loop. It leaves when its parent is gone (it checks every 1000 ticks: an owner killed
# with SIGKILL cannot leave a real-time process behind for more than half a second).
_SLEEPER = """
import os, sys, time
cpu, tick, parent = int(sys.argv[1]), float(sys.argv[2]), os.getppid()
os.sched_setaffinity(0, {cpu})
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
except OSError as e:
    print("refused", e, flush=True)
    sys.exit(3)
print("ok", flush=True)
sleep, n = time.sleep, 0
while True:
    sleep(tick)
    n += 1
    if n % 1000 == 0 and os.getppid() != parent:
        break
"""


class QuotaClock:
    """One sleeper process per CPU this process may run on; ``start()`` returns whether they run
    (all or none), ``stop()`` ends them. ``why`` holds the reason when they do not."""

    def __init__(self, tick_s: float = TICK_S, cpus: list[int] | None = None):
        self.tick_s = tick_s
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self.procs: list[subprocess.Popen] = []
        self.running = False
        self.why = "not started"

    def start(self) -> bool:
        try:
            for cpu in self.cpus:
                self.procs.append(subprocess.Popen([sys.executable, "-S", "-c", _SLEEPER, str(cpu), str(self.tick_s)],
                                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            deadline = time.monotonic() + START_TIMEOUT_S
            for p in self.procs:
                line = p.stdout.readline().strip() if time.monotonic() < deadline else ""
                if line != "ok":
                    self.why = f"a real-time sleeper could not start ({line or 'no answer'})"
                    self.stop()
                    return False
        except BaseException:
            self.stop()
            raise
        self.running, self.why = True, ""
        return True

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def stop(self) -> None:
        """End every sleeper. Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
        self.procs = []
        self.running = False
