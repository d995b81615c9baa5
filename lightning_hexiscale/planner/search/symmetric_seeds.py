"""Machine-aligned symmetric layouts, scored exactly, as seeds of the search (beyond §4).

On clusters of many identical machines the two-phase search can miss the plain symmetric plan
that Megatron or Galvatron would run: its partitions are built pipeline by pipeline, and at scale
it drafts one micro-batch size and prunes. So every run also scores, with its own batch timer
(:meth:`batching.BatchTimer.best`, the arithmetic of ``estimate()``), each layout

    P pipelines x S stages x TP t,   P * S * t = N devices,

where t divides every machine's device count (TP groups never cross a machine; t at most the KV
heads and allowed by the stage rule: ``tp_degrees`` when set, a layer table's measured degrees), P
is at most ``max_pipelines`` and the batch's micro-batches, and S is at most the layers. The N / t
TP groups, numbered in machine order, are dealt to (replica, stage) in the two Megatron rank
orders: group ``s * P + r`` (a stage's replicas side by side, so the gradient all-reduce stays on
the fastest links) or ``r * S + s`` (each pipeline on consecutive
machines). Layers: split evenly (the L mod S extra layers on the middle stages, away from the
embedding and the LM head), and as :func:`assemble.chain_draft` splits them (compute- and
memory-proportional, with its stage leaders); every dp sharding the settings allow; the batch
split and micro-batch size per pipeline are the timer's (:func:`seed_symmetric` says which
variants of which arrangements it scores). The seeds that fit join the search's kept layouts
(:meth:`two_phase.SearchRun.remember`) and so the starts of its final improvement: the search's
plan is never slower than the best seed it scored.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning_hexiscale.planner.cost.compute import without_place
from lightning_hexiscale.planner.search.assemble import DraftContext, chain_draft
from lightning_hexiscale.planner.search.batching import layout_key, layout_plan
from lightning_hexiscale.planner.search.settings import LARGE_FROM

_FULL = 4
"""Arrangements whose every variant (layer split, sharding) is scored after the first pass."""

SearchRun = Any
"""A :class:`two_phase.SearchRun` (which calls this module, so it is not imported here)."""


def tp_group_rows(run: SearchRun) -> dict[int, list[tuple[int, ...]]]:
    """TP degree t -> the cluster's TP groups of t devices, machine by machine in machine order
    (devices in id order inside a machine), for every t that divides every machine's device count,
    is at most the KV heads and whose groups ``run.ev.stage_ok`` allows (``tp_degrees``, layer
    tables). Empty when a machine has no device."""
    machines = [sorted(m.devices) for m in run.cluster.machines]
    if not machines or any(not m for m in machines):
        return {}
    allowed = run.ev.stage_ok
    heads = run.workload.model.num_kv_heads
    out = {}
    for t in range(1, min(len(m) for m in machines) + 1):
        if t > heads or any(len(m) % t for m in machines):
            continue
        groups = [tuple(m[i:i + t]) for m in machines for i in range(0, len(m), t)]
        if allowed is None or all(allowed(g) for g in groups):
            out[t] = groups
    return out


def identical_machines(cluster) -> bool:
    """Every device of one kind (type, speed, memory, ...: :func:`cost.compute.without_place`) and every
    machine of one size: where a symmetric plan is what a user would run."""
    return (len({without_place(d) for d in cluster.devices}) == 1
            and len({len(m.devices) for m in cluster.machines}) == 1)


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """``num_layers`` over ``stages`` as evenly as possible: floor(L / S) each, the L mod S extra
    layers on the middle stages (the first stage also runs the embedding, the last the LM head)."""
    q, r = divmod(num_layers, stages)
    extra = set(range((stages - r) // 2, (stages - r) // 2 + r))
    return tuple(q + (j in extra) for j in range(stages))


def symmetric_shapes(run: SearchRun) -> list[tuple[tuple[tuple[int, ...], ...], ...]]:
    """Every machine-aligned symmetric arrangement of the module docstring, as pipelines of stage
    device tuples (each order once: with one pipeline or one stage both orders are the same)."""
    N = run.cluster.num_devices
    most_p = min(N, run.gb // min(run.mbs))  # every pipeline runs at least one micro-batch
    if run.s.max_pipelines:
        most_p = min(most_p, run.s.max_pipelines)
    out = []
    for t, groups in tp_group_rows(run).items():
        G = len(groups)
        for P in range(1, min(G, most_p) + 1):
            S = G // P
            if G % P or S > run.L:
                continue
            by_stage = tuple(tuple(groups[s * P + r] for s in range(S)) for r in range(P))
            by_replica = tuple(tuple(groups[r * S + s] for s in range(S)) for r in range(P))
            out += [by_stage] if by_stage == by_replica else [by_stage, by_replica]
    return out


def layouts_of(run: SearchRun, pipes, sharding: str, draft: bool = True, drafted: dict | None = None) -> list:
    """Layouts (batch and micro-batch 1 per pipeline: the timer splits the batch) of one arrangement
    drafted for ``sharding``: the even split, and when ``draft`` chain_draft's layer split and
    leaders where every pipeline has one (its leaders may reorder a stage's devices), memoised in
    ``drafted`` by (arrangement, sharding)."""
    P, S = len(pipes), len(pipes[0])
    splits = [([list(p) for p in pipes], [even_split(run.L, S)] * P)]
    if draft:
        drafted = {} if drafted is None else drafted
        if (pipes, sharding) not in drafted:
            mb = min(run.mbs)
            ctx = DraftContext(mb, sharding, P, max(1, run.gb // P // mb), run.s.tau)
            drafts = [chain_draft(run.ev, list(p), ctx) for p in pipes]
            drafted[pipes, sharding] = drafts if all(d is not None for d in drafts) else None
        drafts = drafted[pipes, sharding]
        if drafts is not None:
            splits.append(([list(d.stages) for d in drafts], [tuple(d.layers) for d in drafts]))
    return [layout_plan(st, sp, sharding, run.s.schedule, run.s.recompute, run.L) for st, sp in splits]


def seed_symmetric(run: SearchRun) -> float:
    """Score the symmetric layouts with the run's batch timer in two passes; each one that fits is
    remembered (a start of the final improvement) and the best replaces the run's best where faster.

    1. Every arrangement (:func:`symmetric_shapes`) once: the even split (chain_draft's where that
       does not fit) under ZeRO-2 (the allowed sharding with the least memory but ZeRO-3's,
       whose extra gathers only add time).
    2. The ``_FULL`` best arrangements (every one when none fitted): both layer splits, drafted for
       every allowed sharding (beyond ``LARGE_FROM`` devices drafted once and scored under every
       allowed sharding but ZeRO-3, and under ZeRO-3 only when nothing else fits, as the search
       itself does: ZeRO-3 is there for memory).

    Pass 1 costs about one timer call per arrangement (51 at 512 devices) and few drafts: scoring every
    variant of every arrangement added a third to the search's time there; now about a fifth.

    Only on clusters of identical machines (every device of one kind, every machine of one size):
    on 5 machines of different GPUs (``hetero1``) the seeds were 2 % slower than the search's own
    plan and, over its device subsets, added 15 % to its time. Returns the best seed's
    iteration time in seconds (inf when none fits)."""
    if not identical_machines(run.cluster):
        return math.inf
    shapes = symmetric_shapes(run)
    first = "zero2" if "zero2" in run.shardings else run.shardings[0]
    drafted: dict = {}
    scored: dict = {}  # layout key -> iteration time: pass 2 meets pass 1's layouts again
    coarse = []
    for k, pipes in enumerate(shapes):
        cost = _score(run, layouts_of(run, pipes, first, draft=False), scored)
        if not math.isfinite(cost):  # the even split may overfill the embedding's or the head's stage
            cost = _score(run, layouts_of(run, pipes, first, drafted=drafted)[1:], scored)
        coarse.append((cost, k))
    ranked = sorted(c for c in coarse if math.isfinite(c[0]))
    chosen = [shapes[k] for _, k in ranked[:_FULL]] if ranked else shapes
    if not _large(run):
        layouts = [lay for pipes in chosen for sh in run.shardings for lay in layouts_of(run, pipes, sh, drafted=drafted)]
        return min([_score(run, layouts, scored)] + [c for c, _ in ranked[:1]])
    layouts = [lay for pipes in chosen for lay in layouts_of(run, pipes, first, drafted=drafted)]
    best = _score(run, [replace(lay, dp_sharding=sh) for lay in layouts for sh in run.shardings if sh != "zero3"],
                  scored)
    if not math.isfinite(best) and "zero3" in run.shardings:
        best = _score(run, [replace(lay, dp_sharding="zero3") for lay in layouts], scored)
    return min([best] + [c for c, _ in ranked[:1]])


def _score(run: SearchRun, layouts: list, scored: dict) -> float:
    """The least iteration time of ``layouts`` (each scored once per ``scored``), remembered by the run."""
    best = math.inf
    for layout in layouts:
        key = layout_key(layout)
        if key in scored:
            best = min(best, scored[key])
            continue
        cost, plan = run.timer.best(layout, run.meta())
        scored[key] = cost
        if plan is None:
            continue
        run.remember(cost, plan)
        best = min(best, cost)
        if cost < run.best[0] * (1 - 1e-12):
            run.best = (cost, plan)
    return best


def _large(run: SearchRun) -> bool:
    return run.cluster.num_devices > LARGE_FROM
