"""The rank-layout expressions as they were before ``planner/layout.py``, copied verbatim from
``runtime/topology.py`` and ``planner/cost/communicators.py`` at commit 3fc942a: the independent
reference ``tests/planner/test_layout.py`` holds the layout to. Do not "fix" this file to follow the
layout; it is what the layout must equal."""

from __future__ import annotations

from lightning_hexiscale.runtime.parallelize import param_specs, stage_holds


# ---- runtime/topology.py -------------------------------------------------------------------------
def rank_map(plan, world):
    if world == plan.world_size:
        return tuple(range(world))
    launch = plan.launch_order
    if plan.idle_devices and world == len(launch):
        return tuple(launch.index(d) for d in plan.device_order)
    raise ValueError(world)


def stage_rank_lists(plan):
    order = {d: r for r, d in enumerate(plan.device_order)}
    return [[tuple(order[d] for d in st.devices) for st in p.stages] for p in plan.pipelines]


def role_fields(plan, rank):
    """``role_of``'s fields, as a dict (the Role class now lives in the layout)."""
    ranks = stage_rank_lists(plan)
    offset = 0
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            if rank in ranks[i][j]:
                return dict(rank=rank, device=plan.device_order[rank], pipeline=i, stage=j,
                            num_stages=len(pipe.stages), tp_rank=ranks[i][j].index(rank),
                            stage_ranks=ranks[i][j], prev_stage_ranks=ranks[i][j - 1] if j > 0 else (),
                            next_stage_ranks=ranks[i][j + 1] if j + 1 < len(pipe.stages) else (),
                            layers=st.layers, batch_offset=offset, batch_size=pipe.batch_size,
                            micro_batch_size=pipe.micro_batch_size)
        offset += pipe.batch_size
    raise AssertionError(f"rank {rank} is in no stage")


def segment_bounds(ranges):
    cuts = sorted({b for rs in ranges for r in rs for b in r})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        holders = tuple(next(i for i, (s, e) in enumerate(rs) if s <= a < e) for rs in ranges)
        out.append((a, b, holders))
    return out


def sync_segments(plan, config):
    """(name, shard_dim, start, end, ranks) of every segment."""
    stage_ranks = stage_rank_lists(plan)
    segs = []
    for spec in param_specs(config):
        holders_per_pipe = []
        ranges_per_pipe = []
        for i, pipe in enumerate(plan.pipelines):
            last = len(pipe.stages) - 1
            j = next(j for j, st in enumerate(pipe.stages) if stage_holds(spec, st.layers, j == 0, j == last))
            ranks = stage_ranks[i][j]
            if spec.shard_dim is None:
                ranks = ranks[:1]
            holders_per_pipe.append(list(ranks))
            ranges_per_pipe.append(spec.ranges(config, len(ranks)) if spec.shard_dim is not None
                                   else [(0, spec.shape[0])])
        for a, b, idx in segment_bounds(ranges_per_pipe):
            ranks = tuple(sorted(holders_per_pipe[p][k] for p, k in enumerate(idx)))
            segs.append((spec.name, spec.shard_dim, a, b, ranks))
    return segs


def link_pairs(plan):
    pairs = set()
    for pipe in stage_rank_lists(plan):
        for a, b in zip(pipe, pipe[1:]):
            if len(a) == len(b) > 1:
                pairs.update(tuple(sorted(p)) for p in zip(a, b))
            else:
                pairs.add(tuple(sorted((a[0], b[0]))))
    return sorted(pairs)


def group_ranks(plan, config):
    wanted = set(link_pairs(plan))
    for pipe in stage_rank_lists(plan):
        for st in pipe:
            if len(st) > 1:
                wanted.add(tuple(sorted(st)))
    if plan.num_pipelines > 1:
        wanted.update(seg[4] for seg in sync_segments(plan, config))
    return sorted(wanted)


# ---- planner/cost/communicators.py (its own walk: per layer interval, from the config's splits) ----
def _holder_sets(holders, split):
    if split is None:
        return {tuple(sorted(h[0] for h in holders))}
    ranges = [split(len(h)) for h in holders]
    cuts = sorted({b for rs in ranges for r in rs for b in r})
    out = set()
    for a, b in zip(cuts, cuts[1:]):
        if a == b:
            continue
        out.add(tuple(sorted(h[next(k for k, (s, e) in enumerate(rs) if s <= a < e)]
                             for h, rs in zip(holders, ranges))))
    return out


def data_parallel_groups(plan, config):
    if plan.num_pipelines < 2:
        return set()
    ranks = stage_rank_lists(plan)
    out = set()

    def holders_of(pick):
        return [ranks[i][pick(i, p.stages)] for i, p in enumerate(plan.pipelines)]

    first = holders_of(lambda i, st: 0)
    last = holders_of(lambda i, st: len(st) - 1)
    out |= _holder_sets(first, config.vocab_split)
    out |= _holder_sets(last, None)
    if not config.tie_word_embeddings:
        out |= _holder_sets(last, config.vocab_split)
    for layer in sorted({b for p in plan.pipelines for s in p.stages for b in s.layers})[:-1]:
        held = holders_of(lambda i, st: next(j for j, s in enumerate(st) if s.layers[0] <= layer < s.layers[1]))
        out |= _holder_sets(held, config.kv_head_split) | _holder_sets(held, config.ffn_split) | _holder_sets(held, None)
    return out

