"""NCCL semantics on CPU/gloo: order-only p2p matching and a replay of every rank's communication.

gloo is forgiving where NCCL is not (NCCL user guide, "Point-to-point communication" and "Group
calls"): it honours p2p tags, which NCCL does not have, and its sends complete into buffers whatever
the peer is doing, while an un-fused NCCL send waits for the peer's matching receive. This module makes the CPU test ranks behave,
and be judged, as NCCL ranks:

1. **Order-only matching.** :class:`Recorder` wraps the ``torch.distributed`` functions inside a test
   rank; every point-to-point op runs with ``tag=0``, so gloo matches sends and receives of a rank
   pair by order only, as NCCL does. A runtime that relied on tags now pairs the wrong tensors and
   fails its equivalence check.
2. **A trace.** The same wrappers record, per rank and in program order, one :class:`Step` per
   communication call: an un-fused p2p op, a ``batch_isend_irecv`` (all its ops), or a collective
   (group ranks, op, numel, dtype, root, chunk sizes). Recording costs a dict lookup and a few
   frames of stack walk per call.
3. **A replay** (:func:`replay`, pure Python) under NCCL's rules, with each thread of a rank that
   communicates (:attr:`Step.thread`) modelled as a sequential program that blocks at every
   communication call until it completes (the safe reading of NCCL's "operations on different
   communicators must be issued in the same order on every rank" for the calls of one thread;
   asynchronous calls are therefore judged at the point where they are issued). Threads of one rank
   are independent programs: e.g. the asynchronous checkpoint writer, whose collectives run on a
   process group of its own while the main thread trains. On one communicator a rank's calls are
   numbered in the order it recorded them, whichever thread made them, and the i-th calls of all
   members are one call. Waits that are not communication (a thread joining another) are not
   modelled.

   - communicators: a group is its member ranks AND its identity (:attr:`Step.comm`), because two
     process groups with the same members (a plan group next to a DP group of the same ranks, the
     world group next to a DP group spanning it) are two NCCL communicators, each with its own
     order of calls. The identity is torch's name for the process group, the same on every rank:
     ``"0"`` for the default group, then the creation ordinal of each ``new_group`` within the
     current default group (every rank calls ``new_group`` for every group, in the same order;
     ``destroy_process_group()`` restarts the count), or a hash of the ranks for groups made with
     ``use_local_synchronization`` (two such groups with the same members are not told apart).
     Hand-made traces that leave it empty have one communicator per member set. Every rule below
     is per communicator; messages name a group by its ranks, plus ``[pg NAME]`` where the
     traces hold two communicators with those ranks.
   - p2p: one FIFO per (communicator, sender, receiver); the k-th send matches the k-th receive,
     with equal numel and dtype. A step (un-fused op or batch) completes when every op in it has
     its counterpart posted; the ops of one batch progress together.
   - collectives: the i-th collective of every member of a communicator is one call; it completes
     when all members have posted it, with equal op, numel, dtype, root, reduce op; all-gather and
     reduce-scatter chunks equal on every member.
   - the first batched p2p call on a communicator must involve every member (torch/NCCL: the first
     collective call on a group creates its communicator; ``new_group`` calls, recorded on the
     world group for their order, do not count), and a rank pair must not mix batched and
     un-fused p2p on one communicator (lazily initialised ProcessGroupNCCL puts un-fused p2p on a separate
     2-rank communicator, so the two never match).

   A violation is reported with the first stuck or mismatched step of each rank.
4. **Default groups that change.** A process may destroy its default process group and join a new
   one (the strategy does when a plan leaves launched devices idle: the training ranks form a group
   of their own, with new ranks). The recorder keeps one *segment* per default group a process was
   in (its rank and world size there, and the steps); :func:`replay_segments` replays the k-th
   segments of all processes together, each under the ranks of its own group.

Used by ``tests/runtime/conftest.py`` (every ``run_ranks`` test) and ``tests/lightning/strategy_helpers.py``
(every ``hexiscale_trainer`` run); :func:`link_bytes` counts the wire bytes per link class for the
bytes-on-the-wire test.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_hexiscale import torch_compat

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


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# ---- recording ----------------------------------------------------------------------------------
class Recorder:
    """Wraps torch.distributed in THIS process: tags forced to 0, every call recorded as a Step.

    Install after ``init_process_group`` (in a forked test rank), read :attr:`steps`, uninstall.
    Nested calls (e.g. the isend inside ``batch_isend_irecv``) are not recorded again.
    """

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.phase = ""
        self._saved: list[tuple[object, str, object]] = []
        self._local = threading.local()  # per thread: depth of nested recorded calls
        self._groups: dict[int, tuple[tuple[int, ...], str]] = {}  # id(group) -> (ranks, identity)
        self._starts: list[tuple[int, int, int]] = []  # (rank, world, first step) per default group

    @property
    def segments(self) -> list[tuple[int, int, list[Step]]]:
        """(rank, world size, steps) of each default process group this process was in, in order."""
        out = []
        for i, (rank, world, first) in enumerate(self._starts):
            end = self._starts[i + 1][2] if i + 1 < len(self._starts) else len(self.steps)
            if rank >= 0:
                out.append((rank, world, self.steps[first:end]))
        return out

    def mark(self, phase: str) -> None:
        """Label the steps recorded from now on (byte accounting per phase)."""
        self.phase = phase

    # ---- patching ----
    def install(self) -> Recorder:
        if self._saved:
            return self
        for name in P2P_FUNCS:
            self._patch(name, self._p2p_wrapper)
        self._patch("batch_isend_irecv", self._batch_wrapper)
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            self._patch(name, self._coll_wrapper)
        self._patch("new_group", self._new_group_wrapper)
        self._patch("destroy_process_group", self._destroy_wrapper)
        self._patch("init_process_group", self._init_wrapper)
        self._open_segment()
        return self

    def _open_segment(self) -> None:
        if dist.is_initialized():
            self._starts.append((dist.get_rank(), dist.get_world_size(), len(self.steps)))
        else:
            self._starts.append((-1, 0, len(self.steps)))  # outside any group: nothing to replay

    def _destroy_wrapper(self, name: str, orig):
        def wrapper(group=None):
            out = orig(group)
            if group is None or group is c10d.GroupMember.WORLD:
                self._groups.clear()  # ids of destroyed groups may be reused
                self._starts.append((-1, 0, len(self.steps)))
            else:
                self._groups.pop(id(group), None)
            return out

        return wrapper

    def _init_wrapper(self, name: str, orig):
        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            self._groups.clear()
            self._open_segment()
            return out

        return wrapper

    def uninstall(self) -> None:
        for module, name, orig in reversed(self._saved):
            setattr(module, name, orig)
        self._saved.clear()

    def _patch(self, name: str, make) -> None:
        orig = getattr(c10d, name, None)
        if orig is None:
            return
        wrapper = make(name, orig)
        wrapper.__name__ = name
        wrapper.__wrapped__ = orig
        # Both namespaces: the runtime calls dist.X; torch's own helpers (batch_isend_irecv's
        # _check_op, P2POp) look the names up in distributed_c10d.
        for module in (c10d, dist):
            if getattr(module, name, None) is orig:
                self._saved.append((module, name, orig))
                setattr(module, name, wrapper)

    # ---- helpers ----
    def _group(self, group) -> tuple[tuple[int, ...], str] | None:
        """(member ranks, identity) of a process group argument; None where this rank is no member."""
        if group is c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        key = id(group)
        if key not in self._groups:
            if group is None or group is c10d.GroupMember.WORLD:
                pg = c10d._get_default_group()
                ranks = tuple(range(dist.get_world_size()))
            else:
                pg, ranks = group, tuple(dist.get_process_group_ranks(group))
            self._groups[key] = (ranks, _pg_name(pg))
        return self._groups[key]

    @staticmethod
    def _where() -> str:
        frame = sys._getframe(2)
        skip = (__file__, torch_compat.__file__)  # the shims' caller is the runtime file that matters
        while frame is not None:
            fn = frame.f_code.co_filename
            if fn not in skip and "/torch/" not in fn:
                return f"{fn.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            frame = frame.f_back
        return ""

    @property
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _record(self, step: Step) -> None:
        thread = threading.current_thread()
        if thread is not threading.main_thread():
            step = replace(step, thread=thread.name)
        self.steps.append(step)  # atomic under the GIL: one order per rank, whichever thread calls

    def _inner(self, orig, *args, **kwargs):
        """Call the real function; calls it makes on its own (in this thread) are not recorded again."""
        self._local.depth = self._depth + 1
        try:
            return orig(*args, **kwargs)
        finally:
            self._local.depth -= 1

    def _p2p_wrapper(self, name: str, orig):
        sig = inspect.signature(orig)
        sending = name in ("isend", "send")

        def wrapper(*args, **kwargs):
            ba = sig.bind(*args, **kwargs)
            ba.apply_defaults()
            ba.arguments["tag"] = 0  # NCCL has no tags: match by order only
            if self._depth == 0:
                a = ba.arguments
                pg = self._group(a.get("group"))
                if pg is not None:
                    group, comm = pg
                    peer = a["dst" if sending else "src"]
                    gpeer = a.get("group_dst" if sending else "group_src")
                    if peer is None and gpeer is not None:
                        peer = group[gpeer]
                    t = a["tensor"]
                    op = P2POp("send" if sending else "recv", -1 if peer is None else int(peer), group,
                               t.numel(), _dtype(t), comm)
                    self._record(Step("p2p", (op,), where=self._where(), phase=self.phase))
            return self._inner(orig, *ba.args, **ba.kwargs)

        return wrapper

    def _batch_wrapper(self, name: str, orig):
        def wrapper(p2p_op_list):
            if self._depth == 0 and p2p_op_list:
                ops = []
                for o in p2p_op_list:
                    group, comm = self._group(o.group) or ((), "")
                    sending = getattr(o.op, "__name__", "") in ("isend", "send")
                    ops.append(P2POp("send" if sending else "recv", int(o.peer), group, o.tensor.numel(),
                                     _dtype(o.tensor), comm))
                    o.tag = 0
                self._record(Step("batch", tuple(ops), group=ops[0].group, comm=ops[0].comm, where=self._where(),
                                  phase=self.phase))
            return self._inner(orig, p2p_op_list)

        return wrapper

    def _coll_wrapper(self, name: str, orig):
        sig = inspect.signature(orig)

        def wrapper(*args, **kwargs):
            if self._depth == 0:
                ba = sig.bind(*args, **kwargs)
                ba.apply_defaults()
                step = self._describe(name, ba.arguments)
                if step is not None:
                    self._record(step)
            return self._inner(orig, *args, **kwargs)

        return wrapper

    def _describe(self, name: str, a: dict) -> Step | None:
        pg = self._group(a.get("group"))
        if pg is None:
            return None  # not a member: torch returns without communicating
        group, comm = pg
        numel = out = root = None
        dtype = detail = ""
        if name in OBJECT_COLLECTIVES:
            root = a.get("src", a.get("dst"))
        elif name in ("barrier", "monitored_barrier"):
            numel = 0
        else:
            first = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
                     "gather": "tensor", "scatter": "tensor", "all_to_all": "input_tensor_list",
                     "all_to_all_single": "input", "reduce_scatter": "output"}.get(name)
            if name in ("all_gather_single", "all_gather_into_tensor"):
                t, o = a["input_tensor"], a["output_tensor"]
                numel, out = t.numel(), o.numel()
            elif name in ("reduce_scatter_single", "reduce_scatter_tensor"):
                t, o = a["input"], a["output"]
                numel, out = t.numel(), o.numel()
            else:
                t = a[first]
                if isinstance(t, (list, tuple)):
                    numel = sum(x.numel() for x in t)
                    t = t[0]
                else:
                    numel = t.numel()
            dtype = _dtype(t)
            if "op" in a and a["op"] is not None:
                detail = str(a["op"]).rsplit(".", 1)[-1]
            for key in ("src", "dst"):
                if key in a and a[key] is not None:
                    root = int(a[key])
                gkey = "group_" + key
                if root is None and a.get(gkey) is not None:
                    root = group[a[gkey]]
        return Step("coll", coll=name, group=group, comm=comm, numel=numel, out_numel=out, dtype=dtype, root=root,
                    detail=detail, where=self._where(), phase=self.phase)

    def _new_group_wrapper(self, name: str, orig):
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                ranks = kwargs.get("ranks", args[0] if args else None)
                world, comm = self._group(None)
                detail = "all" if ranks is None else ",".join(map(str, sorted(ranks)))
                self._record(Step("coll", coll="new_group", group=world, comm=comm, numel=0, detail=detail,
                                  where=self._where(), phase=self.phase))
            return self._inner(orig, *args, **kwargs)

        return wrapper


def _pg_name(pg) -> str:
    """torch's name of a process group: the same on every rank (module doc)."""
    name = getattr(c10d, "_get_process_group_name", None)
    return str(name(pg)) if name is not None else str(getattr(pg, "group_name", ""))


