"""Where the stage's fast path meets the strategy: the ``compile`` / ``fast_path`` arguments, fused
AdamW for the optimizers Lightning built, and the run's log line saying what runs on which ranks
(each rank decides for its own device and stage: a heterogeneous cluster may run cuDNN attention
on its H100s and SDPA flash on its A100s).
"""

from __future__ import annotations

import torch.distributed as dist
from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.step_adapter import unwrap_optimizer


def strategy_fast_path(compile, fast_path) -> FastPath:
    """``HexiScaleStrategy(compile=..., fast_path=...)`` as one :class:`FastPath`: ``fast_path`` is a
    FastPath, a mapping of its switches, True/None (all auto) or False (all off); ``compile``
    (True, False or None) overrides its ``compile`` switch."""
    if compile is not None and not isinstance(compile, bool):
        raise ConfigError("HexiScaleStrategy(compile)", compile, "must be True, False or None (auto: on for CUDA)",
                          "pass compile=False to run the stage eagerly")
    return FastPath.coerce(fast_path, key="HexiScaleStrategy(fast_path)").with_compile(compile)


def prepare_optimizers(engine, optimizers: list) -> list[bool]:
    """Fused Adam / AdamW for each optimizer where the fast path asks for it (before any step)."""
    return [engine.prepare_optimizer(unwrap_optimizer(o)) for o in optimizers]


def log_fast_path(engine, fused: list[bool], global_rank: int, world_size: int) -> list[tuple[str, list[int]]]:
    """Collective: every rank's fast-path line (kernels, compilation, attention backend, fused
    AdamW); global rank 0 prints each distinct line with the ranks that run it. Returns the (line, ranks)."""
    line = engine.fast_path.describe()
    if fused:
        line += ", " + ("fused AdamW" if all(fused) else "optimizer not fused")
    lines = [line]
    if world_size > 1 and dist.is_initialized():
        lines = [None] * world_size
        dist.all_gather_object(lines, line)
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(lines):
        groups.setdefault(text, []).append(rank)
    out = list(groups.items())
    if global_rank == 0:  # printed, not logged: recipes and notebooks route Lightning's INFO logger away
        for text, ranks in out:
            where = "all ranks" if len(out) == 1 else f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}"
            print(f"hexiscale {where}: {text}", flush=True)
    return out


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)
