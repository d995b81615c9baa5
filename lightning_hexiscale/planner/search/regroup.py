"""Layouts built from TP groups rather than drafted, scored exactly (beyond §4, small clusters): the
best layouts' TP groups dealt again into pipelines (:func:`regroup`), and every machine cut into
replicas (:func:`replicas`).

The two phases fix which devices share a pipeline before the stages are formed, and the local
improvement (:mod:`.refine`) changes one device, stage or layer at a time. Where memory binds, the
better plan can differ in the number of pipelines, the stage order and the dp sharding at once, and
no single step towards it fits. Found by a random sweep of 2-6 MiB devices and llama_tiny of 1-4
layers (tests/planner/search/test_search_tight_memory.py):

- one four-stage DDP pipeline, where three two-stage pipelines under ZeRO-2, with devices it left
  idle, run 1.34x as fast (a split, idle devices back, a sharding change);
- "no plan fits in memory", where one DDP pipeline of four TP groups fits with the lone T4 in a
  middle stage (the drafts put it at an end, with the embedding or the LM head).

Merges (two pipelines into one, with another sharding) are the same deal with fewer pipelines.

Before the final improvement, each of the best layouts (one per number of pipelines, the ``_FROM``
best) is taken apart into *units*: its stages' TP groups, plus its idle devices (one unit each; or
same-machine pairs where two are idle on a machine). Where nothing fitted, the units are each
machine's device pairs, its odd device alone or paired with the next machine's
(:func:`machine_units`), and up to ``_ORDERS`` units one pipeline is tried in every stage order.
The units, in machine order, are dealt into P pipelines for every P the batch allows, as a stage's
replicas side by side (unit ``s * P + r`` is stage s of pipeline r) and as consecutive blocks (each
pipeline on neighbouring machines), under every dp sharding, the layers split evenly and as
:func:`assemble.chain_draft` splits them (memory- and compute-proportional, with its leaders). Each
layout is scored with the run's batch timer; those that fit join the starts of the final
improvement (:meth:`two_phase.SearchRun.remember`).

Cost: at most ``units x 2 x shardings x 2`` timer calls per unit list; on 8 devices a few hundred
(tens of milliseconds on tight-memory clusters, where it matters).
"""

from __future__ import annotations

import itertools
from typing import Any

from lightning_hexiscale.planner.search.assemble import DraftContext, chain_draft
from lightning_hexiscale.planner.search.batching import layout_key, layout_plan

SearchRun = Any
"""A :class:`two_phase.SearchRun` (which calls this module, so it is not imported here)."""

_REPLICA_LAYOUTS = 256
"""Replica-only layouts the search scores on small clusters (one TP size per machine, every combination)."""
_FROM = 3
"""Best layouts (each with a different number of pipelines) whose TP groups are dealt again."""
_ORDERS = 5
"""Where nothing fitted: up to this many units, one pipeline of them is tried in every order (120)."""


def unit_lists(run: SearchRun, plans) -> list[tuple[tuple[int, ...], ...]]:
    """Per plan: its stages' TP groups plus its idle devices, one unit each, and (where a machine has
    two idle devices) with those paired; units sorted by machine, then device. Distinct lists only."""
    machine = [d.machine for d in run.cluster.devices]
    out: list[tuple[tuple[int, ...], ...]] = []
    for plan in plans:
        groups = [tuple(st.devices) for p in plan.pipelines for st in p.stages]
        used = {d for g in groups for d in g}
        idle = [d for d in range(run.cluster.num_devices) if d not in used]
        paired: list[tuple[int, ...]] = []
        left = list(idle)
        while left:
            d = left.pop(0)
            mate = next((e for e in left if machine[e] == machine[d]), None)
            if mate is not None and run.workload.model.num_kv_heads >= 2:
                left.remove(mate)
                paired.append((d, mate))
            else:
                paired.append((d,))
        for extra in ([(d,) for d in idle], paired):
            units = tuple(sorted(groups + extra, key=lambda g: (machine[g[0]], g)))
            if units not in out:
                out.append(units)
    return out


def machine_units(run: SearchRun) -> list[tuple[tuple[int, ...], ...]]:
    """Where nothing fitted yet: each machine's devices in pairs (TP 2, where the model allows it),
    a machine's odd device alone, or paired with the next machine's odd device (in machine order)."""
    machines = [sorted(m.devices) for m in run.cluster.machines]
    if run.workload.model.num_kv_heads < 2:
        return [tuple((d,) for m in machines for d in m)]
    pairs = [tuple(m[i:i + 2]) for m in machines for i in range(0, len(m) - 1, 2)]
    odd = [m[-1] for m in machines if len(m) % 2]
    alone = tuple(sorted(pairs + [(d,) for d in odd]))
    across = [tuple(odd[i:i + 2]) for i in range(0, len(odd), 2)]
    joined = tuple(sorted(pairs + across))
    return [alone] if joined == alone else [alone, joined]


