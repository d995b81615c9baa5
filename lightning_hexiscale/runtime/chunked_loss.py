"""Chunked (vocabulary-parallel) cross-entropy: never a float32 copy of a whole micro-batch's logits.

The plain loss upcasts the (B, S, V_r) logits to float32 and keeps float32 tensors of that size for
its backward: ``F.cross_entropy`` its log-softmax, the vocabulary-parallel loss its softmax; with
the upcast, the shifted values and the gradient, about 3 * tokens * V_r * 4 bytes at once (a
128,256-word vocabulary and an 8,192-token micro-batch: 12.6 GB). Here the logits stay in their own
dtype (bf16 under mixed precision) and float32 exists one chunk of c tokens at a time:

    forward   per chunk: m_c = max_j z[j];  then m = all-reduce_MAX(m) over the TP group
              per chunk: e = exp(float(z) - m), s_c = sum_j e[j], t_c = float(z[t]) - m (owner only)
              (s, t) = all-reduce_SUM((s, t));  loss = mean_tokens(log s - t)
    backward  per chunk: dz = (exp(float(z) - m) / s - onehot(t)) * g / N, cast to z's dtype

It saves the logits (their dtype), m, s and the targets: tokens * V_r * b + O(tokens) bytes, and
its backward writes a gradient of the logits' dtype; the float32 work is c * V_r * 4 bytes (c from
``FastPath.loss_chunk_bytes``). The same two all-reduces of the same sizes as
:func:`.tensor_parallel.vocab_parallel_cross_entropy` (3 * tokens * 4 bytes on the wire; with TP 1
no communication), and the same arithmetic per token, so the result equals it (and
``F.cross_entropy`` of the whole logits) up to rounding; float64 agrees to 1e-15.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


class _ChunkedCrossEntropy(torch.autograd.Function):
    """See the module docstring; ``group`` is None for TP 1."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: ProcessGroup | None,
                chunk: int) -> torch.Tensor:
        cdt = torch.promote_types(logits.dtype, torch.float32)
        z = logits.reshape(-1, logits.shape[-1])
        n, v = z.shape
        local_t = targets.reshape(-1) - vocab_start
        mine = (local_t >= 0) & (local_t < v)
        idx = local_t.clamp(0, v - 1)
        rows = torch.arange(n, device=z.device)
        m = torch.empty(n, dtype=cdt, device=z.device)
        for a in range(0, n, chunk):
            m[a:a + chunk] = z[a:a + chunk].amax(dim=-1).to(cdt)  # the max is exact in any dtype
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        both = torch.empty(2, n, dtype=cdt, device=z.device)  # (sum of exp, target logit): one all-reduce
        both[1] = torch.where(mine, z[rows, idx].to(cdt) - m, 0.0)
        for a in range(0, n, chunk):
            e = z[a:a + chunk].to(cdt, copy=True)  # a copy even when z is float32 already
            e.sub_(m[a:a + chunk, None]).exp_()
            both[0, a:a + chunk] = e.sum(dim=-1)
            del e
        if group is not None:
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = both[0], both[1]
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(logits, m, sum_exp, idx, mine)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, m, sum_exp, idx, mine = ctx.saved_tensors
        z = logits.reshape(-1, logits.shape[-1])
        n = z.shape[0]
        out = torch.empty_like(z)
        scale = grad / n
        chunk = ctx.chunk
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            e = z[a:b].to(m.dtype, copy=True)
            e.sub_(m[a:b, None]).exp_().div_(sum_exp[a:b, None])  # softmax over the whole vocabulary
            r = torch.arange(b - a, device=z.device)[mine[a:b]]
            e[r, idx[a:b][mine[a:b]]] -= 1.0
            e.mul_(scale)
            out[a:b] = e  # cast to the logits' dtype
            del e
        return out.view(logits.shape), None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                          group: ProcessGroup | None = None, chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean token cross-entropy of logits (B, S, V_r) holding vocabulary columns
    [vocab_start, vocab_start + V_r) on each rank of ``group`` (``None``: the whole vocabulary, no
    communication), in chunks of ``chunk_tokens`` tokens; the same value on every rank."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedCrossEntropy.apply(logits, targets, vocab_start, group, int(chunk_tokens))
