"""The process groups (communicators) each rank of a plan joins, counted without torch.distributed.

Mirrors :func:`lightning_hexiscale.runtime.topology.group_ranks` (which the runtime creates with
``dist.new_group``) from the plan and the model shapes alone, so that the planner can charge the
collective library's buffers per communicator (``Workload.comm_buffer_bytes``) without importing the
runtime. A rank joins:

- the default (world) group (the loss reduction);
- its stage's TP group when the stage has TP degree t > 1;
- one two-rank link group per pipeline neighbour it exchanges activations with (the stage leaders,
  or TP rank r of both stages when adjacent stages have the same t > 1);
- with two or more pipelines, one data-parallel group per distinct holder set (one rank per
  pipeline) of the gradient segments it holds: the union of the pipelines' shard boundaries of each
  parameter (``topology.sync_segments``). Per layer that is the KV-head split (q, k, v, o), the FFN
  split (gate, up, down) and the stage leaders (the two norms); the vocabulary split of the
  embedding (first stages) and of the LM head (last stages), and the last stages' leaders (final
  norm). Asymmetric TP (a TP 2 stage beside a TP 3 one) gives several holder sets per layer.

``tests/planner/test_communicators.py`` checks the count against ``runtime/topology.py``'s groups
on real gloo ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan

Split = Callable[[int], list[tuple[int, int]]]


def stage_ranks(plan: Plan) -> list[list[tuple[int, ...]]]:
    """[pipeline][stage] -> global ranks of that stage, leader first (rank r runs ``device_order[r]``)."""
    order = {d: r for r, d in enumerate(plan.device_order)}
    return [[tuple(order[d] for d in st.devices) for st in p.stages] for p in plan.pipelines]


def _holder_sets(holders: list[tuple[int, ...]], split: Split | None) -> set[tuple[int, ...]]:
    """Holder sets of one parameter whose pipeline p holds it on the ranks ``holders[p]``: segments
    of the union of the pipelines' boundaries of ``split(t_p)`` (None: replicated, leaders only)."""
    if split is None:
        return {tuple(sorted(h[0] for h in holders))}
    ranges = [split(len(h)) for h in holders]
    cuts = sorted({b for rs in ranges for r in rs for b in r})
    out = set()
    for a, b in zip(cuts, cuts[1:]):
        if a == b:
            continue
        out.add(tuple(sorted(h[next(k for k, (s, e) in enumerate(rs) if s <= a < e)]
                             for h, rs in zip(holders, ranges))))
    return out


def data_parallel_groups(plan: Plan, config: LlamaConfig) -> set[tuple[int, ...]]:
    """The holder sets of every gradient segment (empty with one pipeline)."""
    if plan.num_pipelines < 2:
        return set()
    ranks = stage_ranks(plan)
    out: set[tuple[int, ...]] = set()

    def holders_of(pick: Callable[[int, list], int]) -> list[tuple[int, ...]]:
        return [ranks[i][pick(i, p.stages)] for i, p in enumerate(plan.pipelines)]

    first = holders_of(lambda i, st: 0)
    last = holders_of(lambda i, st: len(st) - 1)
    out |= _holder_sets(first, config.vocab_split)  # the embedding (a tied one: its first-stage holder)
    out |= _holder_sets(last, None)  # the final norm
    if not config.tie_word_embeddings:
        out |= _holder_sets(last, config.vocab_split)
    # the holders change only at stage boundaries: one pass per layer interval between any two of them
    for layer in sorted({b for p in plan.pipelines for s in p.stages for b in s.layers})[:-1]:
        held = holders_of(lambda i, st: next(j for j, s in enumerate(st) if s.layers[0] <= layer < s.layers[1]))
        out |= _holder_sets(held, config.kv_head_split) | _holder_sets(held, config.ffn_split) | _holder_sets(held, None)
    return out


def communicator_groups(plan: Plan, config: LlamaConfig) -> list[tuple[int, ...]]:
    """Every group the runtime creates besides the world group, as sorted rank tuples, sorted."""
    wanted: set[tuple[int, ...]] = set()
    for pipe in stage_ranks(plan):
        for st in pipe:
            if len(st) > 1:
                wanted.add(tuple(sorted(st)))
        for a, b in zip(pipe, pipe[1:]):
            if len(a) == len(b) > 1:
                wanted.update(tuple(sorted(p)) for p in zip(a, b))
            else:
                wanted.add(tuple(sorted((a[0], b[0]))))
    return sorted(wanted | data_parallel_groups(plan, config))


def communicators_per_rank(plan: Plan, config: LlamaConfig) -> list[int]:
    """Communicators each global rank joins: the world group plus every group holding it."""
    counts = [1] * plan.world_size
    for g in communicator_groups(plan, config):
        for r in g:
            counts[r] += 1
    return counts


@functools.lru_cache(maxsize=64)
def stage_communicators(plan: Plan, config: LlamaConfig) -> dict[tuple[int, int], int]:
    """(pipeline, stage) -> the most communicators any rank of the stage joins."""
    per_rank = communicators_per_rank(plan, config)
    return {(i, j): max(per_rank[r] for r in st) for i, pipe in enumerate(stage_ranks(plan)) for j, st in enumerate(pipe)}


def communicators_lower_bound(tp: int, first: bool, last: bool, num_pipelines: int) -> int:
    """What the busiest rank of a stage joins at least, from the stage's position alone (the
    search's and oracle's cheap bound; ``estimate()`` counts exactly): the world group, its TP
    group, one link per neighbour, one data-parallel group."""
    return 1 + (tp > 1) + (not first) + (not last) + (num_pipelines > 1)
