"""ZeRO-2 and ZeRO-3 data-parallel time as the runtime runs it (pure terms, per layer).

Appendix B eq. 5 prices ZeRO-2's reduce-scatter AND all-gather as hidden under the last backward
(theta_2 * max(T_b, 2 T_comm)). The runtime (``runtime/zero.py``) starts the reduce-scatters during
the step's last backward, but all-gathers the updated chunks inside ``ShardedOptimizer.step``,
after the backward and after each bucket's optimizer step: that all-gather overlaps nothing the
cost model prices, so it is exposed. ZeRO-3 (``runtime/zero3.py``) prefetches each block's gather
under the previous block's compute (eq. 5's max(T, T_comm)), but a rank also *serves* the block
uses of its partners in the other pipelines: ``Zero3Gatherer._serve`` sends its chunk with
``batch_isend_irecv`` and waits for each send on the compute stream, so every served use stalls
the server's compute by the send. Each partner uses a block twice per micro-batch of ITS pipeline
(its forward and its backward; the recomputed forward runs inside the backward's gather), so a
rank sends a partner in pipeline k its chunk 2 n_mb(k) times per layer and step
(``wire.zero3_served_uses`` counts them; tests/runtime/test_zero3_wire.py checks the count against
the runtime's sends). In T_comm units (eq. 4, which sums the partners' latencies and paces the
bytes by the slowest partner link; a chunk sent equals a chunk received) that is
2 * mean_{k != i} n_mb(k) * T_comm per layer and step (:func:`zero3_served_per_layer`), which the
breakdown's ``dp_comm_s`` charges. The step time (:func:`zero3_serve_layer`) charges it as
2 T_comm per micro-batch of the server's own pipeline i: the same when the pipelines run equal
micro-batch counts, otherwise too high for a pipeline with more micro-batches than its partners
and too low for one with fewer. It stays so because the batch split prices each pipeline's time
from its own batch alone (``search/batching.BatchTimer``, bit for bit equal to ``estimate()``);
charging the partners' counts would couple the pipelines' times.

ZeRO-3's gradient reduce-scatters, too, run after the backward (``ZeroSharder.reduce_grads``), not
under it as eq. 5 has them.

T_comm here is one collective's time of one layer (``estimate.dp_t_comm``: for ZeRO-2 the mean of
the reduce-scatter at the reduce dtype and the all-gather at the wire dtype, exact when the two
dtypes are equal, the default). Both terms are non-decreasing in T_comm and independent of n_mb
per micro-batch (the oracle's bounds rely on both).
"""

from __future__ import annotations


def zero2_exposed_layer(t_b: float, t_comm: float, theta_2: float = 1.0) -> float:
    """Exposed ZeRO-2 time of one layer per iteration: the reduce-scatter under the last backward,
    the post-step all-gather in full:

        max(0, theta_2 * max(T_b, T_comm) - T_b)  +  T_comm

    (eq. 5 as written hides both collectives: max(0, theta_2 * max(T_b, 2 T_comm) - T_b))."""
    return max(0.0, theta_2 * max(t_b, t_comm) - t_b) + t_comm


def zero3_exposed_layer(t_comm: float) -> float:
    """Exposed ZeRO-3 time of one layer per iteration: its gradient reduce-scatter, T_comm, which
    ``ZeroSharder.reduce_grads`` issues after the backward (ZeRO-3 starts nothing during it: its
    block gathers follow one global point-to-point order that collectives inside the backward would
    break), overlapped with nothing priced. Eq. 5 as written charges
    theta_3b * (max(T_b, 2 T_comm) - max(T_b, T_comm)), zero whenever T_b >= 2 T_comm."""
    return t_comm


def zero3_serve_layer(t_comm: float) -> float:
    """Compute-stream time a ZeRO-3 rank spends serving its partners' uses of one layer, per
    micro-batch: 2 * T_comm (one send of its chunk to every partner for each of the partner's
    forward and backward uses), the partners running as many micro-batches as the server (the
    batch split keeps each pipeline's time a function of its own batch; the module doc says where
    this differs from the runtime's count, :func:`zero3_served_per_layer`)."""
    return 2.0 * t_comm


def zero3_served_per_layer(micro_batches: list[int], i: int) -> float:
    """Uses of one layer that a ZeRO-3 rank of pipeline ``i`` serves per step, in T_comm units (one
    chunk to one partner in every other pipeline): 2 * mean_{k != i} n_mb(k), with
    ``micro_batches[k]`` = n_mb(k) (the runtime sends a partner of pipeline k its chunk
    2 n_mb(k) times: ``wire.zero3_served_uses``). 0 with one pipeline."""
    others = [n for k, n in enumerate(micro_batches) if k != i]
    return 2.0 * sum(others) / len(others) if others else 0.0


def zero_head_exposed(t_head: float, backward_s: float, sharding: str) -> float:
    """Exposed part of the LM head's synchronisation ``t_head`` (the sum of its collectives) after
    the last stage's backward ``backward_s``:

        DDP:     max(0, t_head - backward_s)                        (its all-reduce overlaps the backward)
        ZeRO-2:  max(0, t_head / 2 - backward_s) + t_head / 2       (the head stays whole on its holders,
                                                                     ``whole`` buckets: the reduce-scatter
                                                                     overlaps, the all-gather follows the step)
        ZeRO-3:  t_head                                             (both after the backward)
    """
    if sharding == "ddp":
        return max(0.0, t_head - backward_s)
    if sharding == "zero2":
        return max(0.0, 0.5 * t_head - backward_s) + 0.5 * t_head
    return t_head
