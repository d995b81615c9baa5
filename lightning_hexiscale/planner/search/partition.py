"""Device graphs, the multilevel k-way partitions of §4.2 / §4.3, and the top-tau stage-order search.

The global graph G = (D, E) of §4.2: one vertex per device with weight c_d (sustained FLOP/s), one
edge per device pair with weight beta[d, d'] (bytes/s). METIS (pymetis) cuts it in four steps:
coarsen by heavy-edge matching, partition (recursive bisection for k <= 8 and k > 64, k-way between), project
back, refine (Fiduccia-Mattheyses, the linear-time form of Kernighan-Lin), under the balance bound

    max_i sum_{d in D_i} c_d  /  (sum_d c_d / k)  <=  balance                 (§4.2, "balance factor")

which METIS takes as ``ufactor = 1000 * (balance - 1)``. METIS wants positive integers, so vertex
weights are c_d / min c scaled by 16 and edge weights beta / max beta scaled so that their total
stays below 2**30 (idx_t is 32 bits); the slowest link never rounds below 1.

Two objectives for the cut between parts (§4.4, Eq. 2, Cut(P) = sum_{i<j} sum beta[d_i, d_j]):

- ``min``: METIS as above. Parts are well-connected islands; data parallelism crosses slow links.
- ``max``: *dealing*. Every well-connected block (a machine: a clique of equal fast links) deals
  its devices over the k parts, fewest-from-this-block first, then least compute so far. Each part
  then holds floor(g/k) or ceil(g/k) devices of every g-device machine, which is the fewest
  same-machine pairs inside parts any balanced k-partition can have, i.e. the maximum of Eq. 2
  when intra-machine links are faster than inter-machine ones (the usual case). Data parallelism
  then runs over the fast intra-machine links and pipelines cross machines. Unlike partitioning a
  complement graph, dealing is exact for machine-uniform clusters, deterministic and O(N).

Dense graphs are built straight from the bandwidth matrix as CSR arrays with numpy (1024 devices:
1,047,552 directed edges in about 0.1 s); no Python loop over edges.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from lightning_hexiscale.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.config.cluster import Cluster

OBJECTIVES = ("min", "max")
_KWAY_UP_TO = 64
_WHOLE_MACHINES_FROM = 512
"""Beyond this many devices, min cuts keep machines whole, or cut them into few consecutive pieces
(:func:`_whole_machines`), instead of running METIS on the complete device graph. Why 512: on 1024
devices METIS reads 1 M edges, 0.055 s a call (1.4 s of a 9 s search), and its parts split machines
unevenly, so no two pipelines share hardware and each is drafted on its own; with whole machines
the drafts repeat (planner/search/assemble.py reuses them) and the 1024-GPU search took 0.63x the CPU
time. Plan quality on held-out replicated presets (hetero1 x16, hetero3 x16, large_240 x4,
h800_h20_32 x16; 640-960 devices): within 0.13 % of a 10x-longer search, and -2.3 % to +1.4 %
against METIS parts (2026-11-26)."""
_MAX_TOTAL_WEIGHT = 2**30


@dataclass(frozen=True, eq=False)
class DeviceGraph:
    """The (sub)graph of a set of devices: vertex i is cluster device ``devices[i]``."""

    devices: np.ndarray
    """Cluster device ids, int array of length n."""
    flops: np.ndarray
    """c_d, sustained FLOP/s per vertex."""
    bandwidth: np.ndarray
    """n x n bytes/s (inf on the diagonal)."""
    blocks: tuple[tuple[int, ...], ...]
    """Vertex indices of each machine present (the cliques ``max`` deals from)."""

    @classmethod
    def from_cluster(cls, cluster: Cluster, devices: list[int] | np.ndarray | None = None) -> DeviceGraph:
        idx = np.arange(cluster.num_devices) if devices is None else np.asarray(devices, dtype=np.int64)
        flops = cluster.flops[idx]
        bw = cluster.bandwidth[np.ix_(idx, idx)]
        machine = np.array([cluster.devices[d].machine for d in idx])
        blocks = tuple(tuple(np.flatnonzero(machine == m).tolist()) for m in dict.fromkeys(machine.tolist()))
        return cls(idx, flops, bw, blocks)

    @property
    def n(self) -> int:
        return len(self.devices)

    @cached_property
    def csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(xadj, adjncy, eweights, vweights) as METIS wants them: every off-diagonal pair, both ways."""
        n = self.n
        off = ~np.eye(n, dtype=bool)
        xadj = np.arange(0, n * (n - 1) + 1, max(n - 1, 1), dtype=np.int64) if n > 1 else np.zeros(2, np.int64)[:n + 1]
        adjncy = np.nonzero(off)[1].astype(np.int64)
        w = self.bandwidth[off]
        scale = min(1e4, _MAX_TOTAL_WEIGHT / max(len(w), 1)) / w.max() if len(w) else 1.0
        ew = np.maximum(1, np.rint(w * scale)).astype(np.int64)
        vw = np.maximum(1, np.rint(16 * self.flops / self.flops.min())).astype(np.int64)
        return xadj, adjncy, ew, vw


