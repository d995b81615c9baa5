"""CPU benchmark of the HexiScale runtime against torch DistributedDataParallel.

Both sides train the same LLaMA on the same 2 (default) gloo ranks, same data, same micro-batching
and optimizer (SGD after clipping by the global gradient norm at the recipe's default, 1.0): the
HexiScale side with a homogeneous pure-DP plan (one single-device pipeline per rank, equal batches)
through ``PipelineEngine.fit_step`` (the step ``Trainer.fit`` runs); the DDP side with
``DistributedDataParallel`` around the plain ``Llama`` (``no_sync`` on all but the last
micro-batch), then ``clip_grad_norm_``. Both sides live in the same processes and alternate step by step, so that background
load on a shared machine hits both alike; a step's time is the slowest rank's.

Printed: step time and throughput (tokens/s = global_batch * seq_len / step time) of each side, the
ratio hexiscale / ddp (target >= 0.95), the measured peak memory per rank of each side (each
side alone in its own launch), and the cost model's estimate of it for the same plan.

Peak memory per rank: the growth of the process's resident set (Linux VmHWM, reset to the current
RSS through /proc/self/clear_refs when the kernel allows it) from just before the model is built to
the end of the timed steps: parameters, gradients, optimizer state, activations and communication
buffers, plus allocator slack (glibc keeps freed blocks). One-time lazy initialisation is excluded
by :func:`prime_process` before the baseline. :func:`measure_peak_bytes` returns it
for any plan (for the cost-model comparison).

    python benchmarks/bench_runtime.py            # ~30 s on 2 idle cores
    python benchmarks/bench_runtime.py --steps 4 --layers 2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_hexiscale.bench.resident_memory import peak_rss_bytes, prime_process, reset_peak_rss
from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.profiling.calibrate import pure_dp_plan
from lightning_hexiscale.profiling.check import make_batch
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.host import fork_context


# ---- one rank ----------------------------------------------------------------------------------
def _build(mode: str, rank: int, plan: Plan, config: LlamaConfig):
    """The whole optimizer step of one side on this rank, as a function of (tokens, targets): each
    clips by the global norm at the recipe's default (DEFAULT_GRADIENT_CLIP_VAL) before SGD steps."""
    if mode == "hexiscale":  # the step Trainer.fit runs under the strategy (PipelineEngine.fit_step)
        engine = PipelineEngine(plan, config, seed=0)
        opt = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=1e-3))
        return lambda tok, tgt: engine.fit_step(tok, tgt, opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL)
    pipe = plan.pipelines[rank]
    offset = sum(p.batch_size for p in plan.pipelines[:rank])
    model = Llama(config).init_weights(0)
    ddp = DistributedDataParallel(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    m = pipe.num_micro_batches

    def step_fn(tok, tgt):  # what a DDP user writes: backward per micro-batch, clip, step
        tok, tgt = tok[offset:offset + pipe.batch_size], tgt[offset:offset + pipe.batch_size]
        for p in params:
            p.grad = None
        for i, (x, y) in enumerate(zip(tok.split(pipe.micro_batch_size), tgt.split(pipe.micro_batch_size))):
            with ddp.no_sync() if i < m - 1 else contextlib.nullcontext():
                (model.loss(ddp(x), y) / m).backward()
        torch.nn.utils.clip_grad_norm_(params, DEFAULT_GRADIENT_CLIP_VAL)  # replicated: the global norm
        opt.step()

    return step_fn


def _worker(rank: int, world: int, port: int, modes: tuple[str, ...], plan_dict: dict, config: LlamaConfig,
            steps: int, warmup: int, threads: int, out) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        plan = Plan.from_dict(plan_dict)
        prime_process()
        baseline = reset_peak_rss()
        sides = {}
        for mode in modes:
            sides[mode] = _build(mode, rank, plan, config)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for step in range(warmup + steps):
            tok, tgt = make_batch(config, plan.global_batch, step)
            # Alternate the sides step by step (and swap who goes first) so that background load
            # on a shared machine hits both alike.
            for mode in (modes if step % 2 == 0 else modes[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                sides[mode](tok, tgt)
                if step >= warmup:
                    times[mode].append(time.perf_counter() - t0)
        out.put((rank, "ok", times, peak_rss_bytes() - baseline))
    except Exception as e:  # reported by the parent
        out.put((rank, "error", repr(e), 0))
    finally:
        dist.destroy_process_group()


def launch(modes: tuple[str, ...], plan: Plan, config: LlamaConfig, steps: int, warmup: int = 1,
           threads: int = 1, timeout: float = 300.0) -> list[tuple[dict[str, list[float]], int]]:
    """Run the sides ``modes`` ("hexiscale", "ddp"), interleaved step by step, on ``plan.world_size``
    forked gloo ranks; per rank: ({mode: step times in s}, peak memory growth in bytes of all the
    sides together: launch one side alone to measure its memory)."""
    ctx = fork_context()
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = plan.world_size
    procs = [ctx.Process(target=_worker, args=(r, world, port, tuple(modes), plan.to_dict(), config, steps, warmup,
                                               threads, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value, peak = out.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"{modes} rank {rank} failed: {value}")
            results[rank] = (value, peak)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def measure_peak_bytes(plan: Plan, config: LlamaConfig, steps: int = 2) -> list[int]:
    """Measured peak memory growth per rank (bytes, index = global rank) of training ``plan`` on CPU
    gloo ranks for ``steps`` steps; see the module docstring for what is counted."""
    return [peak for _, peak in launch(("hexiscale",), plan, config, steps=steps, warmup=0)]


# ---- entry point -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="processes (pipelines) [2]")
    ap.add_argument("--hidden", type=int, default=256, help="model width H [256]")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers [4]")
    ap.add_argument("--heads", type=int, default=8, help="query heads [8]; KV heads = heads / 2")
    ap.add_argument("--vocab", type=int, default=2048, help="vocabulary [2048]")
    ap.add_argument("--seq", type=int, default=128, help="sequence length in tokens [128]")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step [8]")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch [4]")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side [20]")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side [2]")
    ap.add_argument("--mem-steps", type=int, default=2, help="steps of the separate memory launches [2]")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank [1]")
    args = ap.parse_args(argv)

    config = LlamaConfig(name="bench", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=max(1, args.heads // 2), ffn_hidden_size=(8 * args.hidden // 3 + 7) // 8 * 8,
                         vocab_size=args.vocab, seq_len=args.seq)
    if args.batch % args.micro_batch:
        ap.error(f"--batch {args.batch} is not a multiple of --micro-batch {args.micro_batch}: a rank's batch is "
                 "whole micro-batches; pass e.g. --batch 8 --micro-batch 4")
    plan = pure_dp_plan(args.ranks, config, args.micro_batch, args.batch // args.micro_batch, False).validate(model=config)
    tokens = plan.global_batch * config.seq_len
    print(f"model: {config.total_params / 1e6:.2f} M params (H={config.hidden_size}, L={config.num_layers}, "
          f"V={config.vocab_size}, S={config.seq_len}); {args.ranks} gloo ranks x {args.threads} thread(s); "
          f"global batch {plan.global_batch} ({args.batch}/rank, micro-batch {args.micro_batch}) = {tokens} tokens/step")
    res = launch(("hexiscale", "ddp"), plan, config, args.steps, args.warmup, args.threads)
    # A step ends when the slowest rank ends: per step, the max over ranks.
    step_times = {m: [max(ts) for ts in zip(*(times[m] for times, _ in res))] for m in ("hexiscale", "ddp")}
    median = {m: statistics.median(t) for m, t in step_times.items()}
    pair_ratio = statistics.median(d / h for h, d in zip(step_times["hexiscale"], step_times["ddp"]))
    peaks = {m: [p for _, p in launch((m,), plan, config, args.mem_steps, 0, args.threads)] for m in ("hexiscale", "ddp")}
    print()
    for mode in ("hexiscale", "ddp"):
        mib = ", ".join(f"{p / 2**20:.1f}" for p in peaks[mode])
        print(f"{mode:9s}: median {median[mode] * 1e3:7.1f} ms/step  {tokens / median[mode]:9.0f} tokens/s  "
              f"peak memory growth per rank [MiB]: {mib}")
    print(f"throughput ratio hexiscale / ddp = {median['ddp'] / median['hexiscale']:.3f} (ratio of medians), "
          f"{pair_ratio:.3f} (median of per-step ratios); target >= 0.95")
    est = estimated_peak_bytes(plan, config)
    worst = max(peaks["hexiscale"])
    print(f"cost model (planner/cost/estimate.py) peak memory per rank: {est / 2**20:.1f} MiB; "
          f"measured hexiscale / estimated = {worst / est:.2f}")
    return 0


def estimated_peak_bytes(plan: Plan, config: LlamaConfig) -> float:
    """The cost model's peak memory of the plan's largest stage for this benchmark's setting:
    fp32 weights and gradients (B_type = 4), plain SGD (no optimizer state, K = 0), no reserve."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.planner import Workload, estimate

    cluster = Cluster.load("cpu2").replicate((plan.world_size + 1) // 2)
    work = Workload(config, dtype="fp32", optimizer_bytes_per_param=0.0, reserve_bytes=0.0)
    est = estimate(plan, cluster, work)
    return max(s.peak_memory_bytes for p in est.pipelines for s in p.stages)


if __name__ == "__main__":
    sys.exit(main())
