"""One network namespace per emulated machine, joined through a bridge, each link shaped by ``tc``.

Layout for an emulated cluster with id ``ID`` and machines 0..M-1::

    netns hx<ID>m<k>:  lo (the fast intra-machine link) + veth emu<k>, address 10.77.0.<k+1>/24
    netns hx<ID>hub:   bridge br0 joining the peers p<k> of every emu<k>

The bridge sits in its own namespace so that the host's firewall (bridge-netfilter, Docker's FORWARD
policy) never sees the traffic, and deleting the namespaces removes every link with them.

Shaping happens on each machine's egress, per destination machine, so any pairwise bandwidth
matrix (``machine_links``) is honoured: an ``htb`` root, one class per other machine at
``rate = ceil = bandwidth`` (bytes/s), selected by a ``u32`` filter on the destination address.
When the machine's NICs carry less than its links together (``egress``: three or more machines,
or a NIC slower than the link), the per-destination classes hang under one parent class at the
NIC figure, which all of them share: each class's assured ``rate`` is NIC / (machines - 1) and its
``ceil`` min(link, NIC), so the veth is then the machine's NIC for every destination. A
message from machine a to machine b is therefore limited once, by a's class for b, and TCP's
acknowledgements flow back through b's class for a. The class's leaf queue is ``netem delay
latency`` when the kernel has ``sch_netem`` (the one-way delay), else a deep FIFO (no drops, so TCP
does not back off): then the link's latency is the veth's own (tens of microseconds) and
:attr:`Network.latency_shaped` is False, which :meth:`EmulatedCluster.describe` says.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
"""Private /24 of the emulated machines; every cluster has its own namespaces, so no clash."""
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` bind-mounts ``/etc/netns/NS/hosts`` over /etc/hosts: each machine's file names
every machine's address, so that gloo's reverse lookups of a peer answer at once instead of
failing (c10d's "hostname of the client socket cannot be retrieved") or waiting for a DNS server
the namespace cannot reach."""


