"""lightning/idle_ranks.py's IdleLayout reads the plan's rank layout (planner/layout.py): for many
plans with idle devices launched on every device, it equals what IdleLayout computed before on its
own (the old expressions, verbatim, as the reference)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hexiscale.lightning.idle_ranks import layout_for
from lightning_hexiscale.planner import Pipeline, Plan, Stage


@st.composite
def idle_plans(draw) -> Plan:
    """1-3 pipelines of 1-2 stages (TP 1-2) over 2 layers, on a random permutation of device ids;
    1-3 of the remaining ids idle, so used and idle devices interleave in the launch order."""
    shapes = [[draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 2)))] for _ in range(draw(st.integers(1, 3)))]
    ids = iter(draw(st.permutations(range(sum(map(sum, shapes)) + draw(st.integers(1, 3))))))
    layers = {1: [(0, 2)], 2: [(0, 1), (1, 2)]}
    pipes = tuple(Pipeline(2, 1, tuple(Stage(tuple(next(ids) for _ in range(t)), lr)
                                       for t, lr in zip(tps, layers[len(tps)])))
                  for tps in shapes)
    return Plan(pipes, 2, idle_devices=tuple(sorted(ids))).validate()


def old_idle_layout(plan: Plan, launch_rank: int):
    """IdleLayout's expressions before the rank layout (lightning/idle_ranks.py at commit 3fc942a)."""
    launch_order, idle_devices = tuple(plan.launch_order), tuple(sorted(plan.idle_devices))
    active = tuple(r for r, d in enumerate(launch_order) if d not in idle_devices)
    idle_ranks = tuple(r for r, d in enumerate(launch_order) if d in idle_devices)
    device = launch_order[launch_rank]
    idle = device in idle_devices
    rank = len(active) + idle_ranks.index(launch_rank) if idle else active.index(launch_rank)
    return active, idle_ranks, device, idle, len(active), rank, launch_order, idle_devices


@settings(max_examples=60, deadline=None)
@given(plan=idle_plans())
def test_idle_layout_equals_the_old_expressions(plan):
    for r in range(len(plan.launch_order)):
        got = layout_for(plan, len(plan.launch_order), r)
        assert (got.active_ranks, got.idle_ranks, got.device, got.idle, got.world_size, got.rank, got.launch_order,
                got.idle_devices) == old_idle_layout(plan, r)
