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
(every ``hexiscale_trainer`` run). The module is in three files: this one records (:class:`Recorder`),
:mod:`nccl_trace` holds the trace's types and :func:`~nccl_trace.step_bytes` (the wire bytes of a step, for
the bytes-on-the-wire tests), :mod:`nccl_replay` judges; their names are re-exported here.
"""
from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_hexiscale import torch_compat
from nccl_replay import Report, check, replay, replay_segments  # noqa: F401 (re-exported)
from nccl_trace import (_ESIZE, ALL_GATHERS, OBJECT_COLLECTIVES, P2P_FUNCS, REDUCE_SCATTERS,  # noqa: F401 (re-exported)
                        TENSOR_COLLECTIVES, P2POp, Step, step_bytes)


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
