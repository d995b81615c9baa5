"""CPU benchmark: peak memory per rank under dp_sharding ddp / zero2 / zero3, measured vs estimated.

Trains a LLaMA large enough that weights, gradients and AdamW states dominate (default ~26 M
parameters in fp32: 8 layers of width 512, FFN 1408, byte vocabulary; short sequences and
micro-batches of 1 so that activations are small) with a pure data-parallel plan of ``--ranks``
single-device pipelines on forked gloo ranks, one launch per sharding (fresh processes, so each
peak is its own; glibc's mmap threshold fixed at 64 KiB so that freed memory leaves the resident
set). Measured: the growth of the resident set per rank from before the model is
built to after ``--steps`` optimizer steps (see ``bench_runtime.py``: VmHWM reset through
/proc/self/clear_refs, one-time lazy initialisation primed first). Estimated: the Appendix B
memory model of ``planner/cost/estimate.py`` for the same plan (fp32, K = 8 bytes of Adam state per
parameter, no reserve).

Printed: one row per sharding (measured MiB, estimated MiB, measured/estimated) and the ratios
zero2/ddp and zero3/ddp, measured vs estimated. Expected gap, from the implementation
(``runtime/zero.py``): the local gradient accumulates whole over the pipeline's micro-batches before
the cross-pipeline reduce-scatter (pipelines differ in micro-batch counts), so at the end of the
backward a rank holds 4 bytes/param of gradient that Appendix B's ZeRO-2/3 terms count as 4/N.

    python benchmarks/bench_zero.py                 # 2 ranks, ~1-2 min on 2 idle cores
    python benchmarks/bench_zero.py --ranks 4 --layers 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import socket

import torch
import torch.distributed as dist

from lightning_hexiscale.bench.resident_memory import fixed_mmap_threshold, peak_rss_bytes, prime_process, reset_peak_rss
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload, estimate
from lightning_hexiscale.profiling.calibrate import pure_dp_plan
from lightning_hexiscale.profiling.check import make_batch
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.host import fork_context

SHARDINGS = ("ddp", "zero2", "zero3")
MIB = 2**20


def _worker(rank: int, world: int, port: int, plan_dict: dict, config: LlamaConfig, steps: int, out) -> None:
    torch.set_num_threads(1)
    fixed_mmap_threshold()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        plan = Plan.from_dict(plan_dict)
        prime_process()
        baseline = reset_peak_rss()
        engine = PipelineEngine(plan, config, seed=0)
        opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
        losses = []
        for step in range(steps):
            tok, tgt = make_batch(config, plan.global_batch, step)
            losses.append(engine.fit_step(tok, tgt, opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL).loss)
        out.put((rank, "ok", peak_rss_bytes() - baseline, losses))
    except Exception as e:  # reported by the parent
        out.put((rank, "error", repr(e), None))
    finally:
        dist.destroy_process_group()


def measure(plan: Plan, config: LlamaConfig, steps: int, timeout: float = 600.0) -> tuple[list[int], list[float]]:
    """(peak memory growth in bytes per rank, rank 0's losses) of training ``plan`` on forked ranks."""
    ctx = fork_context()
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, plan.world_size, port, plan.to_dict(), config, steps, q), daemon=True)
             for r in range(plan.world_size)]
    for p in procs:
        p.start()
    peaks, losses = {}, None
    try:
        for _ in procs:
            rank, status, value, ls = q.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"{plan.dp_sharding} rank {rank} failed: {value}")
            peaks[rank] = value
            losses = ls if rank == 0 else losses
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [peaks[r] for r in range(plan.world_size)], losses


def estimated_bytes(plan: Plan, config: LlamaConfig) -> float:
    """Appendix B's peak memory of the plan's largest stage, fp32 weights + AdamW (K = 8), no reserve."""
    cluster = _cpu_cluster(plan.world_size)
    est = estimate(plan, cluster, Workload(config, dtype="fp32", optimizer_bytes_per_param=8.0, reserve_bytes=0.0,
                                           device="cpu"))
    return max(s.peak_memory_bytes for p in est.pipelines for s in p.stages)


def _cpu_cluster(n: int) -> Cluster:
    c = Cluster.load("cpu2") if n <= 2 else Cluster.load("cpu_hetero4")
    if c.num_devices < n:
        raise SystemExit(f"--ranks {n}: the CPU cluster presets describe at most {c.num_devices} devices")
    return c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="pipelines = gloo ranks (default 2)")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (default 512; FFN = 2.75 x)")
    ap.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per launch (default 2)")
    args = ap.parse_args(argv)
    h = args.hidden
    config = LlamaConfig(name="bench_zero", hidden_size=h, num_layers=args.layers, num_heads=max(1, h // 64),
                         num_kv_heads=max(1, h // 64), ffn_hidden_size=int(2.75 * h) // 8 * 8, vocab_size=256,
                         seq_len=args.seq)
    params = sum(p.numel() for p in _meta_llama(config).parameters())
    print(f"model: {params / 1e6:.1f} M parameters fp32, {args.ranks} pipelines of one rank, batch 1 x {args.seq} "
          f"tokens per rank, AdamW, {args.steps} steps")
    base = pure_dp_plan(args.ranks, config, micro_batch=1, num_micro_batches=1, recompute=False)
    rows = {}
    for sharding in SHARDINGS:
        plan = dataclasses.replace(base, dp_sharding=sharding)
        peaks, losses = measure(plan, config, args.steps)
        rows[sharding] = (max(peaks), estimated_bytes(plan, config), losses)
    print(f"\n{'dp_sharding':<12}{'measured MiB':>14}{'estimated MiB':>15}{'meas/est':>10}   losses (rank 0)")
    for s, (m, e, losses) in rows.items():
        print(f"{s:<12}{m / MIB:>14.1f}{e / MIB:>15.1f}{m / e:>10.2f}   {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"\n{'ratio':<12}{'measured':>14}{'estimated':>15}")
    for s in ("zero2", "zero3"):
        print(f"{s + '/ddp':<12}{rows[s][0] / rows['ddp'][0]:>14.3f}{rows[s][1] / rows['ddp'][1]:>15.3f}")
    return 0


def _meta_llama(config: LlamaConfig):
    from lightning_hexiscale.models.llama import Llama

    with torch.device("meta"):
        return Llama(config)


if __name__ == "__main__":
    raise SystemExit(main())
