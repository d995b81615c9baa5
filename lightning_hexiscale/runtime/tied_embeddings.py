"""Tied embeddings across pipeline stages: the first stage's ``embed.weight`` and the last stage's
copy of it (the LM head of a ``tie_word_embeddings`` model) stay one parameter.

On one device the head IS the embedding, so its gradient is the sum of two contributions: E (the
embedding lookups, first stage) and H (the head matmul, last stage). In a pipeline of two or more
stages each of the two stages holds its own copy (vocabulary rows ``vocab_split(t)`` of its TP
group) and sees only its contribution. Per optimizer step, for every pipeline of 2+ stages:

1. :meth:`TiedEmbeddingSync.sum_grads` (before the data-parallel sync): every first-stage rank a and
   every last-stage rank b whose vocabulary rows overlap exchange the gradient of the overlap
   [lo, hi), and each adds what it received: both copies then hold E_i + H_i (pipeline i's total).
   With equal TP degrees (or TP 1 on both) this is a leader-to-leader swap of the whole matrix.
2. The gradient sync sums the FIRST stages' copies across pipelines (the tied parameter's holders,
   see :func:`lightning_hexiscale.planner.layout.sync_segments`): the global gradient, sum_i (E_i + H_i).
3. The last stage's copy follows: :meth:`after_dp_sync` under ddp copies the synchronised gradient
   rows first -> last (so both optimizers take the same step; needed only with 2+ pipelines), and
   :meth:`after_step` under ZeRO copies the updated weight rows (the sharded optimizer steps only
   the holders' chunks; the copy is not one of them).

A stage that is both first and last (a one-stage pipeline) holds one shared parameter: nothing to do.

NCCL rules: each rank posts all its sends and receives of a phase in ONE ``dist.batch_isend_irecv``
(so a two-way exchange cannot deadlock, whatever the message size), on the plan group
(``Topology.plan_group``: the plan's ranks; the default group when the plan runs on all of it), without
tags: between a rank pair there is exactly one message per direction per phase, so matching by
order is unambiguous. The phases run after the schedule has waited for all of its own traffic and
at the same point of the step on every rank. The constructor runs one all-reduce on the plan group,
so a fused batch is never the first collective on it (NCCL requires every member in that case).
Peers are plan ranks in :func:`tied_pairs`, global ranks on the wire (``Topology.to_global``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, RankLayout
from lightning_hexiscale.runtime.parallelize import StageModule
from lightning_hexiscale.runtime.topology import Topology

NAME = "embed.weight"
"""Global name of the tied matrix (the head has no parameter of its own)."""


@dataclass(frozen=True)
class TiedPair:
    """Rows [start, end) of the tied matrix held by first-stage rank ``first`` and last-stage rank
    ``last`` of one pipeline; the two exchange exactly these rows."""

    pipeline: int
    first: int
    last: int
    start: int
    end: int


def tied_pairs(plan: Plan, config: LlamaConfig, layout: RankLayout | None = None) -> list[TiedPair]:
    """Every (first-stage rank, last-stage rank) overlap of the tied matrix, over all pipelines with
    two or more stages, in one canonical order (pipeline, row). Pure: the same list on every rank.
    Example: first stage TP 1 (rows [0, V)), last stage TP 2 (rows [0, V/2) and [V/2, V)): two
    pairs, the first-stage rank exchanging half of its rows with each last-stage rank.
    ``layout``: the plan's rank layout when the caller has it (``Topology.layout``).
    """
    if not config.tie_word_embeddings:
        return []
    pairs = []
    for i, stages in enumerate((layout or RankLayout.of(plan)).stage_ranks):
        if len(stages) < 2:
            continue
        first, last = stages[0], stages[-1]
        fr, lr = config.vocab_split(len(first)), config.vocab_split(len(last))
        for a, (a0, a1) in zip(first, fr):
            for b, (b0, b1) in zip(last, lr):
                lo, hi = max(a0, b0), min(a1, b1)
                if lo < hi:
                    pairs.append(TiedPair(i, a, b, lo, hi))
    return pairs


def needs_tied_sync(plan: Plan, config: LlamaConfig) -> bool:
    """A tied model and at least one pipeline whose embedding and head live on different stages."""
    return config.tie_word_embeddings and any(len(p.stages) > 1 for p in plan.pipelines)


class TiedEmbeddingSync:
    """This rank's part of the tied-embedding exchange (see the module doc). Construct on EVERY rank
    (collective) when :func:`needs_tied_sync`; ranks outside the pairs do nothing in the phases."""

    def __init__(self, stage: StageModule, topology: Topology, device: torch.device):
        self.stage, self.topology = stage, topology
        rank = topology.rank
        shard = stage.shards().get(NAME)
        self.offset = shard.start if shard is not None else 0
        self.param = dict(stage.named_parameters()).get(NAME)
        self.pairs = [p for p in tied_pairs(topology.plan, topology.config, topology.layout)
                      if rank in (p.first, p.last)]
        self.is_first = bool(self.pairs) and self.pairs[0].first == rank
        self.bytes_sent = 0
        """Diagnostics: bytes this rank sent in the last phase."""
        # The exchanges below are fused batches on the plan group: make sure that group has seen
        # a collective in which every rank took part (NCCL's rule for batch_isend_irecv).
        self.group = topology.plan_group
        warm = torch.zeros(1, device=device)
        dist.all_reduce(warm, group=self.group)

    def _rows(self, t: torch.Tensor, p: TiedPair) -> torch.Tensor:
        return t.narrow(0, p.start - self.offset, p.end - p.start)

    def _exchange(self, source: torch.Tensor | None, send: bool, recv: bool) -> list[tuple[TiedPair, torch.Tensor]]:
        """One fused batch: send ``source``'s rows of every pair (when ``send``), receive the peer's
        rows of every pair (when ``recv``); returns the received buffers by pair."""
        ops, received = [], []
        self.bytes_sent = 0
        for p in self.pairs:
            peer = self.topology.to_global(p.last if self.is_first else p.first)
            if send:
                buf = self._rows(source, p).contiguous()
                ops.append(dist.P2POp(dist.isend, buf, peer, group=self.group))
                self.bytes_sent += buf.numel() * buf.element_size()
            if recv:
                into = torch.empty_like(self._rows(self.param, p))
                ops.append(dist.P2POp(dist.irecv, into, peer, group=self.group))
                received.append((p, into))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Phase 1: both copies := E_i + H_i on their rows (two-way exchange, then add)."""
        if not self.pairs:
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        own = self.param.grad.clone()  # what is sent must not include what is received
        for p, got in self._exchange(own, send=True, recv=True):
            self._rows(self.param.grad, p).add_(got)

    @torch.no_grad()
    def after_dp_sync(self) -> None:
        """Phase 3 (ddp, 2+ pipelines): the last stage's gradient rows := the first stage's, which
        the data-parallel sync has summed over all pipelines."""
        if not self.pairs:
            return
        if self.is_first:
            self._exchange(self.param.grad, send=True, recv=False)
        else:
            for p, got in self._exchange(None, send=False, recv=True):
                self._rows(self.param.grad, p).copy_(got)

    @torch.no_grad()
    def after_step(self) -> None:
        """Phase 3 (ZeRO): the last stage's weight rows := the first stage's updated ones."""
        if not self.pairs:
            return
        if self.is_first:
            self._exchange(self.param.detach(), send=True, recv=False)
        else:
            for p, got in self._exchange(None, send=False, recv=True):
                self._rows(self.param.data, p).copy_(got)
