"""What the stage reaches on one GPU, against which ceilings, and where its time goes: one script,
7 minutes or less, JSON out.

    python recipes/mfu_probe.py --json outputs/mfu_probe.json      # on one GPU, <= 7 minutes
    python recipes/mfu_probe.py --smoke                            # CPU, tiny shapes, seconds (the suite runs it)

Reports, in this order (anything that would pass ``--budget-s`` is skipped and says so):

1. **environment**: torch, CUDA, cuDNN and NCCL versions, the device, and its SM/memory clocks,
   temperature and power before and after (``nvidia-smi``; null where absent);
2. **ceilings at the stage's own shapes**: bf16 TFLOP/s of every matmul of a block (q, k, v, o,
   gate, up, down) forward, input-gradient and weight-gradient, for tokens = micro-batch x S; the
   HBM bandwidth of a 1 GiB copy (read + write);
3. **stage forward + backward** (bf16 autocast over float32 weights, the fast path's other
   switches at their defaults) for the check's shape (lightning_hexiscale/bench/gpu_checks.py ``check_stage_speed``:
   4 layers, H 2048, F 5632, 16/16 heads, S 2048, micro-batch 2) and two Llama-3-8B layers (H 4096,
   F 14336, GQA 32/8, S 8192, micro-batch 1), eager and compiled, per attention backend;
4. a **torch.profiler breakdown** of the default stage of each shape into GEMM, attention,
   elementwise, reduction, copy and other device time;
5. **engine-step MFU**: a world-size-1 :class:`PipelineEngine` with the embedding, those layers, the
   LM head and the loss (4 micro-batches, 1F1B, fused AdamW step included), model FLOPs =
   3 x (2 x tokens x (layer matmul params x L + H x V) + 2 x B x S^2 x H x L), i.e. attention's
   scores at the causal half;
6. **memory** of that engine: ``max_memory_allocated`` and ``max_memory_reserved`` (each above what was
   held when the engine was built, after ``empty_cache``) and the device's
   used memory (``mem_get_info``) against ``estimate()``'s peak for the same plan.

MFU = model FLOPs / time / the catalog's dense bf16 peak (``config/catalog.py``; the fastest GEMM
measured when the GPU is not listed). Targets, fixed before any measurement, judged on an H100
(printed PASS/FAIL; ``n/a`` in ``--smoke``): stage and engine MFU >= 40 % on the Llama-3-8B shape,
>= 35 % on the check's shape. Exit status 1 when a target fails on a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_hexiscale.bench import gpu_checks
from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig

TARGETS = {"llama3_8b_2layers": 0.40, "check": 0.35}
"""MFU targets on an H100, per shape (stage forward + backward and engine step)."""
BUDGET_S = 420.0
"""7 minutes."""
COMPILE_RESERVE_S = 45.0
"""Budget a compiled configuration needs (inductor on a GPU host: ~20-40 s per new graph)."""
CATEGORIES = (
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|aten::(mm|addmm|bmm|matmul|linear)\b"),
    ("reduction", r"^triton_(red|per)_"),
    ("elementwise", r"^triton_poi_"),
    ("copy", r"direct_copy|copy_kernel|memcpy|memset|catarray|cat_|aten::(cat|clone|contiguous|_to_copy|to|copy_)\b"),
    ("reduction", r"reduce|norm|softmax|aten::(sum|mean|amax|max|_log_softmax)\b"),
    ("elementwise", r"elementwise|vectorized|pointwise|aten::(mul|add|sub|div|silu|exp|rsqrt|pow|neg|where|fill_|"
                    r"masked_fill|sigmoid)"),
)
"""Kernel (or, on the CPU, aten op) name -> category, first match wins: inductor's own kernels by
their prefix, then torch's (a copy is an ``elementwise_kernel`` of ``direct_copy_kernel``)."""


@dataclass(frozen=True)
class Shape:
    name: str
    config: LlamaConfig
    micro_batch: int


