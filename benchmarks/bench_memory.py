"""CPU benchmark: peak memory per rank under a trainer precision, measured vs ``estimate()``.

For each dp_sharding (ddp, zero2, zero3) and each number of micro-batches in flight (default 1 and
8), trains a small LLaMA (default ~3.3 M parameters: 4 layers of width 256, FFN 704, byte
vocabulary, 128-token sequences: long enough that page rounding of tiny activation tensors does not
dominate the measurement) on ``--ranks`` single-device GPipe pipelines (gloo ranks forked from a fresh
fork server, one launch per row so that each peak is its own) under ``--precision`` (default ``bf16-mixed``: float32
parameters, forward under bf16 autocast, as the Lightning strategy runs it).

Measured: the growth of each rank's peak resident set (VmHWM, reset through /proc/self/clear_refs)
from before the engine is built to after ``--steps`` optimizer steps, with glibc's mmap threshold
fixed at 4 KiB so that freed tensors leave the resident set (``bench_zero.py`` uses 64 KiB; bf16
activations of small micro-batches are smaller than that and would otherwise stay in the heap); one-time lazy
initialisation is primed before the baseline by one throw-away step of the same plan
(:func:`warm_up`). Estimated: ``planner/cost/estimate.py`` for the same plan
and precision (:func:`lightning_hexiscale.profiling.check.cpu_workload`: AdamW, nothing reserved,
no collective-library buffers on gloo).

Printed: one row per (sharding, micro-batches): estimated MiB, measured MiB (largest rank) and
est/meas, then the spread of est/meas over the rows.

    python benchmarks/bench_memory.py                          # ~1-2 min on 2 idle cores
    python benchmarks/bench_memory.py --precision 32-true --micro-batches 1 4
    python benchmarks/bench_memory.py --fast-path off          # the plain stage (no main grads, casts per linear, ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing as mp
import socket

import torch
import torch.distributed as dist

from lightning_hexiscale.bench.resident_memory import fixed_mmap_threshold, peak_rss_bytes, prime_process, reset_peak_rss
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, estimate
from lightning_hexiscale.profiling.check import cpu_workload, make_batch
from lightning_hexiscale.runtime.engine import PipelineEngine

SHARDINGS = ("ddp", "zero2", "zero3")
PRECISIONS = {"32-true": (torch.float32, None), "bf16-mixed": (torch.float32, torch.bfloat16),
              "bf16-true": (torch.bfloat16, None)}
"""Trainer precision -> (parameter dtype, autocast dtype), as the strategy runs the engine."""
MIB = 2**20


def bench_config(layers: int = 4, hidden: int = 256, seq: int = 128) -> LlamaConfig:
    return LlamaConfig(name="bench_memory", hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64),
                       num_kv_heads=max(1, hidden // 64), ffn_hidden_size=int(2.75 * hidden) // 8 * 8,
                       vocab_size=256, seq_len=seq)


def gpipe_plan(world: int, config: LlamaConfig, micro_batches: int, sharding: str) -> Plan:
    """One single-device GPipe pipeline per rank (all ``micro_batches`` in flight at the peak),
    micro-batches of one sequence."""
    return Plan.from_dict({"num_layers": config.num_layers, "schedule": "gpipe", "recompute": False,
                           "dp_sharding": sharding,
                           "pipelines": [{"batch_size": micro_batches, "micro_batch_size": 1,
                                          "stages": [{"devices": [r], "layers": [0, config.num_layers]}]}
                                         for r in range(world)]})


def warm_up(plan: Plan, config: LlamaConfig, dtype: torch.dtype, autocast: torch.dtype | None,
            fast_path: dict | None = None) -> None:
    """One throw-away step of the same plan before the baseline: the one-time lazy initialisation
    of the kernels this precision and these shapes use (oneDNN's bf16 matmul caches and scratch
    buffers: ~14 MiB of resident memory per rank that no tensor holds, measured) is not what the
    estimate models (on CUDA the analogue is the cuBLAS workspace, outside max_memory_allocated)."""
    import gc

    engine = PipelineEngine(plan, config, seed=0, dtype=dtype, autocast_dtype=autocast, fast_path=fast_path)
    opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
    engine.fit_step(*make_batch(config, plan.global_batch, 0), opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL)
    del engine, opt
    gc.collect()


def _worker(rank: int, world: int, port: int, plan_dict: dict, config: LlamaConfig, precision: str, steps: int,
            fast_path: dict | None, out) -> None:
    torch.set_num_threads(1)
    fixed_mmap_threshold(4096)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        plan = Plan.from_dict(plan_dict)
        dtype, autocast = PRECISIONS[precision]
        prime_process()
        warm_up(plan, config, dtype, autocast, fast_path)
        baseline = reset_peak_rss()
        engine = PipelineEngine(plan, config, seed=0, dtype=dtype, autocast_dtype=autocast, fast_path=fast_path)
        opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
        for step in range(steps):
            tok, tgt = make_batch(config, plan.global_batch, step)
            engine.fit_step(tok, tgt, opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL)  # the step Trainer.fit runs
        out.put((rank, "ok", peak_rss_bytes() - baseline))
    except Exception as e:  # reported by the parent
        out.put((rank, "error", repr(e)))
    finally:
        dist.destroy_process_group()


def _fresh_context() -> mp.context.BaseContext:
    """Ranks forked from a fork server (a freshly started interpreter that has imported this
    module and torch, and never runs a tensor op), not from the caller: a rank forked from a
    long-lived process (a pytest run) inherits its heap, allocator and kernel caches, and its peak
    resident-set growth then depends on what that process did before (+14 MiB, ratio 0.82, seen
    for ddp with 1 micro-batch after the rest of the suite). Costs one interpreter start per
    calling process (the server is reused), not one per rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "lightning_hexiscale.bench.resident_memory", "lightning_hexiscale.runtime.engine"])
    return ctx


