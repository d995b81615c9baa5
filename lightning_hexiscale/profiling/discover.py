"""Discovery: the job's own ranks measure their cluster, cheaply, and cache it as an ordinary cluster file.

:func:`discover_process_group` is collective over the default process group (``--local N`` forked
ranks, torchrun, SLURM, Lightning's launcher, ``hexiscale emulate``). In order:

1. every rank reports host, device type, memory and capability (one all-gather); machines are
   grouped by host, uneven ones included (1 rank here, 3 there);
2. the fingerprint of that hardware (inside ``hexiscale emulate`` also its quotas and links,
   HEXISCALE_EMULATION), the model's shape, the precision, the torch version and the
   settings (:func:`~lightning_hexiscale.profiling.discovery_plan.fingerprint`) names the cache
   file ``$HEXISCALE_CACHE_DIR/<fingerprint>.yaml``; if it exists (and ``rediscover`` is off) it
   is reused at once and nothing is measured;
3. else: matmul FLOP/s on every rank at once (median per device type); the model's layer times per
   device type, TP degree and micro-batch size, in the job's precision
   (:func:`~lightning_hexiscale.profiling.layer_times.measure_layer_tables`); one ping-pong pair
   per (type, type) inside a machine; one per (machine, machine), H/2 at a time; each machine's NIC
   shared by its ranks sending out at once, per kind of destination machine (:func:`measure_nic_groups`;
   a kind it carries clearly less toward is written as the machine's ``nics.to``);
4. rank 0 writes the cluster file (the profiler's writer) into the cache, and a copy to ``out``.

The cost grows with the machines and device types, not with the devices squared: for 8 x 8 GPUs 74
measurements, for 128 x 8 8294 (a full profile: 2016 and 523776 rank pairs); see
:mod:`~lightning_hexiscale.profiling.discovery_plan` for the formula. Progress is a tqdm bar on a
terminal (or in a notebook), plain lines otherwise (one per phase, at most one per 10 s within it),
and the elapsed time is held against ``budget_s`` (a warning names the phase that took longest when
it is exceeded).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.profiling import discovery_plan as dp
from lightning_hexiscale.profiling.fit import NicFit, default_sizes, fit_nic, fit_or_bound
from lightning_hexiscale.profiling.measure import (is_hopper, current_device, device_memory_bytes, device_type_name,
                                                   machine_name, measure_matmul_flops, ping_pong, transfer,
                                                   check_matmul_size)
from lightning_hexiscale.profiling.writer import ProfileResult, copy_cluster, infer_machines, write_cluster
from lightning_hexiscale.progress import Heartbeat, shown_as

DEFAULT_BUDGET_S = 60.0
"""The time discovery should take on a small cluster (4 CPU ranks here: well under it)."""
NIC_KIND_RATIO = 0.8
"""A NIC's figure toward a kind of machines is written as its own (``nics.to``) when it carried less
than this fraction of its best kind's: measurement noise stays out of the file, a slow path does not."""
DEFAULT_MICRO_BATCHES = (1, 2, 4)
"""Micro-batch sizes of the layer tables; the cost model interpolates between them and scales the
nearest per sequence beyond them (:func:`~lightning_hexiscale.config.layer_table.interpolate`)."""
LINES_EVERY_S = 10.0
"""Into a pipe or a log, at most one progress line per this many seconds within a phase (:class:`Progress`)."""


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover_process_group` did, on every rank."""

    path: str
    """The cluster file (the cache's, or ``out`` when given); on rank 0's file system."""
    reused: bool
    """True when the cached file of the same fingerprint was reused without measuring."""
    fingerprint: str
    seconds: float
    count: dp.MeasurementCount
    cache_path: str


class Progress:
    """Rank 0's progress: a tqdm bar where one is seen (:func:`~lightning_hexiscale.progress.shown_as`:
    a terminal or a notebook), plain ``discover [k/n] ...`` lines otherwise. Records the seconds of
    each phase (for the budget warning).

    The lines are paced: one when a step starts a new phase, one for the last step, and between them
    at most one per ``every_s`` seconds (a :class:`~lightning_hexiscale.progress.Heartbeat`). A line
    per step read well on 4 CPU ranks (6 steps) and not at 128 machines x 8 GPUs, whose pair rounds
    and NIC groups make 263 steps. ``clock`` is for tests."""

    def __init__(self, total: int, budget_s: float, enabled: bool, log: Callable[[str], None] | None,
                 every_s: float = LINES_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.total, self.budget_s = total, budget_s
        self.heartbeat = Heartbeat(every_s, clock, log or (lambda m: print(m, flush=True)))
        self.t0 = self._last = time.perf_counter()
        self.done = 0
        self.phases: dict[str, float] = {}
        self.phase: str | None = None
        self.bar = None
        self.shown = shown_as(enabled, sys.stderr)
        if self.shown == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="discover", unit="step", file=sys.stderr)

    def step(self, label: str, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now
        self.done += 1
        new_phase, self.phase = phase != self.phase, phase
        if self.shown == "bar":
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.shown == "lines":
            def line() -> str:
                return (f"discover [{self.done}/{self.total}] {label} "
                        f"({now - self.t0:.1f} s of {self.budget_s:.0f} s budget)")

            if new_phase or self.done >= self.total:
                self.heartbeat.write_now(line())
            else:
                self.heartbeat.beat(line)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.t0


def budget_message(seconds: float, budget_s: float, phases: dict[str, float]) -> str | None:
    """The warning of a discovery that took longer than its budget (naming its longest phase), or None."""
    if seconds <= budget_s:
        return None
    worst = max(phases, key=phases.get) if phases else "?"
    return (f"discovery took {seconds:.1f} s, over its budget of {budget_s:.0f} s; the longest phase was {worst} "
            f"({phases.get(worst, 0.0):.1f} s). It runs once per fingerprint (the file is cached); to shorten it, "
            "measure fewer micro-batch sizes (--layer-micro-batches) or TP degrees (--layer-tp)")


def report_ranks(device: torch.device) -> list[dp.RankReport]:
    """Collective: every rank's :class:`~lightning_hexiscale.profiling.discovery_plan.RankReport`, by rank."""
    world = dist.get_world_size()
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, machine_name())
    me = hosts[dist.get_rank()]
    cap = "cpu" if device.type != "cuda" else "sm_%d%d" % torch.cuda.get_device_capability(device)
    mine = dp.RankReport(me, device_type_name(device), device_memory_bytes(device, hosts.count(me)), cap,
                         is_hopper(device))
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return out


def measure_pairs(steps: Sequence[Sequence[tuple[int, int]]], sizes: Sequence[int], reps: int, device: torch.device,
                  stat: str, progress: Progress, label: str, phase: str) -> dict[tuple[int, int], tuple]:
    """Collective: the pairs of each step ping-pong at once (:func:`~lightning_hexiscale.profiling.measure.ping_pong`);
    {pair: (alpha, beta, rel, note)} on every rank."""
    rank = dist.get_rank()
    out_buf = torch.ones(max(sizes), dtype=torch.uint8, device=device)
    in_buf = torch.empty_like(out_buf)
    mine = {}
    for k, step in enumerate(steps):
        dist.barrier()
        for a, b in step:
            if rank in (a, b):
                times = ping_pong(b if rank == a else a, rank == a, sizes, reps, device, out_buf, in_buf)
                if rank == a:
                    mine[(a, b)] = fit_or_bound(sizes, times, reps, stat)
        progress.step(f"{label} {k + 1}/{len(steps)} ({len(step)} pair(s) at once)", phase)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {p: v for part in gathered for p, v in part.items()}


def measure_nic_groups(groups, sizes: Sequence[int], reps: int, device: torch.device, stat: str,
                       progress: Progress) -> tuple[dict[tuple[str, tuple[str, ...]], NicFit], list[str]]:
    """Collective: per (host, kind of destination) of :func:`~lightning_hexiscale.profiling.discovery_plan.nic_groups`,
    the first transfer alone, then all of them at once (every rank joins the barriers; only the
    pairs move data), fitted by :func:`~lightning_hexiscale.profiling.fit.fit_nic` (the NIC figure from
    the transfers' common span on the host's clock). Returns the fits
    and notes (a group whose times do not fit a bandwidth is left out, and the note says so), the
    same on every rank."""
    rank = dist.get_rank()
    out_buf = torch.ones(max(sizes), dtype=torch.uint8, device=device)
    in_buf = torch.empty_like(out_buf)
    mine: dict[int, tuple[list, list, list]] = {}
    for gi, (host, dest, pairs) in enumerate(groups):
        for together in (pairs[:1], pairs):
            role = next(((b, True) if rank == a else (a, False) for a, b in together if rank in (a, b)), (None, False))
            stamps: list[tuple[float, float]] = []
            times = transfer(role[0], role[1], sizes, reps, device, out_buf, in_buf, dist.barrier, stamps)
            if role[1]:
                solo, conc, clocks = mine.setdefault(gi, ([], [], []))
                (solo if len(together) == 1 else conc).append(times)
                if len(together) > 1:
                    clocks.append(stamps)
        progress.step(f"NIC of {host} toward {', '.join(dest)}: alone, then {len(pairs)} at once", "NICs")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    fits, notes = {}, []
    samples = [s for s in sizes for _ in range(reps)]
    for gi, (host, dest, _) in enumerate(groups):
        single = next(g[gi][0][0] for g in gathered if gi in g and g[gi][0])
        concurrent = [t for g in gathered if gi in g for t in g[gi][1]]
        clocks = [c for g in gathered if gi in g for c in g[gi][2]]  # the senders: all on ``host``
        try:
            fits[(host, dest)] = fit_nic(samples, single, concurrent, stat, clocks)
        except ValueError as e:  # every rank fits the same gathered times: all go on alike
            notes.append(f"NIC of {host} toward {', '.join(dest)}: not written, its transfers did not fit a bandwidth ({e})")
    return fits, notes


def nic_figures(fits: dict[tuple[str, tuple[str, ...]], NicFit]):
    """Per host: its NIC (the kind it carried most toward) and the kinds it carried clearly less
    toward (below :data:`NIC_KIND_RATIO` of that), as ``ProfileResult.nics`` and ``nic_to``."""
    nics, nic_to = {}, {}
    for (host, _), f in fits.items():
        if host not in nics or f.aggregate_Bps > nics[host].aggregate_Bps:
            nics[host] = f
    for (host, dest), f in fits.items():
        if f.aggregate_Bps < NIC_KIND_RATIO * nics[host].aggregate_Bps:
            nic_to.setdefault(host, []).append((dest, f.aggregate_Bps))
    return nics, nic_to


def _merge_tables(parts: Sequence[Sequence]) -> tuple:
    """Layer tables of one device type measured one TP degree at a time -> one table per type."""
    by: dict[str, object] = {}
    for tables in parts:
        for t in tables:
            by[t.gpu] = replace(by[t.gpu], rows=by[t.gpu].rows + t.rows) if t.gpu in by else t
    return tuple(replace(t, rows=tuple(sorted(t.rows, key=lambda r: (r.part, r.tp, r.micro_batch))))
                 for t in by.values())


def replaced_by_copy(dst: str | Path) -> str:
    """What a copy to ``dst`` (:func:`copy_cluster`) will replace, as ``; replacing A, B`` for the line
    that names the copy, or "": ``--out`` overwrites, and a file of the user's (a hand-written cluster,
    the matrices beside it) should not go without a word."""
    dst = Path(dst).resolve()
    there = [str(p) for p in (dst, dst.with_name(dst.stem + ".matrix.yaml")) if p.is_file()]
    return f"; replacing {', '.join(there)}" if there else ""


def check_settings(micro_batches: Sequence[int], budget_s: float, reps: int, layer_reps: int,
                   name: str | None = None) -> None:
    """The settings every rank checks alike before any collective (ConfigError naming the option)."""
    if name is not None and not str(name).strip():  # '' would be the default when measuring, '' when reusing
        raise ConfigError("--name", name, "must not be empty", "give e.g. --name my_cluster, or leave --name out "
                          "for discovered_<fingerprint>")
    if not micro_batches or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in micro_batches):
        raise ConfigError("--layer-micro-batches", list(micro_batches), "must be whole numbers >= 1",
                          "give e.g. 1,2,4 (the micro-batch sizes the planner may choose)")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ConfigError("--budget", budget_s, "must be a positive number of seconds", "give e.g. --budget 60")
    for key, v in (("--reps", reps), ("--layer-reps", layer_reps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(key, v, "must be a whole number >= 1", f"give e.g. {key} 3")


def _out_error(out: str | Path | None, cached: Path) -> ConfigError | None:
    """Rank 0: the error of an ``out`` that cannot take the copy (a folder, a path below a file, an
    unwritable folder, the cache's matrix file), found before anything is measured: it used to fail
    in :func:`copy_cluster` after the whole measurement, one rank's traceback and the others' lost
    connections. None when ``out`` is fine (or not given)."""
    if out is None:
        return None
    from lightning_hexiscale.config.recipe import check_output_file

    if Path(out).resolve() == cached.with_name(cached.stem + ".matrix.yaml").resolve():
        return ConfigError("--out", str(out), "is the cache's matrix file, which the cached cluster file points to",
                           "give another path, e.g. --out cluster.yaml")
    try:
        check_output_file("--out", str(out), "cluster.yaml", kind="cluster")
    except ConfigError as e:
        return e
    return None


def _cache_state(cached: Path, rediscover: bool, out: str | Path | None = None) -> bool | ConfigError:
    """Rank 0: reuse the cached file (True), measure (False), or the error of a cached file that does
    not load, of a cache folder that cannot be written or of an ``out`` that cannot be written
    (returned, so that every rank raises it)."""
    bad_out = _out_error(out, cached)
    if bad_out is not None:
        return bad_out
    if cached.is_file() and not rediscover:
        return _check_cached(cached) or True
    return cache_folder_error(cached.parent) or False


def cache_folder_error(folder: Path) -> ConfigError | None:
    """The error of a cache folder that cannot be created or written (a file of this job's own is
    written and removed there), or None. ``hexiscale discover --local`` and ``hexiscale train`` with
    cluster=auto check it before their ranks start, rank 0 again inside discovery."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # a name of this job's own: two jobs probing one folder at once would unlink each other's
        probe = folder / f".probe.{os.getpid()}.{threading.get_ident()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return ConfigError(f"${dp.CACHE_ENV}", str(folder), f"the cache folder cannot be written ({e.strerror})",
                           f"point {dp.CACHE_ENV} at a writable folder")
    return None


def _check_cached(path: Path) -> ConfigError | None:
    """The error of a cached file that does not load (a file cut short, an older format), or None."""
    from lightning_hexiscale.config.cluster import Cluster

    try:
        Cluster.load(str(path))
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as e:
        return ConfigError(f"${dp.CACHE_ENV}", str(path), f"the cached cluster file does not load ({e})",
                           # the fix for every entry point: `hexiscale train` and Trainer have no --rediscover
                           f"delete {path} (a cache: the next run measures again), or run `hexiscale discover "
                           f"--rediscover` (rediscover=True in Python)")
    return None


