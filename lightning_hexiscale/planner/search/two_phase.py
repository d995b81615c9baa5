"""The two-phase hierarchical search of §4 with the iterative optimisation of §4.4, and what it adds.

One iteration, for a number of pipelines D_dp and a cut option (min / max, §4.4):

1. Phase 1 (§4.2): the global graph is cut into D_dp GPU sets (:func:`partition.partition`).
2. Phase 2 (§4.3): set i is cut into k_i groups of well-connected GPUs (min cut, looser balance);
   the groups are ordered by the top-tau path search over inter-group bandwidth; each group's
   *intra-group strategy* (its GPUs split per machine into stages of TP t) is chosen with the cost
   model by coordinate descent on the pipeline's time; stage leaders minimise the hops (a Viterbi
   pass over the stage chain); the reversed chain is tried too (LM head at the other end).
3. Layers to stages in proportion to speed, then out-of-memory rebalancing, then a local refine
   (:func:`assemble.split_layers`).
4. Batches: every distinct layout gets its best batch split and micro-batch size per pipeline
   (:class:`batching.BatchTimer`, the arithmetic of ``estimate()``); the best plan is kept.

Across iterations D_dp is enumerated (every value for small clusters, a geometric ladder plus
machine counts for large ones), the promising D_dp values (all of them when the iterations allow)
then get the cut option the first sweep did not give them, and the best D_dp values (and their
neighbours) are revisited with varied k_i, METIS seeds and balance. The cut option comes from
exponential moving averages of the simulated data-parallel time and pipeline (hop + bubble) time:
when DP dominates, the next iteration maximises the cut (DP gets the fast links), otherwise it
minimises it; one iteration in five takes the other option so that both averages stay informed.
All randomness comes from one ``numpy.random.default_rng(seed)``: a seed gives the same plan.

Where it goes beyond §4 (exact batch splits, layers off slow data-parallel links, mixed structures
on small clusters, a final local improvement, pruning at scale, device subsets) and why: each
closed a gap measured against the true optimum; docs/concepts/planner.md lists them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.units import format_seconds
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.planner.cost.estimate import Estimate, Workload, estimate
from lightning_hexiscale.planner.cost.sources import stage_rule
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.planner.search import refine
from lightning_hexiscale.planner.search.assemble import (DP_OPTIONS, SMALL_CLUSTER, DraftContext, Evaluator,
                                                         batch_micro_sizes, chain_draft, micro_batch_candidates,
                                                         minimum_memory_message)
from lightning_hexiscale.planner.search.batching import BatchTimer, layout_key, layout_plan
from lightning_hexiscale.planner.search.dp_split import resplit, resplit_cost
from lightning_hexiscale.planner.search.floors import exposed_floor, local_time, zero3_step_floor
from lightning_hexiscale.planner.search.infeasible import capacity_message
from lightning_hexiscale.planner.search.partition import DeviceGraph, odd_machine_parts, partition
from lightning_hexiscale.planner.search.regroup import regroup, replicas
from lightning_hexiscale.planner.search.settings import (LARGE_FROM, Iteration, LogEntry, SearchResult,
                                                         SearchSettings, dp_candidates, first_sweep)
from lightning_hexiscale.planner.search.subsets import TRIAL_REFINE, name_idle, shrink
from lightning_hexiscale.planner.search.symmetric_seeds import seed_symmetric
from lightning_hexiscale.progress import Heartbeat, shown_as

_PRUNE = 1.1
"""Large clusters: a layout whose pipelines alone (no data-parallel time: a lower bound of its cost
at the drafted micro-batch size) take 1.1 x the best plan so far is not scored; the 10 % margin
covers the batch split's other micro-batch sizes. 1.25 before 2026-11-26: on seven replicated
presets of 256-1024 devices 1.1 found the same plans (with fewer layouts scored)."""
_STARTS = 4
"""Layouts (the best for each number of pipelines, best first) the final local improvement starts from."""
COLUMN = 0
"""``Iteration.unit`` of a peeled column (:meth:`SearchRun.columns`): one device per machine."""


def progress_kind(s: SearchSettings) -> str | None:
    """How a search shows its progress (:func:`progress.shown_as` on stderr): a tqdm bar on a terminal or
    in a Jupyter kernel, :data:`HEARTBEAT`'s plain lines into a pipe or a log file, where each run's
    bar was a line of carriage returns (``hexiscale plan`` runs up to two searches per device
    subset); None without ``progress`` or with a single iteration."""
    return shown_as(bool(s.progress) and s.iterations >= 2, sys.stderr)


HEARTBEAT = Heartbeat(every_s=10.0)
"""The searches' plain progress lines, one per 10 s at most across the runs of a process (a plan of
32 GPUs is up to 60 runs of a second or two)."""


class SearchRun:
    """State of one search run (caches, moving averages, best plan)."""

    def __init__(self, cluster: Cluster, workload: Workload, global_batch: int, s: SearchSettings,
                 refine_share: float = 1.0, measured: dict[str, frozenset[int]] | None = None):
        self.cluster, self.workload, self.gb, self.s = cluster, workload, global_batch, s
        self.refine_share = refine_share
        """Fraction of the final improvement's budget (:func:`refine.budget_for`) this run gets."""
        self.L = workload.model.num_layers
        self.ev = Evaluator(cluster, workload, s.schedule, s.recompute)
        # the TP groups a stage may be: the settings' degrees, and on a type a layer table prices,
        # the degrees it measured (None when nothing restricts: no check anywhere); ``measured``:
        # cost.sources.measured_tp_degrees as search() found it once (None: read here)
        self.ev.stage_ok = stage_rule(cluster, workload, s.tp_degrees, measured)
        self.ev.idle_remainders = cluster.num_devices <= SMALL_CLUSTER and not s.use_all_devices
        self.graph = DeviceGraph.from_cluster(cluster)
        self.rng = np.random.default_rng(s.seed)
        self.mbs = micro_batch_candidates(global_batch, s.micro_batch_size, cluster.num_devices)
        self.shardings = (s.dp_sharding,) if s.dp_sharding else DP_OPTIONS
        max_dp = min(cluster.num_devices, global_batch // min(self.mbs))
        if s.max_pipelines:
            max_dp = min(max_dp, s.max_pipelines)
        self.dps = dp_candidates(cluster.num_devices, max_dp, len(cluster.machines))
        self.sweep = first_sweep(len(self.dps), s.iterations, cluster.num_devices > LARGE_FROM)
        """Indices into ``dps`` of the first iterations, in the order they are tried."""
        self._p1: dict[tuple, list[np.ndarray]] = {}
        self._p2: dict[tuple, list[tuple[int, ...]]] = {}
        self.ema = {"dp": 0.0, "pp": 0.0}
        self.best: tuple[float, Plan | None] = (math.inf, None)
        self.best_all: tuple[float, Plan | None] = (math.inf, None)
        """The best plan scored that gives every device work (what leaving devices idle is held against)."""
        self.by_dp: dict[int, float] = {}
        self.tried: set[tuple[int, str]] = set()
        self.mixed_tried: set[int] = set()
        self.best_step: tuple[int, str] | None = None
        """(D_dp, cut) of the iteration that found the best plan so far (not a peel)."""
        self.timer = BatchTimer(cluster, workload, global_batch, batch_micro_sizes(global_batch, s.micro_batch_size,
                                                                                 cluster.num_devices))
        self.top: dict[int, list[tuple[float, Plan, frozenset]]] = {}
        n = cluster.num_devices
        self.strongest = sorted(range(n), key=lambda d: (-cluster.devices[d].flops, -cluster.devices[d].memory_bytes, d))
        self.small = n <= SMALL_CLUSTER
        # every stage needs a layer and, without cross-machine TP, is a TP group inside a machine
        widest = max(len(m.devices) for m in cluster.machines)
        self.most_per_pipeline = self.L * min(workload.model.num_kv_heads, n if self.small else widest)
        self.peels: list[tuple[int, int, int]] = []
        self.peeled = 0
        self.units: dict[int, list[tuple[int, ...]]] = {1: [(d,) for d in self.strongest], 2: self.pairs(),
                                                        COLUMN: self.columns()}
        ok = self.ev.stage_ok
        if ok is not None:  # replica units whose TP groups the rule refuses are not peeled
            self.units = {1: [u for u in self.units[1] if ok(u)], 2: [u for u in self.units[2] if ok(u)],
                          COLUMN: [u for u in self.units[COLUMN] if all(ok((d,)) for d in u)]}
        if self.small:
            # mixed structures: r replica units (single devices or same-machine pairs, strongest
            # first; or columns, thin pipelines of one device per machine) + the rest as 1 or 2 pipelines
            for r in range(1, 9):
                for unit in (1, 2, COLUMN):
                    for rest in (1, 2):
                        size = len(self.units[unit][0]) if self.units[unit] else n
                        left = n - size * r
                        if r <= len(self.units[unit]) and left >= rest and r + rest <= max_dp:
                            self.peels.append((r, rest, unit))

    def columns(self) -> list[tuple[int, ...]]:
        """Columns: the k-th strongest device of every machine, k = 0, 1, ... up to the smallest
        machine (none on one machine). Peeled, a column is a thin pipeline of one single-device stage
        per machine (phase 2 groups a set by machine), beside one or two pipelines of the rest.

        Why: over a slow link such a pipeline crosses it once, at another stage boundary than the
        wide pipeline beside it, so their hops do not share the NICs (:mod:`cost.nic` prices a
        boundary's hops together), and the batch split gives it the share its speed earns. Phase 1
        cuts sets of equal compute and never proposes it; from the best equal split the local
        improvement needs two device moves whose intermediate layouts are slower. On 2 x 4 A800 at
        1 GB/s, an 8-layer Llama-2 7B at batch 32 (recomputation on): the optimum, 2.243 s, where
        the search stopped at 2.323 s before columns were peeled."""
        by_machine: dict[int, list[int]] = {}
        for d in self.strongest:
            by_machine.setdefault(self.cluster.devices[d].machine, []).append(d)
        if len(by_machine) < 2:
            return []
        depth = min(len(ds) for ds in by_machine.values())
        return [tuple(sorted(ds[k] for ds in by_machine.values())) for k in range(depth)]

    def pairs(self) -> list[tuple[int, ...]]:
        """Same-machine device pairs, strongest machines first (TP-2 replica candidates)."""
        by_machine: dict[int, list[int]] = {}
        for d in self.strongest:
            by_machine.setdefault(self.cluster.devices[d].machine, []).append(d)
        return [tuple(ds[k:k + 2]) for ds in by_machine.values() for k in range(0, len(ds) - 1, 2)]

    def phase1(self, step: Iteration) -> list[np.ndarray]:
        """D_dp GPU sets (§4.2). With ``step.peel = r`` the r strongest replica units (devices,
        same-machine pairs or columns) are sets of their own and the rest is cut into D_dp - r sets
        (mixed structures, beyond §4)."""
        dp, cut, balance, seed = step.dp, step.cut, step.balance, step.seed
        key = (dp, cut, balance, seed if cut == "min" else seed % dp, step.peel, step.unit)
        if key not in self._p1:
            if step.peel:
                solo = self.units[step.unit][:step.peel]
                taken = {d for u in solo for d in u}
                rest = np.array(sorted(set(range(self.cluster.num_devices)) - taken), dtype=np.int64)
                sub = DeviceGraph.from_cluster(self.cluster, rest)
                parts = [np.array(u) for u in solo] + partition(sub, dp - step.peel, cut, balance, seed)
                self._p1[key] = sorted(parts, key=lambda a: int(a.min()))
            else:
                self._p1[key] = partition(self.graph, dp, cut, balance, seed)
        return self._p1[key]

    def phase2(self, devices: np.ndarray, k: int, seed: int) -> list[tuple[int, ...]]:
        """k_i groups of well-connected GPUs (min cut); each group's devices sorted machine-first."""
        key = (tuple(devices.tolist()), k, seed)
        if key not in self._p2:
            by_machine: dict[int, list[int]] = {}
            for d in sorted(key[0]):
                by_machine.setdefault(self.cluster.devices[d].machine, []).append(d)
            if k == len(by_machine):
                # k = the machines in the set: a machine is a clique of the fastest links, so the
                # min cut into k groups is the machines themselves (METIS would trade that for balance)
                self._p2[key] = [tuple(g) for g in by_machine.values()]
            else:
                sub = DeviceGraph.from_cluster(self.cluster, devices)
                groups = partition(sub, k, "min", self.s.group_balance, seed)
                self._p2[key] = [tuple(sorted(g.tolist())) for g in groups]
        return self._p2[key]

    def mixed_deal(self, dp: int) -> list[np.ndarray] | None:
        """Phase 1's max cut with the weak machines kept whole (beyond §4, small clusters): the
        machines whose GPUs are slower than the median machine's go whole to the sets (largest
        compute first, to the set with the least), the others are dealt GPU by GPU (to the set
        holding the fewest of that machine, then the least compute). A weak machine's GPUs can
        then form a fast TP group inside one pipeline while the strong GPUs still give data
        parallelism its fast links. None when there is no weak or no strong machine."""
        c = self.cluster
        machines = [list(m.devices) for m in c.machines]
        speed = [c.devices[m[0]].flops for m in machines]
        median = float(np.median(speed))
        weak = [m for m, f in zip(machines, speed) if f < median]
        strong = [m for m, f in zip(machines, speed) if f >= median]
        if not weak or not strong or dp < 2:
            return None
        parts: list[list[int]] = [[] for _ in range(dp)]
        load = np.zeros(dp)
        for m in sorted(weak, key=lambda m: (-sum(c.devices[d].flops for d in m), m[0])):
            p = int(np.argmin(load))
            parts[p] += m
            load[p] += sum(c.devices[d].flops for d in m)
        for m in sorted(strong, key=lambda m: (-len(m), m[0])):
            taken = np.zeros(dp, dtype=np.int64)
            for d in sorted(m, key=lambda d: (-c.devices[d].flops, d)):
                p = int(np.lexsort((np.arange(dp), load, taken))[0])
                parts[p].append(d)
                taken[p] += 1
                load[p] += c.devices[d].flops
        if any(not p for p in parts):
            return None
        return sorted((np.array(sorted(p), dtype=np.int64) for p in parts), key=lambda a: int(a.min()))

    def type_groups(self, devices: np.ndarray) -> list[tuple[int, ...]]:
        """The set's devices grouped by GPU type (a group may span machines)."""
        by_type: dict[str, list[int]] = {}
        for d in sorted(devices.tolist()):
            by_type.setdefault(self.cluster.devices[d].gpu_type, []).append(d)
        return [tuple(g) for g in by_type.values()]

    def machines_in(self, devices: np.ndarray) -> int:
        return len({self.cluster.devices[d].machine for d in devices})

    # ---- one iteration ------------------------------------------------------------------------
    def evaluate(self, groups_per_pipe: list[list[tuple[int, ...]]]) -> tuple[float, Plan | None, tuple | None]:
        """Best complete plan for one phase-2 result.

        Each pipeline is drafted (strategies, leaders, layer split) for every dp sharding and a few
        micro-batch sizes; every distinct layout then gets its exact best batch split and
        micro-batch size per pipeline (:meth:`batching.BatchTimer.best`, the arithmetic of
        ``estimate()``). Returns (cost, plan, (exposed DP time, hops + bubble) of its slowest pipeline).
        """
        P = len(groups_per_pipe)
        best: tuple[float, Plan | None] = (math.inf, None)
        large = self.cluster.num_devices > LARGE_FROM
        hopeless = False
        for sharding in self.shardings_for(P):
            if large and sharding == "zero3" and (best[1] is not None or hopeless):
                # large clusters: ZeRO-3 only when neither ZeRO-2 nor DDP fits anything (its
                # gathers overlap compute at theta_3 >= 1 at best and it serves its partners'
                # uses; it is there for memory), nor when the pipelines alone were hopeless
                # (ZeRO-3 only adds to their time), to bound the search time
                continue
            layouts: dict[tuple, Plan] = {}
            for mb in self.draft_mbs(P):
                ctx = DraftContext(mb, sharding, P, max(1, self.gb // P // mb), self.s.tau)
                drafts = [self.ev.draft(g, ctx) for g in groups_per_pipe]
                if any(d is None for d in drafts):
                    continue
                if self.cluster.num_devices > LARGE_FROM and local_time(drafts, self.gb // mb) > _PRUNE * self.best[0]:
                    hopeless = True
                    continue  # large clusters: hopeless even without data parallelism; not scored
                variants = [drafts]
                if P > 1 and self.cluster.num_devices <= LARGE_FROM:  # layers split for their DP links too
                    flat = [tuple(d for g in groups for d in g) for groups in groups_per_pipe]
                    variants.append([resplit(self.ev, d, flat[:i] + flat[i + 1:], ctx) for i, d in enumerate(drafts)])
                for ds in variants:
                    layout = layout_plan([list(d.stages) for d in ds], [d.layers for d in ds], sharding,
                                         self.s.schedule, self.s.recompute, self.L)
                    candidates = [layout]
                    if large and sharding == "zero2" and "ddp" in self.shardings:
                        # large clusters draft for ZeRO-2's memory only and score each layout under
                        # DDP too (which fits where its larger states do): DDP's own drafts would
                        # double the drafting; ZeRO-2 costs DDP's time plus its post-step all-gather
                        candidates.append(dataclasses.replace(layout, dp_sharding="ddp"))
                    for cand in candidates:
                        if large and self.floor_time(ds, mb, cand.dp_sharding) > _PRUNE * self.best[0]:
                            continue  # its data parallelism alone makes it hopeless (planner/search/floors.py)
                        layouts.setdefault(layout_key(cand), cand)
            for layout in layouts.values():
                cost, plan = self.timer.best(layout, self.meta())
                if plan is not None:
                    self.remember(cost, plan)
                    if cost < best[0]:
                        best = (cost, plan)
        if best[1] is None:
            return math.inf, None, None
        return best[0], best[1], self.timer.breakdown(best[1])

    def floor_time(self, drafts: list, mb: int, sharding: str) -> float:
        """A lower bound of a layout's iteration time at micro-batch size ``mb`` (the drafted one):
        the pipelines' own times water-filled with each pipeline's exposed data-parallel time at
        least :func:`floors.exposed_floor` (under ZeRO-3 each stage's per-micro-batch time raised by
        :func:`floors.zero3_step_floor`)."""
        stages, layers = [d.stages for d in drafts], [d.layers for d in drafts]
        floor = exposed_floor(self.timer, stages, layers, mb, sharding, self.s.recompute)
        if sharding == "zero3":  # the drafts price ZeRO-3's compute, not its per-use gathers
            extra = zero3_step_floor(self.timer, stages, layers, mb, self.s.recompute)
            drafts = [dataclasses.replace(d, per_mb_s=tuple(a + b for a, b in zip(d.per_mb_s, x)))
                      for d, x in zip(drafts, extra)]
        return local_time(drafts, self.gb // mb, floor)

    def shardings_for(self, num_pipelines: int) -> tuple[str, ...]:
        """The dp shardings to draft layouts for: every one of the settings (none dominates: ZeRO-2
        needs less memory than DDP but exposes its post-step all-gather, planner/cost/zero_terms.py);
        beyond 64 devices DDP's layouts come from ZeRO-2's drafts (:meth:`evaluate`)."""
        if self.cluster.num_devices > LARGE_FROM and "zero2" in self.shardings and num_pipelines > 1:
            return tuple(sh for sh in self.shardings if sh != "ddp")
        return self.shardings

    def draft_mbs(self, num_pipelines: int) -> list[int]:
        """Micro-batch sizes to draft layer splits with: those of the candidates that fit a
        pipeline's share of the batch (the batch split then picks one per pipeline)."""
        share = max(1, self.gb // num_pipelines)
        fit = [m for m in self.mbs if m <= share] or [min(self.mbs)]
        if self.cluster.num_devices > LARGE_FROM:  # one draft (the split picks the micro-batch size anyway)
            return fit[:1]
        if not self.small:
            return fit[:1] + fit[-1:] if len(fit) > 1 else fit
        return fit

    def remember(self, cost: float, plan: Plan) -> None:
        """Keep the best layouts for each number of pipelines (on small clusters the best two with
        different device sets): the starts of the final local improvement (varied structures, not
        only variations of the best one)."""
        if plan.world_size == self.cluster.num_devices and cost < self.best_all[0]:
            self.best_all = (cost, plan)
        P = plan.num_pipelines
        sets = frozenset(frozenset(p.devices) for p in plan.pipelines)
        kept = [e for e in self.top.get(P, []) if e[2] != sets or e[0] <= cost]
        if any(e[2] == sets for e in kept):
            self.top[P] = kept
            return
        kept = sorted(kept + [(cost, plan, sets)], key=lambda e: e[0])
        self.top[P] = kept[:2 if self.small else 1]

    def meta(self) -> dict[str, Any]:
        return {"planner": "hexiscale-search", "model": self.workload.model.name, "cluster": self.cluster.name,
                "seed": self.s.seed, "iterations": self.s.iterations}

    def choose_cut(self, it: int) -> str:
        if self.s.cut != "auto":
            return self.s.cut
        if it < 2:
            return ("min", "max")[it]
        pick = "max" if self.ema["dp"] > self.ema["pp"] else "min"
        if self.rng.random() < 0.2:
            pick = "max" if pick == "min" else "min"
        return pick

    def plan_iteration(self, it: int) -> Iteration:
        """What iteration ``it`` tries: first every D_dp; then the promising D_dp values (every one
        when the iterations allow) with the cut option they did not get; then, on clusters of up
        to 16 devices, mixed structures (the strongest devices or same-machine pairs as replicas,
        or columns as thin pipelines, the rest as one or two pipelines); then variations around the best D_dp values."""
        cut = self.choose_cut(it)
        explore = len(self.dps)
        if it < len(self.sweep):
            return Iteration(self.dps[self.sweep[it]], cut, self.s.balance, self.s.seed)
        ranked = sorted((c, dp) for dp, c in self.by_dp.items() if math.isfinite(c))
        if self.s.cut == "auto":
            # first the ladder neighbours of the best D_dp with the cut that found it (the first
            # sweep may have given them the other cut), then the promising values' other cut
            cands = []
            if self.best_step is not None and self.best_step[0] in self.dps:
                j = self.dps.index(self.best_step[0])
                cands += [(self.dps[k], self.best_step[1]) for k in (j - 1, j + 1) if 0 <= k < len(self.dps)]
            wide = 2 * explore + len(self.peels) <= self.s.iterations
            cands += [(dp, other) for _, dp in (ranked if wide else ranked[:4]) for other in ("min", "max")]
            for dp, other in cands:
                if (dp, other) not in self.tried:
                    return Iteration(dp, other, self.s.balance, self.s.seed)
        if self.peeled < len(self.peels):
            r, rest, unit = self.peels[self.peeled]
            self.peeled += 1
            return Iteration(r + rest, cut, self.s.balance, self.s.seed, peel=r, unit=unit)
        pool = [dp for _, dp in ranked[:3]] or self.dps
        dp = int(pool[int(self.rng.integers(len(pool)))])
        if self.rng.random() < 0.3:  # a neighbour of a good D_dp in the candidate ladder
            j = self.dps.index(dp) if dp in self.dps else 0
            dp = self.dps[int(np.clip(j + self.rng.choice([-1, 1]), 0, len(self.dps) - 1))]
        balance = float(self.rng.choice([self.s.balance, self.s.balance, 1.05, 1.5, 2.0]))
        return Iteration(dp, cut, balance, int(self.rng.integers(1 << 30)), jitter=0.5)

    def run(self) -> SearchResult:
        t0 = time.perf_counter()
        log: list[LogEntry] = []
        # which search this is: `hexiscale plan` runs one per device subset and recompute setting, and
        # bars that restart from 0 % with the same name read as a loop
        what = [f"{self.cluster.num_devices} devices"] + (
            [f"recompute {'on' if self.s.recompute else 'off'}"] if isinstance(self.s.recompute, bool) else [])
        shown = progress_kind(self.s)
        bar = tqdm(total=self.s.iterations, desc=f"search ({', '.join(what)})", unit="it", leave=False,
                   dynamic_ncols=True, disable=shown != "bar")
        for it in range(self.s.iterations):
            if shown == "lines":
                HEARTBEAT.beat(lambda: f"search ({', '.join(what)}): iteration {it + 1}/{self.s.iterations}"
                               + (f", best {format_seconds(self.best[0])}" if math.isfinite(self.best[0]) else ""))
            step = self.plan_iteration(it)
            sets = self.phase1(step)
            groups = []
            for d in sets:
                k = self.machines_in(d)
                if step.jitter and self.rng.random() < step.jitter:
                    k = int(np.clip(k + self.rng.choice([-1, 1, 2]), 1, len(d)))
                groups.append(self.phase2(d, min(k, len(d)), step.seed))
            if max(len(d) for d in sets) > self.most_per_pipeline:
                cost, plan, est = math.inf, None, None  # a pipeline would need more stages than layers
            else:
                cost, plan, est = self.evaluate(groups)
            if self.small:
                # beyond §4 (small clusters): the same sets grouped by GPU type across machines
                by_type = [self.type_groups(d) for d in sets]
                if by_type != groups:
                    alt = self.evaluate(by_type)
                    if alt[0] < cost:
                        cost, plan, est = alt
                # where nothing fitted: each set as one group, when machines have odd devices to pair
                # across them (the cross-machine options of Evaluator.group_options need a group
                # spanning machines; only then, as it costs a third evaluation)
                whole = [[tuple(sorted(d.tolist(), key=lambda x: (self.cluster.devices[x].machine, x)))] for d in sets]
                if (not math.isfinite(cost) and whole != groups and whole != by_type
                        and odd_machine_parts(self.cluster, sets, self.workload.model)):
                    alt = self.evaluate(whole)
                    if alt[0] < cost:
                        cost, plan, est = alt
                if not step.peel and step.dp not in self.mixed_tried:
                    self.mixed_tried.add(step.dp)
                    mixed = self.mixed_deal(step.dp)
                    if mixed is not None and not all(np.array_equal(a, b) for a, b in zip(mixed, sets)):
                        alt = self.evaluate([self.phase2(d, self.machines_in(d), step.seed) for d in mixed])
                        if alt[0] < cost:
                            cost, plan, est = alt
            if not step.peel:
                self.by_dp[step.dp] = min(self.by_dp.get(step.dp, math.inf), cost)
                self.tried.add((step.dp, step.cut))
            if est is not None and math.isfinite(cost):
                for key, v in zip(("dp", "pp"), est):
                    self.ema[key] = 0.7 * self.ema[key] + 0.3 * v
            if cost < self.best[0]:
                self.best = (cost, plan)
                if not step.peel:
                    self.best_step = (step.dp, step.cut)
            log.append(LogEntry(it, step.dp, step.cut, cost, self.best[0]))
            bar.update(1)
            if math.isfinite(self.best[0]):
                bar.set_postfix_str(f"best {format_seconds(self.best[0])}", refresh=False)
        bar.close()
        seed_symmetric(self)  # machine-aligned symmetric layouts: the search is never slower than these
        if self.small:
            replicas(self)
            regroup(self)  # the best layouts' TP groups dealt into other pipeline counts
        self.improve()
        _, plan = self.best
        if plan is None:
            raise InfeasiblePlan(capacity_message(self.cluster, self.workload, self.gb)
                                 or minimum_memory_message(self.cluster, self.workload, self.gb, self.s.recompute is True))
        plan = name_idle(plan, self.cluster)
        est = estimate(plan, self.cluster, self.workload)
        if not est.feasible:
            plan, est = self.first_that_fits(plan, est)
        return SearchResult(plan, est, log, time.perf_counter() - t0)

    def first_that_fits(self, plan: Plan, est: Estimate) -> tuple[Plan, Estimate]:
        """The best remembered layout (one per number of pipelines) that ``estimate()`` fits, when the
        best plan does not: beyond 64 devices the batch split checks memory against a lower bound of
        the NCCL communicator buffers (``BatchTimer.exact_comms``), so its winner may be short by a few
        MiB (512 A800s with 1 GB/s between machines, Llama-2 70B at batch 512 without recomputation:
        8 devices short by 23-151 MiB, and that plan was returned). ``plan, est`` when none fits."""
        for cost, cand, _ in sorted((e for v in self.top.values() for e in v), key=lambda e: e[0]):
            cand = name_idle(cand, self.cluster)
            e = estimate(cand, self.cluster, self.workload)
            if e.feasible:
                return cand, e
        return plan, est

    def refine_context(self) -> refine.RefineContext:
        return refine.RefineContext(self.timer, self.workload.model, self.shardings,
                                    move_devices=self.small, repair=self.repair,
                                    meta=self.meta(), seed=self.s.seed, may_idle=not self.s.use_all_devices,
                                    stage_ok=self.ev.stage_ok)

    def improve(self) -> None:
        """Local improvement of the best layouts found (:mod:`planner.search.refine`), beyond §4."""
        budget = max(1, int(refine.budget_for(self.cluster.num_devices, self.s.iterations) * self.refine_share))
        ctx = self.refine_context()
        firsts = [e[0] for e in self.top.values()]
        seconds = [e for v in self.top.values() for e in v[1:]]
        starts = sorted(firsts, key=lambda e: e[0])[:_STARTS]
        starts += sorted(seconds, key=lambda e: e[0])[:_STARTS - 2]  # small clusters: runners-up too
        starts.sort(key=lambda e: e[0])
        for k, (cost, plan, _) in enumerate(starts):
            if budget <= 0:
                break
            share = budget if k == len(starts) - 1 else max(budget // 2, 1)
            cost, plan, used = refine.improve(plan, cost, ctx, share)
            budget -= used
            if plan.world_size == self.cluster.num_devices and cost < self.best_all[0]:
                self.best_all = (cost, plan)
            if cost < self.best[0] * (1 - 1e-12):
                self.best = (cost, plan)

    def polish(self, plan: Plan) -> tuple[float, Plan]:
        """The final improvement's climb (:func:`refine.improve`, ``subsets.TRIAL_REFINE`` of its
        budget) from ``plan``, a plan in this run's device ids that may leave devices idle (a device
        subset's plan, :meth:`subsets._Subsets.bring_back`): (time, plan), scored by this run's
        timer; (inf, plan) when it does not fit here."""
        budget = max(1, int(refine.budget_for(self.cluster.num_devices, self.s.iterations) * TRIAL_REFINE))
        like = layout_plan([[]], [()], plan.dp_sharding, self.s.schedule, self.s.recompute, self.L)
        start = refine.plan_from_layout(refine.layout_of(plan), like)
        cost, scored = self.timer.best(start, self.meta())
        if scored is None:
            return math.inf, plan
        ctx = dataclasses.replace(self.refine_context(), lookahead=True)
        cost, found, _ = refine.improve(scored, cost, ctx, budget)
        return cost, found

    def without(self, drop: frozenset[int]) -> tuple[float, Plan | None]:
        """The best layout found with the devices ``drop`` taken out (:func:`subsets.shrink`: stages
        re-formed, leaders and layers re-chosen, batches re-split exactly): how large clusters price
        leaving devices idle without a search of their own."""
        firsts = sorted((v[0] for v in self.top.values()), key=lambda e: e[0])[:1]
        # large clusters: leaders and layers afresh without the data-parallel-aware split (its
        # enumeration over hundreds of pipelines costs more than the search itself)
        repair = self.repair if self.cluster.num_devices <= LARGE_FROM else self.relead
        return shrink([p for _, p, _ in firsts], drop, self.timer, repair, self.meta(), self.ev.stage_ok)

    def relead(self, layout: refine.Layout, before: refine.Layout) -> refine.Layout:
        """The pipelines a move changed get their leaders and a compute- and memory-proportional
        layer split (:func:`assemble.chain_draft`) afresh, in their own stage order."""
        sharding, pipes = layout
        old = set(before[1])
        ctx = DraftContext(1, sharding, len(pipes), max(1, self.gb // len(pipes)), self.s.tau)
        out = []
        for p in pipes:
            d = None if p in old else chain_draft(self.ev, [st for st, _ in p], ctx)
            out.append(p if d is None else tuple(zip(d.stages, d.layers)))
        return sharding, tuple(out)

    def repair(self, layout: refine.Layout, before: refine.Layout) -> refine.Layout:
        """The pipelines a move changed get their leaders (phase 2) and a data-parallel-aware
        layer split (:func:`dp_split.resplit`) afresh."""
        sharding, pipes = layout
        old = set(before[1])
        P = len(pipes)
        flat = [tuple(d for st, _ in p for d in st) for p in pipes]
        out = []
        for i, p in enumerate(pipes):
            if p in old:
                out.append(p)
                continue
            ctx = DraftContext(1, sharding, P, max(1, self.gb // P), self.s.tau)
            best = None
            for stages in ([st for st, _ in p], [st for st, _ in p][::-1]):  # either end may lead
                d = chain_draft(self.ev, stages, ctx)
                if d is not None:
                    d, t = resplit_cost(self.ev, d, flat[:i] + flat[i + 1:], ctx)
                    if best is None or t < best[1]:
                        best = (d, t)
            out.append(p if best is None else tuple(zip(best[0].stages, best[0].layers)))
        return sharding, tuple(out)
