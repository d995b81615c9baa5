"""The trace that :mod:`nccl_semantics` records and replays: one :class:`Step` per communication call
of a rank (an un-fused p2p op, a ``batch_isend_irecv`` with its :class:`P2POp` s, or a collective),
and :func:`step_bytes`, the bytes a step puts on the wire by the cost model's conventions.

Pure data: no torch.distributed. The recorder (:mod:`nccl_semantics`) builds these, the replay
(:mod:`nccl_replay`) judges them, hand-made traces in the harness's own tests feed the replay
directly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

P2P_FUNCS = ("isend", "irecv", "send", "recv")
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
                      "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all",
                      "all_to_all_single", "reduce", "gather", "scatter", "barrier", "monitored_barrier")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor")
"""One collective under its torch >= 2.13 name and its older one (``lightning_hexiscale.torch_compat``)."""
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


@dataclass(frozen=True)
class P2POp:
    """One point-to-point op as the rank issued it."""

    op: str
    """``send`` or ``recv``."""
    peer: int
    """Global rank of the other side."""
    group: tuple[int, ...]
    """Member ranks (global) of the process group."""
    numel: int
    dtype: str
    comm: str = ""
    """Identity of the process group, the same on every rank (module doc): with :attr:`group`, the communicator."""

    def __str__(self) -> str:
        return self.describe()

    def describe(self, shared: frozenset = frozenset()) -> str:
        """``shared``: member tuples that more than one communicator has (their name is added)."""
        way = "to" if self.op == "send" else "from"
        return f"{self.op} {self.numel} {self.dtype} {way} rank {self.peer} on group {_g(self.group, self.comm, shared)}"


@dataclass(frozen=True)
class Step:
    """One communication call of one rank."""

    kind: str
    """``p2p`` (an un-fused op), ``batch`` (one ``batch_isend_irecv``) or ``coll``."""
    ops: tuple[P2POp, ...] = ()
    coll: str = ""
    """Collective name (``all_reduce``, ..., ``new_group``)."""
    group: tuple[int, ...] = ()
    """Member ranks (global) of the process group (of the first op, for a batch)."""
    comm: str = ""
    """Identity of that process group, the same on every rank (module doc)."""
    numel: int | None = None
    """Input elements of a collective (None: not compared, e.g. object collectives)."""
    out_numel: int | None = None
    """Output elements of all-gather / reduce-scatter (the chunk rule)."""
    dtype: str = ""
    root: int | None = None
    """Broadcast / reduce / gather / scatter root, global rank."""
    detail: str = ""
    """Reduce op, or the rank list of ``new_group``: must be equal on every member."""
    where: str = ""
    """Caller file:line (outside torch, this module and the package's ``torch_compat`` shims)."""
    phase: str = ""
    """Label set by :meth:`Recorder.mark` (e.g. ``run``, ``sync``) for byte accounting."""
    thread: str = ""
    """Name of the thread that made the call; empty for the main thread. Each thread of a rank is
    its own sequential program in the replay."""

    def signature(self) -> tuple:
        return (self.coll, self.numel, self.out_numel, self.dtype, self.root, self.detail)

    @property
    def key(self) -> tuple[tuple[int, ...], str]:
        """The communicator of a collective: (member ranks, identity)."""
        return (self.group, self.comm)

    def __str__(self) -> str:
        return self.describe()

    def describe(self, shared: frozenset = frozenset()) -> str:
        """``shared``: member tuples that more than one communicator has (their name is added)."""
        at = f" at {self.where}" if self.where else ""
        if self.kind == "coll":
            size = "" if self.numel is None else f" numel {self.numel}" + (
                f" -> {self.out_numel}" if self.out_numel is not None else "")
            root = "" if self.root is None else f" root {self.root}"
            return (f"{self.coll}({self.dtype}{size}{root}{' ' + self.detail if self.detail else ''}) on group "
                    f"{_g(self.group, self.comm, shared)}{at}")
        kind = "batch_isend_irecv[" if self.kind == "batch" else "un-fused "
        return kind + "; ".join(o.describe(shared) for o in self.ops) + ("]" if self.kind == "batch" else "") + at


def _g(group: tuple[int, ...], comm: str = "", shared: frozenset = frozenset()) -> str:
    """A group by its ranks, plus its communicator's name when ``group`` is in ``shared``."""
    ranks = "(" + ",".join(map(str, group)) + ")"
    return f"{ranks} [pg {comm or '?'}]" if group in shared else ranks


def _shared(traces: list[list[Step]]) -> frozenset:
    """Member tuples that more than one communicator of the traces has."""
    comms: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for trace in traces:
        for step in trace:
            comms[step.group].add(step.comm)
            for op in step.ops:
                comms[op.group].add(op.comm)
    return frozenset(g for g, c in comms.items() if len(c) > 1)


# ---- bytes on the wire ---------------------------------------------------------------------------
_ESIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


def step_bytes(step: Step) -> float:
    """Bytes one rank moves for a step, by the conventions of the cost model (planner/cost/wire.py):
    p2p send n*b (receives count 0: the sender's side carries them); over a group of t ranks,
    all-reduce 2(t-1)/t*n*b, reduce-scatter and all-gather (t-1)/t of the full buffer, broadcast
    (t-1)/t*n*b."""
    if step.kind != "coll":
        return float(sum(o.numel * _ESIZE[o.dtype] for o in step.ops if o.op == "send"))
    t = len(step.group)
    if t <= 1 or step.numel is None or not step.dtype:
        return 0.0
    b = _ESIZE[step.dtype]
    if step.coll == "all_reduce":
        return 2.0 * (t - 1) / t * step.numel * b
    if step.coll in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return (t - 1) / t * step.numel * b
    if step.coll in ("all_gather_single", "all_gather_into_tensor"):
        return (t - 1) / t * step.out_numel * b
    if step.coll == "broadcast":
        return (t - 1) / t * step.numel * b
    return 0.0
