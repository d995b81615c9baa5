"""Local improvement of a plan's layout (beyond §4): move a layer, a device or a stage, and re-split.

The two phases of §4 fix the pipelines' device sets and stage structures from graph partitions
and per-machine strategies; the paper then assigns layers and batches by proportional rules. Here
the best layouts found are polished by first-improvement hill climbing over small moves, each
candidate scored exactly with its best batch split and per-pipeline micro-batch sizes
(:meth:`batching.BatchTimer.best`):

- a layer boundary between two adjacent stages moves by one layer;
- two devices of different stages swap places;
- a device leaves its stage (a single-device stage disappears, its layers going to a neighbour;
  a single-device pipeline disappears) and joins another stage's TP group, or becomes a new stage
  (taking half of a neighbour's layers), or a new single-device pipeline (all layers), or, where
  the plan may leave devices idle (``RefineContext.may_idle``), takes no work at all;
- there, an idle device (or an idle same-machine pair) comes back: it takes a working device's
  place, joins a stage's TP group, or becomes a new stage or a new pipeline;
- two adjacent stages swap places (in one pipeline, or at the same position in every pipeline),
  or merge into one TP group; a TP group changes its leader;
- once, before the climb (every cluster size): every pipeline's stage chain reversed;
- the dp sharding changes.

In the climb from a device subset's plan (``RefineContext.lookahead``) a structural move that does
not fit is also tried with an idle device joining a TP group of the pipeline it changed.

Moving samples between pipelines and changing micro-batch sizes need no move: every candidate is
re-split exactly. The number of candidates scored is capped (:func:`budget_for`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search.batching import BatchTimer, layout_key, layout_plan

Layout = tuple[str, tuple[tuple[tuple[tuple[int, ...], int], ...], ...]]
"""(sharding, pipelines), a pipeline being ((stage devices, layers), ...)."""


@dataclass(frozen=True)
class RefineContext:
    """What the local improvement needs, in one immutable value."""

    timer: BatchTimer
    """Scores a layout exactly with its best batches and micro-batch sizes."""
    model: LlamaConfig
    shardings: tuple[str, ...]
    move_devices: bool = True
    """Device, stage and leader moves (small clusters); else layer and sharding moves only."""
    repair: Callable[[Layout, Layout], Layout] | None = None
    """(candidate, before) -> the candidate with the leaders and layer split of every pipeline
    the move changed chosen afresh (the search's phase-2 rules plus :mod:`dp_split`)."""
    meta: dict = field(default_factory=dict)
    seed: int = 0
    may_idle: bool = False
    """A device may leave the plan (idle): the subset-aware search (``planner.use_all_devices=false``)."""
    stage_ok: Callable[[tuple[int, ...]], bool] | None = None
    """Which TP groups a stage may be (:class:`cost.sources.StageRule`; None: any); layouts with
    another are not scored."""
    lookahead: bool = False
    """A structural move that does not fit is also scored with an idle unit joining a TP group of a
    pipeline it changed (:func:`_joins`). Only in the climb from a device subset's plan
    (:meth:`two_phase.SearchRun.polish`): in the main climb the extra candidates spend the budget
    other moves need (an 8-device tight-memory case fell from the optimum to 0.85 of it)."""


_REPAIR_FLIP = 16
"""Up to this many pipelines the reversed start (:func:`improve`) is also scored repaired."""


def budget_for(num_devices: int, iterations: int) -> int:
    """Candidates the final improvement may score: 24 per iteration on clusters of up to 8 devices
    (1200 at the default 50 iterations), 8 up to 16, one per iteration up to 64, one per ten
    iterations beyond."""
    if num_devices <= 8:
        return 24 * iterations
    if num_devices <= 16:
        return 8 * iterations
    return iterations if num_devices <= 64 else max(2, iterations // 10)


def layout_of(plan: Plan) -> Layout:
    return (plan.dp_sharding, tuple(tuple((s.devices, s.num_layers) for s in p.stages) for p in plan.pipelines))


def plan_from_layout(layout: Layout, like: Plan) -> Plan:
    sharding, pipes = layout
    return layout_plan([[st for st, _ in p] for p in pipes], [tuple(n for _, n in p) for p in pipes], sharding,
                       like.schedule, like.recompute, like.num_layers)


def neighbours(layout: Layout, model: LlamaConfig, shardings: tuple[str, ...], global_batch: int,
               move_devices: bool = True, may_idle: bool = False, idle: tuple[tuple[int, ...], ...] = ()):
    """(kind, layout) for every layout one move away (see the module docstring), cheap moves
    first; kind is ``layers`` for layer and sharding moves, ``structure`` for the others. ``idle``:
    the idle units that may come back (:func:`idle_units`; with ``may_idle`` only)."""
    sharding, pipes = layout
    L, max_tp = model.num_layers, model.num_kv_heads
    # layer boundaries
    for i, p in enumerate(pipes):
        for j in range(len(p) - 1):
            for a, b in ((j, j + 1), (j + 1, j)):
                if p[a][1] > 1:
                    q = list(p)
                    q[a] = (q[a][0], q[a][1] - 1)
                    q[b] = (q[b][0], q[b][1] + 1)
                    yield "layers", (sharding, _put(pipes, i, tuple(q)))
    for other in shardings:
        if other != sharding:
            yield "layers", (other, pipes)
    if not move_devices:
        return
    # stage order, merges, leaders; first the same swap in every pipeline at once (the layers stay
    # aligned across pipelines, as their data-parallel links want)
    if len(pipes) > 1:
        for j in range(max(len(p) for p in pipes) - 1):
            q = [p[:j] + (p[j + 1], p[j]) + p[j + 2:] if len(p) > j + 1 else p for p in pipes]
            if sum(len(p) > j + 1 for p in pipes) > 1:
                yield "structure", (sharding, tuple(q))
    for i, p in enumerate(pipes):
        if len(p) > 2:
            yield "structure", (sharding, _put(pipes, i, p[::-1]))
        for j in range(len(p) - 1):
            q = list(p)
            q[j], q[j + 1] = q[j + 1], q[j]
            yield "structure", (sharding, _put(pipes, i, tuple(q)))
            if len(p[j][0]) + len(p[j + 1][0]) <= max_tp:
                q = list(p)
                q[j:j + 2] = [(p[j][0] + p[j + 1][0], p[j][1] + p[j + 1][1])]
                yield "structure", (sharding, _put(pipes, i, tuple(q)))
        for j, (devs, n) in enumerate(p):
            for k in range(1, len(devs)):
                q = list(p)
                q[j] = ((devs[k],) + devs[:k] + devs[k + 1:], n)
                yield "structure", (sharding, _put(pipes, i, tuple(q)))
    # two devices of different stages swap places (the structure stays, the hardware under it changes)
    slots = [(i, j, r, d) for i, p in enumerate(pipes) for j, (devs, _) in enumerate(p) for r, d in enumerate(devs)]
    for x, (i, j, r, d) in enumerate(slots):
        for i2, j2, r2, e in slots[x + 1:]:
            if (i, j) == (i2, j2):
                continue
            q = [list(p) for p in pipes]
            q[i][j] = _replace_device(q[i][j], r, e)
            q[i2][j2] = _replace_device(q[i2][j2], r2, d)
            yield "structure", (sharding, tuple(tuple(p) for p in q))
    # device moves
    for i, p in enumerate(pipes):
        for j, (devs, _) in enumerate(p):
            for d in devs:
                rest = _without(pipes, i, j, d)
                if rest is None:
                    continue
                if may_idle:
                    yield "structure", (sharding, rest)
                for i2, p2 in enumerate(rest):
                    for j2, (devs2, n2) in enumerate(p2):
                        if len(devs2) < max_tp:
                            q = list(p2)
                            q[j2] = (devs2 + (d,), n2)
                            yield "structure", (sharding, _put(rest, i2, tuple(q)))
                    if len(p2) < L:
                        for pos in range(len(p2) + 1):
                            nb = pos - 1 if pos > 0 else 0  # the neighbour giving layers
                            if p2[nb][1] < 2:
                                continue
                            give = p2[nb][1] // 2
                            q = list(p2)
                            q[nb] = (q[nb][0], q[nb][1] - give)
                            q.insert(pos, ((d,), give))
                            yield "structure", (sharding, _put(rest, i2, tuple(q)))
                if len(rest) + 1 <= global_batch:
                    yield "structure", (sharding, rest + ((((d,), L),),))
    yield from _idle_moves(layout, idle, L, max_tp, global_batch)


def _idle_moves(layout: Layout, idle: tuple[tuple[int, ...], ...], L: int, max_tp: int, global_batch: int):
    """Idle units (single idle devices, idle same-machine pairs) coming back: a single one takes a
    working device's place (that one goes idle), any joins a stage's TP group, becomes a new stage
    (half of a neighbour's layers) or a new pipeline (all layers). Without these a device the drafts
    or a move left idle never returned: three 3 MiB RTX3090s idle beside 6 MiB cards, whose pair
    holds a layer where one alone holds none (0.85 of the optimum)."""
    sharding, pipes = layout
    for unit in idle:
        if len(unit) > max_tp:  # a pair is a TP-2 stage: none where the model has one KV head
            continue
        for i, p in enumerate(pipes):
            for j, (devs, n) in enumerate(p):
                if len(unit) == 1:
                    for r in range(len(devs)):
                        yield "structure", (sharding, _put(pipes, i, p[:j] + (_replace_device(p[j], r, unit[0]),) + p[j + 1:]))
                if len(devs) + len(unit) <= max_tp:
                    yield "structure", (sharding, _put(pipes, i, p[:j] + ((devs + unit, n),) + p[j + 1:]))
            if len(p) < L:
                for pos in range(len(p) + 1):
                    nb = pos - 1 if pos > 0 else 0
                    if p[nb][1] >= 2:
                        q = list(p)
                        q[nb] = (q[nb][0], q[nb][1] - p[nb][1] // 2)
                        q.insert(pos, (unit, p[nb][1] // 2))
                        yield "structure", (sharding, _put(pipes, i, tuple(q)))
        if len(pipes) + 1 <= global_batch and len(unit) <= max_tp:
            yield "structure", (sharding, pipes + (((unit, L),),))


def _joins(layout: Layout, before: Layout, idle: tuple[tuple[int, ...], ...], max_tp: int):
    """``layout`` with one idle unit added to the TP group of a stage of a pipeline that is not in
    ``before`` (one a move changed)."""
    sharding, pipes = layout
    old = set(before[1])
    for i, p in enumerate(pipes):
        if p in old:
            continue
        for j, (devs, n) in enumerate(p):
            for unit in idle:
                if len(devs) + len(unit) <= max_tp:
                    yield sharding, _put(pipes, i, p[:j] + ((devs + unit, n),) + p[j + 1:])


def idle_units(layout: Layout, machine_of) -> tuple[tuple[int, ...], ...]:
    """The devices ``layout`` leaves idle, one by one, then in same-machine pairs (``machine_of``:
    each device's machine)."""
    used = {d for p in layout[1] for devs, _ in p for d in devs}
    idle = [d for d in range(len(machine_of)) if d not in used]
    pairs = [(a, b) for k, a in enumerate(idle) for b in idle[k + 1:] if machine_of[a] == machine_of[b]]
    return tuple((d,) for d in idle) + tuple(pairs)


def _count(layout: Layout) -> int:
    """Devices a layout gives work to."""
    return sum(len(devs) for p in layout[1] for devs, _ in p)


def _put(pipes: tuple, i: int, pipe: tuple) -> tuple:
    return pipes[:i] + (pipe,) + pipes[i + 1:]


def _replace_device(stage: tuple, rank: int, device: int) -> tuple:
    """Stage (devices, layers) with ``device`` in place of its TP rank ``rank``."""
    devs, n = stage
    return devs[:rank] + (device,) + devs[rank + 1:], n


def _without(pipes: tuple, i: int, j: int, d: int) -> tuple | None:
    """The pipelines with device d taken out of stage (i, j); None if that leaves nothing."""
    p = list(pipes[i])
    devs, n = p[j]
    if len(devs) > 1:
        p[j] = (tuple(x for x in devs if x != d), n)
    elif len(p) > 1:
        del p[j]
        k = j - 1 if j > 0 else 0
        p[k] = (p[k][0], p[k][1] + n)
    else:
        out = pipes[:i] + pipes[i + 1:]
        return out or None
    return _put(pipes, i, tuple(p))


def improve(plan: Plan, cost: float, ctx: RefineContext, budget: int) -> tuple[float, Plan, int]:
    """Iterated first-improvement hill climbing from ``plan`` (of time ``cost``), scoring at most
    ``budget`` candidates: a structural move is scored as is and repaired (``ctx.repair``); at a
    local optimum with budget left, two random structural moves kick the best layout and the
    climb restarts from there. Returns (cost, plan, candidates scored)."""
    rng = random.Random(ctx.seed)
    best = (cost, plan, layout_of(plan))
    seen = {layout_key(plan)}
    state = {"used": 0}

    def score(cand: Layout) -> tuple[float, Plan | None]:
        layout = plan_from_layout(cand, plan)
        key = layout_key(layout)
        if key in seen or state["used"] >= budget:
            return math.inf, None
        if ctx.stage_ok is not None and not all(ctx.stage_ok(st) for p in cand[1] for st, _ in p):
            seen.add(key)
            return math.inf, None
        seen.add(key)
        state["used"] += 1
        return ctx.timer.best(layout, ctx.meta or plan.meta)

    machine_of = [d.machine for d in ctx.timer.cluster.devices]

    def units(layout: Layout) -> tuple:
        return idle_units(layout, machine_of) if ctx.may_idle and ctx.move_devices else ()

    def variants(kind: str, cand: Layout, before: Layout):
        yield cand
        if kind == "structure" and ctx.repair is not None:
            yield ctx.repair(cand, before)

    def climb(cost: float, cur_plan: Plan, current: Layout) -> tuple[float, Plan, Layout]:
        improved = True
        while improved and state["used"] < budget:
            improved = False
            for kind, cand in neighbours(current, ctx.model, ctx.shardings, ctx.timer.G, ctx.move_devices,
                                         ctx.may_idle, units(current)):
                if state["used"] >= budget:
                    break
                fitted = False
                for var in variants(kind, cand, current):
                    c, p = score(var)
                    fitted = fitted or p is not None
                    if p is not None and c < cost * (1 - 1e-12):
                        cost, cur_plan, current, improved = c, p, var, True
                        break
                if not improved and not fitted and ctx.lookahead:
                    # the move does not fit: an idle device (or same-machine pair) joining a TP group
                    # of a pipeline it changed may make it fit (a TP-2 group split into two stages,
                    # the one left alone then paired with an idle device: neither step fits alone)
                    for joined in _joins(cand, current, units(cand), ctx.model.num_kv_heads):
                        for var in variants("structure", joined, current):
                            c, p = score(var)
                            if p is not None and c < cost * (1 - 1e-12):
                                cost, cur_plan, current, improved = c, p, var, True
                                break
                        if improved:
                            break
                if not improved and not fitted and ctx.may_idle and _count(cand) < _count(current):
                    # a device went idle and the rest does not fit under this sharding: try the
                    # others (a lone pipeline out of memory under ZeRO-3 may
                    # fit under ZeRO-2 and run faster); two single moves would pass through a
                    # layout that does not fit, which the climb never takes
                    for other in ctx.shardings:
                        if other != cand[0]:
                            c, p = score((other, cand[1]))
                            if p is not None and c < cost * (1 - 1e-12):
                                cost, cur_plan, current, improved = c, p, (other, cand[1]), True
                                break
                if improved:
                    break
        return cost, cur_plan, current

    # first the start with every pipeline's stage chain reversed (the embedding and the LM head
    # change ends: the drafts price the two orientations approximately, this scores the other one
    # exactly, as is and, up to _REPAIR_FLIP pipelines, repaired); the climb goes on from the
    # better of the two. Once per start, not a move of every climb step: its repair re-drafts
    # every pipeline (and re-splits its layers for its DP links: 2.7 s at 110 pipelines)
    sharding, pipes = best[2]
    if any(len(p) > 1 for p in pipes):
        flipped = (sharding, tuple(p[::-1] for p in pipes))
        for var in variants("structure", flipped, best[2]) if len(pipes) <= _REPAIR_FLIP else (flipped,):
            c, p = score(var)
            if p is not None and c < best[0] * (1 - 1e-12):
                best = (c, p, var)
    best = climb(*best)
    kicks = 0
    while ctx.move_devices and state["used"] < budget and kicks < budget:
        kicks += 1
        kicked = best[2]
        for _ in range(2):
            moves = [cand for kind, cand in neighbours(kicked, ctx.model, ctx.shardings, ctx.timer.G, True,
                                                       ctx.may_idle, units(kicked)) if kind == "structure"]
            if not moves:
                break
            before, kicked = kicked, rng.choice(moves)
            if ctx.repair is not None:
                kicked = ctx.repair(kicked, before)
        c, p = score(kicked)
        if p is None:
            continue
        found = climb(c, p, kicked)
        if found[0] < best[0] * (1 - 1e-12):
            best = found
    return best[0], best[1], state["used"]