def cut_weight(graph: DeviceGraph, parts: list[np.ndarray] | list[list[int]]) -> float:
    """Cut(P) of Eq. 2 in bytes/s: the bandwidth of every device pair that lies in different parts,
    each unordered pair counted once. ``parts`` hold cluster device ids."""
    label = np.full(graph.n, -1)
    pos = {int(d): i for i, d in enumerate(graph.devices)}
    for p, members in enumerate(parts):
        label[[pos[int(d)] for d in members]] = p
    cross = label[:, None] != label[None, :]
    return float(graph.bandwidth[cross].sum() / 2.0)


def partition(graph: DeviceGraph, k: int, objective: str = "min", balance: float = 1.2,
              seed: int = 0) -> list[np.ndarray]:
    """Cut ``graph`` into exactly ``k`` non-empty parts; returns cluster device ids per part,
    parts ordered by their smallest device id (deterministic for a seed).

    ``objective="min"`` minimises Cut(P) (METIS multilevel k-way), ``"max"`` maximises it
    (dealing each machine's devices over the parts; see the module docstring). ``balance`` bounds
    max part compute / mean part compute. Tiny cases need no METIS: k == 1 is the whole set,
    k == n is one device per part.
    """
    n = graph.n
    if objective not in OBJECTIVES:
        raise ConfigError("planner.cut", objective, f"must be one of {OBJECTIVES}", "use min or max")
    if not 1 <= k <= n:
        raise ConfigError("k", k, f"a graph of {n} devices splits into 1..{n} non-empty parts", "choose a smaller k")
    if balance < 1.0:
        raise ConfigError("planner.balance", balance, "the balance factor max/mean is at least 1", "use e.g. 1.2")
    if k == 1:
        labels = np.zeros(n, dtype=np.int64)
    elif k == n:
        labels = np.arange(n)
    elif objective == "max":
        labels = _deal(graph, k, seed)
    elif n > _WHOLE_MACHINES_FROM:  # also for k > n/2: agglomeration merges n - k times, O(n^2) each
        labels = _whole_machines(graph, k)
    elif 2 * k > n:
        labels = _agglomerate(graph, k, balance)
    else:
        labels = _metis(graph, k, balance, seed)
    parts = [graph.devices[labels == p] for p in range(k)]
    return sorted(parts, key=lambda a: int(a.min()))


def _metis(graph: DeviceGraph, k: int, balance: float, seed: int) -> np.ndarray:
    """Min-cut labels from pymetis. Recursive bisection first for k <= 8 (the paper's step ii) and
    for k > 64 (k-way takes 5-10x longer there: 0.1-0.2 s on 1024 devices, per call), k-way for
    8 < k <= 64, where it cut better on our benchmarks; when recursive bisection leaves a part empty (it can, with very unequal vertex weights and a loose bound) the
    k-way scheme is tried; any part still empty takes the vertex its largest part is least
    connected to. METIS reports such trouble on the C stdout, which is silenced here so that
    ``--json`` output stays one JSON document."""
    import pymetis

    xadj, adjncy, ew, vw = graph.csr
    opts = pymetis.Options(ufactor=max(1, int(round(1000 * (balance - 1.0)))), seed=int(seed) % (2**31 - 1), niter=10)
    labels = None
    for recursive in ((True, False) if k <= 8 or k > _KWAY_UP_TO else (False,)):
        with _quiet_c_stdout():
            _, out = pymetis.part_graph(k, adjacency=pymetis.CSRAdjacency(xadj, adjncy), vweights=vw, eweights=ew,
                                        options=opts, recursive=recursive)
        labels = np.asarray(out, dtype=np.int64)
        if len(np.unique(labels)) == k:
            return labels
    bw = np.where(np.isfinite(graph.bandwidth), graph.bandwidth, 0.0)
    for p in range(k):
        if not (labels == p).any():
            counts = np.bincount(labels, minlength=k)
            donor = np.flatnonzero(labels == int(np.argmax(counts)))
            inside = bw[np.ix_(donor, donor)].sum(axis=1)
            labels[donor[int(np.argmin(inside))]] = p
    return labels


