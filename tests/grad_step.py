"""One global batch forward and backward through a :class:`PipelineEngine`'s :class:`Step` phases,
without the optimizer update: what the equivalence tests compare with the single-process reference.

It was ``PipelineEngine.train_step``, a method only tests called (issue 42 item 6 drops it from the
engine). It composes the same phases as ``fit_step`` (open the window, run the pipeline, sync) and
leaves out what the tests check separately: the non-finite check, clipping and the update.
"""

from __future__ import annotations

import torch


def train_step(engine, tokens: torch.Tensor, targets: torch.Tensor, *, zero_grad: bool = True,
               sync_grads: bool = True, loss_scale_factor: float = 1.0) -> float:
    """Forward + backward of one global batch (G, S); returns the global mean loss (every rank).

    ``zero_grad`` opens a new accumulation window (grads reset); ``sync_grads`` closes it with the
    gradient sync across pipelines (collective). To accumulate k batches per update, pass
    ``zero_grad`` on the first, ``sync_grads`` on the last and ``loss_scale_factor = 1/k`` on all: the
    gradients are then the mean over the k batches and the returned losses sum to the mean loss.
    """
    step = engine.step
    tok, tgt = engine.local_batch(tokens), engine.local_batch(targets)
    if zero_grad:
        step.open_window()
    pipeline_loss = step.run_pipeline(tok, tgt, step.loss_scale * loss_scale_factor, last=sync_grads)
    if sync_grads:
        step.sync()
    return step.global_loss(pipeline_loss)
