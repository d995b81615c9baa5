"""Peak memory of a stage, phase by phase, as the runtime allocates it (the memory half of the cost
model; ``estimate()`` checks every stage of a plan against its devices, the search and the oracle
bound layer counts with :meth:`MemoryTerms.max_layers`).

Parameters, gradients and optimizer states are priced in the parameters' storage dtype P
(``Workload.param_bytes``), activations and messages in the compute dtype B (``Workload.dtype_bytes``);
the per-term formulas are named functions of :mod:`.model`, measured on the CPU runtime
(``benchmarks/bench_zero.py``, ``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_hexiscale.config.buffers import BUCKET_CAP_BYTES
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost.communicators import communicators_lower_bound

if TYPE_CHECKING:
    from lightning_hexiscale.planner.cost.workload import Workload


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on each device of a stage, phase by phase, each affine in the stage's layer count l:
    the peak is max over phases of ``fixed + l * per_layer``. Phases: the backward (states,
    stored activations, autograd working set, logits), the gradient sync (states, communication
    buckets) and the optimizer step (states, its temporaries)."""

    phases: tuple[tuple[float, float], ...]
    """((fixed, per_layer), ...) in bytes."""

    def peak(self, layers: int) -> float:
        return max(f + layers * p for f, p in self.phases)

    def max_layers(self, usable_bytes: float) -> int:
        """The most layers that fit in ``usable_bytes`` in every phase (0 if none)."""
        most = math.inf
        for f, p in self.phases:
            if f > usable_bytes:
                return 0
            if p > 0:
                most = min(most, math.floor((usable_bytes - f) / p * (1 - 1e-12)))
        return int(min(most, 1 << 30))


def stage_memory_terms(workload: Workload, sharding: str, num_pipelines: int, schedule: str, recompute: bool,
                       num_stages: int, j: int, tp: int, mb: int, n_mb: int,
                       communicators: int | None = None) -> MemoryTerms:
    """Memory of stage j of a pipeline of ``num_stages`` stages; see :func:`stage_memory_at` (the
    position matters only through first / last stage and the in-flight micro-batches)."""
    return stage_memory_at(workload, sharding, num_pipelines, recompute, j == 0, j == num_stages - 1,
                           cm.inflight_micro_batches(schedule, num_stages, j, n_mb), tp, mb, communicators)


def stage_memory_at(workload: Workload, sharding: str, num_pipelines: int, recompute: bool, first: bool,
                    last: bool, inflight: int, tp: int, mb: int, communicators: int | None = None) -> MemoryTerms:
    """Bytes on each device of a stage of TP ``tp`` holding ``inflight`` micro-batches of ``mb``
    sequences at its peak, as the runtime allocates them (each term a named function of
    :mod:`cost.model`). Parameters, gradients and optimizer states are priced in the parameters'
    storage dtype P (``workload.param_bytes``: float32 under bf16-mixed), activations and messages
    in the compute dtype B:

    - in every phase: the parameters' states (weights, gradients, optimizer;
      :func:`cost.model.runtime_state_bytes_per_param`) of the stage's layers, of the embedding
      (first stage) and of the final norm and LM head (last stage; vocabulary-parallel: V/t rows per
      TP rank), ``reserve_bytes``, and on CUDA the collective
      library's buffers for each communicator the device joins (:func:`cost.model.comm_buffer_bytes`):
      ``communicators`` where the caller counted them (:mod:`.communicators`, as ``estimate()``
      does), else the lower bound the search uses (world, TP group, pipeline neighbours, one
      data-parallel group; asymmetric TP joins more);
    - backward: ZeRO-3's gathered current and prefetched layer, the stored activations of the
      in-flight micro-batches (each layer's input when
      recomputing, else :func:`cost.model.stored_activation_bytes`), the working set of the layer
      being back-propagated (its recomputed activations when recomputing, plus
      :func:`cost.model.backward_working_bytes`), the loss's float32 logits on the last stage
      (:func:`cost.model.logits_bytes`) and, under mixed precision, autocast's bf16 weight casts
      (:func:`cost.model.autocast_weight_bytes`); less, per layer, the smaller of one
      micro-batch's stored tensors and the layer's gradient (gradients are None at the start of a
      step and appear as the first backward frees what it consumed);
    - gradient sync: DDP's bucket copies of every synchronised gradient, ZeRO's two buckets in
      flight (:func:`cost.model.ddp_bucket_bytes`, :func:`cost.model.zero_window_bytes`; a bucket
      is the cap or one whole segment when that is larger, within one unit: :func:`bucket_elements`;
      mixed precision concatenates it in P before the cast);
    - optimizer step: Adam's temporaries (:func:`cost.model.optimizer_temp_bytes`): one float32
      state per parameter stepped at once (all of them with the multi-tensor step on CUDA, one
      bucket under ZeRO, the largest parameter with the CPU's single-tensor step).
    """
    s = _stage_static(workload, sharding, max(num_pipelines, 1), recompute, first, last, tp, communicators)
    return MemoryTerms((_backward_phase(s, sharding, recompute, last, inflight, mb),) + s.later_phases)


