"""GPU catalog: datasheet peaks (dense BF16 tensor, FP32, TF32), memory and memory bandwidth per GPU type.

One table, one place, each figure with its source in a comment. FLOP/s are dense (no structured
sparsity); ``peak_flops`` is BF16/FP16 tensor throughput with FP32 accumulation, the rate
mixed-precision training runs at; memory is what the device exposes; bandwidth is the datasheet's
device-memory bandwidth. Users add types, or override a listed type's figures field by field, in a
cluster YAML under ``gpu_types:`` without touching code (see ``config/schema.GpuTypeConfig``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuType:
    """One accelerator model: datasheet figures (dense, no structured sparsity) and what is known of
    how much of them training reaches."""

    name: str
    """Catalog key, e.g. ``A800``."""
    peak_flops: float
    """Peak dense 16-bit (BF16/FP16) tensor FLOP/s with FP32 accumulation, the rate mixed-precision
    and bf16 training run at."""
    memory_bytes: float
    """Device memory in bytes."""
    efficiency: float | None = None
    """Fraction of the peak the cost model's FLOPs / (peak x efficiency) assumes is sustained, set
    by ``hexiscale calibrate`` or by the user; None: not calibrated (CUDA plans are then priced by
    the roofline of :mod:`lightning_hexiscale.planner.cost.compute` where the type has an HBM figure,
    else at the peak)."""
    hopper: bool = False
    """Hopper-class GPU (the paper runs ZeRO-3 on clusters that contain them, Appendix G)."""
    fp32_flops: float | None = None
    """Peak FP32 FLOP/s without tensor cores: what ``32-true`` matmuls run at under torch's default
    ``float32_matmul_precision="highest"`` (the runtime does not enable TF32). None: unknown (the
    cost model then uses ``peak_flops``, e.g. for profiled types measured in the run's own dtype)."""
    tf32_flops: float | None = None
    """Peak dense TF32 tensor FLOP/s (``32-true`` with TF32 matmuls allowed, ``Workload.allow_tf32``)."""
    memory_bandwidth_Bps: float | None = None
    """Datasheet device-memory (HBM / GDDR) bandwidth in bytes/s, the ceiling of memory-bound kernels."""
    gemm_efficiency: float | None = None
    """Fraction of the peak large GEMMs reach on this type, measured (``recipes/mfu_probe.py``'s GEMM
    ceiling at the stage's shapes, written under ``gpu_types.<type>.gemm_efficiency``); None: the
    roofline's documented default (``planner.cost.compute.DEFAULT_GEMM_EFFICIENCY``)."""
    hbm_efficiency: float | None = None
    """Fraction of ``memory_bandwidth_Bps`` memory-bound kernels reach, measured like
    ``gemm_efficiency``; None: ``planner.cost.compute.DEFAULT_HBM_EFFICIENCY``."""
    datasheet: bool = False
    """The figures are the built-in catalog's datasheet values (not a user's or the profiler's)."""

    @property
    def flops(self) -> float:
        """Derived: sustained FLOP/s = peak_flops * efficiency (efficiency 1.0 when not calibrated)."""
        return self.peak_flops * (1.0 if self.efficiency is None else self.efficiency)


_GiB = 2.0**30
_T = 1e12
_GBps = 1e9


def _gpu(name: str, bf16_T: float, memory_GiB: float, fp32_T: float, tf32_T: float, hbm_GBps: float,
         hopper: bool = False) -> GpuType:
    return GpuType(name, bf16_T * _T, memory_GiB * _GiB, None, hopper, fp32_T * _T, tf32_T * _T,
                   hbm_GBps * _GBps, datasheet=True)


CATALOG: dict[str, GpuType] = {
    # Columns: dense BF16 tensor TFLOPS, memory GiB, FP32 (non-tensor) TFLOPS, dense TF32 tensor
    # TFLOPS, memory bandwidth GB/s. Dense = half the datasheets' "with sparsity" figures.
    # NVIDIA A100 datasheet: BF16 312, TF32 156, FP32 19.5 TFLOPS; 40 GB HBM2 at 1,555 GB/s,
    # 80 GB HBM2e at 2,039 GB/s (SXM).
    "A100-40G": _gpu("A100-40G", 312, 40, 19.5, 156, 1555),
    "A100-80G": _gpu("A100-80G", 312, 80, 19.5, 156, 2039),
    # A800 is the export variant of the A100 80GB: same SMs, clocks and HBM2e (only NVLink is capped at 400 GB/s).
    "A800": _gpu("A800", 312, 80, 19.5, 156, 2039),
    # NVIDIA H100 SXM datasheet: BF16 989 (1,979 with sparsity), TF32 494.5 (989 with sparsity),
    # FP32 67 TFLOPS; 80 GB HBM3 at 3.35 TB/s.
    "H100": _gpu("H100", 989, 80, 67, 494.5, 3350, hopper=True),
    # H800 SXM is the export variant of H100 SXM: same compute and HBM3, reduced NVLink bandwidth.
    "H800": _gpu("H800", 989, 80, 67, 494.5, 3350, hopper=True),
    # NVIDIA H200 SXM datasheet: H100 SXM's compute; 141 GB HBM3e at 4.8 TB/s.
    "H200": _gpu("H200", 989, 141, 67, 494.5, 4800, hopper=True),
    # NVIDIA H20 (Hopper, export) product brief: BF16 148, TF32 74, FP32 44 TFLOPS; 96 GB HBM3 at 4.0 TB/s.
    "H20": _gpu("H20", 148, 96, 44, 74, 4000, hopper=True),
    # NVIDIA L40S datasheet: BF16 362 (733 with sparsity), TF32 183 (366), FP32 91.6 TFLOPS;
    # 48 GB GDDR6 at 864 GB/s.
    "L40S": _gpu("L40S", 362, 48, 91.6, 183, 864),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): FP16 tensor with FP32 accumulate
    # 165.2 (dense; 330.3 with FP16 accumulate), TF32 82.6, FP32 82.6 TFLOPS; 24 GB GDDR6X at 1,008 GB/s.
    "RTX4090": _gpu("RTX4090", 165.2, 24, 82.6, 82.6, 1008),
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): FP16 tensor with FP32 accumulate 71 (dense), TF32
    # 35.6, FP32 35.6 TFLOPS; 24 GB GDDR6X at 936 GB/s.
    "RTX3090": _gpu("RTX3090", 71, 24, 35.6, 35.6, 936),
    # RTX 3080 Ti: GA102 with 80 SMs at 1.665 GHz boost; the GA102 whitepaper's per-SM rate
    # (3090: 71 TFLOPS / (82 SMs * 1.695 GHz)) gives 80 * 1.665e9 * 510.8 = 68.1 TFLOPS, and
    # 35.6 * (80 * 1.665) / (82 * 1.695) = 34.1 TFLOPS FP32 / TF32; 12 GB GDDR6X, 384 bit at 19 Gbps = 912 GB/s.
    "RTX3080Ti": _gpu("RTX3080Ti", 68.1, 12, 34.1, 34.1, 912),
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
