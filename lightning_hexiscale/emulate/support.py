"""What the emulated cluster needs from the machine, checked up front with one clear error."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from lightning_hexiscale.emulate.cgroups import CgroupLayout
from lightning_hexiscale.errors import HexiScaleError


class EmulationError(HexiScaleError, RuntimeError):
    """The emulated cluster cannot be set up, or one of its ranks failed."""


def missing_support(memory: bool = False, cgroup_root: str | Path = "/sys/fs/cgroup") -> list[str]:
    """What is missing for an emulated cluster on this machine, one phrase each (empty: all there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (cgroups, network namespaces and tc need them; run as root, e.g. with sudo)")
    layout = CgroupLayout.detect(cgroup_root)
    if layout is None:
        missing.append(f"a cgroup CPU controller under {cgroup_root} (v1 cpu/cpu.cfs_quota_us or v2 cgroup.controllers "
                       "listing cpu)")
    elif memory and not layout.has_memory():
        missing.append(f"a cgroup memory controller under {cgroup_root} (needed by --memory)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (package {pkg})")
    if shutil.which("ip") is not None and not missing:
        p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if p.returncode != 0:
            missing.append(f"network namespaces (`ip netns list` failed: {p.stderr.strip()})")
    return missing


def check_support(memory: bool = False, cgroup_root: str | Path = "/sys/fs/cgroup") -> CgroupLayout:
    """Raise one :class:`EmulationError` naming everything missing; return the cgroup layout when all is there."""
    missing = missing_support(memory, cgroup_root)
    if missing:
        raise EmulationError("the emulated cluster cannot run on this machine; missing: " + "; ".join(missing)
                             + ". Fix: run as root on a Linux machine with cgroups (v1 or v2) and iproute2, "
                               "or run without emulation (hexiscale profile --local N)")
    layout = CgroupLayout.detect(cgroup_root)
    assert layout is not None
    return layout
