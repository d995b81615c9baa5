"""The measurements, run collectively by every rank of an initialised process group.

:func:`profile_process_group` is the whole profile: host names -> matmul FLOP/s and memory of each
rank -> alpha/beta of every pair -> a :class:`~lightning_hexiscale.profiling.writer.ProfileResult`
on rank 0. It uses whatever default process group exists (NCCL on GPUs, gloo on CPU), so it runs
the same under torchrun, SLURM, ``hexiscale profile --local N`` or inside a function launched by
Lightning (``Fabric(strategy="ddp", devices=8).launch(fn)`` with ``fn`` calling it).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from lightning_hexiscale.profiling.fit import NicFit, fit_nic, fit_or_bound, nic_pairs, pair_schedule
from lightning_hexiscale.profiling.writer import ProfileResult


def current_device() -> torch.device:
    """The device this rank measures: its CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_type_name(device: torch.device) -> str:
    """``CPU``, or the CUDA device name with non-alphanumerics replaced: ``NVIDIA-H100-80GB-HBM3``.

    On CPU inside ``hexiscale emulate``, the emulated type (``HEXISCALE_DEVICE_TYPE``, e.g.
    ``EMU-SLOW``): ranks with different CPU quotas are different devices, and the profile's
    per-type FLOP/s must not be a median over both."""
    if device.type == "cuda":
        return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-")
    return os.environ.get("HEXISCALE_DEVICE_TYPE") or "CPU"


def machine_name() -> str:
    """The machine this rank is on: its host name, or under ``hexiscale emulate`` (every rank on one
    host, each machine a network namespace) the emulated machine's name, ``HEXISCALE_MACHINE``."""
    return os.environ.get("HEXISCALE_MACHINE") or socket.gethostname()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MATMUL_MEMORY_SHARE = 0.5
"""The share of a rank's memory the FLOP/s test's three n x n buffers may take: the rest is for what else
the rank holds (torch, the communication buffers, on CPU the host itself)."""


def default_matmul_size(cuda: bool) -> int:
    """The FLOP/s test's n when none is given: 8192 on CUDA, 1024 on CPU."""
    return 8192 if cuda else 1024


def matmul_size_error(n: int | None, dtype: torch.dtype, memory_bytes: float, where: str,
                      key: str = "--matmul-size") -> Exception | None:
    """The ConfigError of an n x n FLOP/s test whose buffers (a, b and the product: 3 n^2 elements of
    ``dtype``) take more than :data:`MATMUL_MEMORY_SHARE` of ``memory_bytes`` (a rank's memory,
    :func:`device_memory_bytes`; ``where`` names whose), or None. Checked before anything is allocated:
    ``--matmul-size 100000`` was a 40 GB allocator traceback from every rank."""
    from lightning_hexiscale.errors import ConfigError

    if n is None:
        return None
    size = torch.tensor([], dtype=dtype).element_size()
    need = 3 * n * n * size
    limit = MATMUL_MEMORY_SHARE * memory_bytes
    if need <= limit:
        return None
    largest = int((limit / (3 * size)) ** 0.5)
    return ConfigError(key, n, f"the FLOP/s test's three {n} x {n} {str(dtype).replace('torch.', '')} buffers take "
                       f"{need / 2**30:.1f} GiB, more than {MATMUL_MEMORY_SHARE:.0%} of {where} "
                       f"({memory_bytes / 2**30:.1f} GiB)",
                       f"give --matmul-size {largest} or less (a few thousand measures the sustained rate), or "
                       f"leave it out for the default")


def measure_matmul_flops(device: torch.device, n: int | None = None, min_time_s: float = 0.5, windows: int = 5,
                         dtype: torch.dtype | None = None) -> float:
    """Sustained FLOP/s of an n x n @ n x n matmul (2 n^3 FLOPs) on this rank, in FLOP/s.

    In ``dtype``: the run's compute dtype (:mod:`~lightning_hexiscale.profiling.precision`); by
    default bf16 on CUDA (bf16-mixed, the training precision the catalog's peak figures refer to)
    and fp32 on CPU, where bf16 matmuls have no fast path on most CPUs and training defaults to
    32-true. After two
    warm-up products, ``windows`` windows of at least ``min_time_s / windows`` each are timed and
    the BEST window's rate (FLOPs / time) is returned: load from other jobs on a shared host only
    ever slows a window down. Every rank measures at the same time, as they compute during
    training, so ranks that share cores (more ranks than cores) each see their share of a core.
    """
    cuda = device.type == "cuda"
    n = n or default_matmul_size(cuda)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=c)
    _sync(device)
    best = 0.0
    for _ in range(max(1, windows)):
        reps = 0
        t0 = time.perf_counter()
        while True:
            torch.mm(a, b, out=c)
            reps += 1
            if reps % 4 == 0 or not cuda:
                _sync(device)
                if time.perf_counter() - t0 >= min_time_s / max(1, windows):
                    break
        best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - t0))
    return best