_CURRENT: Recorder | None = None


def set_current(recorder: Recorder | None) -> None:
    """The recorder of this process (set by the test launchers after installing it)."""
    global _CURRENT
    _CURRENT = recorder


def current() -> Recorder | None:
    """The recorder installed in this process, if any (a rank labels phases with ``current().mark``)."""
    return _CURRENT


# ---- replay -------------------------------------------------------------------------------------
@dataclass
class Report:
    """Outcome of :func:`replay`: ``ok`` or the problems, one line each."""

    problems: list[str] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    """Steps completed per rank."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        return "NCCL semantics: OK" if self.ok else "NCCL semantics violated:\n  " + "\n  ".join(self.problems)


def replay(traces: list[list[Step]]) -> Report:
    """Replay every rank's trace under NCCL's rules (module doc); report what would hang or mismatch."""
    report = Report()
    shared = _shared(traces)
    report.problems += _static_rules(traces, shared)
    n = len(traces)
    # A rank's calls on one communicator (one p2p FIFO) are numbered in its recorded order, whichever
    # thread made them: the i-th collective on a communicator, the k-th send on a FIFO.
    number: list[list] = [[] for _ in range(n)]
    for r, trace in enumerate(traces):
        count: dict[tuple, int] = defaultdict(int)
        for step in trace:
            if step.kind == "coll":
                number[r].append(count[step.key])
                count[step.key] += 1
                continue
            idx = []
            for op in step.ops:
                key = _fifo(r, op)
                idx.append(count[key])
                count[key] += 1
            number[r].append(idx)
    # One sequential program per (rank, thread): the indices of its steps in the rank's trace.
    lanes: list[tuple[int, list[int]]] = []
    for r, trace in enumerate(traces):
        by_thread: dict[str, list[int]] = {}
        for i, step in enumerate(trace):
            by_thread.setdefault(step.thread, []).append(i)
        lanes += [(r, steps) for steps in by_thread.values()]
    pc = [0] * len(lanes)
    dead = [False] * len(lanes)  # a lane whose current step mismatched: stop it, report once
    posted = [False] * len(lanes)
    fifo_ops: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [None, None]))
    coll_posted: dict[tuple, dict[int, dict[int, tuple[int, Step]]]] = defaultdict(lambda: defaultdict(dict))

    def post(lane: int, r: int, i: int, step: Step) -> None:
        if step.kind == "coll":
            t = len(step.group)
            # all-gather: output = t x input; reduce-scatter: input = t x output
            chunked = {"all_gather_single": (t, 1), "all_gather_into_tensor": (t, 1),
                       "reduce_scatter_single": (1, t), "reduce_scatter_tensor": (1, t)}.get(step.coll)
            if chunked and step.numel * chunked[0] != step.out_numel * chunked[1]:
                report.problems.append(f"rank {r} step {i}: {step.describe(shared)}: the chunks must be equal on all {t} members "
                                       f"(input {step.numel}, output {step.out_numel})")
                dead[lane] = True
                return
            c = number[r][i]
            entry = coll_posted[step.key][c]
            entry[r] = (i, step)
            first_rank, (first_i, first) = next(iter(entry.items()))
            if first_rank != r and first.signature() != step.signature():
                report.problems.append(f"collective #{c} on group {_g(step.group, step.comm, shared)} mismatched: "
                                       f"rank {first_rank} step {first_i}: {first.describe(shared)}; rank {r} step "
                                       f"{i}: {step.describe(shared)}")
                dead[lane] = True
            return
        for op, k in zip(step.ops, number[r][i]):
            key, side = _fifo(r, op), _side(op)
            fifo_ops[key][k][side] = (r, i, op)
            other = fifo_ops[key][k][1 - side]
            if other is not None:
                orank, oi, oop = other
                if (oop.numel, oop.dtype) != (op.numel, op.dtype):
                    report.problems.append(f"p2p #{k} from rank {key[2]} to rank {key[3]} on group "
                                           f"{_g(op.group, op.comm, shared)} mismatched: rank {r} step {i} "
                                           f"{op.describe(shared)} vs rank {orank} step {oi} {oop.describe(shared)}")
                    dead[lane] = True

    def complete(r: int, i: int, step: Step) -> bool:
        if step.kind == "coll":
            return len(coll_posted[step.key][number[r][i]]) == len(step.group)
        return all(fifo_ops[_fifo(r, op)][k][1 - _side(op)] is not None for op, k in zip(step.ops, number[r][i]))

    progress = True
    while progress:
        progress = False
        for lane, (r, steps) in enumerate(lanes):
            while pc[lane] < len(steps) and not dead[lane]:
                i = steps[pc[lane]]
                step = traces[r][i]
                if not posted[lane]:
                    if any(op.peer not in op.group or op.peer == r for op in step.ops):
                        report.problems.append(f"rank {r} step {i}: bad peer in {step.describe(shared)}")
                        dead[lane] = True
                        break
                    post(lane, r, i, step)
                    posted[lane] = True
                    if dead[lane]:
                        break
                if not complete(r, i, step):
                    break
                pc[lane] += 1
                posted[lane] = False
                progress = True
    report.completed = [sum(pc[lane] for lane, (q, _) in enumerate(lanes) if q == r) for r in range(n)]
    at = {}  # rank -> [(step index, step)] where its unfinished lanes are
    for lane, (r, steps) in enumerate(lanes):
        if pc[lane] < len(steps):
            at.setdefault(r, []).append((steps[pc[lane]], traces[r][steps[pc[lane]]]))
    for lane, (r, steps) in enumerate(lanes):
        if pc[lane] < len(steps) and not dead[lane]:
            i = steps[pc[lane]]
            step = traces[r][i]
            report.problems.append(f"rank {r} stuck at step {i} of {len(traces[r])}{_in(step)}: "
                                   f"{step.describe(shared)}; "
                                   f"{_waiting_for(r, i, step, traces, at, number, fifo_ops, coll_posted, shared)}")
    return report


def _fifo(r: int, op: P2POp) -> tuple:
    """The p2p FIFO of an op issued by rank ``r``: (group, communicator, sender, receiver)."""
    src, dst = (r, op.peer) if op.op == "send" else (op.peer, r)
    return (op.group, op.comm, src, dst)


def _side(op: P2POp) -> int:
    return 0 if op.op == "send" else 1


def _in(step: Step) -> str:
    return f" (thread {step.thread})" if step.thread else ""


def replay_segments(processes: list[list[tuple[int, int, list[Step]]]]) -> Report:
    """Replay processes whose default group changed (:attr:`Recorder.segments` of each process):
    the k-th segments of all processes that have one are replayed together, indexed by their rank
    in that group; every rank of the group must be there, with the same world size."""
    report = Report()
    depth = max((len(p) for p in processes), default=0)
    for k in range(depth):
        members = [p[k] for p in processes if len(p) > k]
        worlds = {w for _, w, _ in members}
        ranks = sorted(r for r, _, _ in members)
        if len(worlds) != 1 or ranks != list(range(next(iter(worlds)))):
            report.problems.append(f"default group #{k}: ranks {ranks} with world sizes {sorted(worlds)}: every rank "
                                   "of a default group must be recorded, with the same world size")
            continue
        part = replay([steps for _, _, steps in sorted(members, key=lambda m: m[0])])
        report.problems += [f"default group #{k}: {p}" for p in part.problems]
        report.completed += part.completed
    return report


def _waiting_for(r, i, step, traces, at, number, fifo_ops, coll_posted, shared) -> str:
    def where(q: int) -> str:
        if q not in at:
            return f"rank {q} has finished its {len(traces[q])} steps"
        return " and ".join(f"rank {q} is at step {j}{_in(s)}: {s.describe(shared)}" for j, s in at[q])

    if step.kind == "coll":
        missing = [q for q in step.group if q not in coll_posted[step.key][number[r][i]]]
        return "waiting for " + "; ".join(where(q) for q in missing)
    waits = []
    for op, k in zip(step.ops, number[r][i]):
        key, side = _fifo(r, op), _side(op)
        if fifo_ops[key][k][1 - side] is None:
            have = sum(e[1 - side] is not None for e in fifo_ops[key].values())
            other = "receive" if op.op == "send" else "send"
            waits.append(f"needs the matching {other} #{k} of rank {op.peer} (posted {have}); {where(op.peer)}")
    return "; ".join(waits)


def _static_rules(traces: list[list[Step]], shared: frozenset = frozenset()) -> list[str]:
    """First batched call on a communicator involves every member; no mixing of batched and un-fused p2p
    on one."""
    problems = []
    first: dict[tuple, dict[int, tuple[int, Step]]] = defaultdict(dict)
    modes: dict[tuple, dict[str, tuple[int, int]]] = defaultdict(dict)
    for r, trace in enumerate(traces):
        for i, step in enumerate(trace):
            if step.kind == "p2p":
                op = step.ops[0]
                modes[(op.group, op.comm, min(r, op.peer), max(r, op.peer))].setdefault("un-fused", (r, i))
                continue
            if step.coll == "new_group":
                # recorded on the world group (every rank, same order), but not a collective on its
                # communicator: torch syncs new_group through the store, NCCL's world communicator
                # is still made by the first real call on it
                continue
            groups = {(op.group, op.comm) for op in step.ops} if step.kind == "batch" else {step.key}
            for g in groups:
                first[g].setdefault(r, (i, step))
            for op in step.ops:
                modes[(op.group, op.comm, min(r, op.peer), max(r, op.peer))].setdefault("batched", (r, i))
    for (g, comm), by_rank in sorted(first.items()):
        if not any(s.kind == "batch" for _, s in by_rank.values()):
            continue
        linked = set()
        for r, (_, s) in by_rank.items():
            if s.kind == "batch":
                linked.add(r)
                linked.update(op.peer for op in s.ops if (op.group, op.comm) == (g, comm))
        left = [q for q in g if q not in linked or q not in by_rank or by_rank[q][1].kind != "batch"]
        if left:
            r, (i, s) = next((r, v) for r, v in sorted(by_rank.items()) if v[1].kind == "batch")
            problems.append(f"group {_g(g, comm, shared)}: its first call is batch_isend_irecv (rank {r} step {i}: "
                            f"{s.describe(shared)}) but "
                            f"ranks {left} do not take part in it: NCCL needs every member in the first "
                            f"collective call on a group")
    for (g, comm, a, b), seen in sorted(modes.items()):
        if len(seen) == 2:
            problems.append(f"ranks {a} and {b} mix batched and un-fused p2p on group {_g(g, comm, shared)} (batched at rank "
                            f"{seen['batched'][0]} step {seen['batched'][1]}, un-fused at rank {seen['un-fused'][0]} "
                            f"step {seen['un-fused'][1]}): lazily initialised ProcessGroupNCCL runs them on "
                            f"different communicators")
    return problems


def check(traces: list[list[Step]]) -> None:
    """Raise AssertionError with the report when the traces violate NCCL's rules."""
    report = replay(traces)
    if not report.ok:
        raise AssertionError(str(report))


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
