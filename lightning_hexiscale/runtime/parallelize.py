"""Turn the plain LLaMA (built on the meta device) into this rank's pipeline stage.

What a rank of stage (layers [a, b), TP degree t, TP rank r) holds, by global parameter name:

- ``embed.weight`` on first stages and ``lm_head.weight`` on last stages: rows
  ``vocab_split(t)[r]`` of the vocabulary (vocabulary-parallel embedding, head and cross-entropy,
  :mod:`.tensor_parallel`; with t = 1 the whole matrix); ``norm.weight`` whole and replicated.
- tied embeddings (``tie_word_embeddings``): there is no ``lm_head.weight``; the head multiplies
  by ``embed.weight``. A stage that is both first and last holds it once; in a pipeline of two or
  more stages the last stage holds a COPY of its rows, also named ``embed.weight``
  (``LocalShard.tied_copy``), kept equal to the first stage's by
  :mod:`lightning_hexiscale.runtime.tied_embeddings`. The copy is not a gradient-sync holder and is
  written to checkpoints by the first stage only.
- for each layer l in [a, b): the two RMSNorm weights, whole and replicated; q/k/v and gate/up
  as column-parallel shards (rows), o and down as row-parallel shards (columns). The ranges come
  from the model's uneven splits: KV heads ``kv_head_split(t)[r] = [s, e)`` give rows
  [s*g*d, e*g*d) of q_proj and o_proj's columns, rows [s*d, e*d) of k_proj / v_proj
  (g = query heads per KV head, d = head dim); ``ffn_split(t)[r]`` gives the FFN columns.

Local parameter names equal the global names (layers live in a ModuleDict keyed by the global layer
index), so a rank's state dict maps to the full model's by name plus a [start, end) range along one
dim: see :class:`ParamSpec`, :func:`stage_shards`, :func:`load_full_state_dict`,
:func:`local_shards` and :func:`assemble_full_state_dict`.

Order of transformations: TP shards replace the meta linears first (shapes only), then the stage is
materialised on its device (only local shards get memory), then initialised or loaded, and
activation recomputation wraps each layer at call time (so it re-runs the TP collectives in
backward, in the same order on every TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama, RMSNorm, RopeCache, TransformerBlock, causal_lm_loss, init_tensor
from lightning_hexiscale.runtime import tensor_parallel as tpl
from lightning_hexiscale.runtime.chunked_loss import chunked_cross_entropy
# the parameter table is torch-free and lives beside the rank layout (one copy for the planner and the runtime)
from lightning_hexiscale.planner.layout import ParamSpec, param_specs, stage_holds  # noqa: F401 (re-exported)

ProcessGroup = torch.distributed.ProcessGroup


@dataclass(frozen=True)
class LocalShard:
    """This rank's piece of a global parameter: [start, end) along ``spec.shard_dim`` (or all of it)."""

    spec: ParamSpec
    start: int
    end: int
    tied_copy: bool = False
    """True for the last stage's copy of a tied embedding in a pipeline of 2+ stages: equal to the
    first stage's rows after every step; counted, synchronised and saved through the first stage."""

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """The local piece of a full-shape tensor (a view)."""
        if self.spec.shard_dim is None:
            return full
        return full.narrow(self.spec.shard_dim, self.start, self.end - self.start)


def stage_shards(config: LlamaConfig, layers: tuple[int, int], is_first: bool, is_last: bool,
                 tp: int, tp_rank: int) -> dict[str, LocalShard]:
    """Global name -> :class:`LocalShard` for every parameter a rank of this stage holds."""
    out = {}
    for spec in param_specs(config):
        if stage_holds(spec, layers, is_first, is_last):
            start, end = spec.ranges(config, tp)[tp_rank]
            out[spec.name] = LocalShard(spec, start, end, tied_copy=spec.place == "tied" and not is_first)
    return out


class _NormIntoTP(RMSNorm):
    """RMSNorm whose output enters the TP region (f): one gradient all-reduce for q, k and v
    (or gate and up) together. Same parameter name and values as the plain RMSNorm.

    Under autocast the output is cast to the autocast dtype here, once, instead of by each of the
    linears it feeds: always under TP, and at TP 1 with ``cast_once`` (the fast path's switch)."""

    def __init__(self, dim: int, eps: float, group: ProcessGroup | None):
        super().__init__(dim, eps)
        self.group = group
        self.cast_once = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if (self.group is not None or self.cast_once) and torch.is_autocast_enabled(y.device.type):
            # The linears would cast to the autocast dtype anyway; casting before f makes f's
            # backward all-reduce run in that dtype too (bf16: the 2 bytes the cost model prices,
            # instead of the float32 gradient of the norm output).
            y = y.to(torch.get_autocast_dtype(y.device.type))
        return tpl.copy_to_tp_region(y, self.group)


