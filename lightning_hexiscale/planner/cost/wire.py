"""Bytes on the wire per device and link class for one optimizer step: what the runtime moves.

Pure (no torch): from the Plan, the model shapes and the three wire dtypes. The time terms of
:mod:`lightning_hexiscale.planner.cost.estimate` are built on the same message sizes; the runtime test
``tests/runtime/test_wire_bytes.py`` counts the bytes the runtime actually moves (from the
NCCL-semantics harness trace) and asserts they equal :func:`wire_bytes` for the same plan.

Conventions, per device and optimizer step, with b the bytes of the element type:

- point-to-point: the sender counts n*b (a receive counts 0, so link totals are not doubled);
- a collective over a group of t devices, per member: all-reduce 2(t-1)/t*n*b (ring: reduce-scatter
  + all-gather), reduce-scatter and all-gather (t-1)/t of the full buffer, broadcast (t-1)/t*n*b
  (the t-1 receivers' copies spread over the members).

Link classes and what the runtime sends over them (M = micro_batch * seq_len * H elements;
b_act = the activation dtype: the autocast dtype under mixed precision; b_red = ``plan.reduce_dtype``
or b_act; b_par = b_act, the dtype parameters are gathered in):

- ``pp`` per micro-batch and stage boundary, forward (activation) and backward (its gradient):
  leader path: the sending leader M*b_act, then a broadcast in the receiving TP group (t' > 1);
  scatter/gather path (equal TP t > 1): every sending rank c = ceil(M/t) elements, then an
  all-gather of t*c in the receiving TP group.
- ``tp`` per micro-batch, layer and TP rank (t > 1): 4 all-reduces of M (2 forward: after attention
  and MLP; 2 backward: the inputs of q/k/v and gate/up), 5 with recomputation (torch's
  non-reentrant checkpoint stops before the MLP's all-reduce: ``cost.model.RECOMPUTE_TP_SHARE``);
  plus, vocabulary-parallel, one all-reduce of M after the embedding (first stage) and, on the last
  stage, one of M for the head's input gradient and the cross-entropy's two of B_mb*S and 2*B_mb*S
  scalars in b_loss (float32, float64 for a float64 model).
- ``dp`` per step (k pipelines > 1): each rank's share of the gradient: its TP shard of the stage's
  matrices (exact uneven head / FFN splits), its vocabulary rows of the embedding (first stage) and
  LM head (last stage), plus, on the stage leader only, the replicated norms = n_local:
  ddp: all-reduce 2(k-1)/k*n_local*b_red, then the leader broadcasts the stage's replicated
  gradients in its TP group; zero2: reduce-scatter (k-1)/k*n_local*b_red, all-gather of the updated
  parameters (k-1)/k*n_local*b_par, then the replicated parameters' TP broadcast at b_par (also
  with one pipeline, k = 1: under ZeRO only the leader steps them). Exact when k divides every
  bucket (the runtime pads each bucket to a multiple of k: fewer than k elements per bucket more).
  zero3's bytes are priced by the time model, not here; its block transfers are counted by
  :func:`zero3_served_uses` (each use of a block by a device: one chunk from every holder of it in
  the other pipelines).
  A tied embedding (``tie_word_embeddings``) is one parameter: the first stages hold it for the
  sync (a last stage's copy is not synchronised), and in every pipeline of 2+ stages each
  first-stage rank and last-stage rank whose vocabulary rows overlap exchange those rows
  (runtime/tied_embeddings.py), at b_master, the dtype parameters and their gradients are stored
  in (float32 under bf16-mixed): both send n_rows*H*b_master (the gradient sum), then the first
  sends n_rows*H*b_master again (the summed gradient under ddp with k > 1, the updated weights
  under ZeRO, whatever k). Counted as ``dp``: it is part of the step's gradient synchronisation.
"""

from __future__ import annotations

import math

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost.model import RECOMPUTE_TP_SHARE
from lightning_hexiscale.planner.plan import Plan, Stage

CLASSES = ("pp", "tp", "dp")


def local_matrix_params(model: LlamaConfig, tp: int, tp_rank: int) -> int:
    """Elements of one layer's matmul weights held by TP rank ``tp_rank`` of ``tp`` (uneven splits
    in whole KV groups and FFN columns, as the runtime shards them)."""
    h, d, g = model.hidden_size, model.head_dim, model.heads_per_kv
    s, e = model.kv_head_split(tp)[tp_rank]
    f0, f1 = model.ffn_split(tp)[tp_rank]
    kv = e - s
    return h * (2 * kv * g * d + 2 * kv * d) + 3 * h * (f1 - f0)


def stage_replicated_params(model: LlamaConfig, num_layers: int, last: bool) -> int:
    """Elements replicated on every rank of a stage: 2 norms per layer and the final norm."""
    return (num_layers * 2 + (1 if last else 0)) * model.hidden_size


def local_vocab_params(model: LlamaConfig, tp: int, tp_rank: int, first: bool, last: bool) -> int:
    """This TP rank's vocabulary rows of the embedding (first stage) and the untied LM head (last)
    that the gradient sync covers (a tied head is the embedding: synchronised on the first stage)."""
    a, b = model.vocab_split(tp)[tp_rank]
    return (b - a) * model.hidden_size * (int(first) + int(last and not model.tie_word_embeddings))


