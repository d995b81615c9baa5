"""Measured layer times: time the runtime's own stage pieces on the cluster's ranks (collective).

:func:`measure_layer_tables` runs on every rank of an initialised process group (the profile's and
the calibration's launch: ``--local N`` forked CPU ranks, torchrun, SLURM) and returns, on rank 0,
one :class:`~lightning_hexiscale.config.layer_table.LayerTable` per device type. For each TP
degree t (ascending, the same order on every rank) every machine's ranks are cut into consecutive
TP groups of t (ranks left over sit out that degree), and every group at once, as in training,
times with the runtime's :func:`~lightning_hexiscale.runtime.parallelize.build_stage` (so with its
TP collectives, autocast and casts) for each micro-batch size:

- ``layer``: one transformer block (a middle stage's): forward, backward, and the backward with
  recomputation (the runtime's non-reentrant checkpoint re-runs the forward inside it);
- ``head``: a last stage without blocks: final norm, vocabulary-parallel LM head and loss;
- ``embedding``: a first stage without blocks: the vocabulary-parallel embedding.

A rep's time of a group is its slowest rank's (a MAX all-reduce in the group); over ``reps`` timed
reps after ``warmup`` untimed ones, the fastest (load from other jobs only adds time) or the
median. Gradients accumulate over the reps, as over a step's micro-batches. Across the groups of
one device type, the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_hexiscale.config.layer_table import LayerTable, LayerTimeRow, ModelShape
from lightning_hexiscale.models.config import LlamaConfig

PARTS = ("layer", "head", "embedding")


def default_tp_degrees(group_sizes: Sequence[int], num_kv_heads: int) -> list[int]:
    """TP degrees to measure: the powers of two up to the largest machine and each machine's own
    device count (the search's TP groups inside a machine), at most ``num_kv_heads`` (a TP rank
    needs a key/value head)."""
    most = min(max(group_sizes), num_kv_heads)
    out = {1 << k for k in range(most.bit_length()) if (1 << k) <= most}
    out |= {g for g in group_sizes if g <= most}
    return sorted(out)


def tp_groups(machines: Sequence[Sequence[int]], tp: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``tp`` ranks of each machine (rank order), leftovers dropped."""
    return [tuple(m[i:i + tp]) for m in machines for i in range(0, len(m) - tp + 1, tp)]


def check_tp_fits(degrees: Sequence[int], machines: Sequence[Sequence[int]], key: str = "--layer-tp") -> None:
    """Every TP degree forms a group on some machine (:func:`tp_groups`). A degree larger than every
    machine measured nothing and said nothing: its rows were missing from the tables (with no other
    degree, the file had no layer times at all and the planner priced FLOP/s instead)."""
    from lightning_hexiscale.errors import ConfigError

    largest = max(len(m) for m in machines)
    too_big = sorted(t for t in set(degrees) if t > largest)
    if too_big:
        raise ConfigError(key, too_big, f"a TP group is measured inside one machine (ranks of one host and device "
                          f"type), and the largest here has {largest} rank(s), so no group of that size forms",
                          f"give TP degrees up to {largest}, or leave {key} out (the default fits the machines)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_part(part: str, model: LlamaConfig, tp: int, tp_rank: int, group, mb: int, device: torch.device, run,
               reps: int, warmup: int, stat: Callable[[list[float]], float]) -> list[float]:
    """[forward, backward(, backward with recomputation)] seconds of one part on this rank's group."""
    from lightning_hexiscale.models.llama import Llama
    from lightning_hexiscale.runtime.parallelize import build_stage

    L = model.num_layers
    layers, first, last = {"layer": ((0, 1), False, False), "head": ((L, L), False, True),
                           "embedding": ((0, 0), True, False)}[part]
    with torch.device("meta"):
        meta = Llama(model)
    stage = build_stage(meta, layers, first, last, tp, tp_rank, group if tp > 1 else None, device=device,
                        dtype=run.param_dtype, seed=0)
    gen = torch.Generator().manual_seed(7)
    shape = (mb, model.seq_len)
    tokens = torch.randint(0, model.vocab_size, shape, generator=gen).to(device)
    hidden = torch.randn(*shape, model.hidden_size, generator=gen).to(device=device, dtype=run.param_dtype)
    grad_out = torch.randn(*shape, model.hidden_size, generator=gen).to(device=device, dtype=run.param_dtype)

    def once(recompute: bool) -> tuple[float, float]:
        stage.recompute = recompute
        x = tokens if part == "embedding" else hidden.detach().requires_grad_(True)
        _sync(device)
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        with run.autocast(device):
            out = stage(x)
            if part == "head":
                out = stage.loss(out, tokens)
        _sync(device)
        t1 = time.perf_counter()
        if part == "head":
            out.backward()
        else:
            out.backward(grad_out.to(out.dtype))
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    kinds = [False, True] if part == "layer" else [False]
    out: list[float] = []
    for recompute in kinds:
        fwd, bwd = [], []
        for k in range(warmup + reps):
            f, b = once(recompute)
            if k >= warmup:
                fwd.append(f)
                bwd.append(b)
        if not recompute:
            out.append(stat(fwd))
        out.append(stat(bwd))
    return out