def _shard_block(block: TransformerBlock, config: LlamaConfig, tp: int, tp_rank: int,
                 group: ProcessGroup | None) -> None:
    """Replace a (meta) block's norms and linears by their TP versions (shapes only), in place."""
    h, d, g, eps = config.hidden_size, config.head_dim, config.heads_per_kv, config.rms_norm_eps
    kv0, kv1 = config.kv_head_split(tp)[tp_rank]
    f0, f1 = config.ffn_split(tp)[tp_rank]
    nkv = kv1 - kv0
    meta = torch.device("meta")
    with meta:
        block.attn_norm = _NormIntoTP(h, eps, group)
        block.mlp_norm = _NormIntoTP(h, eps, group)
    attn, mlp = block.attn, block.mlp
    attn.q_proj = tpl.ColumnParallelLinear(h, nkv * g * d, group, copy_input=False, device=meta)
    attn.k_proj = tpl.ColumnParallelLinear(h, nkv * d, group, copy_input=False, device=meta)
    attn.v_proj = tpl.ColumnParallelLinear(h, nkv * d, group, copy_input=False, device=meta)
    attn.o_proj = tpl.RowParallelLinear(nkv * g * d, h, group, device=meta)
    attn.num_heads, attn.num_kv_heads = nkv * g, nkv
    mlp.gate_proj = tpl.ColumnParallelLinear(h, f1 - f0, group, copy_input=False, device=meta)
    mlp.up_proj = tpl.ColumnParallelLinear(h, f1 - f0, group, copy_input=False, device=meta)
    mlp.down_proj = tpl.RowParallelLinear(f1 - f0, h, group, device=meta)