def discover_process_group(model: LlamaConfig, *, precision: str | None = None,
                           micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES, tp_degrees: Sequence[int] | None = None,
                           sizes: Sequence[int] | None = None, reps: int = 3, matmul_n: int | None = None,
                           matmul_time_s: float = 0.5, layer_reps: int = 2, link_stat: str = "median",
                           max_pairs: int | None = None, rediscover: bool = False, out: str | Path | None = None,
                           name: str | None = None, budget_s: float = DEFAULT_BUDGET_S, progress: bool = True,
                           log: Callable[[str], None] | None = None) -> Discovery:
    """Discover the cluster of the default process group (module docstring); collective. Returns the
    same :class:`Discovery` on every rank (rank 0 writes the files).

    ``precision``: the job's Lightning precision (None: 32-true on CPU, bf16-mixed on CUDA);
    ``micro_batches`` / ``tp_degrees``: of the layer tables (TP default: the powers of two up to the
    largest machine and each machine's count, at most the model's KV heads); ``sizes`` / ``reps``:
    the ping-pong message sizes (bytes) and timed repetitions; ``max_pairs``: pairs measured at once
    (default: no limit on CUDA, cores // 2 on CPU, as the profile); ``budget_s``: seconds discovery
    should take (a warning when exceeded).
    """
    from lightning_hexiscale.config.layer_table import ModelShape
    from lightning_hexiscale.profiling import precision as prec
    from lightning_hexiscale.profiling.layer_times import check_tp_fits, default_tp_degrees, measure_layer_tables

    check_settings(micro_batches, budget_s, reps, layer_reps, name)
    t_start = time.perf_counter()
    rank = dist.get_rank()
    device = current_device()
    run = prec.resolve(precision, device)
    say = (log or (lambda m: print(m, flush=True))) if rank == 0 else (lambda m: None)
    reports = report_ranks(device)
    hosts = dp.hosts_in_order(reports)
    types = [r.device_type for r in reports]
    machines = [list(m.ranks) for m in infer_machines([r.host for r in reports], types)]
    degrees = sorted(set(tp_degrees or default_tp_degrees([len(m) for m in machines], model.num_kv_heads)))
    model.check_measured_tp(degrees, "tp_degrees")
    check_tp_fits(degrees, machines)  # every rank alike (same reports), before the cache and any measurement
    check_matmul_size(matmul_n, run.compute_dtype, [r.memory_bytes for r in reports], device.type == "cuda")
    mbs = sorted({int(m) for m in micro_batches})
    settings = {"tp_degrees": degrees, "micro_batches": mbs}
    if os.environ.get("HEXISCALE_EMULATION"):  # inside `hexiscale emulate`: its quotas and links are the hardware
        settings["emulation"] = os.environ["HEXISCALE_EMULATION"]
    fp = dp.fingerprint(reports, vars(ModelShape.of(model)), run.name, torch.__version__, settings)
    cached = dp.cache_path(fp)
    count = dp.count_for(reports, len(degrees), len(mbs))
    say(f"discovering {len(reports)} rank(s) on {len(hosts)} machine(s) "
        f"({', '.join(f'{h}: {len(rs)} x {reports[rs[0]].device_type}' for h, rs in hosts.items())}); "
        f"{model.name or 'model'} in {run.name}; fingerprint {fp}")
    # every rank follows rank 0's file system: all measure or none, and all raise its cache error alike
    reuse = _from_rank0(_cache_state(cached, rediscover, out) if rank == 0 else None)
    if isinstance(reuse, ConfigError):
        raise reuse
    if reuse:
        path = cached
        replacing = ""
        if rank == 0 and out is not None:
            replacing = "" if Path(out).resolve() == cached.resolve() else replaced_by_copy(out)
            path = copy_cluster(cached, Path(out), name)
        elif rank == 0 and name is not None:
            copy_cluster(cached, cached, name)
        seconds = time.perf_counter() - t_start
        say(f"reusing the cluster discovered earlier: {cached} (same fingerprint; {seconds:.2f} s; "
            f"to measure again: hexiscale discover --rediscover, or delete that file)" + (f"; copied to {path}" if path != cached else "")
            + replacing)
        return Discovery(_from_rank0(str(path)), True, fp, seconds, count, str(cached))

    say(f"measuring: {count.describe()}")
    sizes = sorted(int(s) for s in (sizes or default_sizes(device.type == "cuda")))
    if max_pairs is None and device.type != "cuda":
        max_pairs = max(1, (os.cpu_count() or 2) // 2)
    intra = dp.intra_pairs(reports)
    intra_steps = dp.disjoint_steps(list(intra.values()), max_pairs)
    inter_steps = dp.inter_steps(reports, max_pairs)
    nic_plan = dp.nic_groups(reports)
    bar = Progress(2 + len(degrees) + len(intra_steps) + len(inter_steps) + len(nic_plan) + 1,
                   budget_s, progress and rank == 0, say)
    bar.step("ranks reported", "report")

    dist.barrier()
    flops = measure_matmul_flops(device, matmul_n, matmul_time_s, dtype=run.compute_dtype)
    per_rank: list = [None] * len(reports)
    dist.all_gather_object(per_rank, flops)
    bar.step("matmul FLOP/s on every rank at once", "flops")

    parts = []
    for t in degrees:
        tables = measure_layer_tables(model, mbs, run.name, [t], reps=layer_reps, types=types, machines=machines)
        parts.append(tables or ())
        bar.step(f"layer times at TP {t}, micro-batches {mbs}", "layer times")

    intra_fits = measure_pairs(intra_steps, sizes, reps, device, link_stat, bar, "intra-machine links", "intra links")
    inter_fits = measure_pairs(inter_steps, sizes, reps, device, link_stat, bar, "machine-pair links", "inter links")
    nic_fits, nic_notes = measure_nic_groups(nic_plan, sizes, reps, device, link_stat, bar)

    path, replacing = cached, ""
    if rank == 0:
        by_type = {key: intra_fits[pair] for key, pair in intra.items()}
        by_host = {tuple(sorted((reports[a].host, reports[b].host))): v for (a, b), v in inter_fits.items()}
        bw, lat, err = dp.fill_links(reports, {k: v[:3] for k, v in by_host.items()},
                                     {k: v[:3] for k, v in by_type.items()})
        import numpy as np

        notes = [f"discovered by `hexiscale discover` (fingerprint {fp}, torch {torch.__version__}): "
                 f"{count.describe()}",
                 f"flops: sustained matmul in {str(run.compute_dtype).replace('torch.', '')} (precision {run.name}), "
                 "every rank at once, median per device type",
                 "links: one ping-pong pair per machine pair and per device-type pair inside a machine "
                 f"({link_stat} of {reps} per size); every other rank pair has its representative's figures"]
        notes += [f"intra {a}/{b}: {v[3]}" for (a, b), v in by_type.items() if v[3]]
        notes += [f"machines {a}/{b}: {v[3]}" for (a, b), v in by_host.items() if v[3]]
        notes += nic_notes
        nics, nic_to = nic_figures(nic_fits)
        result = ProfileResult(hostnames=[r.host for r in reports], device_types=types, flops=list(per_rank),
                               memory_bytes=[r.memory_bytes for r in reports], bandwidth_Bps=np.array(bw),
                               latency_s=np.array(lat), fit_rel_rms=np.array(err), hopper=[r.hopper for r in reports],
                               backend=dist.get_backend(), flops_dtype=str(run.compute_dtype).replace("torch.", ""),
                               sizes_bytes=list(sizes), notes=notes, nics=nics, nic_to=nic_to,
                               layer_tables=_merge_tables(parts))
        write_cluster(result, cached, name or f"discovered_{fp[:8]}", tool="hexiscale discover")
        if out is not None:
            replacing = "" if Path(out).resolve() == cached.resolve() else replaced_by_copy(out)
            path = copy_cluster(cached, Path(out))
    bar.step("cluster file written", "write")
    seconds = bar.close()
    say(f"discovered in {seconds:.1f} s: {path}" + (f" (cached as {cached})" if path != cached else "")
        + replacing)
    over = budget_message(seconds, budget_s, bar.phases)
    if over and rank == 0:
        warnings.warn(over, stacklevel=2)
    return Discovery(_from_rank0(str(path)), False, fp, seconds, count, str(cached))


def _from_rank0(value):
    """Collective: rank 0's ``value`` on every rank (also the last fence: rank 0 has written)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