def shapes(smoke: bool) -> list[Shape]:
    if smoke:
        tiny = LlamaConfig(name="smoke", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           ffn_hidden_size=128, vocab_size=256, seq_len=16)
        return [Shape("check", tiny, 2), Shape("llama3_8b_2layers", tiny, 1)]
    check = LlamaConfig(name="check_speed", hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=16,
                        ffn_hidden_size=5632, vocab_size=32000, seq_len=2048)
    l8b = LlamaConfig(name="llama3_8b_2layers", hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_len=8192, rope_theta=500000.0)
    return [Shape("check", check, 2), Shape("llama3_8b_2layers", l8b, 1)]


# ---- timing --------------------------------------------------------------------------------------------
def timed(fn, steps: int, warmup: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, the wall clock on the CPU)."""
    out = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if i >= warmup:
            out.append(t)
    return statistics.median(out)


# ---- 1. environment ---------------------------------------------------------------------------------
def clocks() -> dict | None:
    """SM and memory clocks (MHz), temperature (C) and power (W) of GPU 0 from nvidia-smi; None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    q = "clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    keys = ("sm_mhz", "mem_mhz", "max_sm_mhz", "temperature_c", "power_w")
    return {k: _number(v) for k, v in zip(keys, line.split(","))}


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text.strip()


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
            "clocks_before": clocks() if cuda else None}