def deals(units: tuple[tuple[int, ...], ...], P: int, L: int) -> list[tuple[tuple[tuple[int, ...], ...], ...]]:
    """``units`` dealt into P pipelines: unit k to pipeline k mod P (replicas side by side), and in
    consecutive blocks of floor or ceil(n / P). None with a pipeline of more stages than layers."""
    n = len(units)
    side = tuple(units[r::P] for r in range(P))
    sizes = [n // P + (r < n % P) for r in range(P)]
    starts = [sum(sizes[:r]) for r in range(P)]
    block = tuple(units[a:a + k] for a, k in zip(starts, sizes))
    out = []
    for pipes in (side, block):
        if all(0 < len(p) <= L for p in pipes) and pipes not in out:
            out.append(pipes)
    return out


def even(num_layers: int, stages: int) -> tuple[int, ...]:
    q, r = divmod(num_layers, stages)
    return tuple(q + (j < r) for j in range(stages))


def regroup(run: SearchRun) -> None:
    """Score the regrouped layouts of the module docstring; each that fits is remembered by the run
    (a start of its final improvement) and replaces its best where faster."""
    firsts = sorted((v[0] for v in run.top.values()), key=lambda e: e[0])[:_FROM]
    ok = run.ev.stage_ok
    most_p = min(run.cluster.num_devices, run.gb // min(run.mbs))
    if run.s.max_pipelines:
        most_p = min(most_p, run.s.max_pipelines)
    seen: set = set()
    lists = unit_lists(run, [plan for _, plan, _ in firsts]) if firsts else machine_units(run)
    for units in lists:
        if ok is not None and not all(ok(u) for u in units):
            continue
        for P in range(1, min(len(units), most_p) + 1):
            arranged = deals(units, P, run.L)
            if not firsts and P == 1 and len(units) <= _ORDERS:
                # nothing fitted: one pipeline in every stage order (which TP group holds the
                # embedding, which the head, decides what fits)
                arranged += [(o,) for o in itertools.permutations(units) if (o,) not in arranged and len(o) <= run.L]
            for pipes in arranged:
                for sharding in run.shardings:
                    for layout in _layouts(run, pipes, sharding):
                        key = layout_key(layout)
                        if key in seen:
                            continue
                        seen.add(key)
                        cost, plan = run.timer.best(layout, run.meta())
                        if plan is None:
                            continue
                        run.remember(cost, plan)
                        if cost < run.best[0] * (1 - 1e-12):
                            run.best = (cost, plan)


def _layouts(run: SearchRun, pipes, sharding: str) -> list:
    """The even layer split and chain_draft's (with its leaders) where every pipeline has one."""
    P = len(pipes)
    out = [layout_plan([list(p) for p in pipes], [even(run.L, len(p)) for p in pipes], sharding, run.s.schedule,
                       run.s.recompute, run.L)]
    mb = min(run.mbs)
    ctx = DraftContext(mb, sharding, P, max(1, run.gb // P // mb), run.s.tau)
    drafts = [chain_draft(run.ev, list(p), ctx) for p in pipes]
    if all(d is not None for d in drafts):
        out.append(layout_plan([list(d.stages) for d in drafts], [tuple(d.layers) for d in drafts], sharding,
                               run.s.schedule, run.s.recompute, run.L))
    return out


def replicas(run: SearchRun) -> None:
    """Mixed structures of replicas only (beyond §4, small clusters): every machine cut into TP
    groups of one size t (t dividing its device count, at most the KV heads), each a
    single-stage pipeline of all layers; every combination of sizes over the machines (at most
    ``_REPLICA_LAYOUTS``), each scored exactly. They join the starts of the final improvement."""
    per_machine = []
    for m in run.cluster.machines:
        devs = sorted(m.devices, key=lambda d: (-run.cluster.devices[d].flops, d))
        only = run.ev.stage_ok
        cuts = []
        for t in range(1, min(len(devs), run.workload.model.num_kv_heads) + 1):
            if only is None and len(devs) % t:
                continue
            # restricted TP (uniform-tp, layer tables): allowed whole groups of t, the rest idle
            groups = [tuple(devs[i:i + t]) for i in range(0, len(devs) - len(devs) % t, t)]
            groups = [g for g in groups if only is None or only(g)]
            if groups:
                cuts.append(groups)
        per_machine.append(cuts or [[]])
    for k, combo in enumerate(itertools.product(*per_machine)):
        if k >= _REPLICA_LAYOUTS:
            break
        groups = [g for part in combo for g in part]
        if not groups or len(groups) > run.gb:
            continue
        for sharding in run.shardings_for(len(groups)):
            layout = layout_plan([[g] for g in groups], [(run.L,)] * len(groups), sharding, run.s.schedule,
                                 run.s.recompute, run.L)
            cost, plan = run.timer.best(layout, run.meta())
            if plan is not None:
                run.remember(cost, plan)
                if cost < run.best[0] * (1 - 1e-12):
                    run.best = (cost, plan)