def agree_on_matmul_size(n: int | None, dtype: torch.dtype, memory_bytes: float, device: torch.device) -> None:
    """Collective: every rank raises the same :func:`matmul_size_error` when ``n``'s buffers do not fit the
    memory of some rank, before any rank allocates them."""
    if n is None:
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, memory_bytes)
    check_matmul_size(n, dtype, everyone, device.type == "cuda")


def check_matmul_size(n: int | None, dtype: torch.dtype, memories: Sequence[float], cuda: bool) -> None:
    """Raise :func:`matmul_size_error` for the rank with the least of ``memories`` (bytes, by rank)."""
    if n is None or not memories:
        return
    least = min(range(len(memories)), key=lambda r: memories[r])
    where = f"rank {least}'s memory" + ("" if cuda else " (its host's RAM shared by its ranks)")
    error = matmul_size_error(n, dtype, memories[least], where)
    if error is not None:
        raise error


def device_memory_bytes(device: torch.device, ranks_on_host: int) -> float:
    """Memory one rank may use, in bytes: the CUDA device's total memory, or on CPU the host's
    physical RAM divided by the ranks that share the host, or the rank's own cgroup memory limit
    when it is lower (``hexiscale emulate --memory`` sets one per rank)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = float(total) / max(ranks_on_host, 1)
    limit = cgroup_memory_limit()
    return min(share, limit) if limit else share


def cgroup_memory_limit() -> float | None:
    """This process's cgroup memory limit in bytes (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``), or None when it has none (v1 reports "none" as a number near 2^63)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            f = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        elif ctrls == "":
            f = f"/sys/fs/cgroup{path}/memory.max"
        else:
            continue
        try:
            text = open(f).read().strip()
        except OSError:
            continue
        if text != "max" and int(text) < 2**60:
            return float(text)
    return None


def is_hopper(device: torch.device) -> bool:
    """A compute-capability 9.x GPU (H100, H200, H800, H20)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def ping_pong(peer: int, initiator: bool, sizes: Sequence[int], reps: int, device: torch.device,
              send_buf: torch.Tensor, recv_buf: torch.Tensor) -> list[float]:
    """One-way times (s) per message, ``reps`` per size after one warm-up, as half round trips.

    The initiator sends s bytes and waits for the same s bytes back; the half round trip is the
    one-way time t(s) = alpha + s/beta with clock offsets between hosts cancelled (one clock).
    Non-blocking isend/irecv + wait: a blocking gloo ``send`` can wait for the matching receive,
    which this order provides, but isend keeps it safe if the order ever changes. Only the
    initiator's list is meaningful; the responder returns [].
    """
    times: list[float] = []
    for s in sizes:
        out, inp = send_buf[:s], recv_buf[:s]
        for k in range(reps + 1):
            _sync(device)
            t0 = time.perf_counter()
            if initiator:
                dist.isend(out, peer).wait()
                dist.irecv(inp, peer).wait()
            else:
                dist.irecv(inp, peer).wait()
                dist.isend(out, peer).wait()
            _sync(device)
            if initiator and k > 0:
                times.append((time.perf_counter() - t0) / 2.0)
    return times


def transfer(peer: int, sender: bool, sizes: Sequence[int], reps: int, device: torch.device,
             send_buf: torch.Tensor, recv_buf: torch.Tensor, barrier=None,
             stamps: list[tuple[float, float]] | None = None) -> list[float]:
    """One-way transfers timed on the sender: s bytes to ``peer``, then a 1-byte acknowledgement back
    (so the time ends when the receiver holds every byte: t(s) = alpha + s / beta + alpha_ack),
    ``reps`` per size after one warm-up. ``barrier``: called before every transfer by every rank
    (a collective), so that concurrent transfers start together. Returns the sender's times; the
    receiver (and a rank with ``peer`` None, which only joins the barriers) returns []. ``stamps``:
    the sender appends (start, end) of each timed transfer (``time.perf_counter``), from which
    :func:`~lightning_hexiscale.profiling.fit.common_spans` reads concurrent transfers' span."""
    ack_out, ack_in = send_buf[:1], recv_buf[:1]
    times: list[float] = []
    for s in sizes:
        for k in range(reps + 1):
            if barrier is not None:
                barrier()
            if peer is None:
                continue
            _sync(device)
            t0 = time.perf_counter()
            if sender:
                dist.isend(send_buf[:s], peer).wait()
                dist.irecv(ack_in, peer).wait()
            else:
                dist.irecv(recv_buf[:s], peer).wait()
                dist.isend(ack_out, peer).wait()
            _sync(device)
            if sender and k > 0:
                t1 = time.perf_counter()
                times.append(t1 - t0)
                if stamps is not None:
                    stamps.append((t0, t1))
    return times


