"""Main grads: 16-bit compute copies of the matmul weights, cast once per step; each micro-batch's
weight gradient is added straight into the parameter's own ``.grad`` (FSDP2's ``param_dtype`` /
Megatron's ``main_grad``, without their flat buffers).

Under plain autocast every linear casts its float32 weight to bf16 in each forward (the runtime
shares one cast across the first n-1 micro-batches, ``runtime/schedule.py``), and in each backward
autograd casts the bf16 weight gradient back to float32 (one kernel, a float32 temporary) and adds
it to ``.grad`` (a second kernel). Here, per step:

- :meth:`MainGrads.refresh` (the executor calls it before the step's first forward) copies every
  matmul weight into its compute copy c (``torch._foreach_copy_``: one pass, P + B bytes read and
  written per parameter);
- the linears multiply by c (``compute_weight``, :mod:`.tensor_parallel`), a leaf tensor that
  requires grad: autograd hands each micro-batch's bf16 gradient to c's accumulator, and a
  post-accumulate hook adds it into the float32 ``p.grad`` (``p.grad += g``: one kernel, no
  float32 temporary; the first micro-batch of a step converts it once) and drops it;
- then it calls ``p``'s own post-accumulate-grad hooks, so everything that watches ``p``'s
  gradient (the data-parallel sync's bucket starts, :class:`~.grad_sync.BoundaryStarts`) sees it
  land exactly where autograd would have accumulated it.

The gradient values are those of autocast (the same bf16 product, summed in float32): the
equivalence tests are unchanged. Memory: one copy of the matmul weights in B bytes from the step's
first forward into its last backward, which frees each copy once its gradient is added
(:meth:`MainGrads.free_after_use`; :meth:`MainGrads.release` frees what is left after the run), so
the gradient sync's buckets that start during that backward never meet all of them; instead of
autocast's one or two casts and the shared cast's pending gradients (``planner/cost/memory.py``). With a
compute dtype equal to the parameters' (float64 tests) it is the same mechanism, exact.

Not for ZeRO-3 (its block parameters exist only around their uses) and not for a head tied to the
embedding (autograd also accumulates the embedding's gradient into that matrix).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hexiscale.runtime import tensor_parallel as tpl
from lightning_hexiscale.runtime.weak_hooks import weak_hook


def main_grad_modules(stage: nn.Module) -> list[nn.Module]:
    """The stage's modules that can take a compute copy: column/row-parallel linears and an untied
    vocabulary-parallel head (their ``compute_weight`` attribute)."""
    out = []
    for m in stage.modules():
        if isinstance(m, (tpl.ColumnParallelLinear, tpl.RowParallelLinear)):
            out.append(m)
        elif isinstance(m, tpl.VocabParallelHead) and m._tied is None:
            out.append(m)
    return out


class MainGrads:
    """Compute copies in ``compute_dtype`` for the matmul weights of ``stage`` (see module doc)."""

    def __init__(self, stage: nn.Module, compute_dtype: torch.dtype):
        self.compute_dtype = compute_dtype
        self.params: list[nn.Parameter] = []
        self.copies: list[torch.Tensor] = []
        self.free_as_used = False
        """Set by :meth:`free_after_use` for the run's last backward: each copy is freed once its
        gradient is added (the gradient sync's buckets start meanwhile: they must not coexist)."""
        for i, m in enumerate(main_grad_modules(stage)):
            p = m.weight
            c = torch.empty_like(p, dtype=compute_dtype, requires_grad=p.requires_grad)
            if p.requires_grad:  # a frozen weight has no gradient to route
                # weakly held (weak_hooks.py): a hook that held self or p would keep them forever
                c.register_post_accumulate_grad_hook(weak_hook(self, lambda mg, c, i=i: mg._accumulate(mg.params[i], c)))
            m.compute_weight = c
            self.params.append(p)
            self.copies.append(c)
        self.refresh()  # usable at once (a stage called directly); the executor releases after each run

    @property
    def numel(self) -> int:
        """Elements of all compute copies (bytes = numel * compute dtype size)."""
        return sum(c.numel() for c in self.copies)

    @torch.no_grad()
    def refresh(self) -> None:
        """Every compute copy := its weight, cast (once per step, before the first forward); a
        released copy gets its memory back first."""
        self.free_as_used = False
        for c in self.copies:
            storage = c.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(c.numel() * c.element_size())
        if self.copies:
            torch._foreach_copy_(self.copies, [p.detach() for p in self.params])

    @torch.no_grad()
    def release(self) -> None:
        """Free the compute copies' memory (after the step's last backward: the gradient sync and the
        optimizer step do not need them), as FSDP2 frees its unsharded parameters; the tensors stay,
        so the linears and autograd keep their references, and :meth:`refresh` refills them."""
        self.free_as_used = False
        for c in self.copies:
            c.untyped_storage().resize_(0)

    def free_after_use(self) -> None:
        """The next backward is the run's last (the executor calls it right before): free each copy
        as soon as its gradient has been added, as autocast's casts are freed with their nodes. The
        block's recomputation (if any) has run by then: it precedes the block's gradients."""
        self.free_as_used = True

    @torch.no_grad()
    def _accumulate(self, p: nn.Parameter, c: torch.Tensor) -> None:
        g, c.grad = c.grad, None
        if p.grad is None:
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        else:
            p.grad.add_(g)
        del g
        if self.free_as_used:
            c.untyped_storage().resize_(0)
        # What autograd would have run had it accumulated into p itself (public registration,
        # torch keeps the hooks in this ordered dict; None until one is registered).
        for hook in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(p)