@dataclass(frozen=True)
class _StageStatic:
    """What a stage's memory reads that is the same for every micro-batch size and in-flight count:
    computed once per (workload, sharding, pipelines, recompute, first, last, tp, communicators) by
    :func:`_stage_static` (the search asks for the same stage shape with hundreds of (m, n) pairs)."""

    model: LlamaConfig
    tp: int
    bt: int
    pb: int
    mixed: bool
    fast: object  # ResolvedFastPath
    layer_local: float
    matmul_local: float
    vfrac: float
    head_matmul: float
    main_head: float
    backward_states: tuple[float, float]
    later_phases: tuple[tuple[float, float], ...]
    """The gradient-sync and optimizer-step phases (independent of m and n)."""


@functools.lru_cache(maxsize=1 << 14)
def _stage_static(workload: Workload, sharding: str, P: int, recompute: bool, first: bool, last: bool, tp: int,
                  communicators: int | None) -> _StageStatic:
    model = workload.model
    bt, pb, mixed = workload.dtype_bytes, workload.param_bytes, workload.mixed
    H, F = model.hidden_size, model.ffn_hidden_size
    K = workload.optimizer_bytes_per_param
    frac = shard_fraction(model, tp)
    layer_local = model.layer_params * frac
    # vocabulary-parallel: this rank's V/t rows of the embedding (first stage) and of the LM head
    # (last stage; a tied head is the embedding itself on a one-stage pipeline, a copy elsewhere)
    vfrac = model.max_vocab_fraction(tp)
    head_matmul = (model.vocab_size * H * vfrac) if last else 0.0
    extra_params = ((model.embedding_params * vfrac if first else 0.0)
                    + (model.hidden_size + (model.stage_head_params(is_first=first) - model.hidden_size) * vfrac
                       if last else 0.0))
    comms = communicators_lower_bound(tp, first, last, P) if communicators is None else communicators
    common = workload.reserve_bytes + (cm.comm_buffer_bytes(comms, workload.comm_buffer_bytes)
                                       if workload.device == "cuda" else 0.0)
    fast = workload.fast_path.resolve(workload.device, mixed, sharding, recompute)
    matmul_local = model.layer_matmul_params * frac
    # main grads: compute copies of the block linears and of an untied head (backward phase only)
    main_head = head_matmul if fast.main_grads and not model.tie_word_embeddings else 0.0

    def states(phase: str) -> tuple[float, float]:
        spp = cm.runtime_state_bytes_per_param(sharding, P, bt, K, phase, recompute, pb)
        return common + extra_params * spp, layer_local * spp

    # gradient-sync / ZeRO buckets: the cap (in parameter elements) or one whole segment when that
    # is larger, never more than its unit; sent in the reduce / wire dtype B; mixed precision first
    # concatenates a bucket in P, then casts
    bucket = bucket_elements(BUCKET_CAP_BYTES,  # the runtime's cap: one constant for both
                              pb, stage_bucket_units(model, tp, first, last))
    window = cm.zero_window_bytes(bucket * bt) + (bucket * pb if mixed else 0.0)
    phases = []
    # gradient sync between pipelines: DDP's bucket copies (in the reduce dtype, B_type by
    # default), ZeRO's buckets in flight
    if P > 1:
        fixed, per = states("sync")
        if sharding == "ddp":
            phases.append((fixed + cm.ddp_bucket_bytes(extra_params, bt) + (bucket * pb if mixed else 0.0),
                           per + cm.ddp_bucket_bytes(layer_local, bt)))
        else:
            phases.append((fixed + window, per))
    # optimizer step: Adam's temporaries (one state-sized temporary per parameter stepped at once;
    # states in the parameters' dtype, at least float32 where K counts fp32 masters besides them)
    fixed, per = states("step")
    state_b = max(4, pb) if K > 2 * pb else pb
    if sharding != "ddp":
        phases.append((fixed + window + cm.optimizer_temp_bytes(bucket, state_b), per))
    elif workload.device == "cuda":
        phases.append((fixed + cm.optimizer_temp_bytes(extra_params, state_b),
                       per + cm.optimizer_temp_bytes(layer_local, state_b)))
    else:
        largest = max(H * F / tp, model.vocab_size * vfrac * H if (first or last) else 0)
        phases.append((fixed + cm.optimizer_temp_bytes(largest, state_b), per))
    return _StageStatic(model, tp, bt, pb, mixed, fast, layer_local, matmul_local, vfrac, head_matmul, main_head,
                        states("backward"), tuple(phases))