# ---- 2. ceilings -----------------------------------------------------------------------------------------
def gemm_ceilings(shape: Shape, device: torch.device, steps: int, warmup: int) -> list[dict]:
    """bf16 TFLOP/s of each block matmul's forward (T x in @ in x out), input gradient
    (T x out @ out x in) and weight gradient (out x T @ T x in), T = micro-batch x S."""
    c = shape.config
    t = shape.micro_batch * c.seq_len
    h, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.kv_dim, c.ffn_hidden_size
    rows = []
    for name, fan_in, fan_out in (("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, f),
                                  ("up", h, f), ("down", f, h)):
        for kind, (m, k, n) in (("fwd", (t, fan_in, fan_out)), ("dgrad", (t, fan_out, fan_in)),
                                ("wgrad", (fan_out, t, fan_in))):
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            s = timed(lambda: a @ b, steps, warmup, device)
            rows.append({"matmul": name, "pass": kind, "m": m, "k": k, "n": n, "tflops": 2 * m * k * n / s / 1e12})
    return rows


def hbm_ceiling(device: torch.device, steps: int, warmup: int, nbytes: int) -> float:
    """GB/s of a copy of ``nbytes`` (read + write)."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), steps, warmup, device) / 1e9


# ---- 3. the stage --------------------------------------------------------------------------------------
def layer_flops_causal(c: LlamaConfig, micro_batch: int) -> float:
    """Forward FLOPs of one layer, attention scores at the causal half: 2 B S P_matmul + 2 B S^2 H."""
    return 2.0 * micro_batch * c.seq_len * c.layer_matmul_params + 2.0 * micro_batch * c.seq_len ** 2 * c.hidden_size


def build_stage(shape: Shape, fast: FastPath, device: torch.device, first: bool = False, last: bool = False):
    """Layers 0..L-1 of ``shape`` as one TP-1 stage on ``device`` (float32 weights), fast path applied
    for bf16 autocast (as bf16-mixed runs it)."""
    from lightning_hexiscale.models.llama import Llama
    from lightning_hexiscale.runtime.fast_path import apply_fast_path
    from lightning_hexiscale.runtime.parallelize import build_stage as build

    with torch.device("meta"):
        meta = Llama(shape.config)
    stage = build(meta, (0, shape.config.num_layers), first, last, 1, 0, None, device=device, dtype=torch.float32,
                  seed=gpu_checks.SEED)
    info, _ = apply_fast_path(stage, fast.resolve(device.type, True), compute_dtype=torch.bfloat16, mixed=True)
    return stage, info


def stage_step(stage, shape: Shape, device: torch.device):
    """fwd + bwd of the stage on a (micro-batch, S, H) input, under bf16 autocast."""
    c = shape.config
    x = torch.randn(shape.micro_batch, c.seq_len, c.hidden_size, device=device, requires_grad=True)

    def run():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = stage(x)
        out.backward(torch.ones_like(out))
        x.grad = None
        for p in stage.parameters():
            p.grad = None
    return run


def time_stage(shape: Shape, fast: FastPath, device: torch.device, steps: int, warmup: int, peak: float) -> dict:
    try:
        stage, info = build_stage(shape, fast, device)
    except ConfigError as e:  # this attention backend cannot run these shapes here
        return {"status": "unsupported", "why": str(e)}
    s = timed(stage_step(stage, shape, device), steps, warmup, device)
    flops = 3 * shape.config.num_layers * layer_flops_causal(shape.config, shape.micro_batch)
    del stage
    _free(device)
    return {"status": "ok", "ms": s * 1e3, "tflops": flops / s / 1e12, "mfu": flops / s / peak,
            "attention": info.attention, "compile": info.compile}


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- 4. profile ------------------------------------------------------------------------------------------
def breakdown(fn, device: torch.device) -> dict[str, float]:
    """Device time (ms; CPU self time on the CPU) of two runs of ``fn`` per category (:data:`CATEGORIES`)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = dict.fromkeys([name for name, _ in CATEGORIES] + ["other"], 0.0)
    for evt in prof.key_averages():
        if device.type == "cuda":
            us = getattr(evt, "self_device_time_total", 0.0)
            if not us or evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            us = evt.self_cpu_time_total
            if not evt.key.startswith("aten::") or not us:
                continue
        out[classify(evt.key)] += us / 1e3 / 2
    return out


def classify(kernel: str) -> str:
    low = kernel.lower()
    for name, pattern in CATEGORIES:
        if re.search(pattern, low):
            return name
    return "other"


# ---- 5, 6. engine step and memory ------------------------------------------------------------------------
def engine_step(shape: Shape, device: torch.device, steps: int, warmup: int, peak: float,
                fast: FastPath | None = None, micro_batches: int = 4) -> dict:
    """World-size-1 engine: embedding, the layers, LM head and chunked loss, 1F1B over
    ``micro_batches``, AdamW (fused where the device has it); ``fast`` None: the default fast path."""
    from lightning_hexiscale.runtime.engine import PipelineEngine

    c = shape.config
    plan = gpu_checks.one_device_plan(c.num_layers, micro_batches, shape.micro_batch, False)
    est = gpu_checks.estimated_peak(plan, c, "bf16-mixed", device=device.type)
    created = gpu_checks._init_single_process_group(device.type)
    cuda = device.type == "cuda"
    try:
        _free(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            base_reserved = torch.cuda.memory_reserved()  # what earlier measurements left cached
        engine = PipelineEngine(plan, c, seed=gpu_checks.SEED, device=device, dtype=torch.float32,
                                autocast_dtype=torch.bfloat16, fast_path=fast)
        opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-5))
        tok, tgt = (t.to(device) for t in gpu_checks.make_batch(c.vocab_size, c.seq_len, plan.global_batch, 0))

        def step():  # the step Trainer.fit runs under the recipe's defaults (clipping included)
            engine.fit_step(tok, tgt, opt, clip_norm=DEFAULT_GRADIENT_CLIP_VAL)
        s = timed(step, steps, warmup, device)
        tokens = plan.global_batch * c.seq_len
        head = 2.0 * tokens * c.hidden_size * c.vocab_size
        flops = 3 * (c.num_layers * layer_flops_causal(c, plan.global_batch) + head)
        out = {"ms": s * 1e3, "tflops": flops / s / 1e12, "mfu": flops / s / peak, "tokens_per_s": tokens / s,
               "fast_path": engine.fast_path.describe(), "fused_adamw": bool(opt.param_groups[0].get("fused")),
               "estimate_bytes": est["peak_bytes"], "estimate_allocator_bytes": est["allocator_bytes"]}
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            out.update(allocated_bytes=torch.cuda.max_memory_allocated() - base,
                       reserved_bytes=torch.cuda.max_memory_reserved() - base_reserved,
                       reserved_base_bytes=base_reserved, device_used_bytes=total - free)
            out["allocated_vs_estimate"] = out["allocated_bytes"] / est["allocator_bytes"]
        del engine, opt
        _free(device)
        return out
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