def measure_nics(hosts: Sequence[str], sizes: Sequence[int], reps: int, device: torch.device,
                 send_buf: torch.Tensor, recv_buf: torch.Tensor, link_stat: str = "median",
                 log=None) -> tuple[dict[str, NicFit], list[str]]:
    """Collective: for every host with several ranks (:func:`~lightning_hexiscale.profiling.fit.nic_pairs`),
    the first pair's transfers alone, then all of the host's pairs at once (every rank joins the
    barriers; only the pairs move data). Returns ({host: NicFit}, notes) on every rank (gathered):
    a host whose times do not fit a bandwidth (loopback so fast that scheduling noise hides the
    size) is left out and a note says so, as discovery does, rather than ending the profile."""
    rank = dist.get_rank()
    mine: dict[str, tuple[list, list, list]] = {}
    for host, pairs in nic_pairs(list(hosts)):
        for together in (pairs[:1], pairs):
            role = next(((b, True) if rank == a else (a, False) for a, b in together if rank in (a, b)), (None, False))
            stamps: list[tuple[float, float]] = []
            times = transfer(role[0], role[1], sizes, reps, device, send_buf, recv_buf, dist.barrier, stamps)
            if role[1]:
                solo, conc, clocks = mine.setdefault(host, ([], [], []))
                (solo if len(together) == 1 else conc).append(times)
                if len(together) > 1:
                    clocks.append(stamps)
        if log:
            log(f"  NIC of {host}: {len(pairs)} transfers to other hosts alone and at once")
    gathered: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[str, NicFit] = {}
    notes: list[str] = []
    samples = [s for s in sizes for _ in range(reps)]
    for host, pairs in nic_pairs(list(hosts)):
        single = next(g[host][0][0] for g in gathered if host in g and g[host][0])
        concurrent = [t for g in gathered if host in g for t in g[host][1]]
        clocks = [c for g in gathered if host in g for c in g[host][2]]  # the senders: all on ``host``
        try:
            out[host] = fit_nic(samples, single, concurrent, link_stat, clocks)
        except ValueError as e:  # every rank fits the same gathered times: all go on alike
            notes.append(f"NIC of {host}: not written, its transfers did not fit a bandwidth ({e})")
    return out, notes