def _backward_phase(s: _StageStatic, sharding: str, recompute: bool, last: bool, inflight: int,
                    mb: int) -> tuple[float, float]:
    """(fixed, per_layer) bytes of the backward phase: stored activations, the working set of the
    layer in its backward, the logits, and under mixed precision autocast's one bf16 copy of every
    matmul weight."""
    model, bt, pb, mixed, fast = s.model, s.bt, s.pb, s.mixed, s.fast
    H, F = model.hidden_size, model.ffn_hidden_size
    tokens = mb * model.seq_len
    matmul_local, main_head, head_matmul = s.matmul_local, s.main_head, s.head_matmul
    full = cm.stored_activation_bytes(tokens, H, model.kv_dim, F, s.tp, bt, mixed, fast.cast_once)
    fixed, per = s.backward_states
    if sharding == "zero3":  # the gathered current and next layer (parameter dtype), freed after the backward
        fixed += 2 * s.layer_local * pb
    work = (full if recompute else 0.0) + cm.backward_working_bytes(tokens, H, F, s.tp, bt, pb)
    if last and fast.chunked_loss:
        vocab_local = model.vocab_size * s.vfrac
        fixed += cm.chunked_loss_bytes(tokens, vocab_local, bt, fast.loss_chunk_tokens(round(vocab_local)), inflight)
    elif last:
        work += cm.logits_bytes(tokens, model.vocab_size * s.vfrac)
    # the weights the stored micro-batches' graphs keep for their backward: under mixed precision
    # autocast's bf16 casts, one copy shared by micro-batches 0..n-2 and the last one's own
    # (runtime/schedule.py), or only the recomputed layer's; with main grads the one compute copy
    # of every matmul weight that all graphs share (freed after the last backward); under ZeRO-3 the gathered
    # block parameters themselves, per micro-batch (freeing p.data does not free what autograd saved)
    copies = min(inflight, 2)
    saved_weights = 0.0
    if fast.main_grads:
        fixed += cm.main_grad_copy_bytes(main_head, bt)
        per += cm.main_grad_copy_bytes(matmul_local, bt)
    if mixed:
        work += cm.autocast_weight_bytes(head_matmul - main_head, bt, 1 if recompute else copies)
        if fast.main_grads:
            pass  # no autocast casts of the block linears
        elif recompute:
            work += cm.autocast_weight_bytes(matmul_local, bt)
        else:
            per += cm.autocast_weight_bytes(matmul_local, bt, copies)
            if inflight > 1:
                per += cm.shared_cast_grad_bytes(matmul_local, bt)
    elif sharding == "zero3" and not recompute:
        saved_weights = matmul_local * pb
    # recomputation stores each layer's input: the residual stream, in the parameters' dtype.
    # Gradients are None at the start of a step: a layer's gradient (P per parameter) appears in
    # the first backward that reaches it, which frees that micro-batch's stored tensors of the
    # layer as it goes (its casts too when it is the only one), so the peak holds one of the two.
    stored = (tokens * H * pb if recompute else full) + saved_weights
    freed = stored + (cm.autocast_weight_bytes(matmul_local, bt)
                      if mixed and not recompute and inflight == 1 and not fast.main_grads else 0.0)
    per -= min(freed, s.layer_local * pb)
    return fixed + work, per + inflight * stored


