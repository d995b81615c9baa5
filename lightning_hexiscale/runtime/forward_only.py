"""Evaluation and prediction: the pipeline's forward-only walk, reduced over the world.

Both are collective over the plan's ranks (``topology.plan_group``: the default group unless the
plan leaves launched ranks idle; every rank of the plan calls them with its pipeline's batch) and
walk the executor's forward-only schedule (micro-batches of the plan's size, the last one possibly
smaller); under ZeRO-3 every block is gathered once for the whole batch (pipelines cut different
numbers of chunks, so per-use gathers could not be paired across pipelines here).
:meth:`~lightning_hexiscale.runtime.engine.PipelineEngine.eval_loss` and
:meth:`~lightning_hexiscale.runtime.engine.PipelineEngine.predict_logits` are the entry points
(``engine`` below is a PipelineEngine; not imported here, since the engine imports this module).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import HexiScaleError


@torch.no_grad()
def eval_loss(engine, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Global mean token cross-entropy of the world's batch (the same float on every rank).

    The last-stage leader of each pipeline contributes (sum over chunks of chunk_mean * chunk_size,
    n) to one world all-reduce of two float64s; loss = sum / sum n.
    """
    return eval_loss_and_rows(engine, tokens, targets)[0]


def eval_loss_and_rows(engine, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """:func:`eval_loss` and the number of sequences of the world's batch (sum n), which the same
    all-reduce gives: what the loss is the mean of."""
    role = engine.role
    with engine.full_params():
        weighted = engine.executor.forward_only(tokens, targets)
    buf = torch.zeros(2, dtype=torch.float64, device=engine.loss_device)
    if role.is_last and role.is_leader:
        buf[0], buf[1] = weighted.item(), float(tokens.shape[0])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=engine.topology.plan_group)
    return float(buf[0] / buf[1]), int(buf[1])


@torch.no_grad()
def predict_logits(engine, tokens: torch.Tensor) -> torch.Tensor | None:
    """The logits (n_total, S, vocab) of the plan's batch on plan rank 0, in batch order; None
    on the other ranks.

    Each pipeline walks its slice; a forward hook on the stage keeps the last stage's outputs. Then
    ONE ``gather_object`` to plan rank 0 over the plan's group, entered by every rank in the same order
    (the same on every backend): last-stage leaders send (pipeline, logits); the other ranks of a
    last stage send their part only when the head is split over the vocabulary, else nothing.
    Rank 0 joins vocabulary parts in TP order and pipelines in batch order, on ``tokens.device``.
    """
    role, vocab = engine.role, engine.config.vocab_size
    outs: list[torch.Tensor] = []
    hook = engine.stage.register_forward_hook(lambda _m, _args, out: outs.append(out.detach()))
    try:
        with engine.full_params():  # ZeRO-3: every block whole for the walk, as in eval_loss
            engine.executor.forward_only(tokens, torch.zeros_like(tokens))
    finally:
        hook.remove()
    mine = None
    if role.is_last and outs:
        full = torch.cat(outs)
        if role.tp_rank == 0 or full.shape[-1] < vocab:
            mine = (role.pipeline, role.tp_rank, full.cpu())
    topo = engine.topology
    gathered: list | None = [None] * len(topo.ranks) if topo.rank == 0 else None
    dist.gather_object(mine, gathered, dst=topo.to_global(0), group=topo.plan_group)
    if topo.rank != 0:
        return None
    parts: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for item in gathered:
        if item is not None:
            parts.setdefault(item[0], []).append((item[1], item[2]))
    pipes = []
    for i in sorted(parts):
        shards = [t for _, t in sorted(parts[i], key=lambda x: x[0])]
        whole = shards[0] if shards[0].shape[-1] == vocab else torch.cat(shards, dim=-1)
        if whole.shape[-1] != vocab:
            raise HexiScaleError(f"pipeline {i}'s last stage gave logits of width {whole.shape[-1]}, "
                                 f"not the vocabulary's {vocab}")
        pipes.append(whole)
    return torch.cat(pipes).to(tokens.device)
