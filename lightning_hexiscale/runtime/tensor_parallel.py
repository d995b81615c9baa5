"""Megatron-style tensor parallelism inside one stage, and the attention kernel choice.

Two conjugate autograd operations over the stage's TP process group (Megatron-LM's f and g):

- ``copy_to_tp_region`` (f): forward identity, backward all-reduce(SUM) of the input gradient.
  Placed where a replicated activation enters column-parallel linears: each rank's partial input
  gradient dL/dx_r = dL/dy_r @ W_r covers only its output columns; their sum is the full gradient.
- ``reduce_from_tp_region`` (g): forward all-reduce(SUM), backward identity. Placed after a
  row-parallel linear: y = sum_r x_r @ W_r^T over the ranks' input shards.

A column-parallel linear holds rows [start, end) of W (out x in) and outputs that slice of the
features; a row-parallel linear holds columns [start, end) and outputs a partial sum. Nothing here
assumes equal shard sizes: shard shapes come from the caller (``LlamaConfig.kv_head_split`` /
``ffn_split``), and the collectives operate on full-size (replicated-shape) tensors only.

With f and g placed this way, every activation outside the column->row sandwich, and every
gradient of a replicated parameter (norm weights, embedding, LM head), is identical on all ranks of
the TP group. The gradient synchroniser relies on this.

``group`` is ``None`` for a TP degree of 1: then every operation is the identity.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hexiscale.models.llama import sdpa_attention

ProcessGroup = dist.ProcessGroup


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce(SUM) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce(SUM) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f (see module doc); identity when ``group`` is None."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g (see module doc); identity when ``group`` is None."""
    return x if group is None else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y_r = x @ W[start:end, :]^T: this rank's slice of the output features.

    ``weight`` has shape (end - start, in_features). With ``copy_input`` the input passes through
    f first; set it False when the caller already applied f once for several column-parallel
    linears that share one input (q, k, v share the normed hidden state: one all-reduce in
    backward instead of three).
    """

    def __init__(self, in_features: int, out_local: int, group: ProcessGroup | None, copy_input: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group, self.copy_input = group, copy_input
        self.weight = nn.Parameter(torch.empty(out_local, in_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.group)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = g(x_r @ W[:, start:end]^T): sums the partial products of all ranks.

    ``weight`` has shape (out_features, end - start); the input is this rank's slice of the
    features, as produced by a column-parallel linear.
    """

    def __init__(self, in_local: int, out_features: int, group: ProcessGroup | None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(F.linear(x, self.weight), self.group)


# ---- attention kernel -------------------------------------------------------------------------
def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package can be imported (it only builds with CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on (B, heads, S, d); k/v may have fewer heads (GQA).

    flash-attn when it is importable, the tensors are on CUDA and in fp16/bf16 (its only dtypes);
    otherwise ``F.scaled_dot_product_attention(is_causal=True)``. The two agree here because q and
    k always have the same length (flash-attn aligns the causal mask bottom-right, SDPA top-left).
    """
    if q.is_cuda and q.dtype in _FLASH_DTYPES and flash_attn_available():
        from flash_attn import flash_attn_func  # optional GPU extra

        # flash-attn takes (B, S, heads, d) and supports GQA when nq is a multiple of nkv.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    return sdpa_attention(q, k, v)


def default_backend(device: torch.device | str) -> str:
    """Process-group backend for a device type: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