class CommandError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message holds the command and its stderr."""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; raise :class:`CommandError` with its stderr when it fails and ``check``."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise CommandError(f"`{' '.join(cmd)}` failed (exit {p.returncode}): {p.stderr.strip()}")
    return p


@dataclass
class Network:
    """Namespaces and shaped links of one emulated cluster.

    ``bandwidth[a][b]`` (bytes/s) and ``latency[a][b]`` (s) are the shaped links between machines
    a != b (already scaled); the diagonal is ignored (same machine: loopback)."""

    cluster_id: str
    bandwidth: list[list[float]]
    latency: list[list[float]]
    namespaces: list[str] = field(default_factory=list)
    latency_shaped: bool = False
    egress: list[float] | None = None
    """Per machine, what its NICs carry together (bytes/s, already scaled); None: no shared limit."""

    @property
    def num_machines(self) -> int:
        return len(self.bandwidth)

    def ns(self, k: int) -> str:
        return f"hx{self.cluster_id}m{k}"

    @property
    def hub(self) -> str:
        return f"hx{self.cluster_id}hub"

    @staticmethod
    def ifname(k: int) -> str:
        """The machine's interface name inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"emu{k}"

    def host(self, k: int) -> str:
        """Machine k's host name in the namespaces' /etc/hosts."""
        return f"hx{self.cluster_id}-m{k}"

    @staticmethod
    def address(k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def create(self) -> None:
        """Build everything; on failure removes what it made and re-raises."""
        if self.num_machines > 250:
            raise ValueError(f"{self.num_machines} machines: the emulated subnet holds at most 250")
        try:
            self._add_ns(self.hub)
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for k in range(self.num_machines):
                ns = self.ns(k)
                self._add_ns(ns)
                sh("ip", "link", "add", self.ifname(k), "netns", ns, "type", "veth", "peer", "name", f"p{k}",
                   "netns", self.hub)
                sh("ip", "-n", self.hub, "link", "set", f"p{k}", "master", "br0")
                sh("ip", "-n", self.hub, "link", "set", f"p{k}", "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", self.ifname(k))
                sh("ip", "-n", ns, "link", "set", self.ifname(k), "up")
            # the IPv4-mapped IPv6 form too: c10d's store listens dual-stack and sees its clients so
            hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{self.address(k)} {self.host(k)}\n::ffff:{self.address(k)} {self.host(k)}\n"
                for k in range(self.num_machines))
            for k in range(self.num_machines):
                d = NETNS_ETC / self.ns(k)
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text(hosts)
            self.latency_shaped = netem_available(self.ns(0))
            for k in range(self.num_machines):
                self._shape(k)
        except BaseException:
            self.remove()
            raise

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)

    def _shape(self, k: int) -> None:
        """Egress shaping of machine k: one htb class (+ leaf) per destination machine."""
        ns, dev = self.ns(k), self.ifname(k)
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "0")
        parent, nic = "1:", float("inf")
        links = sum(self.bandwidth[k][j] for j in range(self.num_machines) if j != k)
        if self.egress is not None and self.egress[k] < links:  # the NIC binds: every destination shares it
            nic = self.egress[k]
            burst = max(1600, int(nic * 0.001))
            sh("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate",
               f"{int(nic)}bps", "ceil", f"{int(nic)}bps", "burst", str(burst), "cburst", str(burst))
            parent = "1:1"
        for j in range(self.num_machines):
            if j == k:
                continue
            ceil = int(min(self.bandwidth[k][j], nic))
            # htb lets a class send at its own ``rate`` whatever its parent has left: only what it
            # borrows above that, up to ``ceil``, is bounded by the parent. Under a shared NIC the
            # classes' rates must therefore add up to the NIC (an equal share each), with ``ceil`` at
            # the link: one flow alone still gets min(link, NIC), several share the NIC. With each
            # rate at the link, two flows out of one machine had got 2 x the NIC.
            rate = ceil if parent == "1:" else max(1, int(min(ceil, nic / (self.num_machines - 1))))
            # burst: 1 ms of traffic (at least one MTU): a deeper bucket lets the first bytes of
            # every message through faster than the link. htb sends a packet while its tokens are
            # >= 0 and charges it afterwards, so 64 KiB GSO packets pass a smaller bucket too.
            burst = max(1600, int(ceil * 0.001))
            cls = f"1:{j + 10:x}"
            sh("tc", "-n", ns, "class", "add", "dev", dev, "parent", parent, "classid", cls, "htb",
               "rate", f"{rate}bps", "ceil", f"{ceil}bps", "burst", str(burst), "cburst", str(burst))
            if self.latency_shaped and self.latency[k][j] > 0:
                leaf = ["netem", "delay", f"{self.latency[k][j] * 1e6:.0f}us", "limit", "100000"]
            else:
                leaf = ["pfifo", "limit", "100000"]
            sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", cls, "handle", f"{j + 10:x}:", *leaf)
            sh("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "dst", f"{self.address(j)}/32", "flowid", cls)

    def remove(self) -> None:
        """Delete every namespace made (their links go with them). Idempotent; kills what still runs inside."""
        for ns in reversed(self.namespaces):
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                sh("kill", "-9", pid, check=False)
            sh("ip", "netns", "delete", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        existing = set(list_namespaces())
        self.namespaces = [ns for ns in self.namespaces if ns in existing]


def list_namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netem_available(ns: str) -> bool:
    """Whether the kernel has ``sch_netem`` (tried on the namespace's loopback, then removed)."""
    ok = sh("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us", check=False).returncode == 0
    if ok:
        sh("tc", "-n", ns, "qdisc", "del", "dev", "lo", "root", check=False)
    return ok


def netem_probe() -> bool | None:
    """Whether the kernel has ``sch_netem``, before any namespace of ours exists (``--describe``):
    tried on the loopback of a throwaway network namespace (``unshare --net``, gone with the probe).
    None when that cannot be tried (no root, no ``unshare`` or ``tc``)."""
    if not (shutil.which("unshare") and shutil.which("tc")):
        return None
    probe = subprocess.run(["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        return True
    return False if "unknown" in (probe.stderr or "").lower() else None