def profile_process_group(sizes: Sequence[int] | None = None, reps: int = 5, max_pairs: int | None = None,
                          isolate_hosts: bool = True, matmul_n: int | None = None,
                          matmul_time_s: float = 0.5, link_stat: str = "median", log=None,
                          precision: str | None = None, nics: bool = True) -> ProfileResult | None:
    """Profile every rank of the default process group; collective (all ranks call it).

    Steps (each fenced by a barrier so that one phase does not disturb the next):
    1. host names are all-gathered (they define machines and the CPU memory share);
    2. every rank measures its matmul FLOP/s at the same time, in the compute dtype of ``precision``
       (a Lightning precision string; None: 32-true on CPU, bf16-mixed on CUDA), and its memory;
    3. the pairs run in the steps of :func:`~lightning_hexiscale.profiling.fit.pair_schedule`:
       disjoint pairs at once, at most ``max_pairs`` pairs per step (default: no limit on CUDA,
       ``cores // 2`` on a CPU host, because a gloo pair keeps two cores busy and more pairs than
       that would measure the CPU scheduler, not the link), and with ``isolate_hosts`` at most one
       cross-host pair per host per step;
    4. each pair's initiator fits alpha, beta (``link_stat``: median or min per size, see
       :func:`~lightning_hexiscale.profiling.fit.fit_alpha_beta`); rank 0 gathers everything;
    5. with ``nics``, per host with several ranks: transfers from its ranks to other hosts, first one
       alone, then all at once (:func:`measure_nics`): what its network interface carries when
       they share it, written as the machine's ``nics.bandwidth``.

    Returns the :class:`ProfileResult` on rank 0 and None elsewhere.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    cuda = device.type == "cuda"
    from lightning_hexiscale.profiling.fit import default_sizes
    from lightning_hexiscale.profiling.precision import resolve

    run = resolve(precision, device)
    flops_dtype = str(run.compute_dtype).replace("torch.", "")

    sizes = sorted(int(s) for s in (sizes or default_sizes(cuda)))
    say = (log or (lambda msg: None)) if rank == 0 else (lambda msg: None)

    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, machine_name())
    on_host = hosts.count(hosts[rank])
    say(f"profiling {world} ranks on {len(set(hosts))} host(s), backend {dist.get_backend()}")

    memory = device_memory_bytes(device, on_host)
    agree_on_matmul_size(matmul_n, run.compute_dtype, memory, device)
    dist.barrier()
    flops = measure_matmul_flops(device, matmul_n, matmul_time_s, dtype=run.compute_dtype)
    me = {"type": device_type_name(device), "flops": flops, "memory": memory, "hopper": is_hopper(device)}
    info: list[dict] = [{}] * world
    dist.all_gather_object(info, me)
    say(f"matmul FLOP/s measured on all ranks at once ({flops_dtype}, precision {run.name})")

    if max_pairs is None and not cuda:
        max_pairs = max(1, (os.cpu_count() or 2) // 2)
    steps = pair_schedule(world, hosts, max_pairs, isolate_hosts)
    buf_out = torch.ones(max(sizes) if sizes else 1, dtype=torch.uint8, device=device)
    buf_in = torch.empty_like(buf_out)
    mine: dict[tuple[int, int], tuple[float, float, float, str]] = {}
    t_start = time.perf_counter()
    for k, step in enumerate(steps):
        dist.barrier()
        for a, b in step:
            if rank in (a, b):
                peer = b if rank == a else a
                times = ping_pong(peer, rank == a, sizes, reps, device, buf_out, buf_in)
                if rank == a:
                    mine[(a, b)] = fit_or_bound(sizes, times, reps, link_stat)
        if k == 0 or (k + 1) % max(1, len(steps) // 10) == 0:
            say(f"  link step {k + 1}/{len(steps)} ({len(step)} pair(s) at once), "
                f"{time.perf_counter() - t_start:.1f} s")
    dist.barrier()
    nic_fits, nic_notes = measure_nics(hosts, sizes, reps, device, buf_out, buf_in, link_stat, say) if nics else ({}, [])
    fits: list[dict] = [{}] * world
    dist.all_gather_object(fits, mine)
    if rank != 0:
        return None
    bw = np.full((world, world), np.inf)
    lat = np.zeros((world, world))
    err = np.zeros((world, world))
    bounds = []
    for part in fits:
        for (a, b), (alpha, beta, rel, note) in part.items():
            lat[a, b] = lat[b, a] = alpha
            bw[a, b] = bw[b, a] = beta
            err[a, b] = err[b, a] = rel
            if note:
                bounds.append(f"link {a}-{b}: {note}")
    notes = [f"flops: sustained {matmul_n or default_matmul_size(cuda)}^3 matmul, "
             f"{flops_dtype} (precision {run.name}) on {'CUDA' if cuda else 'CPU (one intra-op thread per rank)'}, "
             f"all ranks at once, "
             f"best of 5 windows"]
    notes.append("memory: CUDA total device memory" if cuda else
                 "memory: CPU host RAM divided by the ranks on that host")
    notes.append(f"links: {link_stat} of {reps} ping-pongs per size; "
                 + (f"at most {max_pairs} pair(s) at once" if max_pairs else "all disjoint pairs of a round at once")
                 + ("; cross-host pairs one per host at a time" if isolate_hosts else ""))
    notes += bounds + nic_notes
    for host, f in nic_fits.items():
        notes.append(f"NIC of {host}: {f.flows} transfers at once carried {f.aggregate_Bps / 1e6:.1f} MB/s together "
                     f"({f.aggregate_Bps / f.flows / 1e6:.1f} MB/s each), one alone {f.single_Bps / 1e6:.1f} MB/s")
    return ProfileResult(hostnames=hosts, device_types=[i["type"] for i in info], flops=[i["flops"] for i in info],
                         memory_bytes=[i["memory"] for i in info], bandwidth_Bps=bw, latency_s=lat, fit_rel_rms=err,
                         hopper=[i["hopper"] for i in info], backend=dist.get_backend(),
                         flops_dtype=flops_dtype, sizes_bytes=list(sizes), notes=notes, nics=nic_fits)