def tied_pairs(model: LlamaConfig, first: Stage, last: Stage) -> list[tuple[int, int, int]]:
    """[(first-stage device, last-stage device, rows)] of one pipeline's tied-embedding exchange:
    every pair whose vocabulary rows overlap, with the number of overlapping rows (empty when the
    model is untied or the stages are one)."""
    if not model.tie_word_embeddings or first is last:
        return []
    out = []
    for a, (a0, a1) in zip(first.devices, model.vocab_split(first.tp)):
        for b, (b0, b1) in zip(last.devices, model.vocab_split(last.tp)):
            if min(a1, b1) > max(a0, b0):
                out.append((a, b, min(a1, b1) - max(a0, b0)))
    return out


def tied_phases(dp_sharding: str, num_pipelines: int) -> tuple[int, int]:
    """(two-way exchanges, one-way first->last copies) of the tied rows per optimizer step: the
    gradient sum, then the summed gradient (ddp, 2+ pipelines) or the updated weights (ZeRO)."""
    return 1, int(dp_sharding != "ddp" or num_pipelines > 1)


def zero3_served_uses(plan: Plan) -> dict[tuple[int, int], int]:
    """{(holder, user): block uses of ``user`` per optimizer step that ``holder`` serves} under ZeRO-3
    (runtime/zero3.py): a device uses each block of its stage twice per micro-batch of its own
    pipeline (forward, backward; a recomputed forward re-uses the backward's gather), and for each
    use every device of another pipeline that holds a part of its TP shard of that block (even
    splits) sends it that part, one send per use. A holder therefore serves a user
    2 * n_mb(user's pipeline) times per shared block, whatever its own pipeline's n_mb."""
    out: dict[tuple[int, int], int] = {}
    pipes = plan.pipelines
    for i, user_pipe in enumerate(pipes):
        uses = 2 * user_pipe.num_micro_batches
        for st in user_pipe.stages:
            for k, other in enumerate(pipes):
                if k == i:
                    continue
                for h in other.stages:
                    shared = min(st.layers[1], h.layers[1]) - max(st.layers[0], h.layers[0])
                    if shared <= 0:
                        continue
                    for r, d in enumerate(st.devices):
                        for r2, d2 in enumerate(h.devices):
                            if max(r / st.tp, r2 / h.tp) < min((r + 1) / st.tp, (r2 + 1) / h.tp):
                                out[(d2, d)] = out.get((d2, d), 0) + uses * shared
    return out


def wire_bytes(plan: Plan, model: LlamaConfig, act_bytes: int, reduce_bytes: int | None = None,
               param_bytes: int | None = None, loss_bytes: int = 4,
               master_bytes: int | None = None) -> dict[int, dict[str, float]]:
    """{device: {"pp", "tp", "dp": bytes sent per optimizer step}} (conventions in the module doc);
    ``master_bytes``: the stored parameters' dtype (default ``act_bytes``), which only the tied
    embedding's exchange uses."""
    if plan.dp_sharding == "zero3":
        raise ValueError("wire_bytes covers ddp and zero2; zero3's per-use gathers are priced by the time model")
    b_act = act_bytes
    b_master = master_bytes or act_bytes
    b_red = reduce_bytes or act_bytes
    b_par = param_bytes or act_bytes
    out = {d: dict.fromkeys(CLASSES, 0.0) for d in plan.device_order}
    k = plan.num_pipelines
    seq, hid = model.seq_len, model.hidden_size
    for pipe in plan.pipelines:
        n_mb, m = pipe.num_micro_batches, pipe.micro_batch_size * seq * hid
        stages = pipe.stages
        two_way, one_way = tied_phases(plan.dp_sharding, k)
        for a, b, rows in tied_pairs(model, stages[0], stages[-1]):
            out[a]["dp"] += (two_way + one_way) * rows * hid * b_master
            out[b]["dp"] += two_way * rows * hid * b_master
        for j, st in enumerate(stages):
            t, l = st.tp, st.num_layers
            first, last = j == 0, j == len(stages) - 1
            if t > 1:  # tensor parallelism inside the stage
                ar = l * (4 + 2 * RECOMPUTE_TP_SHARE * pipe.recompute) + int(first) + int(last)
                tokens = pipe.micro_batch_size * seq
                for d in st.devices:
                    out[d]["tp"] += n_mb * 2 * (t - 1) / t * (ar * m * b_act + last * 3 * tokens * loss_bytes)
            if j + 1 < len(stages):  # the boundary to the next stage, both directions
                nxt = stages[j + 1]
                for src, dst in ((st, nxt), (nxt, st)):
                    if src.tp == dst.tp > 1:
                        c = math.ceil(m / src.tp)
                        for d in src.devices:
                            out[d]["pp"] += n_mb * c * b_act
                        for d in dst.devices:
                            out[d]["pp"] += n_mb * (dst.tp - 1) * c * b_act
                    else:
                        out[src.leader]["pp"] += n_mb * m * b_act
                        if dst.tp > 1:
                            for d in dst.devices:
                                out[d]["pp"] += n_mb * (dst.tp - 1) / dst.tp * m * b_act
            repl = stage_replicated_params(model, l, last)
            if k == 1:
                if plan.dp_sharding != "ddp" and t > 1:  # ZeRO: the leader alone steps them, even unshared
                    for d in st.devices:
                        out[d]["dp"] += (t - 1) / t * repl * b_par
                continue
            for r, d in enumerate(st.devices):
                n_local = (l * local_matrix_params(model, t, r) + local_vocab_params(model, t, r, first, last)
                           + (repl if r == 0 else 0))
                if plan.dp_sharding == "ddp":
                    out[d]["dp"] += 2 * (k - 1) / k * n_local * b_red
                    if t > 1:
                        out[d]["dp"] += (t - 1) / t * repl * b_red
                else:
                    out[d]["dp"] += (k - 1) / k * n_local * (b_red + b_par)
                    if t > 1:
                        out[d]["dp"] += (t - 1) / t * repl * b_par
    return out
