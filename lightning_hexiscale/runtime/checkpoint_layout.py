"""Which boxes of which global tensors a rank writes to, and reads from, a checkpoint (no I/O here).

The checkpoint is a set of global tensors by name, each the FULL shape of the plain
:class:`~lightning_hexiscale.models.llama.Llama`'s parameter, whatever plan saved it:

- ``model.<param>``: the parameter;
- ``optim.<key>.<param>``: an optimizer state tensor (``exp_avg``, ``exp_avg_sq``, ... of the
  parameter's shape; ``step`` and other 0-dim tensors with shape ``()``);
- ``optim_py.<key>.<param>``: a Python number of the state (int64 / float64 / bool, shape ``()``).

Each rank contributes :class:`Piece` s: a box (global offsets + sizes) of one global tensor and a
VIEW of the local memory holding it (no copy). Every element of every tensor is written by exactly
one rank (torch.distributed.checkpoint's planner checks that the boxes neither overlap nor leave a
gap), and no rank touches another rank's memory:

- ``dp_sharding=ddp``: every pipeline holds the whole model. The checkpoint is cut into the gradient
  segments of :func:`~lightning_hexiscale.runtime.topology.sync_segments` (the union of all
  pipelines' TP boundaries, so a segment lies inside one TP shard of every pipeline); segment i is
  written by its holder ``ranks[i % k]`` (one holder per pipeline), which spreads the writes over
  the replicas instead of leaving them all to pipeline 0. Replicated tensors (norms, embedding, LM
  head) are held by the TP leaders only, so each is written once.
- ``zero2`` / ``zero3``: a rank writes exactly the chunks it owns (:mod:`.zero_layout`): the optimizer
  state it alone holds, and the same elements of the parameters (ZeRO-3: its master chunks, the
  only copy). A chunk is a flat range of a bucket; inside one item (a rectangular region of one
  local parameter) a flat range is at most ``2 * ndim - 1`` boxes (:func:`flat_range_boxes`).

Reading is the mirror image with the CURRENT plan's pieces: whole local shards (params, and the
optimizer state under ddp), or the owned chunks (ZeRO optimizer state and ZeRO-3 masters);
DCP's planner intersects them with the saved boxes, whatever plan wrote those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.runtime.parallelize import LocalShard

MODEL, OPTIM, OPTIM_PY = "model", "optim", "optim_py"
"""Name spaces of the checkpoint's global tensors."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box inside a tensor."""


def model_fqn(name: str) -> str:
    return f"{MODEL}.{name}"


def optim_fqn(key: str, name: str, python: bool = False) -> str:
    return f"{OPTIM_PY if python else OPTIM}.{key}.{name}"


@dataclass(frozen=True)
class Piece:
    """A box of one global tensor and the local memory that holds it."""

    fqn: str
    """Global tensor name (see the module doc)."""
    offsets: tuple[int, ...]
    """Offsets of the box in the global tensor."""
    shape: tuple[int, ...]
    """Full shape of the global tensor."""
    tensor: torch.Tensor
    """This rank's box (``tensor.shape`` = the box's sizes): a view of live memory."""

    @property
    def key(self) -> str:
        """Unique per rank: a rank's boxes of one tensor never overlap, so their offsets differ."""
        return f"{self.fqn}@{','.join(map(str, self.offsets))}"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


# ---- box arithmetic -------------------------------------------------------------------------------
def flat_range_boxes(shape: tuple[int, ...], start: int,
                     end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes (offsets, sizes, flat start) tiling the row-major flat range [start, end) of a tensor of
    ``shape``, in flat order; each box is itself a contiguous run of that order. For a matrix:
    the tail of the first row, the whole rows, the head of the last row (at most 3 boxes).

    >>> flat_range_boxes((3, 4), 2, 11)
    [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 3), 8)]
    """
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    inner = math.prod(shape[1:])

    def part_of_row(r: int, a: int, b: int):
        return [((r, *o), (1, *z), r * inner + f) for o, z, f in flat_range_boxes(shape[1:], a, b)]

    first, last = start // inner, (end - 1) // inner
    if first == last:
        return part_of_row(first, start - first * inner, end - first * inner)
    out = []
    if start % inner:
        out += part_of_row(first, start % inner, inner)
        first += 1
    full_end = end // inner  # rows [first, full_end) are whole
    if full_end > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (full_end - first, *shape[1:]), first * inner))
    if end % inner:
        out += part_of_row(full_end, 0, end % inner)
    return out


def narrow_box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box of ``t`` (a view)."""
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        if o != 0 or s != t.shape[d]:
            t = t.narrow(d, o, s)
    return t


