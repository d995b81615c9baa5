"""GPU catalog: peak dense 16-bit tensor-core FLOP/s and memory per GPU type.

One table, one place. FLOP/s are dense (no structured sparsity) BF16/FP16 tensor throughput with
FP32 accumulation, the rate mixed-precision training runs at; memory is what the device exposes.
Users add or override types in a cluster YAML under ``gpu_types:`` without touching code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuType:
    """One accelerator model."""

    name: str
    """Catalog key, e.g. ``A800``."""
    peak_flops: float
    """Peak dense 16-bit tensor FLOP/s (FP32 accumulate)."""
    memory_bytes: float
    """Device memory in bytes."""
    efficiency: float = 1.0
    """Fraction of ``peak_flops`` the cost model assumes is sustained (calibrated per cluster; 1.0 = paper)."""
    hopper: bool = False
    """Hopper-class GPU (the paper runs ZeRO-3 on clusters that contain them, Appendix G)."""

    @property
    def flops(self) -> float:
        """Derived: sustained FLOP/s = peak_flops * efficiency."""
        return self.peak_flops * self.efficiency


_GiB = 2.0**30
_T = 1e12

CATALOG: dict[str, GpuType] = {
    # NVIDIA A100 datasheet: 312 TFLOPS BF16/FP16 tensor (dense), 40 GB / 80 GB HBM2e.
    "A100-40G": GpuType("A100-40G", 312 * _T, 40 * _GiB),
    "A100-80G": GpuType("A100-80G", 312 * _T, 80 * _GiB),
    # A800 is the export variant of the A100 80GB: same SMs and clocks (only NVLink is capped at 400 GB/s).
    "A800": GpuType("A800", 312 * _T, 80 * _GiB),
    # NVIDIA H100 SXM datasheet: 989 TFLOPS BF16 dense (1979 with sparsity), 80 GB HBM3.
    "H100": GpuType("H100", 989 * _T, 80 * _GiB, hopper=True),
    # H800 SXM is the export variant of H100 SXM: same compute, reduced NVLink bandwidth.
    "H800": GpuType("H800", 989 * _T, 80 * _GiB, hopper=True),
    # NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense (1979 with sparsity), 141 GB HBM3e.
    "H200": GpuType("H200", 989 * _T, 141 * _GiB, hopper=True),
    # NVIDIA H20 (Hopper, export): 148 TFLOPS BF16 dense, 96 GB HBM3 (NVIDIA H20 product brief).
    "H20": GpuType("H20", 148 * _T, 96 * _GiB, hopper=True),
    # NVIDIA L40S datasheet: 362 TFLOPS FP16/BF16 tensor dense (733 with sparsity), 48 GB GDDR6.
    "L40S": GpuType("L40S", 362 * _T, 48 * _GiB),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 165.2 TFLOPS FP16 tensor with FP32
    # accumulate, dense (330.3 with FP16 accumulate), 24 GB GDDR6X.
    "RTX4090": GpuType("RTX4090", 165.2 * _T, 24 * _GiB),
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): 71 TFLOPS FP16 tensor with FP32 accumulate, dense, 24 GB.
    "RTX3090": GpuType("RTX3090", 71 * _T, 24 * _GiB),
    # RTX 3080 Ti: GA102 with 80 SMs at 1.665 GHz boost; the GA102 whitepaper's per-SM rate
    # (3090: 71 TFLOPS / (82 SMs * 1.695 GHz)) gives 80 * 1.665e9 * 510.8 = 68.1 TFLOPS; 12 GB.
    "RTX3080Ti": GpuType("RTX3080Ti", 68.1 * _T, 12 * _GiB),
    # Emulated devices for CPU runs: nominal figures chosen so that planning on a laptop-sized
    # model gives a heterogeneous (fast + slow) split; they are not measurements.
    "CPU-FAST": GpuType("CPU-FAST", 100e9, 4 * _GiB),
    "CPU-SLOW": GpuType("CPU-SLOW", 50e9, 2 * _GiB),
}

ALIASES = {
    "4090": "RTX4090", "RTX-4090": "RTX4090", "3090": "RTX3090", "RTX-3090": "RTX3090",
    "3080Ti": "RTX3080Ti", "RTX-3080Ti": "RTX3080Ti", "A100": "A100-80G", "A100-80GB": "A100-80G",
    "A100-40GB": "A100-40G", "A800-80G": "A800",
}


def lookup(name: str, extra: dict[str, GpuType] | None = None) -> GpuType | None:
    """Find a GPU type by name or alias; ``extra`` (user types from YAML) takes precedence."""
    if extra and name in extra:
        return extra[name]
    return CATALOG.get(ALIASES.get(name, name))


def known_names(extra: dict[str, GpuType] | None = None) -> list[str]:
    return sorted(set(CATALOG) | set(extra or {}))


def name_of_device(device_name: str) -> str | None:
    """The catalog type a CUDA device name denotes ("NVIDIA A800-SXM4-80GB" -> A800), None if unlisted.

    The name is cut into tokens at spaces, dashes and underscores; a catalog name (its part before
    a dash, e.g. A100 of A100-80G) matches one token or two or three adjacent ones joined ("RTX 4090"
    -> RTX4090), or the start of one when no digit follows ("A800SXM4"): H20 does not match "H200".
    Among several matches the longest wins, then the one whose memory suffix ("80G") the name
    carries ("A100-SXM4-80GB" -> A100-80G). The emulated CPU types are never matched.
    """
    tokens = [t for t in re.split(r"[\s\-_]+", device_name.upper()) if t]
    spans = {"".join(tokens[i:i + k]) for k in (1, 2, 3) for i in range(len(tokens) - k + 1)}

    def matches(name: str) -> bool:
        base = re.sub(r"[\s\-_]", "", name.split("-")[0]).upper()
        return any(s == base or (s.startswith(base) and not s[len(base)].isdigit()) for s in spans)

    def memory(name: str) -> bool:
        return "-" in name and any(t.startswith(name.split("-", 1)[1].upper()) for t in tokens)

    hits = [n for n in CATALOG if not n.startswith("CPU") and matches(n)]
    return max(hits, key=lambda n: (len(n.split("-")[0]), memory(n), len(n))) if hits else None
