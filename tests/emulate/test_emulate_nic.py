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


@pytest.mark.slow
def test_two_machines_at_the_default_nic_keep_one_class_per_destination():
    with EmulatedCluster("emu_4to1", cores=1.0) as emu:
        out = classes(emu, 0)
        assert "class htb 1:1 " not in out and "320Mbit" in out