class StageModule(nn.Module):
    """One rank's part of one pipeline stage.

    ``forward(x)``: x is tokens (B, S) on a first stage, else the hidden state (B, S, H) received
    from the previous stage; returns, on a last stage, this rank's vocabulary columns of the logits
    (B, S, V_r) (all V with TP 1), else the hidden state. ``loss(logits, targets)``: the mean token
    cross-entropy, vocabulary-parallel over the TP group (:func:`tpl.vocab_parallel_cross_entropy`).
    """

    def __init__(self, config: LlamaConfig, layers: tuple[int, int], is_first: bool, is_last: bool,
                 tp: int, tp_rank: int, blocks: dict[str, TransformerBlock], embed: nn.Module | None,
                 norm: nn.Module | None, lm_head: nn.Module | None, recompute: bool = False,
                 tp_group: ProcessGroup | None = None):
        super().__init__()
        self.config, self.layer_range = config, layers
        self.is_first, self.is_last, self.tp, self.tp_rank = is_first, is_last, tp, tp_rank
        self.recompute = recompute
        self.tp_group = tp_group
        self.vocab_start = config.vocab_split(tp)[tp_rank][0]
        self.embed = embed
        self.layers = nn.ModuleDict(blocks)
        self.norm, self.lm_head = norm, lm_head
        self.rope = RopeCache(config)
        self.loss_chunk_tokens: int | None = None
        """Set (by the fast path's ``chunked_loss``): :meth:`loss` runs in chunks of this many tokens."""

    def shards(self) -> dict[str, LocalShard]:
        """Global name -> local piece, for every parameter of this module."""
        return stage_shards(self.config, self.layer_range, self.is_first, self.is_last, self.tp, self.tp_rank)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of this micro-batch (last stages; equal on every TP rank)."""
        if self.loss_chunk_tokens is not None:
            return chunked_cross_entropy(logits, targets, self.vocab_start, self.tp_group if self.tp > 1 else None,
                                         self.loss_chunk_tokens)
        if self.tp > 1:
            return tpl.vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.tp_group)
        return causal_lm_loss(logits, targets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.is_first else x
        # RoPE tables in the norm's compute dtype (float32, or float64 for a float64 model), cached.
        cos, sin = self.rope(h.shape[1], h.device, torch.promote_types(h.dtype, torch.float32))
        for block in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                # Non-reentrant checkpoint: keeps only the block input, re-runs the block (and its
                # TP all-reduces) in backward; works with inputs that do not require grad.
                h = checkpoint(block, h, cos, sin, use_reentrant=False)
            else:
                h = block(h, cos, sin)
        if self.is_last:
            return self.lm_head(self.norm(h))
        return h


def build_stage(model: Llama, layers: tuple[int, int], is_first: bool, is_last: bool, tp: int, tp_rank: int,
                tp_group: ProcessGroup | None, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, recompute: bool = False, seed: int | None = 0) -> StageModule:
    """This rank's :class:`StageModule`, cut out of ``model`` (a :class:`Llama` on the meta device;
    its blocks are modified in place and reused, so build a fresh meta model per stage).

    Only the local shards are materialised, on ``device`` in ``dtype``. With ``seed`` they are
    initialised to the slices of :func:`init_tensor` (bit-identical to ``Llama.init_weights(seed)``);
    with ``seed=None`` they are left uninitialised (load a state dict next).
    ``tp_group`` must be the stage's TP group when ``tp > 1`` (``None`` for TP 1).
    """
    config = model.config
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("build_stage expects the plain Llama on the meta device: build it under "
                         "torch.device('meta') so that only this rank's shards get memory")
    if tp > 1 and tp_group is None:
        raise ValueError(f"a stage with TP degree {tp} needs its TP process group")
    group = tp_group if tp > 1 else None
    blocks = {}
    for layer in range(*layers):
        block = model.layers[layer]
        _shard_block(block, config, tp, tp_rank, group)
        blocks[str(layer)] = block
    embed, head = _vocab_modules(config, is_first, is_last, tp, tp_rank, group)
    stage = StageModule(config, layers, is_first, is_last, tp, tp_rank, blocks, embed,
                        model.norm if is_last else None, head, recompute, group)
    stage.to(dtype=dtype)  # still meta: free
    stage.to_empty(device=device)
    if seed is not None:
        init_stage_weights(stage, seed)
    return stage


def _vocab_modules(config: LlamaConfig, is_first: bool, is_last: bool, tp: int, tp_rank: int,
                   group: ProcessGroup | None) -> tuple[nn.Module | None, nn.Module | None]:
    """(embedding, LM head) of a stage, on the meta device, over this rank's vocabulary rows.

    The embedding exists on first stages, and on last stages of a tied model (there it only holds
    the tied copy the head multiplies by). The head of a tied model owns no parameter.
    """
    v0, v1 = config.vocab_split(tp)[tp_rank]
    h, tied = config.hidden_size, config.tie_word_embeddings
    meta = torch.device("meta")
    embed = head = None
    if is_first or (is_last and tied):
        embed = tpl.VocabParallelEmbedding(v0, v1, h, group, device=meta)
    if is_last:
        head = (tpl.VocabParallelHead(group, tied_to=embed) if tied else
                tpl.VocabParallelHead(group, weight=nn.Parameter(torch.empty(v1 - v0, h, device=meta))))
    return embed, head


@torch.no_grad()
def init_stage_weights(stage: StageModule, seed: int) -> None:
    """Each local parameter := its slice of ``init_tensor(global name, full shape, seed)``.

    Draws the full tensor of one parameter at a time on CPU (a transient of one full parameter),
    which is what makes the result independent of the TP degree.
    """
    shards = stage.shards()
    for name, p in stage.named_parameters():
        shard = shards[name]
        full = init_tensor(name, shard.spec.shape, seed, p.dtype)
        p.copy_(shard.slice_of(full))


@torch.no_grad()
def load_full_state_dict(stage: StageModule, state) -> None:
    """Copy this rank's pieces out of a full (global-name) state dict.

    ``state`` maps global names to full tensors; if it also has ``read_slice(name, dim, start,
    end)`` (:class:`lightning_hexiscale.data.weights.HFWeights`), only this rank's rows (or columns)
    are read from disk, and ``shape_of(name)`` is checked instead of reading the full tensor.
    """
    shards = stage.shards()
    read_slice = getattr(state, "read_slice", None)
    for name, p in stage.named_parameters():
        if name not in state:
            raise KeyError(f"state dict has no entry {name!r} needed by this stage")
        shard = shards[name]
        if read_slice is not None:
            shape = tuple(state.shape_of(name))
            if shape != shard.spec.shape:
                raise ValueError(f"{name}: state dict shape {shape} != model shape {shard.spec.shape}")
            dim = shard.spec.shard_dim
            piece = read_slice(name, dim, shard.start, shard.end) if dim is not None else state[name]
            p.copy_(piece.to(p.device))
            continue
        full = state[name]
        if tuple(full.shape) != shard.spec.shape:
            raise ValueError(f"{name}: state dict shape {tuple(full.shape)} != model shape {shard.spec.shape}")
        p.copy_(shard.slice_of(full.to(p.device)))


def local_shards(stage: StageModule, grads: bool = False) -> dict[str, tuple[torch.Tensor, int | None, int, int]]:
    """Global name -> (local tensor, shard dim or None, start, end): the inverse of
    :func:`load_full_state_dict`. With ``grads`` the tensors are the gradients (zeros when None)."""
    shards = stage.shards()
    out = {}
    for name, p in stage.named_parameters():
        t = p.detach() if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
        s = shards[name]
        out[name] = (t, s.spec.shard_dim, s.start, s.end)
    return out


def assemble_full_state_dict(pieces: list[dict[str, tuple[torch.Tensor, int | None, int, int]]],
                             config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Full tensors from the :func:`local_shards` of several ranks (any plan; the first piece of a
    region wins where pipelines overlap). Raises if some element of some parameter is missing."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    shapes = {s.name: s.shape for s in param_specs(config)}
    for piece in pieces:
        for name, (t, dim, start, end) in piece.items():
            if name not in out:
                out[name] = torch.zeros(shapes[name], dtype=t.dtype)
                covered[name] = torch.zeros(shapes[name][0] if dim is None else shapes[name][dim], dtype=torch.bool)
            if dim is None:
                out[name].copy_(t.cpu())
                covered[name][:] = True
            else:
                out[name].narrow(dim, start, end - start).copy_(t.cpu())
                covered[name][start:end] = True
    missing = [n for n in shapes if n not in covered or not bool(covered[n].all())]
    if missing:
        raise ValueError(f"pieces do not cover the model: missing (parts of) {missing[:5]}")
    return out
