"""From GPU groups to a complete Plan: stage costs, intra-group strategies, leaders, layer and batch splits.

Shared by the §4 search and the baselines. The choices made here use the pipeline-local terms of
Appendix B (the same :mod:`cost.model` functions :func:`estimate.estimate` composes), cached per
stage; every complete plan is then scored by ``estimate()``. Pipeline-local means: per micro-batch

    Stage_j = l_j * (T_f + T_b)_j + head_j + Hop_j,      Pipeline(n) = sum_j Stage_j + (n - 1) * max_j Stage_j

with T_f, T_b from eq. 1-3 (recompute adds one forward to T_b; ZeRO-3 scales them by theta_3f,
theta_3b), head_j the LM head (3 x 2BSHV FLOPs) on the last stage, Hop_j eq. 6 with the chosen
leaders. The data-parallel term is left to ``estimate()`` (it couples the pipelines).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost.estimate import (Workload, hop_time, layer_times, stage_extra_times,
                                                       stage_memory_terms, usable_memory)
from lightning_hexiscale.planner.cost.sources import StageRule
from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage
from lightning_hexiscale.planner.search.partition import group_bandwidth, top_tau_order

DP_OPTIONS = ("ddp", "zero2", "zero3")
SMALL_CLUSTER = 16
"""Up to this many devices the search also tries what §4 does not (cross-machine TP groups, GPU-type
groups, single-device replicas peeled off, device moves in the final improvement): affordable there,
and where heterogeneous optima most often need it."""
_PERMUTE_GROUPS = 4
"""Up to SMALL_CLUSTER devices, a pipeline of at most this many groups tries every order of them."""
_UNCAPPED = 1 << 40


class Evaluator:
    """Cached pipeline-local cost terms for one cluster and workload."""

    def __init__(self, cluster: Cluster, workload: Workload, schedule: str = "1f1b", recompute: bool = True):
        if not isinstance(recompute, bool):  # "auto" is resolved by the search, per run (entry.search)
            raise TypeError(f"Evaluator(recompute={recompute!r}): pass True or False; the search resolves 'auto' "
                            "by running once without and once with recomputation")
        self.cluster, self.workload, self.schedule, self.recompute = cluster, workload, schedule, recompute
        self.model = workload.model
        self.bw, self.lat = cluster.bandwidth, cluster.latency
        self.flops, self.memory = cluster.flops, cluster.memory
        self.machine = np.array([d.machine for d in cluster.devices])
        self.types = [d.gpu_type for d in cluster.devices]
        c = cluster.calibration
        self.theta3 = (c.theta_zero3_fwd, c.theta_zero3_bwd)
        self.max_tp = self.model.num_kv_heads
        self._layer: dict[tuple, float] = {}
        self._tb: dict[tuple, tuple[float, float]] = {}
        self._hop: dict[tuple, tuple[np.ndarray, bool]] = {}
        self._order: dict[tuple, list[int]] = {}
        self._options: dict[tuple, list[list[tuple[int, ...]]]] = {}
        self._drafts: dict[tuple, PipeDraft | None] = {}
        self._caps: dict[tuple, int] = {}
        self._extra: dict[tuple, float] = {}
        self._usable: dict[tuple[int, ...], float] = {}
        self._sig: dict[tuple, bytes] = {}
        self._leaders: dict[tuple, tuple[list[tuple[int, ...]], list[float]]] = {}
        self._group_sig: dict[tuple[int, ...], bytes] = {}
        self._choices: dict[tuple, tuple[tuple[int, ...], int]] = {}
        self.reuse_choices = cluster.num_devices > 64
        self.cross_machine_tp = cluster.num_devices <= SMALL_CLUSTER
        """Up to SMALL_CLUSTER devices, groups spanning machines may also form TP groups across them."""
        self.stage_ok: StageRule | None = None
        """Which TP groups a stage may be (:class:`cost.sources.StageRule`: the settings' TP degrees
        and the degrees the layer tables measured; None: any up to the KV heads). With a restriction,
        the devices of a machine part that no allowed TP group covers are left out (idle)."""
        self.idle_remainders = False
        """Set by the search on small clusters whose plans may leave devices idle: a machine part
        not divisible by a TP degree t may also form whole groups of t, the rest idle (:meth:`group_options`)."""
        """Beyond 64 devices a structure's intra-group strategies are chosen once (first micro-batch
        size and sharding tried) and reused, to bound the search time; see :func:`draft_pipeline`."""

    def group_signature(self, group: tuple[int, ...]) -> bytes:
        if group not in self._group_sig:
            self._group_sig[group] = self.signature([group])
        return self._group_sig[group]

    def signature(self, groups: list[tuple[int, ...]]) -> bytes:
        """Digest of everything a pipeline's draft depends on, device for device in group order:
        bandwidth and latency among its devices, their FLOP/s, memory and type, group sizes, machine
        and NIC layout (which devices share a NIC, and its bandwidth)."""
        key = tuple(groups)
        if key in self._sig:
            return self._sig[key]
        idx = np.array([d for g in groups for d in g])
        h = hashlib.blake2b(digest_size=16)
        sub = (idx[:, None], idx)
        for arr in (self.bw[sub], self.lat[sub], self.flops[idx], self.memory[idx]):
            h.update(np.ascontiguousarray(arr).tobytes())
        # the device types too: compute is priced per type (measured layer tables, roofline figures)
        h.update(repr([self.types[d] for d in idx.tolist()]).encode())
        relabel = {m: i for i, m in enumerate(dict.fromkeys(self.machine[idx].tolist()))}
        h.update(repr(([len(g) for g in groups], [relabel[m] for m in self.machine[idx].tolist()])).encode())
        nics = self.cluster.nic_of[idx].tolist()
        renic = {n: i for i, n in enumerate(dict.fromkeys(nics))}
        h.update(repr([renic[n] for n in nics]).encode())
        h.update(np.ascontiguousarray(self.cluster.nic_bandwidth[self.cluster.nic_of[idx]]).tobytes())
        if len(self._sig) > 100000:
            self._sig.clear()
        self._sig[key] = h.digest()
        return self._sig[key]

    def act_bytes(self, mb: int) -> float:
        """M = B_mb * S * H * B_type, the activation one hop or TP all-reduce moves."""
        return mb * self.model.seq_len * self.model.hidden_size * self.workload.dtype_bytes

    def layer_s(self, devices: tuple[int, ...], mb: int, sharding: str) -> float:
        """One layer, one micro-batch, forward + backward (+ recompute) on this TP group (eq. 1-3),
        as :func:`estimate.layer_step` prices it with no data-parallel communication."""
        key = (tuple(sorted(devices)), mb, sharding == "zero3")
        if key not in self._layer:
            t_f, t_b = self.layer_tb(key[0], mb)
            self._layer[key] = self.theta3[0] * t_f + self.theta3[1] * t_b if key[2] else t_f + t_b
        return self._layer[key]

    def layer_tb(self, devices: tuple[int, ...], mb: int) -> tuple[float, float]:
        """(T_f, T_b) of one layer for one micro-batch on this TP group (:func:`estimate.layer_times`)."""
        key = (tuple(sorted(devices)), mb)
        if key not in self._tb:
            self._tb[key] = layer_times(self.cluster, self.workload, key[0], mb, self.recompute)[:2]
        return self._tb[key]

    def head_s(self, devices: tuple[int, ...], mb: int) -> float:
        """Vocabulary-parallel LM head + loss, forward + backward, one micro-batch on the last stage
        (:func:`estimate.stage_extra_times`, as estimate() prices it)."""
        key = (devices, mb, True)
        if key not in self._extra:
            self._extra[key] = sum(stage_extra_times(self.cluster, self.workload, devices, mb, first=False, last=True))
        return self._extra[key]

    def embed_s(self, devices: tuple[int, ...], mb: int) -> float:
        """The first stage's vocabulary-parallel embedding all-reduce, one micro-batch (as estimate())."""
        key = (devices, mb, False)
        if key not in self._extra:
            self._extra[key] = sum(stage_extra_times(self.cluster, self.workload, devices, mb, first=True, last=False))
        return self._extra[key]

    def max_layers(self, devices: tuple[int, ...], j: int, num_stages: int, mb: int, n_mb: int,
                   sharding: str, num_pipelines: int) -> int:
        """Most layers stage j can hold: the largest l with fixed + l * per_layer <= usable memory of its
        smallest device (:func:`estimate.stage_memory_terms`, the model ``estimate()`` checks)."""
        usable = self._usable.get(devices)
        if usable is None:
            usable = self._usable[devices] = usable_memory(self.workload, float(min(self.memory[d] for d in devices)))
        inflight = cm.inflight_micro_batches(self.schedule, num_stages, j, n_mb)
        # memory depends on the devices only through the TP degree and the smallest memory
        key = (len(devices), usable, j == 0, j == num_stages - 1, inflight, mb, sharding, num_pipelines)
        if key not in self._caps:
            terms = stage_memory_terms(self.workload, sharding, num_pipelines, self.schedule, self.recompute,
                                       num_stages, j, len(devices), mb, n_mb)
            self._caps[key] = terms.max_layers(usable)
        return self._caps[key]

    # ---- intra-group strategies and order ------------------------------------------------------
    def group_options(self, group: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
        """Intra-group strategies: the group's devices split per machine, each machine part cut into
        consecutive TP groups of t (the last may be smaller: 4 GPUs with t = 3 give TP 3 + TP 1),
        t <= KV heads; beyond 64 devices only t a power of two or a divisor of the part.
        Returned as stage lists in execution order."""
        if group not in self._options:
            parts = [tuple(d for d in group if self.machine[d] == mach) for mach in dict.fromkeys(self.machine[list(group)])]
            per_part = []
            only = self.stage_ok
            for part in parts:
                g = len(part)
                cuts, remainders = [], []
                for t in range(1, min(g, self.max_tp) + 1):
                    if self.reuse_choices and (t & (t - 1)) != 0 and g % t != 0:
                        continue
                    groups = [part[i:i + t] for i in range(0, g, t)]
                    if only is not None:
                        # restricted TP: only allowed whole groups of t, the rest of the part idle
                        groups = [st for st in groups if len(st) == t and only(st)]
                    if groups:
                        cuts.append(groups)
                    if self.idle_remainders and only is None and g % t and g >= t:
                        # beyond §4 (small clusters, plans that may leave devices idle): whole TP groups
                        # of t, the weakest g mod t devices idle. A part of 3 devices whose single
                        # devices hold no layer has no plan otherwise: a pair and a lone device that
                        # does not fit, or three stages for a model of two layers
                        strong = sorted(part, key=lambda d: (-self.flops[d], -self.memory[d], d))
                        remainders.append([tuple(sorted(strong[i:i + t])) for i in range(0, g - g % t, t)])
                per_part.append(cuts + remainders or [[]])  # none allowed: the whole part idle
            combos = list(itertools.product(*per_part))
            if len(combos) > 32:  # many machine parts: the same rule for every part
                combos = [tuple(opts[min(i, len(opts) - 1)] for opts in per_part) for i in range(max(map(len, per_part)))]
            options = [opt for opt in ([st for part in combo for st in part] for combo in combos) if opt]
            if len(parts) > 1 and self.cross_machine_tp:
                # beyond §4 (small clusters): TP across the group's machines, one TP group per GPU
                # type or one for the whole group, so that devices too small to hold a stage alone
                # can share one (the slow links then carry few layers)
                types = {}
                for d in group:
                    types.setdefault(self.cluster.devices[d].gpu_type, []).append(d)
                crosses = [[tuple(ds) for ds in types.values()], [tuple(group)]]
                # the group's devices in machine order cut into consecutive TP groups of t: TP groups
                # inside the machines, the odd devices of adjacent machines paired across them (three
                # V100s of 3 MiB beside one RTX3090, a 2-layer model: no single device holds a layer,
                # [V100 V100] + [V100 3090] is the plan). Whole groups only where devices may idle
                flat = [d for part in parts for d in part]
                for t in range(2, min(len(flat), self.max_tp) + 1):
                    cut = [tuple(flat[i:i + t]) for i in range(0, len(flat), t)]
                    if len(cut[-1]) < t and self.idle_remainders:
                        crosses.append(cut[:-1])
                    crosses.append(cut)
                for cross in crosses:
                    if (cross and all(len(st) <= self.max_tp and (only is None or only(st)) for st in cross)
                            and cross not in options):
                        options.append(cross)
            self._options[group] = options
        return self._options[group]

    def group_order(self, groups: list[tuple[int, ...]], tau: int) -> list[int]:
        key = (tuple(groups), tau)
        if key not in self._order:
            self._order[key] = top_tau_order(group_bandwidth(self.bw, groups), tau)[0]
        return self._order[key]

    def hop_matrix(self, src: tuple[int, ...], dst: tuple[int, ...], mb: int) -> tuple[np.ndarray, bool]:
        """Comm-PP-Hop (eq. 6) for every (src leader, dst leader) pair, |src| x |dst|, vectorised:
        2 * [alpha[s,d] + M/beta[s,d] + sum_{d'' in dst, d'' != d} (alpha[d,d''] + M/(|dst| beta[d,d'']))],
        and whether every pair costs the same (then the leaders do not matter)."""
        key = (src, dst, mb)
        if key not in self._hop and len(src) == len(dst) > 1:
            # equal TP degrees: the runtime's scatter/gather path, whatever the leaders (as estimate
            # prices it; its t sends share their NICs, other pipelines' are not known yet)
            h = hop_time(self.cluster, self.workload, src, dst, mb, None, self.schedule)
            self._hop[key] = (np.full((len(src), len(dst)), h), True)
        if key not in self._hop:
            m = self.act_bytes(mb)
            s_idx, d_idx = np.asarray(src)[:, None], np.asarray(dst)
            send = self.lat[s_idx, d_idx] + m / self.bw[s_idx, d_idx]
            inner = self.lat[d_idx[:, None], d_idx] + m / (len(dst) * self.bw[d_idx[:, None], d_idx])
            np.fill_diagonal(inner, 0.0)
            h = 2.0 * (send + inner.sum(axis=1)[None, :])
            self._hop[key] = (h, bool(h.max() == h.min()))
        return self._hop[key]

    def leaders(self, stages: list[tuple[int, ...]], mb: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """Leaders minimising the sum of hops (Viterbi over the chain: state = leader of stage j).
        Returns the stages with their leader first, and Hop_j per stage (0 for the last).
        When every hop costs the same for any leaders (uniform links), the first devices lead.
        Memoised per chain and micro-batch size."""
        if len(stages) == 1:
            return [stages[0]], [0.0]
        key = (tuple(stages), mb)
        if key not in self._leaders:
            if len(self._leaders) > 100000:
                self._leaders.clear()
            self._leaders[key] = self._viterbi(stages, mb)
        out, hops = self._leaders[key]
        return list(out), list(hops)

    def _viterbi(self, stages: list[tuple[int, ...]], mb: int) -> tuple[list[tuple[int, ...]], list[float]]:
        mats = [self.hop_matrix(stages[j - 1], stages[j], mb) for j in range(1, len(stages))]
        if all(flat for _, flat in mats):
            return list(stages), [float(h[0, 0]) for h, _ in mats] + [0.0]
        cost = np.zeros(len(stages[0]))
        back = []
        for j in range(1, len(stages)):
            total = cost[:, None] + mats[j - 1][0]
            arg = np.argmin(total, axis=0)  # first minimum: ties keep the lowest position
            back.append(arg)
            cost = total[arg, np.arange(len(stages[j]))]
        pos = [int(np.argmin(cost))]
        for arg in reversed(back):
            pos.append(int(arg[pos[-1]]))
        pos.reverse()
        lead = [st[p] for st, p in zip(stages, pos)]
        out = [(ld,) + tuple(d for d in st if d != ld) for st, ld in zip(stages, lead)]
        hops = [float(mats[j][0][pos[j], pos[j + 1]]) for j in range(len(stages) - 1)] + [0.0]
        return out, hops


    # ---- phase 2, steps (ii)-(iii): one pipeline's draft ------------------------------------------
    def draft(self, groups: list[tuple[int, ...]], ctx: DraftContext) -> PipeDraft | None:
        """Order the groups by top-tau, pick each group's intra-group strategy by coordinate descent
        on Pipeline(n_mb) (start: every group at its highest layer rate sum 1/t_j, or its fewest
        stages when the chain would exceed the layers; groups on identical hardware change
        together), try the reversed chain, return the best draft (None: nothing fits).

        Pipelines on identical hardware (same bandwidth, latency, FLOP/s, memory and machine layout,
        device for device) get the same draft: it is computed once, in positions, and relabelled.
        """
        flat = [d for g in groups for d in g]
        sig = self.signature(groups)
        key = (sig, ctx)
        if key in self._drafts:
            local = self._drafts[key]
            return None if local is None else local.relabel(flat)
        d = self._descend(groups, ctx, (sig, ctx.num_pipelines, ctx.tau))
        pos = {dev: i for i, dev in enumerate(flat)}
        self._drafts[key] = None if d is None else d.relabel(pos)
        return d

    def _descend(self, groups: list[tuple[int, ...]], ctx: DraftContext, choice_key: tuple) -> PipeDraft | None:
        order = self.group_order(groups, ctx.tau)
        ordered = [groups[i] for i in order]
        if self.stage_ok is not None:  # groups no allowed TP group can use stay out (idle)
            ordered = [g for g in ordered if self.group_options(g)]
            if not ordered:
                return None
        opts = [self.group_options(g) for g in ordered]
        if self.reuse_choices and choice_key in self._choices:
            # large clusters: the strategies chosen for this structure at the first (micro-batch,
            # sharding) tried are kept; a full descent runs only when they no longer fit
            ch, orient = self._choices[choice_key]
            d = chain_draft(self, _chain(opts, ch, orient), ctx)
            if d is not None:
                return d
        mb, sh = ctx.mb, ctx.sharding
        choice = [max(range(len(o)), key=lambda k: (sum(1.0 / self.layer_s(st, mb, sh) for st in o[k]), -k))
                  for o in opts]
        if sum(len(o[k]) for o, k in zip(opts, choice)) > self.model.num_layers:
            choice = [min(range(len(o)), key=lambda k: (len(o[k]), k)) for o in opts]
        built: dict[tuple, PipeDraft | None] = {}
        # groups on identical hardware (same signature) move together: one descent step per class
        classes: dict[bytes, list[int]] = {}
        for g, grp in enumerate(ordered):
            classes.setdefault(self.group_signature(grp), []).append(g)
        best_ch = tuple(choice)
        best = self._built(opts, best_ch, 0, ctx, built)
        if best is None:  # nothing fits: start from the fewest, widest stages (least memory repeated per stage)
            fewest = tuple(min(range(len(o)), key=lambda k: (len(o[k]), k)) for o in opts)
            if fewest != best_ch:
                best_ch, best = fewest, self._built(opts, fewest, 0, ctx, built)
        for _ in range(2):
            improved = False
            for members in classes.values():
                for k in range(len(opts[members[0]])):
                    if all(best_ch[g] == k for g in members):
                        continue
                    ch = list(best_ch)
                    for g in members:
                        ch[g] = k
                    d = self._built(opts, tuple(ch), 0, ctx, built)
                    if _draft_time(d, ctx) < _draft_time(best, ctx) * (1 - 1e-9):
                        best, best_ch, improved = d, tuple(ch), True
            if not improved:
                break
        # the chain's two ends matter (embedding on the first stage, LM head on the last): try the
        # group order reversed, the stages inside each group reversed, and both
        orient = 0
        others: list = [1, 2, 3]
        if self.cross_machine_tp and 2 < len(ordered) <= _PERMUTE_GROUPS:
            # small clusters: every order of a few groups (the top-tau path fixes the links, not
            # where the embedding and the LM head go, nor which group is the bottleneck)
            k = len(ordered)
            others += [(perm, inner) for perm in itertools.permutations(range(k))
                       if perm not in (tuple(range(k)), tuple(range(k))[::-1]) for inner in (False, True)]
        for o in others:
            d = self._built(opts, best_ch, o, ctx, built)
            if _draft_time(d, ctx) < _draft_time(best, ctx) * (1 - 1e-9):
                best, orient = d, o
        if best is not None:
            self._choices[choice_key] = (best_ch, orient)
        return best

    def _built(self, opts: list, ch: tuple[int, ...], orient: int, ctx: DraftContext,
               built: dict[tuple, PipeDraft | None]) -> PipeDraft | None:
        if (ch, orient) not in built:
            built[(ch, orient)] = chain_draft(self, _chain(opts, ch, orient), ctx)
        return built[(ch, orient)]


def _draft_time(d: PipeDraft | None, ctx: DraftContext) -> float:
    return d.time_s(ctx.n_mb) if d is not None else math.inf


@dataclass(frozen=True)
class PipeDraft:
    """A pipeline before its batch is known: stages (leader first), layer counts, per-micro-batch times."""

    stages: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    per_mb_s: tuple[float, ...]
    """Stage_j + Hop_j for one micro-batch."""
    max_micro: int = _UNCAPPED
    """Micro-batches this pipeline may take before running out of memory (GPipe only)."""

    @property
    def sum_s(self) -> float:
        return sum(self.per_mb_s)

    @property
    def max_s(self) -> float:
        return max(self.per_mb_s)

    def time_s(self, n_mb: int) -> float:
        """Pipeline-Time (eq. 8) for n_mb micro-batches, without the data-parallel tail."""
        return self.sum_s + (n_mb - 1) * self.max_s

    def relabel(self, mapping: Any) -> PipeDraft:
        """The same draft with device d renamed mapping[d] (device -> position or back)."""
        stages = tuple(tuple(int(mapping[d]) for d in st) for st in self.stages)
        return PipeDraft(stages, self.layers, self.per_mb_s, self.max_micro)


def split_layers(layer_s: list[float], fixed_s: list[float], max_layers: list[int], num_layers: int) -> list[int] | None:
    """Layers per stage (§4.4 "layer assignment"), None when they cannot fit.

    1. Proportional to speed: each stage starts with one layer, then each further layer goes to the
       stage whose time l_j * t_j + f_j grows least (the integer form of l_j proportional to 1/t_j).
    2. Out-of-memory rebalancing: a stage above ``max_layers`` gives layers, one at a time, to the
       stage with the most free memory (in layers).
    3. Refine: move a layer off the slowest stage while that lowers the slowest stage time.
    """
    S = len(layer_s)
    if S > num_layers or min(max_layers) < 1 or sum(min(m, num_layers) for m in max_layers) < num_layers:
        return None
    n = [1] * S
    heap = [(2 * layer_s[j] + fixed_s[j], j) for j in range(S)]
    heapq.heapify(heap)
    for _ in range(num_layers - S):
        _, j = heapq.heappop(heap)
        n[j] += 1
        heapq.heappush(heap, ((n[j] + 1) * layer_s[j] + fixed_s[j], j))
    for j in range(S):
        while n[j] > max_layers[j]:
            r = max(range(S), key=lambda q: (max_layers[q] - n[q], -q))
            n[j] -= 1
            n[r] += 1
    while True:
        t = [n[j] * layer_s[j] + fixed_s[j] for j in range(S)]
        b = max(range(S), key=lambda q: t[q])
        if n[b] <= 1:
            break
        room = [r for r in range(S) if r != b and n[r] < max_layers[r]]
        if not room:
            break
        r = min(room, key=lambda q: (n[q] + 1) * layer_s[q] + fixed_s[q])
        if (n[r] + 1) * layer_s[r] + fixed_s[r] >= t[b] * (1 - 1e-12):
            break
        n[b] -= 1
        n[r] += 1
    return n


def split_batches(sum_s: list[float], max_s: list[float], tail_s: list[float], total_micro: int,
                  caps: list[int] | None = None) -> list[int]:
    """Micro-batches per pipeline in proportion to simulated speed (§4.4 "batch assignment").

    Pipeline i with n micro-batches takes sum_i + (n - 1) * max_i + tail_i (eq. 8 plus its
    data-parallel tail, which does not depend on n). Each pipeline gets one micro-batch, then each
    further one goes to the pipeline that would finish earliest with it: for these affine times
    the greedy gives the smallest possible slowest pipeline. ``caps`` bounds each count.
    """
    P = len(sum_s)
    caps = caps or [_UNCAPPED] * P
    n = [1] * P
    heap = [(sum_s[i] + max_s[i] + tail_s[i], i) for i in range(P)]
    heapq.heapify(heap)
    left = total_micro - P
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        if n[i] >= caps[i]:
            continue
        n[i] += 1
        left -= 1
        heapq.heappush(heap, (sum_s[i] + n[i] * max_s[i] + tail_s[i], i))
    if left > 0:  # every pipeline at its cap: the rest goes round-robin (estimate() will say OOM)
        for k in range(left):
            n[k % P] += 1
    return n


@dataclass(frozen=True)
class DraftContext:
    """Everything a pipeline draft depends on besides its devices (one immutable value instead of
    arguments threaded through helper functions)."""

    mb: int
    """Micro-batch size the layer split and leaders are chosen for."""
    sharding: str
    num_pipelines: int
    n_mb: int
    """Micro-batches the pipeline is expected to run: the descent's objective Pipeline(n_mb), and
    GPipe's in-flight memory."""
    tau: int = 2


def chain_draft(ev: Evaluator, stages: list[tuple[int, ...]], ctx: DraftContext) -> PipeDraft | None:
    """Leaders, layer split and per-micro-batch times for a stage chain (None: does not fit)."""
    if len(stages) > ev.model.num_layers:  # every stage needs a layer
        return None
    stages, hops = ev.leaders(stages, ctx.mb)
    S = len(stages)
    layer_s = [ev.layer_s(st, ctx.mb, ctx.sharding) for st in stages]
    fixed = cm.hop_charges(hops, ev.schedule)
    fixed[0] += ev.embed_s(stages[0], ctx.mb)
    fixed[-1] += ev.head_s(stages[-1], ctx.mb)
    gpipe = ev.schedule == "gpipe"
    mem_n = max(2 * ctx.n_mb, 1) if gpipe else S
    caps = [ev.max_layers(st, j, S, ctx.mb, mem_n, ctx.sharding, ctx.num_pipelines) for j, st in enumerate(stages)]
    n = split_layers(layer_s, fixed, caps, ev.model.num_layers)
    cap = mem_n if gpipe else _UNCAPPED
    if n is None and max(ctx.n_mb, 1) < mem_n:
        # drafted for more micro-batches in flight than the pipeline may run (1F1B: S, GPipe: twice
        # its share), the chain may not fit where its own share does: with a small batch (fewer
        # micro-batches than stages) it was never drafted, and the oracle found plans where the
        # search found none. Drafted for its share in flight, it is capped there; the batch split
        # checks the memory exactly.
        cap = max(ctx.n_mb, 1)
        caps = [ev.max_layers(st, j, S, ctx.mb, cap, ctx.sharding, ctx.num_pipelines) for j, st in enumerate(stages)]
        n = split_layers(layer_s, fixed, caps, ev.model.num_layers)
    if n is None:
        return None
    per = tuple(n[j] * layer_s[j] + fixed[j] for j in range(S))
    return PipeDraft(tuple(stages), tuple(n), per, cap)


def draft_pipeline(ev: Evaluator, groups: list[tuple[int, ...]], ctx: DraftContext) -> PipeDraft | None:
    """Phase 2 steps (ii)-(iii) for one pipeline (:meth:`Evaluator.draft`)."""
    return ev.draft(groups, ctx)


def _chain(opts: list[list[list[tuple[int, ...]]]], ch: tuple[int, ...], orient) -> list[tuple[int, ...]]:
    """Stage chain of the chosen options; orient bit 0 reverses the group order, bit 1 the stage
    order inside every group (the top-tau path is as good either way round); a tuple
    (permutation of the groups, reverse inside) orders the groups explicitly."""
    blocks = [list(opts[g][k]) for g, k in enumerate(ch)]
    if isinstance(orient, tuple):
        perm, inner = orient
        blocks = [blocks[g][::-1] if inner else blocks[g] for g in perm]
        return [st for b in blocks for st in b]
    if orient & 2:
        blocks = [b[::-1] for b in blocks]
    if orient & 1:
        blocks = blocks[::-1]
    return [st for b in blocks for st in b]


def make_plan(drafts: list[PipeDraft], micro_counts: list[int], mb: int, sharding: str, schedule: str,
              recompute: bool, num_layers: int, meta: dict[str, Any]) -> Plan:
    """The Plan of drafted pipelines: layer counts become [start, end) ranges, batches n_i * mb."""
    pipes = []
    for d, n in zip(drafts, micro_counts):
        bounds = np.concatenate([[0], np.cumsum(d.layers)]).tolist()
        stages = tuple(Stage(tuple(int(x) for x in st), (int(bounds[j]), int(bounds[j + 1]))) for j, st in enumerate(d.stages))
        pipes.append(Pipeline(batch_size=int(n * mb), micro_batch_size=int(mb), stages=stages))
    return Plan(tuple(pipes), num_layers, schedule=schedule, recompute=recompute, dp_sharding=sharding, meta=dict(meta))


def micro_batch_candidates(global_batch: int, user_mb: int | None, num_devices: int) -> list[int]:
    """Micro-batch sizes to draft layer splits with: the user's (must divide the global batch), else
    the powers of two up to 16 (up to 8 beyond 64 devices, to bound the search time)."""
    if user_mb is not None:
        _check_user_mb(global_batch, user_mb)
        return [int(user_mb)]
    top = 16 if num_devices <= 64 else 8
    return [m for m in (1, 2, 4, 8, 16) if m <= min(top, global_batch)]


def batch_micro_sizes(global_batch: int, user_mb: int | None, num_devices: int) -> list[int]:
    """Micro-batch sizes the batch split may give a pipeline: the user's, else every size up to 64 on
    clusters of up to SMALL_CLUSTER devices, every size up to 16 and a few larger ones up to 64 up to
    64 devices, 1, 2, 4, 8 beyond; each pipeline picks its own."""
    if user_mb is not None:
        _check_user_mb(global_batch, user_mb)
        return [int(user_mb)]
    if num_devices > 64:
        return [m for m in (1, 2, 4, 8) if m <= global_batch]
    if num_devices <= SMALL_CLUSTER:  # a pipeline's batch may be any integer: every size may matter
        return list(range(1, min(64, global_batch) + 1))
    return [m for m in list(range(1, 17)) + [20, 24, 28, 32, 40, 48, 56, 64] if m <= global_batch]


def _check_user_mb(global_batch: int, user_mb: int) -> None:
    if isinstance(user_mb, bool) or not isinstance(user_mb, int) or user_mb < 1:  # 0 or -2 does not "divide"
        raise ConfigError("train.micro_batch_size", user_mb, "must be a positive integer",
                          "use e.g. train.micro_batch_size=1, or null to let the planner choose")
    if global_batch % user_mb:
        raise ConfigError("train.micro_batch_size", user_mb, f"must divide train.global_batch={global_batch}",
                          "choose a divisor of the global batch or null to let the planner choose")


def minimum_memory_message(cluster: Cluster, workload: Workload, global_batch: int, recompute: bool | None = None) -> str:
    """What is missing when nothing fits (:func:`lightning_hexiscale.planner.search.infeasible.memory_message`)."""
    from lightning_hexiscale.planner.search.infeasible import memory_message

    return memory_message(cluster, workload, global_batch, recompute)