def measure_layer_tables(model: LlamaConfig, micro_batches: Sequence[int], precision: str | None = None,
                         tp_degrees: Sequence[int] | None = None, reps: int = 3, warmup: int = 1,
                         types: Sequence[str] | None = None, machines: Sequence[Sequence[int]] | None = None,
                         stat: str = "min", log: Callable[[str], None] | None = None) -> tuple[LayerTable, ...] | None:
    """Collective over the default process group (module docstring). ``types``: the device type of
    each rank (default: :func:`~lightning_hexiscale.profiling.measure.device_type_name`);
    ``machines``: the ranks of each machine (default: runs of consecutive ranks with one host and
    type); ``tp_degrees``: default :func:`default_tp_degrees`. Returns the tables on rank 0, None
    elsewhere."""
    from lightning_hexiscale.profiling import precision as prec
    from lightning_hexiscale.profiling.measure import current_device, device_type_name, machine_name
    from lightning_hexiscale.profiling.writer import infer_machines

    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    run = prec.resolve(precision, device)
    say = (log or (lambda m: None)) if rank == 0 else (lambda m: None)
    reduce = min if stat == "min" else statistics.median
    if types is None or machines is None:
        me = (machine_name(), device_type_name(device))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, me)
        types = types or [t for _, t in everyone]
        machines = machines or [m.ranks for m in infer_machines([h for h, _ in everyone], [t for _, t in everyone])]
    machines = [list(m) for m in machines]
    degrees = sorted(set(tp_degrees or default_tp_degrees([len(m) for m in machines], model.num_kv_heads)))
    check_tp_fits(degrees, machines)
    model.check_measured_tp(degrees)
    mbs = sorted(set(int(m) for m in micro_batches))
    mine: list[tuple[str, int, int, list[float]]] = []  # (part, tp, mb, times) of this rank's groups
    for t in degrees:
        groups = tp_groups(machines, t)
        handles = {g: (dist.new_group(list(g)) if t > 1 else None) for g in groups}  # every rank, same order
        say(f"layer times: TP {t}, {len(groups)} group(s), micro-batches {mbs}")
        for g in groups:
            if rank not in g:
                continue
            for part in PARTS:
                for mb in mbs:
                    times = _time_part(part, model, t, g.index(rank), handles[g], mb, device, run, reps, warmup, reduce)
                    if handles[g] is not None:  # a group is as fast as its slowest rank
                        v = torch.tensor(times, dtype=torch.float64, device=device)
                        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=handles[g])
                        times = v.tolist()
                    if g.index(rank) == 0:
                        mine.append((part, t, mb, times))
        dist.barrier()
        for g, h in handles.items():
            if h is not None and rank in g:
                dist.destroy_process_group(h)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (types[rank], mine))
    if rank != 0:
        return None
    return tables_from_measurements(gathered, model, run.name,
                                    f"hexiscale profile: build_stage pieces, {stat} of {reps} reps after {warmup}, "
                                    f"{dist.get_backend()}, groups of consecutive ranks per machine")


def tables_from_measurements(gathered: Sequence[tuple[str, list]], model: LlamaConfig, precision: str,
                             note: str = "") -> tuple[LayerTable, ...]:
    """One table per device type from every rank's (type, [(part, tp, mb, times)]) (the leaders of
    groups report): the median over the groups of a type."""
    by: dict[tuple[str, str, int, int], list[list[float]]] = {}
    for dtype, items in gathered:
        for part, tp, mb, times in items:
            by.setdefault((dtype, part, tp, mb), []).append(times)
    tables = []
    for gpu in dict.fromkeys(k[0] for k in by):
        rows = []
        for (g, part, tp, mb), samples in sorted(by.items()):
            if g != gpu:
                continue
            med = [statistics.median(s[i] for s in samples) for i in range(len(samples[0]))]
            rows.append(LayerTimeRow(part, tp, mb, med[0], med[1], med[2] if part == "layer" else None))
        tables.append(LayerTable(gpu, precision, ModelShape.of(model), tuple(rows), model.name, note))
    return tuple(tables)
