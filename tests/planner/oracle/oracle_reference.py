"""An independent brute force over the whole plan space, for tiny cases only: every subset of the
devices (the rest idle), every set partition of it into pipelines, every ordered split of each pipeline into stages with every rank order,
every layer split, every batch split, every micro-batch size per pipeline, every dp sharding (and
under ``recompute="auto"`` every recompute flag per pipeline), each plan scored by ``estimate()``. No symmetry, no bounds: the oracle's yardstick in the tests."""

from __future__ import annotations

import itertools
import math

from lightning_hexiscale.planner import DP_SHARDINGS, Pipeline, Plan, Stage, estimate


def set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def chains(devices: list[int], max_tp: int, max_stages: int):
    """Every ordered sequence of stages (each an ordered tuple of devices) using ``devices`` once."""
    if not devices:
        yield []
        return
    if max_stages == 0:
        return
    n = len(devices)
    for size in range(1, min(n, max_tp) + 1):
        for stage in itertools.permutations(devices, size):
            rest = [d for d in devices if d not in stage]
            for tail in chains(rest, max_tp, max_stages - 1):
                yield [stage] + tail


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (total,))]


def device_subsets(n: int, all_devices: bool):
    """Every non-empty subset of devices 0..n-1 (only all of them with ``all_devices``)."""
    if all_devices:
        yield list(range(n))
        return
    for k in range(n, 0, -1):
        yield from (list(c) for c in itertools.combinations(range(n), k))


def brute_force(cluster, workload, global_batch: int, schedule: str = "1f1b", recompute: bool | str = True,
                shardings=DP_SHARDINGS, all_devices: bool = False):
    """(best cost, best plan, plans scored) over plans on every device subset (the others idle),
    or on all devices only."""
    L, max_tp = workload.model.num_layers, workload.model.num_kv_heads
    best, best_plan, count = math.inf, None, 0
    for used in device_subsets(cluster.num_devices, all_devices):
        idle = tuple(d for d in range(cluster.num_devices) if d not in used)
        b, p, c = _brute_force(cluster, workload, global_batch, schedule, recompute, shardings, used, idle, L, max_tp)
        count += c
        if b < best:
            best, best_plan = b, p
    return best, best_plan, count


def _brute_force(cluster, workload, global_batch, schedule, recompute, shardings, used, idle, L, max_tp):
    best, best_plan, count = math.inf, None, 0
    for blocks in set_partitions(used):
        P = len(blocks)
        if P > global_batch:
            continue
        per_pipe = []
        for block in blocks:
            opts = []
            for ch in chains(block, max_tp, L):
                for split in compositions(L, len(ch)):
                    bounds = list(itertools.accumulate([0] + split))
                    opts.append(tuple(Stage(st, (bounds[j], bounds[j + 1])) for j, st in enumerate(ch)))
            per_pipe.append(opts)
        flag_opts = list(itertools.product((False, True), repeat=P)) if recompute == "auto" else [(recompute,) * P]
        for batches in compositions(global_batch, P):
            mb_opts = [[m for m in range(1, b + 1) if b % m == 0] for b in batches]
            for structs in itertools.product(*per_pipe):
                for mbs in itertools.product(*mb_opts):
                    for flags in flag_opts:
                        pipes = tuple(Pipeline(b, m, st, r) for b, m, st, r in zip(batches, mbs, structs, flags))
                        for sh in shardings:
                            plan = Plan(pipes, L, schedule=schedule, recompute=None, dp_sharding=sh,
                                        idle_devices=idle)
                            count += 1
                            cost = estimate(plan, cluster, workload).cost
                            if cost < best:
                                best, best_plan = cost, plan
    return best, best_plan, count
