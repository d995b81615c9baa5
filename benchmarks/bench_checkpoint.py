"""CPU benchmark of sharded checkpoints: save / load time and peak memory per rank vs checkpoint size.

For each number of ranks (``--ranks``, 2-8 forked gloo processes) and each model width (``--hidden``),
a LLaMA (``--layers`` layers, FFN 4h, 8 heads over 4 KV heads, vocabulary 4096, fp32, AdamW) trains
one step under a plan that uses every rank (one pipeline of two stages of TP r/2 up to 4 ranks; two
such pipelines beyond, so that replicas exist), then:

- **save**: :class:`~lightning_hexiscale.runtime.checkpoint.Checkpointer` writes the parameters and
  the AdamW state (every rank its own pieces, torch.distributed.checkpoint);
- **async**: the same with ``async_save``: the time the training thread is held (staging), and the
  time until the checkpoint is complete;
- **load**: fresh engines and optimizers (as on resume) read it back (each rank its own bytes).

Times are the slowest rank's (wall clock, between barriers). "extra" is the growth of a rank's
resident set during the operation (Linux VmHWM reset through /proc/self/clear_refs; CUDA:
``max_memory_allocated``), the largest over the ranks; "peak" is what a rank holds for the
checkpoint's tensors at the operation's peak: what it held before (save: its own shards, i.e.
parameters and optimizer state; load: its freshly built parameters) + its extra, the largest over
the ranks. For the baseline: torch.save's peak is the full state it holds + its growth;
torch.load's is its growth (it allocates the whole state).

Baseline, measured in the same run on one process: a plain ``torch.save`` of the same full state
(the plain Llama's state dict and its AdamW optimizer's) to one file, and ``torch.load`` of it, in a
forked process. Printed: one table row per (ranks, size), then the ratios sharded / plain of time
and of peak memory per rank. The sharded save also fsyncs every file and plans collectively
(durability and the atomic rename): a fixed cost that small checkpoints show most. glibc's mmap
threshold is fixed at 64 KiB (``lightning_hexiscale.bench.resident_memory.fixed_mmap_threshold``) so that freed memory leaves the
resident set.

    python benchmarks/bench_checkpoint.py                       # 2, 4, 8 ranks x 2 sizes, ~2-4 min on 2 cores
    python benchmarks/bench_checkpoint.py --ranks 2 --hidden 128 --layers 2    # seconds
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_hexiscale.bench.resident_memory import fixed_mmap_threshold
from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.profiling.check import make_batch, peak_memory, prime, reset_peak_memory
from lightning_hexiscale.runtime.host import fork_context

MB = 1e6
MIB = 2**20


def model_config(hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(name=f"bench_h{hidden}", hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4,
                       ffn_hidden_size=4 * hidden, vocab_size=4096, seq_len=16)


def bench_plan(ranks: int, layers: int) -> Plan:
    """Every rank used: 1 pipeline of 2 stages (TP ranks/2) up to 4 ranks, 2 such pipelines beyond."""
    pipes = 1 if ranks <= 4 else 2
    if ranks % (2 * pipes):
        raise SystemExit(f"--ranks {ranks}: use an even number of ranks (2-8)")
    tp = ranks // (2 * pipes)
    half = layers // 2
    pipelines, r = [], 0
    for _ in range(pipes):
        stages = []
        for lo, hi in ((0, half), (half, layers)):
            stages.append({"devices": list(range(r, r + tp)), "layers": [lo, hi]})
            r += tp
        pipelines.append({"batch_size": 2, "micro_batch_size": 1, "stages": stages})
    return Plan.from_dict({"num_layers": layers, "schedule": "1f1b", "recompute": False, "pipelines": pipelines})


# ---- the sharded side: one rank -------------------------------------------------------------------
def _timed(device: torch.device, fn) -> tuple[float, float]:
    """(seconds between barriers, peak growth in bytes) of ``fn()``: collective."""
    dist.barrier()
    base = reset_peak_memory(device)
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0, peak_memory(device) - base


def _rank(rank: int, world: int, port: int, plan_dict: dict, config: LlamaConfig, root: str, device: str, out) -> None:
    from lightning_hexiscale.runtime import checkpoint as ckpt
    from lightning_hexiscale.runtime.checkpoint_layout import own_bytes
    from lightning_hexiscale.runtime.engine import PipelineEngine

    torch.set_num_threads(1)
    fixed_mmap_threshold()  # freed memory leaves the resident set at once: growths are honest
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        plan = Plan.from_dict(plan_dict)
        prime(dev)

        def engine():
            e = PipelineEngine(plan, config, seed=0, device=dev)
            opt = e.wrap_optimizer(torch.optim.AdamW(e.parameters(), lr=1e-4))
            return e, getattr(opt, "user", opt), opt

        eng, user, opt = engine()
        tok, tgt = make_batch(config, plan.global_batch, 0)
        eng.fit_step(tok.to(dev), tgt.to(dev), opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL)
        ckpt.save(f"{root}/warm", eng, user)  # one-time lazy initialisation (DCP's code paths)
        own = own_bytes(eng, user)
        save_s, save_peak = _timed(dev, lambda: ckpt.save(f"{root}/ckpt", eng, user, {"global_step": 1}))
        background = ckpt.Checkpointer(dist.new_group(backend="gloo"), async_save=True)
        held = {}

        def async_save():
            t0 = time.perf_counter()
            background.save(f"{root}/async", eng, user, {"global_step": 1})
            held["s"] = time.perf_counter() - t0
            background.wait()

        async_s, async_peak = _timed(dev, async_save)
        background.close()
        del eng, user, opt
        eng, user, opt = engine()
        ckpt.load_model(f"{root}/warm", eng)

        def load():
            ckpt.load_model(f"{root}/ckpt", eng)
            ckpt.load_optimizer(f"{root}/ckpt", eng, user)

        before = own_bytes(eng, user)  # the fresh engine's parameters: the optimizer has no state yet
        load_s, load_peak = _timed(dev, load)
        out.put((rank, "ok", {"own": own, "save_s": save_s, "save_peak": save_peak, "async_held_s": held["s"],
                              "async_s": async_s, "async_peak": async_peak, "load_s": load_s, "load_peak": load_peak,
                              "load_before": before}))
    except Exception as e:  # reported by the parent
        out.put((rank, "error", repr(e)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sharded(ranks: int, config: LlamaConfig, root: Path, device: str, timeout: float) -> list[dict]:
    plan = bench_plan(ranks, config.num_layers)
    plan.validate(model=config)
    ctx = fork_context()
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, plan.to_dict(), config, str(root), device, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(ranks):
            rank, status, value = out.get(timeout=timeout)
            if status != "ok":
                raise SystemExit(f"rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(ranks)]


# ---- the baseline: torch.save / torch.load of the same full state on one process -------------------
def full_state(config: LlamaConfig) -> dict:
    """The plain Llama's state dict and its AdamW state dict after one step (the same tensors the
    sharded checkpoint holds, in one process)."""
    model = Llama(config).init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tok, tgt = make_batch(config, 2, 0)
    model.loss(model(tok), tgt).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _baseline(config: LlamaConfig, path: str, out) -> None:
    torch.set_num_threads(1)
    fixed_mmap_threshold()
    cpu = torch.device("cpu")
    state = full_state(config)
    base = reset_peak_memory(cpu)
    t0 = time.perf_counter()
    torch.save(state, path)
    save = (time.perf_counter() - t0, peak_memory(cpu) - base)
    del state
    base = reset_peak_memory(cpu)
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    load = (time.perf_counter() - t0, peak_memory(cpu) - base)
    nbytes = sum(t.numel() * t.element_size() for t in loaded["model"].values())
    nbytes += sum(v.numel() * v.element_size() for st in loaded["optimizer"]["state"].values() for v in st.values())
    out.put((save, load, nbytes))


def run_baseline(config: LlamaConfig, root: Path) -> tuple[tuple[float, float], tuple[float, float], int]:
    ctx = fork_context()
    out = ctx.Queue()
    p = ctx.Process(target=_baseline, args=(config, str(root / "plain.pt"), out))
    p.start()
    res = out.get(timeout=600)
    p.join()
    return res


# ---- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated numbers of ranks (even, 2-8; default 2,4,8)")
    ap.add_argument("--hidden", default="256,512", help="comma-separated model widths (checkpoint sizes)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (even; default 4)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one GPU per rank, NCCL, peak = max_memory_allocated (needs --ranks GPUs)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    widths = [int(x) for x in args.hidden.split(",")]
    if any(r < 2 or r > 8 for r in ranks):
        ap.error("--ranks: 2 to 8 ranks")
    if args.layers < 2 or args.layers % 2:
        ap.error("--layers: an even number >= 2 (two stages)")
    if args.device == "cuda" and torch.cuda.device_count() < max(ranks):
        ap.error(f"--device cuda: needs {max(ranks)} GPUs, found {torch.cuda.device_count()}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    rows = []
    try:
        for hidden in widths:
            config = model_config(hidden, args.layers)
            base_dir = root / f"h{hidden}"
            base_dir.mkdir(parents=True, exist_ok=True)
            (b_save_s, b_save_peak), (b_load_s, b_load_peak), nbytes = run_baseline(config, base_dir)
            shutil.rmtree(base_dir)
            for r in ranks:
                run_dir = root / f"h{hidden}_r{r}"
                run_dir.mkdir(parents=True, exist_ok=True)
                res = run_sharded(r, config, run_dir, args.device, args.timeout)
                shutil.rmtree(run_dir)
                worst = {k: max(x[k] for x in res) for k in res[0]}
                worst["save_held"] = max(x["own"] + x["save_peak"] for x in res)
                worst["load_held"] = max(x["load_before"] + x["load_peak"] for x in res)
                base = (b_save_s, nbytes + b_save_peak, b_load_s, b_load_peak)
                rows.append(dict(ranks=r, hidden=hidden, mb=nbytes / MB, base=base, **worst))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint = fp32 parameters + AdamW state; {args.layers} layers; device {args.device}; times: slowest "
          "rank; extra: largest growth of one rank during the operation; peak: largest (own shard + extra) of one "
          "rank; torch.save peak: the full state + growth, torch.load peak: growth (MiB)")
    head = (f"{'ranks':>5} {'ckpt MB':>8} {'own MiB':>8} | {'save s':>7} {'extra':>6} {'peak':>6} | "
            f"{'async held s':>12} {'done s':>7} {'extra':>6} | {'load s':>7} {'extra':>6} {'peak':>6} || "
            f"{'torch.save s':>12} {'peak':>6} {'torch.load s':>12} {'peak':>6}")
    print(head)
    print("-" * len(head))
    for w in rows:
        bs, bsp, bl, blp = w["base"]
        print(f"{w['ranks']:>5} {w['mb']:>8.1f} {w['own'] / MIB:>8.1f} | {w['save_s']:>7.3f} "
              f"{w['save_peak'] / MIB:>6.1f} {w['save_held'] / MIB:>6.1f} | {w['async_held_s']:>12.3f} {w['async_s']:>7.3f} "
              f"{w['async_peak'] / MIB:>6.1f} | {w['load_s']:>7.3f} {w['load_peak'] / MIB:>6.1f} "
              f"{w['load_held'] / MIB:>6.1f} || {bs:>12.3f} {bsp / MIB:>6.1f} {bl:>12.3f} {blp / MIB:>6.1f}")
    print()
    print("ratios to one process's torch.save / torch.load of the same state (time; peak memory per rank):")
    for w in rows:
        bs, bsp, bl, blp = w["base"]
        print(f"  ranks {w['ranks']} ckpt {w['mb']:.0f} MB: save {w['save_s'] / bs:.2f}x time, "
              f"{w['save_held'] / bsp:.2f}x peak; async holds training {w['async_held_s'] / bs:.2f}x of torch.save's "
              f"time; load {w['load_s'] / bl:.2f}x time, {w['load_held'] / blp:.2f}x peak")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
