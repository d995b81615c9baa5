"""`EmulatedCluster`: a cluster YAML played by unequal processes on one Linux machine.

Each rank runs in its own cgroup with a CPU quota proportional to its GPU type's FLOP/s, and
optionally a memory limit proportional to its device memory; each machine of the YAML is a network
namespace, joined to the others by shaped veth links (:mod:`lightning_hexiscale.emulate.network`).

Quotas (cores): ``q_r = cores * F_r / sum_s F_s`` with ``F_r`` rank r's sustained FLOP/s, so the
quotas sum to ``cores``; a rank runs one compute thread (OMP_NUM_THREADS=1) and cannot use more
than one core, so when the largest ``q_r`` exceeds 1 every quota is scaled by ``1 / max q`` (the
ratios stay; the sum is then below ``cores``). Memory limits (bytes): ``m_r = total * M_r / sum_s M_s``
with ``M_r`` the device memory. Links (bytes/s, s): the YAML's inter-machine bandwidth times
``bw_scale``, its latency divided by ``bw_scale`` (a scaled-down network is scaled in both).

    with EmulatedCluster("conf/cluster/emu_4to1.yaml", cores=1.0) as emu:
        print(emu.describe())
        procs = emu.launch([sys.executable, "-m", "lightning_hexiscale.cli", "profile", "--out", "p.yaml"],
                           master_port=29500)
        emu.wait(procs, timeout=300)
"""

from __future__ import annotations

import atexit
import math
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_hexiscale.emulate.cgroups import (CFS_PERIOD_US, CLOCKED_PERIOD_US, CgroupLayout, RankCgroups,
                                                 cfs_period_us, own_cpu_limit)
from lightning_hexiscale.emulate.clock import QuotaClock
from lightning_hexiscale.emulate import registry
from lightning_hexiscale.emulate.network import Network, netem_probe
from lightning_hexiscale.emulate.support import EmulationError, check_support

MAX_CORES_PER_RANK = 1.0
"""One compute thread per rank (OMP_NUM_THREADS=1) uses at most one core."""
KILL_GRACE_S = 2.0
"""After the first failure, SIGTERM, then this long before SIGKILL."""

_LIVE: set[EmulatedCluster] = set()


def cpu_quotas(flops: list[float], cores: float, max_per_rank: float = MAX_CORES_PER_RANK) -> list[float]:
    """Cores per rank: proportional to ``flops``, summing to ``cores``, none above ``max_per_rank``
    (all scaled down together when one would be)."""
    if cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    total = float(sum(flops))
    q = [cores * f / total for f in flops]
    top = max(q)
    return [x * max_per_rank / top for x in q] if top > max_per_rank else q


def memory_limits(memory: list[float], total: float) -> list[float]:
    """Bytes per rank, proportional to the devices' memory, summing to ``total``."""
    s = float(sum(memory))
    return [total * m / s for m in memory]


def available_cores(layout: CgroupLayout | None) -> float:
    """CPUs this process may use: its affinity mask, capped by its own cgroup's quota."""
    n = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    lim = own_cpu_limit(layout)
    return min(n, lim) if lim else n