# ---- main --------------------------------------------------------------------------------------------------
def backends(device: torch.device) -> list[str]:
    """The attention kernels timed: every SDPA backend torch may pick on a GPU (and flash-attn when
    installed); two on the CPU."""
    if device.type != "cuda":
        return ["sdpa", "sdpa_math"]
    from lightning_hexiscale.models.attention import load_flash_attn

    return (["flash_attn"] if load_flash_attn() is not None else []) + ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]


def verdict(mfu: float | None, target: float, smoke: bool) -> str:
    if smoke or mfu is None:
        return "n/a"
    return "PASS" if mfu >= target else "FAIL"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, compile with dynamo only (seconds)")
    ap.add_argument("--json", default="outputs/mfu_probe.json", help="where the report goes")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="skip what would pass this many seconds")
    ap.add_argument("--steps", type=int, default=10, help="timed runs per measurement")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    if not args.smoke and not torch.cuda.is_available():
        print("mfu_probe: no CUDA device (torch.cuda.is_available() is False); run with --smoke on the CPU")
        return 1
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
    compile_backend = "eager" if args.smoke else "inductor"  # smoke: dynamo traces, nothing is generated
    report: dict = {"smoke": args.smoke, "targets": TARGETS, "environment": environment(device)}
    print(f"mfu_probe: {report['environment']['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {report['environment']['cudnn']}, NCCL {report['environment']['nccl']}", flush=True)
    spec = gpu_checks.catalog_entry(report["environment"]["device"]) if device.type == "cuda" else None
    report["hbm_gbps"] = hbm_ceiling(device, steps, warmup, 2**20 if args.smoke else 2**30)
    report["gemm"] = {s.name: gemm_ceilings(s, device, steps, warmup) for s in shapes(args.smoke)}
    best = max(r["tflops"] for rows in report["gemm"].values() for r in rows) * 1e12
    peak = spec.peak_flops if spec is not None else best
    report["peak_flops"] = peak
    report["peak_source"] = f"catalog {spec.name}" if spec is not None else "fastest GEMM measured"
    print(f"ceilings: HBM copy {report['hbm_gbps']:.3g} GB/s, fastest block GEMM {best / 1e12:.3g} TFLOP/s; "
          f"MFU against {peak / 1e12:.3g} TFLOP/s ({report['peak_source']})", flush=True)
    report["stage"], report["profile"], report["engine"] = {}, {}, {}
    for shape in shapes(args.smoke):  # eager, every backend: no compilation, seconds
        rows = report["stage"][shape.name] = {}
        for b in backends(device):
            rows[f"eager/{b}"] = time_stage(shape, FastPath(compile=False, attention=b), device, steps, warmup, peak)
            _print_stage(shape.name, f"eager/{b}", rows[f"eager/{b}"])
    auto = FastPath(compile=True, compile_backend=compile_backend)
    for shape in shapes(args.smoke):  # the default (auto attention) compiled, its profile, the engine step
        rows = report["stage"][shape.name]
        if left() < COMPILE_RESERVE_S:
            rows["compiled/auto"] = {"status": "skipped", "why": f"budget: {left():.0f} s left"}
            continue
        rows["compiled/auto"] = time_stage(shape, auto, device, steps, warmup, peak)
        _print_stage(shape.name, "compiled/auto", rows["compiled/auto"])
        stage, _ = build_stage(shape, auto, device)
        report["profile"][shape.name] = breakdown(stage_step(stage, shape, device), device)
        del stage
        _free(device)
        print(f"  {shape.name} profile (ms per fwd+bwd): " + ", ".join(
            f"{k} {v:.2f}" for k, v in report["profile"][shape.name].items()), flush=True)
        if left() < COMPILE_RESERVE_S:
            report["engine"][shape.name] = {"status": "skipped", "why": f"budget: {left():.0f} s left"}
            continue
        fast = FastPath(compile=True, compile_backend=compile_backend) if args.smoke else None  # smoke: dynamo only
        report["engine"][shape.name] = engine_step(shape, device, steps, warmup, peak, fast, 2 if args.smoke else 4)
        _print_engine(shape.name, report["engine"][shape.name])
    for shape in shapes(args.smoke):  # compiled per backend while the budget lasts
        for b in backends(device)[:1] if args.smoke else backends(device):
            key = f"compiled/{b}"
            if left() < COMPILE_RESERVE_S:
                report["stage"][shape.name][key] = {"status": "skipped", "why": f"budget: {left():.0f} s left"}
                continue
            fast = FastPath(compile=True, attention=b, compile_backend=compile_backend)
            report["stage"][shape.name][key] = time_stage(shape, fast, device, steps, warmup, peak)
            _print_stage(shape.name, key, report["stage"][shape.name][key])
    report["environment"]["clocks_after"] = clocks() if device.type == "cuda" else None
    report["verdicts"] = verdicts(report, args.smoke)
    report["seconds"] = time.monotonic() - t0
    for v in report["verdicts"]:
        print(f"target {v['what']}: MFU {_pct(v['mfu'])} >= {v['target']:.0%}: {v['result']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print(f"mfu_probe: {report['seconds']:.0f} s; wrote {args.json}")
    return 1 if any(v["result"] == "FAIL" for v in report["verdicts"]) else 0


def verdicts(report: dict, smoke: bool) -> list[dict]:
    """Each target against the best stage row (the fastest configuration a run can choose) and the engine step."""
    out = []
    for name, target in TARGETS.items():
        rows = [r for r in report["stage"].get(name, {}).values() if r.get("status") == "ok"]
        best = max((r["mfu"] for r in rows), default=None)
        eng = report["engine"].get(name, {}).get("mfu")
        out.append({"what": f"{name} stage fwd+bwd (best configuration)", "mfu": best, "target": target,
                    "result": verdict(best, target, smoke)})
        out.append({"what": f"{name} engine step", "mfu": eng, "target": target, "result": verdict(eng, target, smoke)})
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _print_stage(shape: str, key: str, r: dict) -> None:
    if r.get("status") != "ok":
        print(f"  {shape} stage {key}: {r.get('status')} ({r.get('why', '')[:120]})", flush=True)
        return
    print(f"  {shape} stage {key}: {r['ms']:.2f} ms, {r['tflops']:.3g} TFLOP/s, MFU {r['mfu']:.1%} "
          f"(attention {r['attention']}, compile {r['compile']})", flush=True)


def _print_engine(shape: str, r: dict) -> None:
    mem = ""
    if "allocated_bytes" in r:
        mem = (f"; allocated {r['allocated_bytes'] / 2**30:.2f} GiB vs estimate "
               f"{r['estimate_allocator_bytes'] / 2**30:.2f} GiB ({r['allocated_vs_estimate']:.2f}x), reserved {r['reserved_bytes'] / 2**30:.2f} GiB, device used "
               f"{r['device_used_bytes'] / 2**30:.2f} GiB")
    print(f"  {shape} engine step: {r['ms']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s, MFU {r['mfu']:.1%}{mem}",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
