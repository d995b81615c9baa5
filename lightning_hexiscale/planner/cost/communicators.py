"""The process groups (communicators) each rank of a plan joins, counted without torch.distributed.

The groups are the plan's rank layout's (:meth:`~lightning_hexiscale.planner.layout.RankLayout.group_ranks`),
the very lists ``runtime/topology.py`` creates with ``dist.new_group``, so that the planner can charge
the collective library's buffers per communicator (``Workload.comm_buffer_bytes``). A rank joins the
default (world) group (the loss reduction), its stage's TP group when its TP degree t > 1, one
two-rank link group per pipeline neighbour it exchanges activations with, and, with two or more
pipelines, one data-parallel group per distinct holder set of the gradient segments it holds.
Asymmetric TP (a TP 2 stage beside a TP 3 one) gives several holder sets per layer.

``tests/runtime/test_communicators.py`` checks the count against ``runtime/topology.py``'s groups
on real gloo ranks.
"""

from __future__ import annotations

import functools

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.layout import RankLayout
from lightning_hexiscale.planner.plan import Plan


def communicator_groups(plan: Plan, config: LlamaConfig) -> list[tuple[int, ...]]:
    """Every group the runtime creates besides the world group, as sorted rank tuples, sorted."""
    return list(RankLayout.of(plan).group_ranks(config))


def communicators_per_rank(plan: Plan, config: LlamaConfig, layout: RankLayout | None = None) -> list[int]:
    """Communicators each plan rank joins: the world group plus every group holding it."""
    counts = [1] * plan.world_size
    for g in (layout or RankLayout.of(plan)).group_ranks(config):
        for r in g:
            counts[r] += 1
    return counts


@functools.lru_cache(maxsize=64)
def stage_communicators(plan: Plan, config: LlamaConfig) -> dict[tuple[int, int], int]:
    """(pipeline, stage) -> the most communicators any rank of the stage joins."""
    layout = RankLayout.of(plan)
    per_rank = communicators_per_rank(plan, config, layout)
    return {(i, j): max(per_rank[r] for r in st) for i, pipe in enumerate(layout.stage_ranks) for j, st in enumerate(pipe)}


def communicators_lower_bound(tp: int, first: bool, last: bool, num_pipelines: int) -> int:
    """What the busiest rank of a stage joins at least, from the stage's position alone (the
    search's and oracle's cheap bound; ``estimate()`` counts exactly): the world group, its TP
    group, one link per neighbour, one data-parallel group."""
    return 1 + (tp > 1) + (not first) + (not last) + (num_pipelines > 1)