def available_memory() -> float:
    """Bytes: 80 % of the kernel's MemAvailable (the rest stays for the launcher and the system)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return 0.8 * int(line.split()[1]) * 1024
    return 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class EmulatedRank:
    """One rank as emulated: where it runs and what it gets. Units: cores, bytes, bytes/s, s."""

    rank: int
    machine: int
    machine_name: str
    local_rank: int
    local_world: int
    gpu_type: str
    flops: float
    cores: float
    memory_bytes: float | None
    address: str
    ifname: str


class EmulatedCluster:
    """Context manager: ``__enter__`` creates the cgroups and namespaces, ``__exit__`` removes them
    (also on an exception or Ctrl-C; SIGTERM/SIGHUP are turned into SystemExit meanwhile, and an
    atexit hook catches a manager never exited). See the module docstring for the formulas."""

    def __init__(self, cluster, *, cores: float | None = None, bw_scale: float = 1.0, memory: bool = False,
                 memory_total: float | None = None, cgroup_root: str | Path = "/sys/fs/cgroup",
                 quota_clock: bool = True):
        from lightning_hexiscale.config.cluster import Cluster

        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster.load(str(cluster))
        if not 0 < bw_scale < math.inf:
            raise EmulationError(f"bw_scale = {bw_scale!r}: must be > 0 and finite. Fix: e.g. --bw-scale 0.5 halves "
                                 "every link")
        if cores is not None and not 0 < cores < math.inf:
            raise EmulationError(f"cores = {cores!r}: must be > 0 and finite. Fix: give the CPU cores to share, "
                                 "e.g. --cores 1.5")
        self.bw_scale, self.memory = float(bw_scale), bool(memory)
        self._cores_arg, self._memory_total_arg, self._cgroup_root = cores, memory_total, cgroup_root
        self.id = secrets.token_hex(3)
        self.cgroups: RankCgroups | None = None
        self.network: Network | None = None
        self.clock: QuotaClock | None = None
        self._want_clock = bool(quota_clock)
        self._key: str | None = None
        self.ranks: list[EmulatedRank] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        c = self.cluster
        m = len(c.machines)
        # Links between machines: any device pair of the two machines carries the YAML's figure
        self.link_bandwidth = [[float(c.bandwidth[c.machines[a].devices[0], c.machines[b].devices[0]]) * self.bw_scale
                                if a != b else float("inf") for b in range(m)] for a in range(m)]
        self.link_latency = [[float(c.latency[c.machines[a].devices[0], c.machines[b].devices[0]]) / self.bw_scale
                              if a != b else 0.0 for b in range(m)] for a in range(m)]
        # One veth per machine: its egress is the machine's NICs together (bytes/s, x bw_scale; which GPU
        # uses which NIC is not emulated), so transfers to different machines share it too
        self.egress_bandwidth = [sum(n.bandwidth_Bps for n in c.nics if n.machine == k) * self.bw_scale
                                 for k in range(m)]

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        layout = check_support(self.memory, self._cgroup_root)
        c = self.cluster
        quotas, self.ranks = self._plan(layout)  # refuses too small quotas before anything exists
        self._key = self._emulation_key(quotas)
        registry.remove_stale()  # what owners killed with SIGKILL left behind
        _LIVE.add(self)
        self._install_signal_handlers()
        mem = None if not self.memory else [r.memory_bytes for r in self.ranks]
        try:
            self.clock = QuotaClock()
            if self._want_clock:
                self.clock.start()
            else:
                self.clock.why = "turned off (quota_clock=False)"
            base = CLOCKED_PERIOD_US if self.clock.running else CFS_PERIOD_US
            self.cgroups = RankCgroups(layout, f"hexiscale-emu-{self.id}", quotas, mem, base)
            self.network = Network(self.id, self.link_bandwidth, self.link_latency, egress=self.egress_bandwidth)
            # recorded before anything exists: a SIGKILL during the set-up leaves nothing unrecorded
            registry.record(self.id, [self.network.hub] + [self.network.ns(k) for k in range(len(c.machines))],
                            [self.cgroups.group_dir(ctrl) for ctrl in self.cgroups.controllers])
            self.cgroups.create()
            self.network.create()
        except BaseException as e:
            self.close()
            if isinstance(e, Exception) and not isinstance(e, EmulationError):
                raise EmulationError(f"setting up the emulated cluster failed: {e}. Fix: see the message; "
                                     "everything created was removed") from e
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the launched processes and remove the cgroups and namespaces. Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.network is not None:
            self.network.remove()
        if self.cgroups is not None:
            self.cgroups.remove()
        if self.clock is not None:
            self.clock.stop()
        if not (self.cgroups and self.cgroups.created) and not (self.network and self.network.namespaces):
            registry.forget(self.id)  # kept while something could not be removed: a later run retries
        _LIVE.discard(self)
        self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def to_exit(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, to_exit)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    def set_cores(self, cores: list[float]) -> None:
        """New CPU quotas (cores per rank, in rank order), applied at once, also to running ranks
        (:meth:`~lightning_hexiscale.emulate.fidelity.trim` uses it)."""
        if self.cgroups is None:
            raise EmulationError("EmulatedCluster.set_cores outside its context. Fix: call it inside "
                                 "`with EmulatedCluster(...) as emu:`")
        if len(cores) != len(self.ranks):
            raise EmulationError(f"set_cores got {len(cores)} quotas for {len(self.ranks)} ranks. Fix: one per rank")
        for r, c in enumerate(cores):
            self.cgroups.set_cores(r, c)
        self.ranks = [replace(r, cores=c) for r, c in zip(self.ranks, cores)]

    def pids(self) -> list[int]:
        """Every process of the cluster still running: the ranks' (and their children) in the cgroups,
        and the quota clock's sleepers."""
        return (self.cgroups.pids() if self.cgroups else []) + (self.clock.pids if self.clock else [])

    # ---- running ranks -------------------------------------------------------------------------
    def launch(self, argv: list[str], *, env: dict | None = None, master_port: int, stdout=None,
               stderr=None) -> list[subprocess.Popen]:
        """Start ``argv`` once per rank, in rank order, each in its machine's namespace and its
        rank's cgroups, with a torchrun-like environment (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, MASTER_ADDR = rank 0's machine address, MASTER_PORT, GLOO_SOCKET_IFNAME =
        the machine's veth, HEXISCALE_MACHINE = machine name, HEXISCALE_DEVICE_TYPE = its GPU type,
        HEXISCALE_EMULATED=1, OMP_NUM_THREADS=1, GROUP_RANK = machine index, TORCHELASTIC_RUN_ID,
        HEXISCALE_EMULATION = :meth:`emulation_key`) over ``os.environ`` and ``env``."""
        if self.network is None or self.cgroups is None:
            raise EmulationError("EmulatedCluster.launch outside its context. Fix: call it inside "
                                 "`with EmulatedCluster(...) as emu:`")
        if not argv:
            raise EmulationError("no command to launch. Fix: give the command, e.g. "
                                 "hexiscale emulate c.yaml -- python train.py")
        procs = []
        for r in self.ranks:
            e = dict(os.environ)
            e.update(env or {})
            e.update(RANK=str(r.rank), WORLD_SIZE=str(len(self.ranks)), LOCAL_RANK=str(r.local_rank),
                     LOCAL_WORLD_SIZE=str(r.local_world), MASTER_ADDR=self.ranks[0].address,
                     MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME=r.ifname, HEXISCALE_MACHINE=r.machine_name,
                     HEXISCALE_MACHINE_INDEX=str(r.machine), HEXISCALE_DEVICE_TYPE=r.gpu_type, HEXISCALE_EMULATED="1",
                     OMP_NUM_THREADS="1", GROUP_RANK=str(r.machine), TORCHELASTIC_RUN_ID=f"hexiscale-emulate-{self.id}",
                     HEXISCALE_EMULATION=self._key)
            # GROUP_RANK and TORCHELASTIC_RUN_ID as torchrun sets them: Lightning then takes every rank from
            # RANK/WORLD_SIZE (its TorchElasticEnvironment); otherwise it computes node_rank * devices +
            # LOCAL_RANK with node_rank 0, and the ranks of different machines collide. Rank 0 still
            # hosts the rendezvous store (no TORCHELASTIC_USE_AGENT_STORE), as with env://.
            # The shell joins the cgroups with its own pid, then exec's `ip netns exec`, which exec's
            # argv: one pid from the first instruction on, so nothing runs outside the quota.
            joins = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}"
                                for d in self.cgroups.rank_dirs(r.rank))
            cmd = ["sh", "-c", f'{joins} && exec "$@"', "sh", "ip", "netns", "exec", self.network.ns(r.machine), *argv]
            procs.append(subprocess.Popen(cmd, env=e, stdout=stdout, stderr=stderr))
            self._procs.append(procs[-1])  # at once: a Ctrl-C during the loop still stops the ranks started
        return procs

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[int]:
        """Wait for every rank (``procs`` in rank order, as :meth:`launch` returns them); return
        their exit codes (all 0). The first rank to fail, or the deadline, kills all the others
        (SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`) and raises :class:`EmulationError`
        naming the rank."""
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or time.monotonic() >= deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                _stop(procs)
                if failed:
                    oom = [r for r in failed if self.cgroups is not None and self.cgroups.oom_kills(r)]
                    r = (oom or failed)[0]  # an OOM-killed rank's peers fail after it, of a broken connection
                    rk = self.ranks[r] if r < len(self.ranks) else None
                    where = f" (machine {rk.machine_name}, {rk.gpu_type})" if rk else ""
                    if oom:
                        from lightning_hexiscale.config.units import format_bytes

                        limit = format_bytes(rk.memory_bytes) if rk and rk.memory_bytes else "its limit"
                        raise EmulationError(f"rank {r}{where} was killed by the kernel's OOM killer at its --memory "
                                             f"limit of {limit} (exit code {codes[r]}, no output of its own); ranks "
                                             f"{running} were stopped. Fix: run without --memory, or with a "
                                             "smaller model or batch")
                    raise EmulationError(f"rank {r}{where} exited with code {codes[r]}; ranks {running} were "
                                         "stopped. Fix: see that rank's output above")
                raise EmulationError(f"ranks {running} still running after {timeout:.0f} s; all were stopped. "
                                     "Fix: raise the timeout or look for a hang in those ranks' output")
            if all(c == 0 for c in codes):
                return codes
            time.sleep(0.05)

    def emulation_key(self) -> str:
        """The emulated hardware as 16 hex digits (sha256): per rank its device type and CPU quota as set
        up before trimming (cores), every link's rate and latency and each machine's egress (after
        ``bw_scale``), whether memory is limited and whether the quota clock runs. Ranks get it as
        HEXISCALE_EMULATION and discovery's cache fingerprint includes it: another ``--cores`` or
        ``--bw-scale``, or an edited cluster YAML, is other hardware, whose host names and device types
        are the same. Not the trimmed quotas nor the memory limits' bytes: they follow the host's load
        and free memory, and would make every run miss the cache."""
        if self._key is None:
            return self._emulation_key([r.cores for r in self._planned_ranks()])
        return self._key

    def _emulation_key(self, quotas: list[float]) -> str:
        import hashlib
        import json

        doc = {"ranks": [[d.gpu_type, f"{q:.6g}"] for d, q in zip(self.cluster.devices, quotas)],
               "bandwidth": [[f"{x:.6g}" for x in row] for row in self.link_bandwidth],
               "latency": [[f"{x:.6g}" for x in row] for row in self.link_latency],
               "egress": [f"{x:.6g}" for x in self.egress_bandwidth], "memory": self.memory,
               "quota_clock": self._want_clock}
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]

    # ---- reading -------------------------------------------------------------------------------
    def describe(self) -> str:
        """A table of ranks: machine, device type, CPU quota (cores), memory limit, and the shaped
        links of its machine to the others (rate / latency)."""
        from lightning_hexiscale.config.units import format_bandwidth, format_bytes

        ranks = self.ranks or self._planned_ranks()
        # latency is emulated only where the kernel has sch_netem: not shown as if it were otherwise
        shaped = self.network.latency_shaped if self.network is not None else netem_probe()
        lines = [f"{'rank':>4}  {'machine':<12} {'device':<10} {'cores':>6}  {'memory':>10}  links to other machines"
                 + (" (rate / latency)" if shaped else " (rate)")]
        for r in ranks:
            links = ", ".join(f"{self.cluster.machines[j].name} {format_bandwidth(self.link_bandwidth[r.machine][j])}"
                              + (f" / {self._latency_text(self.link_latency[r.machine][j])}" if shaped else "")
                              for j in range(len(self.cluster.machines)) if j != r.machine) or "-"
            mem = format_bytes(r.memory_bytes) if r.memory_bytes is not None else "no limit"
            lines.append(f"{r.rank:>4}  {r.machine_name:<12} {r.gpu_type:<10} {r.cores:>6.3f}  {mem:>10}  {links}")
        lines.append(f"total {sum(r.cores for r in ranks):.3f} cores; one compute thread per rank; "
                     "same-machine ranks share the namespace's loopback (unshaped)")
        if self.cgroups is not None:
            periods = sorted(set(self.cgroups.periods_us))
            span = f"{periods[0] / 1e3:g}" + (f"-{periods[-1] / 1e3:g}" if len(periods) > 1 else "")
            clock = (f"quota clock every {self.clock.tick_s * 1e3:g} ms" if self.clock and self.clock.running
                     else f"no quota clock ({self.clock.why if self.clock else 'not started'}): quotas are "
                          "enforced at the kernel's scheduler tick")
            lines.append(f"CPU quota periods {span} ms; {clock}")
        if self.network is not None:
            lines.append(f"emulated cluster {self.id}: cgroups {self.cgroups.name}, network namespaces "
                         f"{', '.join(self.network.namespaces)}")
        if shaped is False:
            lines.append("latency: NOT emulated (this kernel has no sch_netem); links keep the veth's own latency "
                         "(tens of microseconds); bandwidth is shaped")
        elif shaped is None:
            lines.append("latency: emulated only if the kernel has sch_netem (could not be checked without root); "
                         "bandwidth is shaped")
        return "\n".join(lines)

    def _latency_text(self, s: float) -> str:
        return f"{s * 1e6:.0f} us"

    def _planned_ranks(self) -> list[EmulatedRank]:
        """The ranks as they would be set up (for describe() before entering)."""
        return self._plan(CgroupLayout.detect(self._cgroup_root))[1]

    def _plan(self, layout: CgroupLayout | None) -> tuple[list[float], list[EmulatedRank]]:
        """The quotas (cores, before trimming) and the ranks as ``__enter__`` sets them up, memory
        limits included; one path for both, so that describe() shows what a run gets, and refuses
        what it would refuse (a quota below the kernel's minimum)."""
        c = self.cluster
        avail = available_cores(layout)
        cores = self._cores_arg if self._cores_arg is not None else avail
        quotas = cpu_quotas([d.flops for d in c.devices], cores)
        if sum(quotas) > avail + 1e-9:
            # quotas are ceilings: beyond the CPUs there are, ranks share cores and the fast ones lose most
            raise EmulationError(f"cores = {cores:g}: the ranks' quotas sum to {sum(quotas):.3g} cores, more than the "
                                 f"{avail:g} this process may use (its CPU affinity and cgroup quota); the ranks would "
                                 "contend for cores and the emulated ratio would drift toward 1:1. Fix: --cores "
                                 f"{avail:g} or less (or leave --cores out)")
        try:
            cfs_period_us(quotas, CLOCKED_PERIOD_US)
        except ValueError as e:
            raise EmulationError(f"{e} ({len(quotas)} ranks sharing {cores:g} cores in the ratio of their FLOP/s). "
                                 "Fix: give more --cores or emulate fewer or less unequal ranks") from None
        mem = None
        if self.memory:
            total = self._memory_total_arg if self._memory_total_arg is not None else available_memory()
            mem = memory_limits([d.memory_bytes for d in c.devices], total)
        ranks = [EmulatedRank(d.id, d.machine, c.machines[d.machine].name, c.machines[d.machine].devices.index(d.id),
                              len(c.machines[d.machine].devices), d.gpu_type, d.flops, quotas[d.id],
                              None if mem is None else mem[d.id], Network.address(d.machine),
                              Network.ifname(d.machine)) for d in c.devices]
        return quotas, ranks


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@atexit.register
def _close_all() -> None:
    for emu in list(_LIVE):
        emu.close()