def _whole_machines(graph: DeviceGraph, k: int) -> np.ndarray:
    """Min-cut labels for very large graphs (METIS on a complete graph of 4096 devices reads 16 M
    edges, 0.03-1 s a call): with at most as many parts as machines, whole machines (cliques of
    the fastest links, so no machine is cut) go, largest compute first, to the part with the least
    compute so far (LPT), which balances the parts within one machine's compute; with more parts,
    each machine is cut into pieces in proportion to its compute. With equal links between
    machines every partition that keeps the machines whole cuts about the same bandwidth, so this
    is the min cut there (not so with uneven links between machines: a heuristic)."""
    labels = np.empty(graph.n, dtype=np.int64)
    blocks = [list(b) for b in graph.blocks]
    if k > len(blocks):
        # more parts than machines: machine m is cut into c_m consecutive pieces, c_m in proportion
        # to its compute (largest remainders, 1 <= c_m <= its devices, sum c_m = k)
        comp = np.array([graph.flops[b].sum() for b in blocks])
        sizes = np.array([len(b) for b in blocks])
        share = comp / comp.sum() * k
        c = np.clip(np.floor(share).astype(np.int64), 1, sizes)
        while c.sum() < k:
            room = np.where(c < sizes, share - c, -np.inf)
            c[int(np.argmax(room))] += 1
        while c.sum() > k:
            room = np.where(c > 1, share - c, np.inf)
            c[int(np.argmin(room))] -= 1
        p = 0
        for b, cm in zip(blocks, c.tolist()):
            for piece in np.array_split(np.array(b), cm):
                labels[piece] = p
                p += 1
        return labels
    load = np.zeros(k)
    for block in sorted(blocks, key=lambda b: (-float(graph.flops[b].sum()), b[0])):
        p = int(np.argmin(load))
        labels[block] = p
        load[p] += float(graph.flops[block].sum())
    return labels


@contextlib.contextmanager
def _quiet_c_stdout():
    """Send file descriptor 1 to /dev/null for the duration (C libraries print there directly)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real stdout (embedded interpreters)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _agglomerate(graph: DeviceGraph, k: int, balance: float) -> np.ndarray:
    """Min-cut labels when k > n/2, where METIS' recursive bisection would have to split graphs
    of one or two vertices (it then fails loudly): start from singletons and merge, n - k times,
    the two parts joined by the most bandwidth (heavy-edge matching, the coarsening step itself)
    among the pairs whose merged compute stays within the balance bound; if no pair qualifies,
    the two lightest parts merge."""
    n = graph.n
    bw = np.where(np.isfinite(graph.bandwidth), graph.bandwidth, 0.0)
    labels = np.arange(n)
    load = graph.flops.astype(float).copy()
    limit = balance * graph.flops.sum() / k
    alive = list(range(n))
    between = bw.copy()
    for _ in range(n - k):
        sub = between[np.ix_(alive, alive)]
        ok = (load[alive][:, None] + load[alive][None, :]) <= limit * (1 + 1e-9)
        np.fill_diagonal(ok, False)
        if ok.any():
            flat = int(np.argmax(np.where(ok, sub, -1.0)))
            a, b = alive[flat // len(alive)], alive[flat % len(alive)]
        else:
            a, b = sorted(alive, key=lambda p: (load[p], p))[:2]
        a, b = min(a, b), max(a, b)
        labels[labels == b] = a
        load[a] += load[b]
        between[a, :] += between[b, :]
        between[:, a] += between[:, b]
        between[a, a] = 0.0
        alive.remove(b)
    return np.searchsorted(np.array(alive), labels)


def _deal(graph: DeviceGraph, k: int, seed: int) -> np.ndarray:
    """Max-cut labels: deal each block (machine) over the k parts; within a block the fastest
    devices go first; each goes to the part holding the fewest of this block, then the least
    compute, then (ties) a seed-rotated order. Larger blocks are dealt first so remainders of
    small machines can even out the compute."""
    labels = np.full(graph.n, -1, dtype=np.int64)
    load = np.zeros(k)
    rot = np.roll(np.arange(k), seed % k)
    rank = np.empty(k, dtype=np.int64)
    rank[rot] = np.arange(k)
    for block in sorted(graph.blocks, key=lambda b: (-len(b), b[0])):
        taken = np.zeros(k, dtype=np.int64)
        for v in sorted(block, key=lambda v: (-graph.flops[v], v)):
            # the part with the fewest of this block, then the least compute, then the rotated order
            p = int(np.lexsort((rank, load, taken))[0])
            labels[v] = p
            taken[p] += 1
            load[p] += graph.flops[v]
    # the parts must be non-empty; with n >= k dealing the first block already touches min(g, k)
    # parts, and later blocks fill the emptiest parts first, so this only repairs pathological inputs
    for p in range(k):
        if not (labels == p).any():
            counts = np.bincount(labels, minlength=k)
            labels[np.flatnonzero(labels == int(np.argmax(counts)))[-1]] = p
    return labels


# ---- phase 2, step (iii): stage order --------------------------------------------------------
def group_bandwidth(cluster_bandwidth: np.ndarray, groups: list[tuple[int, ...]] | list[np.ndarray]) -> np.ndarray:
    """g x g matrix of the best link between two groups (bytes/s): max beta over device pairs,
    the pair whose devices will be chosen as the two stages' leaders."""
    g = len(groups)
    if g <= 1:
        return np.zeros((g, g))
    flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in groups])
    starts = np.cumsum([0] + [len(x) for x in groups[:-1]])
    sub = cluster_bandwidth[np.ix_(flat, flat)]
    sub = np.where(np.isfinite(sub), sub, 0.0)
    out = np.maximum.reduceat(np.maximum.reduceat(sub, starts, axis=0), starts, axis=1)
    np.fill_diagonal(out, 0.0)
    return out


