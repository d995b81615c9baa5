"""Megatron-style tensor parallelism inside one stage: column/row-parallel linears, and the
vocabulary-parallel embedding, LM head and cross-entropy of first and last stages.

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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
        self.compute_weight: torch.Tensor | None = None
        """The weight the matmul uses when set: a 16-bit copy cast once per step (:mod:`.main_grads`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.group)
        return F.linear(x, _matmul_weight(self))


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
        self.compute_weight: torch.Tensor | None = None
        """As :attr:`ColumnParallelLinear.compute_weight`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(F.linear(x, _matmul_weight(self)), self.group)


def _matmul_weight(module: nn.Module) -> torch.Tensor:
    """The module's compute copy of its weight where main grads are on, else the weight itself."""
    w = module.compute_weight
    return module.weight if w is None else w


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``t``'s device and narrower than ``t``, else None."""
    if not torch.is_autocast_enabled(t.device.type):
        return None
    dtype = torch.get_autocast_dtype(t.device.type)
    return dtype if torch.finfo(dtype).bits < torch.finfo(t.dtype).bits else None


# ---- vocabulary parallelism (Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy) ----
class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of the token embedding on this rank.

    out = g(E_r[t - vocab_start] if vocab_start <= t < vocab_end else 0): each token's vector comes
    from the one rank that holds its row; the forward all-reduce (g) assembles the full (B, S, H)
    on every rank, and backward (identity) gives each rank the gradient of its own rows only.
    Same parameter name as ``nn.Embedding`` (``weight``), so global names do not change.
    """

    def __init__(self, vocab_start: int, vocab_end: int, hidden: int, group: ProcessGroup | None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_start, self.vocab_end, self.group = vocab_start, vocab_end, group
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden, device=device, dtype=dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.group is None:  # TP 1: all rows, a plain lookup
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        wire = _autocast_dtype(out)
        if wire is None:
            return reduce_from_tp_region(out, self.group)
        # mixed precision: the all-reduce in the autocast dtype (what the cost model prices), the
        # residual stream back in the parameter dtype
        return reduce_from_tp_region(out.to(wire), self.group).to(out.dtype)


class VocabParallelHead(nn.Module):
    """LM head over this rank's vocabulary rows: logits_r = f(x) @ W_r^T, shape (B, S, V_r).

    ``weight_of`` is the module that owns the matrix: the head itself (untied, parameter
    ``lm_head.weight``) or the stage's embedding (tied: one parameter ``embed.weight``); it is looked
    up at call time, so the tie survives ``to_empty``. f (:func:`copy_to_tp_region`) sums the
    ranks' partial input gradients dL/dx = sum_r dL/dlogits_r @ W_r in backward.
    """

    def __init__(self, group: ProcessGroup | None, weight: nn.Parameter | None = None,
                 tied_to: nn.Module | None = None):
        super().__init__()
        self.group = group
        if (weight is None) == (tied_to is None):
            raise ValueError("VocabParallelHead needs exactly one of weight (untied) or tied_to (the embedding)")
        if weight is not None:
            self.weight = weight
        self._tied = (tied_to,) if tied_to is not None else None  # a tuple: not a submodule
        self.compute_weight: torch.Tensor | None = None
        """As :attr:`ColumnParallelLinear.compute_weight` (untied heads only: a tied matrix also
        feeds the embedding, whose gradient autograd accumulates)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.weight if self.compute_weight is None else self.compute_weight) if self._tied is None \
            else self._tied[0].weight
        wire = _autocast_dtype(x) if self.group is not None else None
        if wire is not None:  # the matmul casts anyway; f's backward all-reduce then runs in this dtype
            x = x.to(wire)
        return F.linear(copy_to_tp_region(x, self.group), w)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy of logits split over the vocabulary (Megatron-LM's formulation).

    Per token, with z_r this rank's logits (V_r columns), in the compute dtype (>= float32):
        m   = all-reduce_MAX(max_j z_r[j])                   (stability shift, no gradient)
        s   = all-reduce_SUM(sum_j exp(z_r[j] - m))
        z_t = all-reduce_SUM(z_r[t - v0] if t in [v0, v1) else 0)   (the target logit, from its owner)
        loss = mean_tokens(log s - (z_t - m))
    Backward: dL/dz_r = (softmax_r - onehot_r(t)) / N, with softmax_r = exp(z_r - m) / s: local, no
    communication. Three all-reduces of B*S scalars; the full (B, S, V) logits never exist on a rank.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: ProcessGroup) -> torch.Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        z = z.reshape(-1, z.shape[-1])
        t = targets.reshape(-1)
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)
        local_t = t - vocab_start
        mine = (local_t >= 0) & (local_t < z.shape[-1])
        rows = torch.arange(z.shape[0], device=z.device)
        target_logit = torch.where(mine, shifted[rows, local_t.clamp(0, z.shape[-1] - 1)], 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([sum_exp, target_logit])  # one all-reduce for both sums
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = both[0], both[1]
        loss = (sum_exp.log() - target_logit).mean()
        exp.div_(sum_exp.unsqueeze(-1))  # softmax_r, kept for backward
        ctx.save_for_backward(exp, local_t, mine)
        ctx.shape, ctx.in_dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)[mine]
        g[rows, local_t[mine]] -= 1.0
        g.mul_(grad / g.shape[0])
        return g.view(ctx.shape).to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group: ProcessGroup) -> torch.Tensor:
    """Mean cross-entropy over all B*S tokens of logits (B, S, V_r) holding vocabulary columns
    [vocab_start, vocab_start + V_r) on each rank of ``group``; the same value on every rank.
    Equals ``F.cross_entropy`` of the concatenated logits (see :class:`_VocabParallelCrossEntropy`)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group)


def default_backend(device: torch.device | str) -> str:
    """Process-group backend for a device type: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
