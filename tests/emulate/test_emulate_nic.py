"""The emulator's veth is the machine's NIC: with three machines (or a NIC slower than its links) the
per-destination classes share one parent class at the NIC figure; with two machines at the default
NIC nothing changes. Skipped without root / cgroups / `ip netns`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.emulate import EmulatedCluster, missing_support

MISSING = missing_support() if sys.platform.startswith("linux") else ["Linux"]
pytestmark = [pytest.mark.skipif(bool(MISSING), reason=f"emulated cluster unsupported here: {'; '.join(MISSING)}"),
              pytest.mark.timeout(120)]


def classes(emu: EmulatedCluster, k: int) -> str:
    return subprocess.run(["tc", "-n", f"hx{emu.id}m{k}", "class", "show", "dev", f"emu{k}"], capture_output=True,
                          text=True).stdout


@pytest.mark.slow
def test_three_machines_share_one_nic_each():
    c = Cluster.from_config({"name": "three", "gpu_types": {"E": {"flops": "10 GFLOPS", "memory": "1 GiB"}},
                             "machines": [{"name": f"m{k}", "gpu": "E", "count": 1, "intra_bandwidth": "1 GB/s"}
                                          for k in range(3)],
                             "inter_machine": {"bandwidth": "40 MB/s"}})
    with EmulatedCluster(c, cores=0.3) as emu:
        assert emu.egress_bandwidth == [40e6, 40e6, 40e6]
        out = classes(emu, 0)
        assert "class htb 1:1 root" in out and "rate 320Mbit" in out  # the NIC: 40 MB/s for both destinations
        assert out.count("parent 1:1") == 2  # one class per other machine, both under it
        # each destination's assured rate is half the NIC, its ceiling the NIC: htb lets a class send
        # at its rate whatever the parent has left, so rates at the NIC would give 2 x the NIC
        assert out.count("rate 160Mbit ceil 320Mbit") == 2, out


RECEIVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n, flush=True)
"""
SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
data = bytes(1 << 20); t = time.perf_counter()
for _ in range(int(sys.argv[3])): c.sendall(data)
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.perf_counter() - t, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timing
def test_two_flows_out_of_one_machine_share_its_nic():
    """Machine 0 sends 12 MiB to each of machines 1 and 2 at once through its 40 MB/s NIC: both
    flows together take at least 24 MiB / 40 MB/s (less 15 %), not half of it."""
    c = Cluster.from_config({"name": "three", "gpu_types": {"E": {"flops": "10 GFLOPS", "memory": "1 GiB"}},
                             "machines": [{"name": f"m{k}", "gpu": "E", "count": 1, "intra_bandwidth": "1 GB/s"}
                                          for k in range(3)],
                             "inter_machine": {"bandwidth": "40 MB/s"}})
    mib = 12
    with EmulatedCluster(c, cores=0.3) as emu:
        net = emu.network
        recv = [subprocess.Popen(["ip", "netns", "exec", net.ns(k), sys.executable, "-c", RECEIVER, "29500"],
                                 stdout=subprocess.PIPE, text=True) for k in (1, 2)]
        for r in recv:
            assert r.stdout.readline().strip() == "ready"
        send = [subprocess.Popen(["ip", "netns", "exec", net.ns(0), sys.executable, "-c", SENDER, net.address(k),
                                  "29500", str(mib)], stdout=subprocess.PIPE, text=True) for k in (1, 2)]
        took = [float(p.communicate(timeout=60)[0]) for p in send]
        for r in recv:
            r.kill()
    together = 2 * mib * 2**20 / max(took)
    assert together <= 40e6 * 1.15, f"{together / 1e6:.1f} MB/s out of a 40 MB/s NIC"


@pytest.mark.slow
def test_two_machines_at_the_default_nic_keep_one_class_per_destination():
    with EmulatedCluster("emu_4to1", cores=1.0) as emu:
        out = classes(emu, 0)
        assert "class htb 1:1 " not in out and "320Mbit" in out
