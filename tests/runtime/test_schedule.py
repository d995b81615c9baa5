"""Pipeline schedules as data: GPipe and 1F1B op lists, and a dependency simulation of all stages."""

from __future__ import annotations

import pytest

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.runtime.schedule import (Exchange, exchange_points, forward_ops, gpipe_schedule,
                                                  one_f_one_b_schedule, schedule_ops)

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


# ---- p2p exchanges: every link pairs up and nothing can hang under NCCL's rules --------------------
def _exchange_traces(ops_of, stages: int) -> list[list]:
    """Synthetic traces, one rank per stage (TP 1), one batch Step per exchange of exchange_points."""
    from nccl_semantics import P2POp, Step

    traces = []
    for s in range(stages):
        steps = []
        for point in exchange_points(ops_of, stages, s):
            for ex in point:
                peer = s - 1 if ex.side == "prev" else s + 1
                group = tuple(sorted((s, peer)))
                ops = []
                if ex.send:  # the message id stands in for its size: a wrong pairing is a size mismatch
                    ops.append(P2POp("send", peer, group, 1 + 2 * ex.send[1] + (ex.send[0] == "grad"), "float32"))
                if ex.recv:
                    ops.append(P2POp("recv", peer, group, 1 + 2 * ex.recv[1] + (ex.recv[0] == "grad"), "float32"))
                steps.append(Step("batch", tuple(ops), group=group))
        traces.append(steps)
    return traces


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,mbs", [(1, 3), (2, 1), (2, 2), (2, 5), (3, 1), (3, 2), (3, 4), (4, 2), (4, 4),
                                        (4, 9), (5, 3), (6, 6), (8, 3)])
def test_exchanges_pair_up_and_replay_under_nccl_rules(name, stages, mbs):
    from nccl_semantics import replay

    ops_of = lambda s: schedule_ops(name, stages, s, mbs)  # noqa: E731
    report = replay(_exchange_traces(ops_of, stages))
    assert report.ok, str(report)
    # every stage sends and receives each of its messages exactly once
    for s in range(stages):
        exs = [ex for point in exchange_points(ops_of, stages, s) for ex in point]
        sent = sorted(ex.send for ex in exs if ex.send)
        got = sorted(ex.recv for ex in exs if ex.recv)
        assert sent == sorted(([("act", i) for i in range(mbs)] if s < stages - 1 else [])
                              + ([("grad", i) for i in range(mbs)] if s > 0 else []))
        assert got == sorted(([("act", i) for i in range(mbs)] if s > 0 else [])
                             + ([("grad", i) for i in range(mbs)] if s < stages - 1 else []))


def test_1f1b_steady_state_is_fused():
    """Stage 1 of 3, 4 micro-batches: after F(i) the activation goes out in the same batch as the
    gradient of B(i-1) comes in (send-forward + recv-backward), and vice versa with the previous stage."""
    ops_of = lambda s: one_f_one_b_schedule(3, s, 4)  # noqa: E731
    fused = [ex for point in exchange_points(ops_of, 3, 1) for ex in point if ex.send and ex.recv]
    assert Exchange("next", send=("act", 1), recv=("grad", 0)) in fused
    assert Exchange("prev", send=("grad", 0), recv=("act", 2)) in fused
    assert len(fused) == 5  # 3 with the next stage, 2 with the previous one


def test_forward_only_exchanges_replay():
    from nccl_semantics import replay

    assert replay(_exchange_traces(lambda s: forward_ops(3), 4)).ok


def test_old_unfused_1f1b_is_flagged():
    """Mutation: the exchange order of the former executor (an isend after every op, an irecv before
    every op, each on its own) deadlocks under NCCL's rules for 2 stages and 2 micro-batches."""
    from nccl_semantics import P2POp, Step, replay

    traces = []
    for s in range(2):
        steps = []
        for kind, i in one_f_one_b_schedule(2, s, 2):
            peer = 1 - s
            need = (kind == "F" and s == 1) or (kind == "B" and s == 0)
            make = (kind == "F" and s == 0) or (kind == "B" and s == 1)
            if need:
                steps.append(Step("p2p", (P2POp("recv", peer, (0, 1), 8, "float32"),)))
            if make:
                steps.append(Step("p2p", (P2POp("send", peer, (0, 1), 8, "float32"),)))
        traces.append(steps)
    report = replay(traces)
    assert not report.ok and "stuck" in str(report)