def top_tau_order(weight: np.ndarray, tau: int = 2, budget: int = 500) -> tuple[list[int], float]:
    """Stage order by the top-tau greedy path search of §4.3 step (iii).

    ``weight[a, b]`` is the bandwidth between groups a and b (bytes/s). The cost of a path is the
    time to move one byte along it, sum over its edges of 1 / weight (the bandwidth part of
    Comm-PP-Hop, Appendix B eq. 6), so the best path is the one with the highest bandwidths.
    Two nested loops as in the paper: every group is tried as the start; from each partial path
    the search recurses into the tau unvisited neighbours with the highest bandwidth, until a
    full (Hamiltonian) path is built. Unlike the public prototype it keeps the BEST complete path
    over all branches, and it prunes a partial path as soon as its cost reaches the best so far
    (costs are non-negative, so no better path is lost) or when even the cheapest edge for every
    missing hop cannot beat it (this makes equal-bandwidth groups cost O(g^2)). ``budget`` caps the number of expanded
    partial paths; past it every branch completes greedily (tau = 1), so the call stays
    O(budget * g) for any number of groups. Returns (order, cost in s/byte).
    """
    g = len(weight)
    if g <= 1:
        return list(range(g)), 0.0
    with np.errstate(divide="ignore"):
        inv = np.where(weight > 0, 1.0 / np.maximum(weight, 1e-300), np.inf)
    np.fill_diagonal(inv, np.inf)
    best_cost, best_path = np.inf, list(range(g))
    expanded = 0
    neighbours = np.argsort(inv, axis=1, kind="stable")  # per group: most bandwidth first
    cheapest = float(inv[np.isfinite(inv)].min()) if np.isfinite(inv).any() else 0.0

    def extend(path: list[int], seen: np.ndarray, cost: float) -> None:
        nonlocal best_cost, best_path, expanded
        # lower bound: every edge still to add costs at least the cheapest edge of the graph
        if cost + (g - len(path)) * cheapest >= best_cost * (1 - 1e-12):
            return
        if len(path) == g:
            best_cost, best_path = cost, list(path)
            return
        expanded += 1
        width = tau if expanded <= budget else 1
        last, taken = path[-1], 0
        for nb in neighbours[last]:
            if taken == width:
                break
            if seen[nb]:
                continue
            taken += 1
            seen[nb] = True
            path.append(int(nb))
            extend(path, seen, cost + inv[last, nb])
            path.pop()
            seen[nb] = False

    for start in range(g):
        seen = np.zeros(g, dtype=bool)
        seen[start] = True
        extend([start], seen, 0.0)
    return best_path, float(best_cost)


def odd_machine_parts(cluster: Cluster, sets: list[np.ndarray], model) -> bool:
    """Whether some set spans machines of which two hold an odd number of its devices: TP 2 inside
    the machines leaves one device on each, and a pair across them may be the only stage they fit
    (the search then also drafts each set as one group, whose options pair them: ``Evaluator.group_options``)."""
    if model.num_kv_heads < 2:
        return False
    for d in sets:
        per = np.bincount([cluster.devices[x].machine for x in d.tolist()])
        if int((per % 2 == 1).sum()) >= 2:
            return True
    return False
