"""Peak resident memory of a CPU rank, as the memory benchmarks measure it.

A CPU rank's memory is its resident set: the peak (VmHWM) from a baseline taken after a throw-away
step, so one-time lazy initialisation is not counted (the same helpers ``hexiscale check-estimate``
uses, :mod:`lightning_hexiscale.profiling.check`, on the CPU device). With glibc's default dynamic
mmap threshold freed tensors stay in the heap, so :func:`fixed_mmap_threshold` is set first.
"""

from __future__ import annotations

import torch

from lightning_hexiscale.profiling.check import peak_memory, prime, reset_peak_memory

CPU = torch.device("cpu")


def reset_peak_rss() -> int:
    """Reset the peak-RSS mark (VmHWM) to the current RSS where the kernel allows it; baseline bytes."""
    return int(reset_peak_memory(CPU))


def prime_process() -> None:
    """One throw-away tiny step and all-reduce, so that one-time lazy initialisation (about 100 MiB
    of resident memory on the first step, measured) happens before the baseline."""
    prime(CPU)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (VmHWM)."""
    return int(peak_memory(CPU))


def fixed_mmap_threshold(nbytes: int = 64 * 1024) -> None:
    """glibc: serve allocations >= ``nbytes`` by mmap and turn off the dynamic threshold, so that a
    freed gradient goes back to the OS at once. With the default dynamic threshold (up to 32 MiB)
    freed tensors stay in the heap and the resident set keeps memory that is no longer live
    (measured with benchmarks/bench_zero.py: ZeRO-2/DDP 0.94 instead of 0.72)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, nbytes)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: measure with the default allocator
        pass
