"""The torch names this package uses that are newer than its torch floor, with their older forms.

``pyproject.toml`` promises the oldest torch the distributed suites were run on (README, "Torch and
Lightning versions"). Where the package calls a name that torch added later, it calls the function
here instead, which takes the new name when this torch has it and the older form otherwise:

=================================  =======  ===================================================
new name (used when present)       since    older form (same semantics)
=================================  =======  ===================================================
``dist.all_gather_single``         2.13     ``dist.all_gather_into_tensor`` (2.0; deprecated
                                            from 2.13 with a FutureWarning, hence the order)
``dist.reduce_scatter_single``     2.13     ``dist.reduce_scatter_tensor`` (2.0; deprecated
                                            from 2.13)
SDPA's ``enable_gqa=`` argument    2.5      key/value heads repeated ``nq / nkv`` times
                                            (``repeat_interleave`` on dim 1) before plain SDPA
=================================  =======  ===================================================

Communication is unchanged by the choice: ``all_gather_into_tensor`` and ``all_gather_single``
(likewise the reduce-scatters) are one NCCL/gloo collective with the same group, input and output
sizes and dtype (torch 2.13's deprecated names are thin wrappers around the new ones), so the bytes
on the wire and the collective order the cost model and the NCCL rules rely on are the same on every
torch. The collectives look the name up at every call, not at import, so a test can hide the new
names from ``torch.distributed`` and a wrapper installed after import (the suite's NCCL recorder)
sees the call.

The GQA fallback computes the same attention (query head j reads key/value head ``j // (nq/nkv)``,
which is what ``enable_gqa`` does) at the memory cost of the repeated k/v: (nq/nkv - 1) x the k/v
activations of one layer, only on torch < 2.5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

SDPA_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
"""Whether ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5)."""


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False):
    """All-gather equal chunks ``input`` (n elements) of every member of ``group`` into ``output``
    (t x n elements, rank order): ``dist.all_gather_single`` (torch >= 2.13) or
    ``dist.all_gather_into_tensor``. Returns the work handle when ``async_op``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Reduce ``input`` (t x n elements) over ``group`` with ``op`` and keep this rank's chunk (n
    elements, rank order) in ``output``: ``dist.reduce_scatter_single`` (torch >= 2.13) or
    ``dist.reduce_scatter_tensor``. Returns the work handle when ``async_op``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``F.scaled_dot_product_attention`` on q (B, nq, S, d) and k, v (B, nkv, S, d), nq a
    multiple of nkv: ``enable_gqa`` where torch has it (>= 2.5), else k/v heads repeated."""
    group = q.shape[1] // k.shape[1]
    if SDPA_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
