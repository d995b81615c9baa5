"""An emulated heterogeneous cluster on one Linux machine: per-rank cgroups (CPU quota ~ FLOP/s,
optional memory limit ~ device memory) and one network namespace per machine with shaped links.

Its own layer: imports no torch and no torch.distributed; ranks are plain processes started with a
torchrun-like environment. See :class:`EmulatedCluster` and ``hexiscale emulate --help``.
"""

from lightning_hexiscale.emulate.emulated import EmulatedCluster, EmulatedRank, cpu_quotas, memory_limits
from lightning_hexiscale.emulate.registry import remove_stale
from lightning_hexiscale.emulate.support import EmulationError, check_support, missing_support

__all__ = ["EmulatedCluster", "EmulatedRank", "EmulationError", "check_support", "cpu_quotas", "memory_limits",
           "missing_support", "remove_stale"]