def local_box(shard: LocalShard) -> Box:
    """Where this rank's whole local piece of the parameter sits in the full tensor."""
    spec = shard.spec
    offsets, sizes = [0] * len(spec.shape), list(spec.shape)
    if spec.shard_dim is not None:
        offsets[spec.shard_dim], sizes[spec.shard_dim] = shard.start, shard.end - shard.start
    return tuple(offsets), tuple(sizes)


def _shift(base: tuple[int, ...], offsets: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b + o for b, o in zip(base, offsets))


# ---- ddp: segments, one writer each ---------------------------------------------------------------
def ddp_write_boxes(engine) -> dict[str, list[tuple[Box, Box]]]:
    """name -> [(global box, box in the local tensor)] that THIS rank writes under ddp."""
    rank = engine.topology.rank
    shards = engine.stage.shards()
    out: dict[str, list[tuple[Box, Box]]] = {}
    for i, seg in enumerate(engine.topology.segments):
        if seg.ranks[i % len(seg.ranks)] != rank:
            continue
        shard = shards[seg.name]
        goff, gsize = local_box(shard)
        loff = [0] * len(gsize)
        if seg.shard_dim is not None:
            d = seg.shard_dim
            goff, gsize = list(goff), list(gsize)
            goff[d], gsize[d], loff[d] = seg.start, seg.end - seg.start, seg.start - shard.start
        out.setdefault(seg.name, []).append(((tuple(goff), tuple(gsize)), (tuple(loff), tuple(gsize))))
    return out


