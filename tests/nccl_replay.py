"""The replay of recorded traces under NCCL's rules (pure Python): the module doc of
:mod:`nccl_semantics`, item 3, states the rules; :func:`check` raises with the report of the first
stuck or mismatched step of each rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from nccl_trace import P2POp, Step, _g, _shared

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
