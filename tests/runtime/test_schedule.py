"""Pipeline schedules as data: GPipe and 1F1B op lists, and a dependency simulation of all stages."""

from __future__ import annotations

import pytest

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.runtime.schedule import gpipe_schedule, one_f_one_b_schedule, schedule_ops

SHAPES = [(1, 0, 1), (1, 0, 4), (2, 0, 1), (2, 1, 1), (3, 0, 2), (3, 1, 2), (3, 2, 2), (4, 0, 6), (4, 1, 6),
          (4, 3, 6), (4, 0, 3), (5, 2, 8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,stage,mbs", SHAPES)
def test_every_micro_batch_once_in_order(name, stages, stage, mbs):
    ops = schedule_ops(name, stages, stage, mbs)
    fwd = [i for k, i in ops if k == "F"]
    bwd = [i for k, i in ops if k == "B"]
    assert fwd == list(range(mbs)) and bwd == list(range(mbs))
    for i in range(mbs):
        assert ops.index(("F", i)) < ops.index(("B", i))


def test_gpipe_all_forward_then_all_backward():
    assert gpipe_schedule(3, 1, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_1f1b_first_stage_of_four_with_six_micro_batches():
    # warm-up 3 forwards, 3 (F, B) pairs, 3 cool-down backwards
    assert one_f_one_b_schedule(4, 0, 6) == [
        ("F", 0), ("F", 1), ("F", 2),
        ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5), ("B", 2),
        ("B", 3), ("B", 4), ("B", 5)]


def test_1f1b_last_stage_alternates():
    assert one_f_one_b_schedule(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_1f1b_fewer_micro_batches_than_stages_is_gpipe_like():
    assert one_f_one_b_schedule(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("stages,stage,mbs", SHAPES)
def test_1f1b_bounds_activations_in_flight(stages, stage, mbs):
    in_flight = peak = 0
    for kind, _ in one_f_one_b_schedule(stages, stage, mbs):
        in_flight += 1 if kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak == min(stages - stage, mbs)
    gpipe_peak = max(sum(1 for k, _ in gpipe_schedule(stages, stage, mbs)[:n] if k == "F") for n in range(2 * mbs))
    assert gpipe_peak == mbs


def simulate(name: str, stages: int, mbs: int) -> int:
    """Run every stage's op list against the data dependencies of a pipeline; return the number of
    rounds. F(i) on stage s needs F(i) done on s-1; B(i) needs B(i) done on s+1. Sends never block
    (isend), receives do. Raises on a deadlock."""
    lists = [schedule_ops(name, stages, s, mbs) for s in range(stages)]
    pos = [0] * stages
    done: set[tuple[str, int, int]] = set()
    rounds = 0
    while any(pos[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            kind, i = lists[s][pos[s]]
            ready = (s == 0 or ("F", i, s - 1) in done) if kind == "F" else (
                s == stages - 1 or ("B", i, s + 1) in done)
            if ready:
                done.add((kind, i, s))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"deadlock: positions {pos}")
        rounds += 1
    return rounds


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (6, 3)])
def test_all_stages_together_never_deadlock(name, stages, mbs):
    assert simulate(name, stages, mbs) >= 2 * mbs


def test_unknown_schedule_is_a_plan_error():
    with pytest.raises(PlanError, match="plan.schedule"):
        schedule_ops("interleaved", 2, 0, 2)


@pytest.mark.parametrize("args", [(0, 0, 1), (2, 2, 1), (2, 0, 0)])
def test_bad_shapes_rejected(args):
    with pytest.raises(ValueError):
        gpipe_schedule(*args)