# ---- zero: owned chunks ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkBox:
    """One box of an owned ZeRO chunk."""

    bucket: int
    name: str
    offsets: tuple[int, ...]
    """Global offsets."""
    sizes: tuple[int, ...]
    chunk_pos: int
    """Position of the box's first element in the chunk (the box is a contiguous run of the chunk)."""
    region_offsets: tuple[int, ...]
    """Offsets of the box inside the item's region of the local parameter."""
    item: Any
    """The :class:`~lightning_hexiscale.runtime.zero_layout.Item`."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def zero_chunk_boxes(sharder) -> list[ChunkBox]:
    """Every box of every chunk this rank owns, bucket by bucket (:class:`ZeroSharder` layout)."""
    shards = sharder.stage.shards()
    out = []
    for i, b in enumerate(sharder.buckets):
        lo = b.index * b.chunk
        for j, a, e in b.owned_items():
            it, off = b.items[j], b.offsets[j]
            base, rshape = local_box(shards[it.name])
            rshape = list(rshape)
            if it.dim is not None:
                rshape[it.dim] = it.length
                base = tuple(it.global_start if d == it.dim else o for d, o in enumerate(base))
            s = lo + a - off  # the owned range in the item's own flat order
            for o, z, f in flat_range_boxes(tuple(rshape), s, lo + e - off):
                out.append(ChunkBox(i, it.name, _shift(base, o), z, a + f - s, o, it))
    return out


def _item_region(p: torch.Tensor, it) -> torch.Tensor:
    return p if it.dim is None else p.narrow(it.dim, it.start, it.length)


def _run_of(runs: list[tuple[int, int, int]], pos: int, numel: int) -> int:
    for r, (a, e, _g) in enumerate(runs):
        if a <= pos and pos + numel <= e:
            return r
    raise AssertionError(f"chunk range [{pos}, {pos + numel}) crosses an optimizer run {runs}")


# ---- state classification -------------------------------------------------------------------------
def _classify(key: str, value: Any, numel: int, where: str) -> str | None:
    """``"vector"`` (one value per element), ``"scalar"`` (0-dim tensor), ``"python"`` or ``None`` (skip)."""
    if value is None:
        return None
    if torch.is_tensor(value):
        if value.dim() == 0:
            return "scalar"
        if value.numel() == numel:
            return "vector"
    elif isinstance(value, (bool, int, float)):
        return "python"
    raise ConfigError("configure_optimizers", f"state {key!r} of {where}",
                      f"holds {type(value).__name__} {tuple(getattr(value, 'shape', ()))}, neither one value per "
                      "parameter element nor a scalar: hexiscale checkpoints reshard element-wise optimizer "
                      "states only", "use an element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad)")


def _python_tensor(value: bool | int | float) -> torch.Tensor:
    dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
    return torch.tensor(value, dtype=dtype)


def _scalar_pieces(name: str, state: dict[str, Any], numel: int) -> list[Piece]:
    out = []
    for key, v in state.items():
        kind = _classify(key, v, numel, name)
        if kind == "scalar":
            out.append(Piece(optim_fqn(key, name), (), (), v.detach()))
        elif kind == "python":
            out.append(Piece(optim_fqn(key, name, python=True), (), (), _python_tensor(v)))
    return out


# ---- what a rank writes ---------------------------------------------------------------------------
def write_pieces(engine, optimizer=None) -> list[Piece]:
    """This rank's share of the checkpoint: model pieces, plus optimizer pieces when ``optimizer``
    is given (the user's torch optimizer; under ZeRO the state is read from the engine's
    :class:`~lightning_hexiscale.runtime.zero.ShardedOptimizer`)."""
    params = dict(engine.stage.named_parameters())
    shards = engine.stage.shards()
    shapes = {n: s.spec.shape for n, s in shards.items()}
    out: list[Piece] = []
    if engine.zero is None:
        boxes = ddp_write_boxes(engine)
        for name, pairs in boxes.items():
            for (goff, _gs), (loff, size) in pairs:
                out.append(Piece(model_fqn(name), goff, shapes[name], narrow_box(params[name].detach(), loff, size)))
        if optimizer is not None:
            for name, pairs in boxes.items():
                state = optimizer.state.get(params[name], {})
                numel = params[name].numel()
                for key, v in state.items():
                    if _classify(key, v, numel, name) == "vector":
                        for (goff, _gs), (loff, size) in pairs:
                            out.append(Piece(optim_fqn(key, name), goff, shapes[name],
                                             narrow_box(v.detach().view(params[name].shape), loff, size)))
                if any(all(o == 0 for o in goff) for (goff, _gs), _l in pairs):
                    out += _scalar_pieces(name, state, numel)
        return out

    sh = engine.zero
    sopt = engine.sharded_optimizer if optimizer is not None else None
    if optimizer is not None and sopt is None:
        raise RuntimeError("under ZeRO the optimizer must be wrapped (engine.wrap_optimizer) before a checkpoint")
    origin_done: set[str] = set()
    for cb in zero_chunk_boxes(sh):
        if sh.has_master(cb.bucket):  # the exact copy: ZeRO-3's only one, or mixed precision's float32
            t = sh.masters[cb.bucket][cb.chunk_pos:cb.chunk_pos + cb.numel].view(cb.sizes)
        else:
            t = narrow_box(_item_region(params[cb.name].detach(), cb.item), cb.region_offsets, cb.sizes)
        out.append(Piece(model_fqn(cb.name), cb.offsets, shapes[cb.name], t))
        if sopt is None:
            continue
        runs = sopt.runs[cb.bucket]
        r = _run_of(runs, cb.chunk_pos, cb.numel)
        leaf = sopt.leaves[cb.bucket][r]
        state = sopt.inner[cb.bucket].state.get(leaf, {})
        run_len = runs[r][1] - runs[r][0]
        for key, v in state.items():
            if _classify(key, v, run_len, cb.name) == "vector":
                a = cb.chunk_pos - runs[r][0]
                out.append(Piece(optim_fqn(key, cb.name), cb.offsets, shapes[cb.name],
                                 v.detach()[a:a + cb.numel].view(cb.sizes)))
        if all(o == 0 for o in cb.offsets) and cb.name not in origin_done:
            origin_done.add(cb.name)
            out += _scalar_pieces(cb.name, state, run_len)
    return out


# ---- what a rank reads ----------------------------------------------------------------------------
def read_model_pieces(engine) -> list[Piece]:
    """Where this rank's parameters come from: every local parameter whole, except ZeRO-3's
    sharded blocks, whose only storage is the owned master chunks."""
    shards = engine.stage.shards()
    sh = engine.zero
    master_names = set(getattr(sh, "sharded_names", ())) if sh is not None and sh.zero3 else set()
    out = []
    for name, p in engine.stage.named_parameters():
        if name in master_names:
            continue
        off, _ = local_box(shards[name])
        out.append(Piece(model_fqn(name), off, shards[name].spec.shape, p.detach()))
    if master_names:
        for cb in zero_chunk_boxes(sh):
            if sh.on_demand(cb.bucket):
                t = sh.masters[cb.bucket][cb.chunk_pos:cb.chunk_pos + cb.numel].view(cb.sizes)
                out.append(Piece(model_fqn(cb.name), cb.offsets, shards[cb.name].spec.shape, t))
    return out


@dataclass
class OptimizerTargets:
    """Freshly allocated optimizer state to load into, and the pieces that point into it."""

    pieces: list[Piece]
    state: dict[Any, dict[str, Any]]
    """ddp: parameter name -> {key: tensor}; zero: (bucket, run) -> {key: tensor}. 0-dim tensors may
    be shared between owners: copy them before use."""
    python_keys: set[tuple[Any, str]]
    """(state owner, key) pairs whose 0-dim tensor stands for a Python number (``.item()`` it)."""


def saved_optimizer_keys(tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                         names: list[str]) -> dict[str, dict[str, tuple[bool, tuple[int, ...], torch.dtype]]]:
    """name -> {key: (python?, shape, dtype)} of the saved optimizer state, from the checkpoint's
    tensor list {fqn: (shape, dtype)}."""
    out: dict[str, dict[str, tuple[bool, tuple[int, ...], torch.dtype]]] = {n: {} for n in names}
    for fqn, (shape, dtype) in tensors.items():
        space, _, rest = fqn.partition(".")
        if space not in (OPTIM, OPTIM_PY):
            continue
        # "<key>.<name>": the key ends at the first dot after which a parameter name of ours follows
        dot = rest.find(".")
        while dot != -1 and rest[dot + 1:] not in out:
            dot = rest.find(".", dot + 1)
        if dot > 0:
            out[rest[dot + 1:]][rest[:dot]] = (space == OPTIM_PY, tuple(shape), dtype)
    return out


def read_optimizer_targets(engine, optimizer, saved: dict[str, dict[str, tuple[bool, tuple[int, ...], torch.dtype]]]
                           ) -> OptimizerTargets:
    """Allocate this rank's optimizer state (zeros, the saved dtypes) and the pieces to read into it.
    ``saved``: :func:`saved_optimizer_keys` for this rank's parameters."""
    shards = engine.stage.shards()
    pieces: list[Piece] = []
    state: dict[Any, dict[str, Any]] = {}
    python_keys: set[tuple[Any, str]] = set()

    scalars: dict[str, torch.Tensor] = {}

    def scalar(owner, name: str, key: str, python: bool, dtype: torch.dtype) -> None:
        # Several ZeRO runs may take their scalars from one parameter: read it once, share it here
        # (the caller gives every owner its own copy before an optimizer increments it in place).
        fqn = optim_fqn(key, name, python)
        if fqn not in scalars:
            scalars[fqn] = torch.zeros((), dtype=dtype)
            pieces.append(Piece(fqn, (), (), scalars[fqn]))
        state[owner][key] = scalars[fqn]
        if python:
            python_keys.add((owner, key))

    if engine.zero is None:
        for name, p in engine.stage.named_parameters():
            off, size = local_box(shards[name])
            state[name] = {}
            for key, (python, shape, dtype) in saved[name].items():
                if shape == ():
                    scalar(name, name, key, python, dtype)
                else:
                    t = torch.zeros(size, dtype=dtype, device=p.device)
                    state[name][key] = t
                    pieces.append(Piece(optim_fqn(key, name), off, shards[name].spec.shape, t))
        return OptimizerTargets(pieces, state, python_keys)

    sh, sopt = engine.zero, engine.sharded_optimizer
    if sopt is None:
        raise RuntimeError("under ZeRO the optimizer must be wrapped (engine.wrap_optimizer) before loading into it")
    boxes: dict[tuple[int, int], list[ChunkBox]] = {}
    for cb in zero_chunk_boxes(sh):
        boxes.setdefault((cb.bucket, _run_of(sopt.runs[cb.bucket], cb.chunk_pos, cb.numel)), []).append(cb)
    for i, b in enumerate(sh.buckets):
        for r, (a, e, _g) in enumerate(sopt.runs[i]):
            owner = (i, r)
            state[owner] = {}
            mine = boxes.get(owner, [])
            # A run that is all padding still needs its state: take the bucket's last parameter's keys.
            rep = mine[0].name if mine else b.items[-1].name
            for key, (python, shape, dtype) in saved[rep].items():
                if shape == ():
                    scalar(owner, rep, key, python, dtype)
                    continue
                t = torch.zeros(e - a, dtype=sh.dtype, device=sh.device)
                state[owner][key] = t
                for cb in mine:
                    pos = cb.chunk_pos - a
                    pieces.append(Piece(optim_fqn(key, cb.name), cb.offsets, shards[cb.name].spec.shape,
                                        t[pos:pos + cb.numel].view(cb.sizes)))
    return OptimizerTargets(pieces, state, python_keys)


def own_bytes(engine, optimizer=None) -> int:
    """Bytes of this rank's own shards: local parameters (ZeRO-3: the master chunks) plus the
    optimizer state it holds. The memory bound of a save or a load is stated against this."""
    total = sum(p.numel() * p.element_size() for p in engine.stage.parameters())
    if engine.zero is not None and engine.zero.zero3:
        total += sum(m.numel() * m.element_size() for m in engine.zero.masters if m is not None)
    states: Iterator[dict] = iter(())
    if engine.sharded_optimizer is not None:
        states = (st for o in engine.sharded_optimizer.inner for st in o.state.values())
    elif optimizer is not None:
        states = iter(optimizer.state.values())
    for st in states:
        total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total
