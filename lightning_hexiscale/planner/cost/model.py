"""Appendix B of the HexiScale paper as named, pure cost terms.

Notation (paper Tab. 1): a stage's device set d_ij with |d_ij| = t (its TP degree), per-pair latency
alpha[d, d'] (s) and bandwidth beta[d, d'] (bytes/s), device compute c_d (FLOP/s), micro-batch
B_mb, sequence length S, hidden size H, bytes per element B_type, n_mb micro-batches.
All times are seconds for ONE micro-batch of ONE layer unless a docstring says otherwise.
Composition into stage, pipeline and iteration times is in :mod:`lightning_hexiscale.planner.cost.estimate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Group = Sequence[int]


def comm_tp(group: Group, message_bytes: float, bandwidth: np.ndarray, latency: np.ndarray) -> float:
    """Comm-TP-Fwd (= Comm-TP-Bwd) of one layer for one micro-batch, Appendix B eq. 1:

        4 * max_{d in g} sum_{d' in g \\ {d}} ( alpha[d,d'] + M / (|g| * beta[d,d']) ),  M = B_mb*S*H*B_type

    i.e. two ring all-reduces (after attention and after the MLP) of the activation M, each moving
    2(t-1)/t * M per device. Zero for a single device.
    """
    t = len(group)
    if t <= 1:
        return 0.0
    g = np.asarray(group)
    lat = latency[np.ix_(g, g)]
    bw = bandwidth[np.ix_(g, g)]
    per_pair = lat + message_bytes / (t * bw)
    np.fill_diagonal(per_pair, 0.0)
    return float(4.0 * per_pair.sum(axis=1).max())


def allreduce_time(group: Group, message_bytes: float, bandwidth: np.ndarray, latency: np.ndarray) -> float:
    """One ring all-reduce of M bytes over ``group`` (the unit comm_tp counts four of):

        2 * max_{d in g} sum_{d' in g \\ {d}} ( alpha[d,d'] + M / (|g| * beta[d,d']) )

    Zero for a single device.
    """
    return 0.5 * comm_tp(group, message_bytes, bandwidth, latency)


def vocab_parallel_head(head_fwd_flops: float, vocab_fraction: float, flops: float, group: Group,
                        tokens: int, hidden: int, dtype_bytes: int, bandwidth: np.ndarray,
                        latency: np.ndarray) -> tuple[float, float]:
    """(compute_s, comm_s) of the last stage's LM head and cross-entropy, forward + backward, one
    micro-batch of ``tokens`` = B_mb*S tokens, vocabulary-parallel over the stage's TP group g
    (Megatron-LM's vocab_parallel_cross_entropy; runtime: ``tensor_parallel.VocabParallelHead``):

        compute = 3 * (2*B_mb*S*H*V) * f_V / c            f_V = ceil(V/t)/V, the largest vocabulary share
                                                          (forward matmul + two backward matmuls)
        comm    = AR(4*B_mb*S) + AR(8*B_mb*S)             forward: the fp32 max per token, then the
                                                          fp32 (sum of exp, target logit) pair per token
                + AR(B_mb*S*H*B_type)                     backward: the head's input gradient (sum over ranks)

    with AR = :func:`allreduce_time`. No rank ever holds the (B_mb, S, V) logits, only V/t columns.
    With t = 1 this is the whole head and no communication.
    """
    compute = 3.0 * head_fwd_flops * vocab_fraction / flops
    if len(group) <= 1:
        return compute, 0.0
    comm = (allreduce_time(group, 4.0 * tokens, bandwidth, latency)
            + allreduce_time(group, 8.0 * tokens, bandwidth, latency)
            + allreduce_time(group, float(tokens) * hidden * dtype_bytes, bandwidth, latency))
    return compute, comm


def vocab_parallel_embedding(group: Group, message_bytes: float, bandwidth: np.ndarray, latency: np.ndarray) -> float:
    """Comm of a first stage's vocabulary-parallel embedding for one micro-batch: each rank looks up
    the tokens of its V/t rows, one forward all-reduce of the (B_mb, S, H) output, M = B_mb*S*H*B_type
    (backward needs none: each rank's rows get their own gradient). Zero with TP 1."""
    return allreduce_time(group, message_bytes, bandwidth, latency)


def comp_layer_fwd(layer_fwd_flops: float, shard_fraction: float, flops: float) -> float:
    """Comp-TP-Fwd, Appendix B eq. 2: FLOPs of the layer's forward on this rank / c_d.

    With the paper's 12H^2-parameter layer, layer_fwd_flops = 24*B_mb*S*H^2*(1 + S/(6H)) and
    shard_fraction = 1/|d|, giving 24*B_mb*S*H^2*(1+S/6H) / (c_d*|d|). ``flops`` is the slowest
    device of the group (a TP group waits for its slowest member); ``shard_fraction`` is the
    largest share of the layer on one rank (1/t for even splits).
    """
    return layer_fwd_flops * shard_fraction / flops


def comp_layer_bwd(fwd_s: float) -> float:
    """Comp-TP-Bwd = 2 x Comp-TP-Fwd (gradients w.r.t. inputs and weights), Appendix B eq. 2."""
    return 2.0 * fwd_s


def layer_time_fwd(comp_fwd_s: float, comm_tp_s: float) -> float:
    """T_f = Comp-TP-Fwd + Comm-TP-Fwd (Appendix B eq. 3)."""
    return comp_fwd_s + comm_tp_s


RECOMPUTE_TP_SHARE = 0.5
"""Share of a layer's forward TP all-reduces that recomputation re-runs: torch's non-reentrant
checkpoint stops recomputing once the last tensor saved for backward is back, which is before the
MLP's output all-reduce, so 1 of the 2 forward all-reduces is re-run (counted from the runtime's
trace by tests/runtime/test_wire_bytes.py)."""


def layer_time_bwd(comp_fwd_s: float, comm_tp_s: float, recompute: bool) -> float:
    """T_b = Comp-TP-Bwd + Comm-TP-Bwd (Appendix B eq. 3), plus the re-run forward when recomputing.

    The paper folds recomputation into its assumptions; here it is explicit so that turning it off
    is priced: recompute adds Comp-TP-Fwd + RECOMPUTE_TP_SHARE * Comm-TP-Fwd to every backward.
    """
    t_b = comp_layer_bwd(comp_fwd_s) + comm_tp_s
    if recompute:
        t_b += comp_fwd_s + RECOMPUTE_TP_SHARE * comm_tp_s
    return t_b


def comm_dp(partners: Sequence[tuple[int, int, float]], layer_bytes: float, num_pipelines: int,
            bandwidth: np.ndarray, latency: np.ndarray, nic_rate: float = np.inf) -> float:
    """T_comm of one layer for one device (one reduce-scatter or all-gather), Appendix B eq. 4 with
    the bytes paced by the slowest partner link:

        sum_{d' in D_dp \\ {d}} alpha[d,d'] + sum_{d'} share(d,d') * 12H^2*B_type / (|D_dp| * min_{d'} beta[d,d'])

    generalised to asymmetric TP: ``partners`` lists (d, d', share) with share the fraction of the
    layer's weights that d and d' both hold (1 when both are unsharded). An all-reduce costs 2*T_comm.

    Why the minimum: eq. 4 as written charges each partner's share at that partner's own link,
    which is a ring all-reduce's cost only when the links are equal. A ring (gloo, NCCL) moves a
    chunk of M/|D_dp| through EVERY link of the ring at every one of its |D_dp|-1 steps, so the
    slowest link paces all of them: 2(N-1)/N * M / beta_min for the all-reduce. With equal links
    this is exactly the paper's formula; a DP group with two members on one machine and two on
    another pays 1.5x what the per-link sum gives (measured on the emulated 4:1 cluster: the
    per-link sum left a factor ~2 to theta_ddp, which then inflated every compute-bound sync).

    ``nic_rate``: the rate the device's rings get from the NICs they cross when other rings share
    them (``planner/cost/nic.py``: ``dp_ring_rates``); min_{d'} beta becomes min(min_{d'} beta, nic_rate).
    """
    if num_pipelines <= 1 or not partners:
        return 0.0
    alpha = sum(latency[d, dp] for d, dp, _ in partners)
    shares = sum(share for _, _, share in partners)
    slowest = min(min(bandwidth[d, dp] for d, dp, _ in partners), nic_rate)
    return float(alpha + shares * layer_bytes / (num_pipelines * slowest))


def dp_overhead_layer(n_mb: int, t_f: float, t_b: float, t_comm: float, sharding: str,
                      theta: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)) -> float:
    """DP-Overhead-Layer(k, sigma), Appendix B eq. 5: time of one layer over ALL n_mb micro-batches
    including its data-parallel collectives and their overlap with the last backward:

        DDP:    n_mb*T_f + (n_mb-1)*T_b + theta_1 * max(T_b, 2*T_comm)
        ZeRO-2: n_mb*T_f + (n_mb-1)*T_b + theta_2 * max(T_b, 2*T_comm)
        ZeRO-3: n_mb*theta_3f*max(T_f, T_comm) + (n_mb-1)*theta_3b*max(T_b, T_comm)
                + theta_3b*max(T_b, 2*T_comm)

    ``theta`` = (theta_1, theta_2, theta_3f, theta_3b), profiled slowdowns of overlapped work.
    """
    th1, th2, th3f, th3b = theta
    if sharding == "ddp":
        return n_mb * t_f + (n_mb - 1) * t_b + th1 * max(t_b, 2 * t_comm)
    if sharding == "zero2":
        return n_mb * t_f + (n_mb - 1) * t_b + th2 * max(t_b, 2 * t_comm)
    if sharding == "zero3":
        return (n_mb * th3f * max(t_f, t_comm) + (n_mb - 1) * th3b * max(t_b, t_comm)
                + th3b * max(t_b, 2 * t_comm))
    raise ValueError(f"unknown dp_sharding {sharding!r}")


def dp_exposed_layer(t_b: float, t_comm: float, sharding: str,
                     theta: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)) -> float:
    """The part of DP-Overhead-Layer (eq. 5) that the per-micro-batch times do not already hold, i.e.
    the data-parallel time of one layer left exposed after its last backward, per iteration:

        DDP:    max(0, theta_1 * max(T_b, 2*T_comm) - T_b)
        ZeRO-2: max(0, theta_2 * max(T_b, 2*T_comm) - T_b)
        ZeRO-3: theta_3b * (max(T_b, 2*T_comm) - max(T_b, T_comm))

    so that DP-Overhead-Layer = n_mb * (f + b) + exposed with f + b = T_f + T_b (DDP, ZeRO-2) or
    theta_3f*max(T_f, T_comm) + theta_3b*max(T_b, T_comm) (ZeRO-3). It does not depend on n_mb and
    is non-decreasing in T_comm (the planner's oracle relies on both).
    """
    th1, th2, _, th3b = theta
    if sharding in ("ddp", "zero2"):
        return max(0.0, (th1 if sharding == "ddp" else th2) * max(t_b, 2 * t_comm) - t_b)
    if sharding == "zero3":
        return th3b * (max(t_b, 2 * t_comm) - max(t_b, t_comm))
    raise ValueError(f"unknown dp_sharding {sharding!r}")


def comm_pp_hop(src: Group, dst: Group, message_bytes: float, bandwidth: np.ndarray, latency: np.ndarray,
                leaders: tuple[int, int] | None = None, send_cap: float = np.inf) -> float:
    """Comm-PP-Hop(d_ij, d_i,j+1) for one micro-batch, Appendix B eq. 6:

        2 * min_{d in src, d' in dst} [ (alpha[d,d'] + M / beta[d,d'])
                                        + sum_{d'' in dst \\ {d'}} (alpha[d',d''] + M / (|dst| * beta[d',d''])) ]

    a leader-to-leader send of the activation M = B_mb*S*H*B_type followed by the receiving leader's
    broadcast in its TP group, x2 for the activation gradient going back. ``leaders`` fixes the
    pair (the plan's stage leaders, as the runtime uses them) instead of the minimum over pairs.
    ``send_cap``: the leader send's share of the NICs it crosses when other transfers run at once
    (``planner/cost/nic.py``); beta[d,d'] becomes min(beta[d,d'], send_cap) in the first term.
    """
    dst = list(dst)
    pairs = [leaders] if leaders is not None else [(d, dp) for d in src for dp in dst]
    best = np.inf
    for d, dp in pairs:
        t = latency[d, dp] + message_bytes / min(bandwidth[d, dp], send_cap)
        for dpp in dst:
            if dpp != dp:
                t += latency[dp, dpp] + message_bytes / (len(dst) * bandwidth[dp, dpp])
        best = min(best, t)
    return float(2.0 * best)


def comm_pp_hop_scatter(src: Group, dst: Group, message_bytes: float, bandwidth: np.ndarray,
                        latency: np.ndarray, caps: Sequence[float] = ()) -> float:
    """Comm-PP-Hop on the scatter/gather path between stages of equal TP degree t > 1, one micro-batch:

        2 * [ max_r (alpha[s_r,d_r] + c / beta[s_r,d_r])
              + max_r sum_{r' != r} (alpha[d_r,d_r'] + c / beta[d_r,d_r']) ],   c = M / t

    TP rank r sends chunk r (1/t of the activation M) to TP rank r of the next stage, then the
    receivers all-gather the chunks in their TP group; x2 for the gradient going back (the
    runtime's path when both TP degrees are equal, see runtime/schedule.py).

    ``caps``: per rank r, the NIC fair share of its send (``planner/cost/nic.py``: the t sends of a
    boundary between two machines, and other pipelines' sends in the same phase, share the NICs);
    beta[s_r,d_r] becomes min(beta[s_r,d_r], caps[r]). Empty: every send has its link to itself.
    """
    src, dst = list(src), list(dst)
    t = len(src)
    c = message_bytes / t
    caps = list(caps) if len(caps) else [np.inf] * t
    send = max(latency[a, b] + c / min(bandwidth[a, b], cap) for a, b, cap in zip(src, dst, caps))
    gather = max(sum(latency[d, e] + c / bandwidth[d, e] for e in dst if e != d) for d in dst)
    return float(2.0 * (send + gather))


def hop_charges(hop_s, schedule: str, axis: int = -1):
    """Per-micro-batch share of the pipeline hops each stage pays, from ``hop_s[j]`` = Comm-PP-Hop
    (eq. 6, both directions) of the link from stage j to stage j+1 (0 for the last stage):

        GPipe:  charge_j = Hop_j                      (Appendix B: the sender pays both directions)
        1F1B:   charge_j = (Hop_{j-1} + Hop_j) / 2    (Hop_{-1} = 0)

    Why 1F1B differs: in its steady state the runtime fuses send-forward + receive-backward with the
    next stage, and send-backward + receive-forward with the previous one, into ONE
    ``batch_isend_irecv`` (runtime/schedule.py) that both neighbours wait for. The two directions of
    a link then travel at once on the full-duplex link, so an exchange takes one direction's time,
    Hop_j / 2, and it holds BOTH neighbours (p2p sends are rendezvous: a gloo send completes only
    once the receiver has posted, tests/runtime/test_p2p_rendezvous.py). On the emulated cluster
    (benchmarks/bench_hetero.py) the sender-pays charge priced the fast-first-stage plan 14-22 % above
    its measured time; this charge takes about 5 % of that off (the rest is open, see the README).
    GPipe's sends and receives are not fused (each phase moves one direction), so its charge stays
    the paper's. Either way sum_j charge_j = sum_j Hop_j: a micro-batch's trip through the pipeline
    still crosses every hop once in each direction.

    ``hop_s``: a sequence (returns a list) or an array whose ``axis`` runs over the stages (returns
    an array). Pipelines laid end to end along ``axis`` need no separation: a pipeline's last stage
    has hop 0, so the next pipeline's first stage receives nothing from it.
    """
    if isinstance(hop_s, np.ndarray):
        if schedule == "gpipe":
            return hop_s.copy()
        prev = np.zeros_like(hop_s)
        src = [slice(None)] * hop_s.ndim
        dst = [slice(None)] * hop_s.ndim
        src[axis], dst[axis] = slice(None, -1), slice(1, None)
        prev[tuple(dst)] = hop_s[tuple(src)]
        return 0.5 * (hop_s + prev)
    n = len(hop_s)
    if schedule == "gpipe" or n <= 1:
        return [float(h) for h in hop_s]
    return [0.5 * ((hop_s[j - 1] if j > 0 else 0.0) + hop_s[j]) for j in range(n)]


def pipeline_time(stage_s: Sequence[float], hop_s: Sequence[float], n_mb: int) -> float:
    """Pipeline-Time(i), Appendix B eq. 8, with per-micro-batch stage times:

        sum_j (Stage_j + Hop_j) + (n_mb - 1) * max_j (Stage_j + Hop_j)

    The first micro-batch crosses every stage once; the rest stream at the pace of the slowest
    stage (the paper writes the max over j = 2..D_pp, read here as over all stages). ``hop_s`` is
    each stage's share of the hops (:func:`hop_charges`: the paper's Hop_j under GPipe, half of
    each adjacent link's under 1F1B's fused exchanges); the first sum is the same either way.
    """
    per = [s + h for s, h in zip(stage_s, hop_s)]
    return float(sum(per) + (n_mb - 1) * max(per))


def total_time(pipeline_s: Sequence[float]) -> float:
    """Total-Time(sigma) = max_i Pipeline-Time(i), Appendix B eq. 9: the slowest pipeline sets the pace."""
    return float(max(pipeline_s))


def mem_layer_paper(hidden: int, tp: int, micro_batch: int, seq_len: int, dtype_bytes: int) -> float:
    """Mem-Layer(sigma), Appendix B eq. 10 (full recompute, DDP): 48*H^2*B_type/|d| + B_mb*S*H*B_type bytes.

    Kept for reference and tests; :func:`memory_per_device` is the model the planner uses (real
    parameter counts, optimizer states, sharding, in-flight micro-batches).
    """
    return 48.0 * hidden**2 * dtype_bytes / tp + micro_batch * seq_len * hidden * dtype_bytes


def activation_bytes_layer(micro_batch: int, seq_len: int, hidden: int, tp: int, dtype_bytes: int) -> float:
    """Activations one layer keeps for backward without recomputation, for one micro-batch:

        S*B*H*(5 + 12/t) * B_type   (Korthikanti et al. 2022, Tab. 2, TP without sequence parallelism,
                                     with the 5*a*S/H attention-score term removed: flash-style
                                     attention does not store the S x S scores)

    written per element (the paper counts 34 bytes = 17 elements of 2 bytes at t = 1).
    """
    return seq_len * micro_batch * hidden * (5.0 + 12.0 / tp) * dtype_bytes


def inflight_micro_batches(schedule: str, num_stages: int, stage_index: int, n_mb: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe n_mb; 1F1B min(D_pp - j, n_mb)."""
    if schedule == "gpipe":
        return n_mb
    return min(num_stages - stage_index, n_mb)


def state_bytes_per_param(sharding: str, num_pipelines: int, dtype_bytes: int, optimizer_bytes: float) -> float:
    """Bytes per local parameter for weights, gradients and optimizer states (ZeRO paper, §5):

        DDP:    B_type + B_type + K
        ZeRO-2: B_type + (B_type + K) / N_dp
        ZeRO-3: (B_type + B_type + K) / N_dp
    with K = ``optimizer_bytes`` (12 for Adam with fp32 master weights) and N_dp the pipelines
    sharing each chunk.
    """
    n = max(num_pipelines, 1)
    if sharding == "ddp":
        return 2 * dtype_bytes + optimizer_bytes
    if sharding == "zero2":
        return dtype_bytes + (dtype_bytes + optimizer_bytes) / n
    if sharding == "zero3":
        return (2 * dtype_bytes + optimizer_bytes) / n
    raise ValueError(f"unknown dp_sharding {sharding!r}")


# ---- what the runtime allocates beyond Appendix B (measured on the CPU runtime; see tests) ----------
def runtime_state_bytes_per_param(sharding: str, num_pipelines: int, dtype_bytes: int, optimizer_bytes: float,
                                  phase: str = "backward", recompute: bool = True,
                                  param_bytes: float | None = None) -> float:
    """Bytes per local parameter the runtime holds for weights, gradients and optimizer states in
    each phase of a step (``runtime/zero.py``, ``runtime/zero3.py``; measured on CPU), k = N_dp,
    P = ``param_bytes`` (the parameters' storage dtype, which their gradients share; default
    B = ``dtype_bytes``; float32 under mixed precision, where P > B):

        phase      DDP           ZeRO-2                      ZeRO-2, mixed (P > B)       ZeRO-3
        backward   P + P + K     P + P + K/k                 P + P + P/k + K/k           P/k + P/k + P + K/k
        sync       P + P + K     P + P + K/k                 P + P + P/k + K/k           P/k + P/k + P + K/k
        step       P + P + K     P + P/k + K/k + P           P + P/k + P/k + K/k         P/k + P/k + K/k

    The local gradient is whole until the cross-pipeline reduce-scatter (the pipelines run
    different numbers of micro-batches, so it accumulates over all of them first), where
    :func:`state_bytes_per_param` (ZeRO paper) counts it 1/k. ZeRO-2's sharded step keeps every
    bucket's flat copy of the parameters alive (its inner optimizers step views of them); under
    mixed precision it steps the exact float32 master chunk instead (P/k, kept between steps: the
    full local parameters hold the bf16-rounded values). ZeRO-3 keeps the parameter chunks it owns
    (P/k, its masters) and, bound to its sharded optimizer until the next step, the previous
    step's gradient chunks (P/k). Measured on the CPU runtime (``benchmarks/bench_zero.py``,
    ``benchmarks/bench_memory.py``); ``recompute`` is accepted for symmetry (no term depends on it).
    """
    P = dtype_bytes if param_bytes is None else param_bytes
    K, k = optimizer_bytes, max(num_pipelines, 1)
    if sharding == "ddp":
        return 2 * P + K
    if sharding == "zero2":
        if P > dtype_bytes and k > 1:  # mixed precision: float32 master chunks, no flat copy in the step
            return (2 * P if phase != "step" else P + P / k) + P / k + K / k
        return 2 * P + K / k if phase != "step" else P + P / k + K / k + P
    if sharding == "zero3":
        return 2 * P / k + K / k + (P if phase != "step" else 0.0)
    raise ValueError(f"unknown dp_sharding {sharding!r}")


def autocast_weight_bytes(matmul_params: float, dtype_bytes: int, copies: int = 1) -> float:
    """Mixed precision: autocast's B_type copies of the matmul weights that linears save for their
    backward, ``copies * matmul_params * B_type``. The runtime (``runtime/schedule.py``) lets
    micro-batches 0..n-2 of a step share one cached cast and casts afresh for the last one, so a
    stage holds at most two copies (one with a single micro-batch in flight); with recomputation
    only the layer being recomputed has its casts (one copy of one layer)."""
    return copies * matmul_params * dtype_bytes


def shared_cast_grad_bytes(matmul_params: float, dtype_bytes: int) -> float:
    """The price of sharing one cast across micro-batches: in each backward but the last, autograd
    runs the shared cast's node (the oldest in the graph) last, so the B_type gradients of every
    weight wait in its input buffers until the end of that backward: one more copy of the weights
    in B_type (measured: ``benchmarks/bench_memory.py``, 8 micro-batches)."""
    return matmul_params * dtype_bytes


def main_grad_copy_bytes(matmul_params: float, compute_bytes: float) -> float:
    """Main grads (``runtime/main_grads.py``): one compute copy of every matmul weight (the block
    linears and an untied LM head), ``matmul_params * B_type``, from the step's first forward to its
    last backward, whatever the micro-batches in flight; it replaces :func:`autocast_weight_bytes`
    and :func:`shared_cast_grad_bytes` for those weights."""
    return matmul_params * compute_bytes


def chunked_loss_bytes(tokens: int, vocab: float, dtype_bytes: int, chunk_tokens: int, inflight: int = 1) -> float:
    """The chunked cross-entropy (``runtime/chunked_loss.py``) on a last stage holding ``vocab``
    words (V/t under TP), in bytes, at the start of its backward:

        inflight * tokens * (V * B + 2 * C + 9)  +  tokens * V * B  +  min(c, tokens) * V * C

    each micro-batch in flight keeps its logits in B_type (the head's output dtype) and, per token,
    the max and the sum of exponentials (C) and the target index and mask (9); the backward writes
    the gradient of the logits in B_type and works in C = float32 on one chunk of c tokens at a time
    (:func:`logits_bytes` is the plain loss: float32 copies of the whole micro-batch)."""
    C = compute_bytes(dtype_bytes)
    return (inflight * tokens * (vocab * dtype_bytes + 2 * C + 9) + tokens * vocab * dtype_bytes
            + min(chunk_tokens, tokens) * vocab * C)


def compute_bytes(dtype_bytes: int) -> int:
    """Bytes of the dtype norms and the loss run in: at least float32 (``models/llama.py``)."""
    return max(4, dtype_bytes)


def stored_activation_bytes(tokens: int, hidden: int, kv_dim: int, ffn: int, tp: int, dtype_bytes: int,
                            mixed: bool = False, cast_once: bool = False) -> float:
    """Bytes one LLaMA layer keeps for its backward, for ``tokens`` = B_mb * S tokens (no recompute):

        tokens * [ 2 * (2 * C / B_type + 1) * H  +  (2 * H + 2 * kv + 4 * F) / t ] * B_type

    measured with saved-tensor hooks on ``models/llama.py`` (tests/planner/cost/test_memory_terms.py):
    each RMSNorm keeps its input and normalised value in its compute dtype C (float32) and its
    output feeds the next projection (replicated over the TP group); attention keeps q, out and
    the k, v of the local heads; the SwiGLU MLP keeps gate, up, silu(gate) and their product.

    ``mixed`` (autocast over float32 parameters): the residual stream stays float32, and each
    linear saves its own B_type cast of its input; a norm's output enters q, k, v (3 casts) and
    gate, up (2 casts) when t = 1, but one cast under TP, and at t = 1 with the fast path's
    ``cast_once`` (``runtime/parallelize.py`` casts it before the TP region):

        tokens * [ 4 * C * H  +  c * B_type * H  +  (2 * H + 2 * kv + 4 * F) / t * B_type ],
        c = 5 if t = 1 and not cast_once else 2
    """
    C = compute_bytes(dtype_bytes)
    if mixed:
        casts = 5 if tp == 1 and not cast_once else 2
        return tokens * (4 * C * hidden + (casts * hidden + (2 * hidden + 2 * kv_dim + 4 * ffn) / tp) * dtype_bytes)
    norms = 2 * (2 * C / dtype_bytes + 1) * hidden
    return tokens * (norms + (2 * hidden + 2 * kv_dim + 4 * ffn) / tp) * dtype_bytes


def backward_working_bytes(tokens: int, hidden: int, ffn: int, tp: int, dtype_bytes: int,
                           param_bytes: float | None = None) -> float:
    """Autograd temporaries while one layer runs its backward: the three FFN-wide gradients of the
    SwiGLU alive at once (3 * tokens * F / t) and the fresh gradient of its largest weight shard
    (H * F / t), which is allocated and then added into the accumulated gradient. Measured within a
    few % on the CPU runtime (the stage's peak minus its stored activations). Mixed precision
    (``param_bytes`` P > B_type): that fresh gradient exists in B_type and, cast back, in P."""
    P = dtype_bytes if param_bytes is None else param_bytes
    fresh = hidden * ffn / tp * (dtype_bytes + P if P > dtype_bytes else dtype_bytes)
    return 3 * tokens * ffn / tp * dtype_bytes + fresh


def logits_bytes(tokens: int, vocab: int, vocab_shards: int = 1) -> float:
    """The loss on a stage holding the (full, or 1/``vocab_shards``) vocabulary: at the start of the
    backward the float32 log-softmax output, the gradient of the loss w.r.t. it and the gradient
    w.r.t. the logits coexist, 3 * tokens * V * 4 bytes (measured)."""
    return 3.0 * tokens * vocab / vocab_shards * 4


def ddp_bucket_bytes(synced_params: float, dtype_bytes: int) -> float:
    """DDP gradient sync: every bucket's flat copy of its gradients is alive until the sync ends
    (``runtime/grad_sync.py`` starts them all, then waits), i.e. one more copy of the gradients."""
    return synced_params * dtype_bytes


def zero_window_bytes(bucket_cap_bytes: float, window: int = 2) -> float:
    """ZeRO collectives: ``window`` buckets in flight, each a flat input and its output chunk."""
    return 2.0 * window * bucket_cap_bytes


def optimizer_temp_bytes(stepped_params: float, state_bytes: float) -> float:
    """Adam/AdamW's multi-tensor step (the default on GPUs) allocates one state-sized temporary per
    stepped parameter (the square-root of the second moment); the single-tensor step on CPU one
    parameter at a time (then pass the largest parameter)."""
    return stepped_params * state_bytes


def comm_buffer_bytes(communicators: int, per_communicator_bytes: float) -> float:
    """Buffers a collective library keeps per communicator a device belongs to (NCCL: its
    NCCL_BUFFSIZE per channel and peer; 0 on gloo)."""
    return communicators * per_communicator_bytes
