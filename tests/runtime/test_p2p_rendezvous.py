
import pytest
"""The p2p semantics the cost model's hop charge rests on (planner/cost/model.py: hop_charges).

Under 1F1B each stage pays half of each adjacent hop because an exchange holds BOTH neighbours: a
send completes only once the receiver has taken the message (rendezvous), it is not buffered and
forgotten. NCCL sends behave so for messages beyond its buffers; these tests pin it for gloo, the
backend the emulated-cluster benchmark measures: if a send returned before the receiver posted, the
sender would not pay the hop and the charge would have to change."""

import time

import torch
import torch.distributed as dist

LATE_S = 0.4  # how long the receiver waits before posting its side
ACTIVATION = 2 * 128 * 192  # elements of the emulated benchmark's activation (micro-batch 2, S=128, H=192)


def _wait(ops) -> float:
    t0 = time.perf_counter()
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return time.perf_counter() - t0


def _send_then_late_receive(rank: int, world: int) -> float:
    x = torch.ones(ACTIVATION)
    dist.barrier()
    if rank == 0:
        return _wait([dist.P2POp(dist.isend, x, 1)])
    time.sleep(LATE_S)
    got = torch.empty(ACTIVATION)
    _wait([dist.P2POp(dist.irecv, got, 0)])
    assert torch.equal(got, x)
    return 0.0


def _fused_exchange_late_peer(rank: int, world: int) -> float:
    """1F1B's steady state on one link: stage 0 sends an activation and receives a gradient in one batch."""
    peer = 1 - rank
    mine, got = torch.full((ACTIVATION,), float(rank)), torch.empty(ACTIVATION)
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    took = _wait([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)])
    assert torch.equal(got, torch.full((ACTIVATION,), float(peer)))
    return took


@pytest.mark.slow
def test_a_send_waits_for_its_receiver(run_ranks):
    sender, _ = run_ranks(2, _send_then_late_receive, timeout=60)
    assert sender >= 0.75 * LATE_S, f"the send returned after {sender:.3f} s, before the receiver posted"


@pytest.mark.slow
def test_a_fused_exchange_holds_both_neighbours(run_ranks):
    early, late = run_ranks(2, _fused_exchange_late_peer, timeout=60)
    assert early >= 0.75 * LATE_S  # the early side waits for the late one
    assert late < early  # and the late one does not wait again