def measure(plan: Plan, config: LlamaConfig, precision: str, steps: int = 2, timeout: float = 300.0,
            fast_path: dict | None = None) -> list[int]:
    """Peak resident-set growth in bytes per rank (index = global rank) of training ``plan`` (the
    engine's ``fast_path``: None = its default)."""
    ctx = _fresh_context()
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, plan.world_size, port, plan.to_dict(), config, precision, steps,
                                               fast_path, q),
                         daemon=True) for r in range(plan.world_size)]
    for p in procs:
        p.start()
    peaks = {}
    try:
        for _ in procs:
            rank, status, value = q.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"{plan.dp_sharding} rank {rank} failed: {value}")
            peaks[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [peaks[r] for r in range(plan.world_size)]


def estimated_bytes(plan: Plan, config: LlamaConfig, precision: str, fast_path: dict | None = None) -> list[float]:
    """``estimate()``'s peak memory per rank (index = global rank) for the CPU runtime's workload
    (and the same ``fast_path`` switches)."""
    cluster = Cluster.load("cpu2") if plan.world_size <= 2 else Cluster.load("cpu_hetero4")
    est = estimate(plan, cluster, dataclasses.replace(cpu_workload(config, precision), device="cpu",
                                                      fast_path=FastPath.coerce(fast_path)))
    per_rank = {}
    for p, pe in zip(plan.pipelines, est.pipelines):
        for st, se in zip(p.stages, pe.stages):
            for d in st.devices:
                per_rank[d] = se.peak_memory_bytes
    return [per_rank[r] for r in range(plan.world_size)]


def rows(world: int, config: LlamaConfig, precision: str, micro_batches: list[int], steps: int,
         shardings: tuple[str, ...] = SHARDINGS, fast_path: dict | None = None) -> list[dict]:
    """One dict per (sharding, micro-batches): estimated and measured bytes of the largest rank."""
    out = []
    for sharding in shardings:
        for m in micro_batches:
            plan = gpipe_plan(world, config, m, sharding)
            meas = measure(plan, config, precision, steps, fast_path=fast_path)
            est = estimated_bytes(plan, config, precision, fast_path)
            r = max(range(world), key=lambda k: meas[k])
            out.append(dict(sharding=sharding, micro_batches=m, estimated=est[r], measured=meas[r]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="pipelines = gloo ranks (default 2)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256; FFN = 2.75 x)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per launch (default 2)")
    ap.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 8], help="micro-batches per pipeline")
    ap.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=SHARDINGS)
    ap.add_argument("--fast-path", default="auto", choices=("auto", "off"),
                    help="the stage's fast path: auto (the runtime's default) or off (the plain stage)")
    args = ap.parse_args(argv)
    config = bench_config(args.layers, args.hidden, args.seq)
    with torch.device("meta"):
        from lightning_hexiscale.models.llama import Llama

        params = sum(p.numel() for p in Llama(config).parameters())
    print(f"model: {params / 1e6:.1f} M parameters, {args.precision}, fast path {args.fast_path}, {args.ranks} GPipe "
          f"pipelines of one rank, "
          f"micro-batches of 1 x {args.seq} tokens, AdamW, {args.steps} steps")
    fast = None if args.fast_path == "auto" else False
    table = rows(args.ranks, config, args.precision, args.micro_batches, args.steps, tuple(args.shardings), fast)
    print(f"\n{'dp_sharding':<12}{'micro-batches':>14}{'estimated MiB':>15}{'measured MiB':>14}{'est/meas':>10}")
    for r in table:
        print(f"{r['sharding']:<12}{r['micro_batches']:>14}{r['estimated'] / MIB:>15.1f}{r['measured'] / MIB:>14.1f}"
              f"{r['estimated'] / r['measured']:>10.2f}")
    ratios = [r["estimated"] / r["measured"] for r in table]
    print(f"\nest/meas over the rows: {min(ratios):.2f} .. {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