def bucket_elements(cap_bytes: float, param_bytes: float, units: Iterable[tuple[float, float]]) -> float:
    """Elements of the largest bucket a stage packs for its gradient sync or ZeRO collectives:

        max_u  min( n_u, max(cap / P, s_u) )

    over the stage's units u (a transformer block, the embedding, the final norm + LM head) with
    n_u the unit's local elements and s_u its largest segment (``units`` = [(n_u, s_u), ...]),
    cap in bytes and P = ``param_bytes`` per element. The runtime packs a unit's segments into
    buckets of at most the cap, but a bucket holds at least one whole segment
    (``runtime/grad_sync.GradSynchronizer._pack``, ``runtime/zero_layout.build_buckets``), so a
    segment larger than the cap is a bucket of its own size (an 8B layer's 4096 x 14336 MLP shard:
    58.7 M elements, 235 MB in float32, against the 4 MiB cap); and no bucket spans two units.
    Elements (multiply by the dtype's bytes)."""
    cap = cap_bytes / param_bytes
    return max((min(n, max(cap, s)) for n, s in units), default=0.0)


@functools.lru_cache(maxsize=4096)
def stage_bucket_units(model: LlamaConfig, tp: int, first: bool, last: bool) -> tuple[tuple[float, float], ...]:
    """(local elements, largest segment) of each bucket unit on a rank of a TP-``tp`` stage
    (:func:`bucket_elements`): a block's matrices (their largest shard H x max(query rows, FFN
    columns) of this rank is the segment when every pipeline splits the layer alike; unequal TP
    degrees cut smaller ones; the norms are buckets of their own), the embedding's V/t rows on a
    first stage, the untied LM head's V/t rows and the final norm on a last stage."""
    H = model.hidden_size
    kv = max(e - s for s, e in model.kv_head_split(tp))
    ffn = max(e - s for s, e in model.ffn_split(tp))
    widest = H * max(kv * model.heads_per_kv * model.head_dim, ffn)
    units = [(model.layer_matmul_params * shard_fraction(model, tp), float(widest))]
    rows = model.vocab_size * model.max_vocab_fraction(tp) * H
    if first:
        units.append((rows, rows))
    if last and not model.tie_word_embeddings:
        units.append((rows + H, rows))
    return tuple(units)


def usable_memory(workload: Workload, capacity_bytes: float) -> float:
    """Bytes of a device the plan may use: its capacity less the ``memory_headroom`` fraction."""
    return capacity_bytes * (1.0 - workload.memory_headroom)


def shard_fraction(model: LlamaConfig, tp: int) -> float:
    """model.max_shard_fraction(tp), memoised per model shape (the planner calls estimate() often)."""
    key = (model, tp)
    if key not in _FRAC:
        _FRAC[key] = model.max_shard_fraction(tp)
    return _FRAC[key]


_FRAC: dict[tuple[LlamaConfig, int], float] = {}
