"""One global order of every stage's communication events in a training run (pure, from the Plan).

Why (ZeRO-3 across asymmetric pipelines): a block's parameters exist only as chunks spread over its
holders, one rank per pipeline, and a stage needs them whole at every use: the forward and the
backward of every micro-batch. The holders sit in pipelines with different schedules and numbers of
micro-batches, so their uses do not line up, and the only way to serve a use is point-to-point from
each holder. On NCCL a p2p call completes only when the peer issues the matching call, and calls on
different communicators must be issued in one consistent order on every rank (NVIDIA's NCCL user
guide, "Using multiple NCCL communicators concurrently"). Pre-posting all
sends at the start of a run breaks that rule (and the pre-posted sends of two holders block each
other on one NCCL stream); tags do not exist on NCCL.

So the runtime fixes, from the plan alone, one global sequence of events that every rank follows:

- ``("x", side, k)``: a stage's k-th pipeline exchange with its ``side`` neighbour
  (:func:`~lightning_hexiscale.runtime.schedule.exchange_points`); an event of both stages;
- ``("u", layer)``: a stage uses block ``layer`` (forward: blocks ascending; backward: descending),
  i.e. gathers it; the holders in other pipelines *serve* it. An op's first use is placed before the
  exchanges that precede the op (a gather needs only the holders' chunks, not the exchanged
  activation), so every use directly follows the stage's previous one and ZeRO-3 can post each gather
  during the previous block's compute (prefetch, :mod:`.zero3`).

:func:`global_order` simulates all stages of all pipelines: a use can always fire (the servers
interleave it between their own events), an exchange fires when both stages have reached it. Ties
go to the stage with the least virtual time (each stage's run spans [0, 1] in equal steps per use;
an exchange sets both clocks to the later one), so pipelines interleave in proportion to their
progress. Every rank's communication is then a subsequence of one sequence, and a sequence of
rendezvous that every participant walks in the same order cannot deadlock: the first unfinished
event has all its participants at it. The simulation stalls only if the exchanges of two adjacent
stages do not pair up; that is reported as a :class:`PlanError` before any process communicates.
"""

from __future__ import annotations

import functools

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.runtime.schedule import exchange_points, schedule_ops

Event = tuple
"""``("x", side, k)`` or ``("u", layer)``."""


def stage_events(plan: Plan, pipeline: int, stage: int) -> list[Event]:
    """The communication events of one stage in its program order (same on all its TP ranks)."""
    pipe = plan.pipelines[pipeline]
    num_stages = len(pipe.stages)
    ops_of = lambda s: schedule_ops(plan.schedule, num_stages, s, pipe.num_micro_batches)  # noqa: E731
    ops = ops_of(stage)
    points = exchange_points(ops_of, num_stages, stage)
    start, end = pipe.stages[stage].layers
    count = {"prev": 0, "next": 0}
    events: list[Event] = []

    def exchanges(point) -> None:
        for ex in point:
            events.append(("x", ex.side, count[ex.side]))
            count[ex.side] += 1

    for k, (kind, _) in enumerate(ops):
        layers = range(start, end) if kind == "F" else range(end - 1, start - 1, -1)
        uses = [("u", layer) for layer in layers]
        # The op's first use comes BEFORE the exchanges that precede the op: its gather does not
        # depend on them, so ZeRO-3 posts it during the previous op's last block (prefetch).
        events += uses[:1]
        exchanges(points[k])
        events += uses[1:]
    exchanges(points[len(ops)])
    return events


@functools.lru_cache(maxsize=8)
def global_order(plan: Plan) -> tuple[tuple[int, int, Event], ...]:
    """Every stage's events merged into one sequence of (pipeline, stage, event); an exchange
    appears once, under the stage on its ``next`` side's left (the lower stage index)."""
    programs = {(i, j): stage_events(plan, i, j) for i, p in enumerate(plan.pipelines) for j in range(len(p.stages))}
    pos = dict.fromkeys(programs, 0)
    clock = dict.fromkeys(programs, 0.0)
    step = {key: 1.0 / max(1, sum(ev[0] == "u" for ev in prog)) for key, prog in programs.items()}
    total = sum(len(p) for p in programs.values())
    done = 0
    order: list[tuple[int, int, Event]] = []
    while done < total:
        best = None
        for (i, j), prog in programs.items():
            if pos[(i, j)] == len(prog):
                continue
            ev = prog[pos[(i, j)]]
            if ev[0] == "u":
                key = (clock[(i, j)], i, j)
            else:
                if ev[1] == "prev":
                    continue  # fired from the lower stage's side
                other = (i, j + 1)
                if pos[other] == len(programs[other]) or programs[other][pos[other]] != ("x", "prev", ev[2]):
                    continue
                key = (max(clock[(i, j)], clock[other]), i, j)
            if best is None or key < best[0]:
                best = (key, i, j, ev)
        if best is None:
            stuck = {f"pipeline {i} stage {j}": programs[(i, j)][pos[(i, j)]] for (i, j) in programs
                     if pos[(i, j)] < len(programs[(i, j)])}
            raise PlanError("plan.schedule", plan.schedule,
                            f"the pipeline exchanges of this plan do not pair up between adjacent stages "
                            f"(next events: {stuck}); a run would hang on NCCL", "report this plan as a bug")
        key, i, j, ev = best
        order.append((i, j, ev))
        pos[(i, j)] += 1
        done += 1
        if ev[0] == "u":
            clock[(i, j)] += step[(i, j)]
        else:
            t = key[0]
            clock[(i, j)] = clock[(i, j + 1)] = t
            pos[(i, j + 1)] += 1
            done += 1
    return tuple(order)


def check_exchanges(plan: Plan) -> None:
    """Raise :class:`PlanError` when some pipeline's exchanges cannot pair up (see :func:`global_order`)."""
    global_order(plan)
