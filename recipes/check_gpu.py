"""Everything in this project that needs CUDA, run on whatever GPUs are present, in one table.

    python recipes/check_gpu.py                 # on a GPU node; ~1-2 min on 2 GPUs
    python recipes/check_gpu.py --timeout 300 --json outputs/check_gpu.json

Without CUDA it says so and exits 0 (nothing to check). Exit status 1 when any check FAILs or HANGs.

On 1 GPU (in this process):

- **stage vs float64**: a TP-1 stage of the runtime (``runtime/parallelize.build_stage``, 2 layers,
  H=256, GQA 8/4 heads, S=128) in bf16 (float32 weights + bf16 autocast, as ``bf16-mixed``), once
  with flash-attn (when ``flash_attn`` imports) and once with ``F.scaled_dot_product_attention``,
  against the plain Llama in float64 on the CPU, same weights and batch. Pass: relative loss error
  <= 2e-2 and cosine similarity of every parameter's gradient >= 0.99 (bf16 keeps 8 bits of mantissa:
  a wrong kernel, mask or layout is off by far more).
- **stage speed**: forward + backward of one runtime stage (4 layers, H=2048, F=5632, S=2048, micro-batch
  2, bf16 autocast) against the same blocks as plain PyTorch modules (``models/llama.TransformerBlock``),
  median of CUDA-event timings; achieved TFLOP/s = 3 x forward FLOPs (Appendix B count) / time. Pass:
  stage time <= 1.10 x plain time (the runtime adds no overhead to a TP-1 stage).

On 2+ GPUs (spawned ranks, NCCL, ``torch.cuda.set_device`` per rank, float64, AdamW, 3 steps, every
parameter of every rank against the float64 CPU reference of the same global batches, atol 1e-6):

- **1F1B, 2 stages**: one pipeline of two single-GPU stages, 4 micro-batches (fused exchanges);
- **TP-2 stage**: one pipeline, one stage over 2 GPUs (TP all-reduces);
- **ddp / zero2 / zero3, 2 pipelines**: two single-GPU pipelines with batches 3 and 1 (different
  numbers of micro-batches: ZeRO-3's served gathers).

Each multi-GPU check runs under a watchdog: when its ranks have not all reported after ``--timeout``
seconds, they are killed and the row says HANG with the check's name and the ranks that were missing.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

SEED = 1234
ATOL = 1e-6


@dataclass
class Row:
    check: str
    devices: str
    result: str
    """PASS, FAIL, HANG, SKIP."""
    measured: str
    criterion: str


def table(rows: list[Row]) -> str:
    head = ("check", "devices", "result", "measured", "criterion")
    cells = [head] + [(r.check, r.devices, r.result, r.measured, r.criterion) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- models and data ------------------------------------------------------------------------------
def tiny_config():
    from lightning_hexiscale.models.config import LlamaConfig

    return LlamaConfig(name="check_tiny", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=128, vocab_size=256, seq_len=32)


def make_batch(vocab: int, seq: int, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    seqs = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def _flash_attention(q, k, v):
    from flash_attn import flash_attn_func  # optional GPU extra

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)


def flash_available() -> bool:
    """flash-attn imports and this GPU passes the runtime's capability gate (sm_80+)."""
    from lightning_hexiscale.models.llama import flash_attn_supported

    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken build raises anything)
        return False
    return torch.cuda.is_available() and flash_attn_supported(0)


# ---- 1 GPU -------------------------------------------------------------------------------------------
def check_stage_accuracy(kernel: str, device: str = "cuda") -> Row:
    """A TP-1 stage in bf16 autocast on ``device`` against the float64 CPU Llama (loss and gradients)."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.models.llama import Llama, causal_lm_loss, sdpa_attention
    from lightning_hexiscale.runtime.parallelize import build_stage

    name = f"stage bf16 {kernel} vs float64 CPU"
    criterion = "loss rel err <= 2e-2, grad cosine >= 0.99"
    where = f"{device}:0" if device == "cuda" else device
    if kernel == "flash-attn" and not flash_available():
        return Row(name, where, "SKIP", "flash_attn does not import, or compute capability < 8.0", criterion)
    cfg = LlamaConfig(name="check_acc", hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
                      ffn_hidden_size=688, vocab_size=512, seq_len=128)
    tokens, targets = make_batch(cfg.vocab_size, cfg.seq_len, 2, 0)
    ref = Llama(cfg).to(torch.float64).init_weights(SEED)
    ref_loss = ref.loss(ref(tokens), targets)
    ref_loss.backward()
    with torch.device("meta"):
        model = Llama(cfg)
    stage = build_stage(model, (0, cfg.num_layers), True, True, 1, 0, None, device=device, dtype=torch.float32,
                        seed=SEED)
    for block in stage.layers.values():
        block.attn.attention_fn = _flash_attention if kernel == "flash-attn" else sdpa_attention
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = causal_lm_loss(stage(tokens.to(device)), targets.to(device))
    loss.backward()
    err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    ref_grads = dict(ref.named_parameters())
    cos = min(torch.nn.functional.cosine_similarity(p.grad.double().cpu().reshape(1, -1),
                                                    ref_grads[n].grad.reshape(1, -1)).item()
              for n, p in stage.named_parameters())
    ok = err <= 2e-2 and cos >= 0.99
    return Row(name, where, "PASS" if ok else "FAIL", f"loss rel err {err:.1e}, min grad cosine {cos:.5f}", criterion)


def check_stage_speed(steps: int, warmup: int) -> Row:
    """Forward + backward of a runtime stage vs the same blocks as plain PyTorch modules."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.models.llama import Llama, RopeCache, TransformerBlock
    from lightning_hexiscale.runtime.parallelize import build_stage

    cfg = LlamaConfig(name="check_speed", hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=16,
                      ffn_hidden_size=5632, vocab_size=32000, seq_len=2048)
    mb = 2
    with torch.device("meta"):
        meta = Llama(cfg)
    stage = build_stage(meta, (0, cfg.num_layers), False, False, 1, 0, None, device="cuda", dtype=torch.float32,
                        seed=SEED)
    plain = torch.nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers)).to("cuda")  # plain modules
    cos, sin = RopeCache(cfg)(cfg.seq_len, torch.device("cuda"), torch.float32)

    def run_plain(x):
        for block in plain:
            x = block(x, cos, sin)
        return x

    def timed(fn) -> float:
        x = torch.randn(mb, cfg.seq_len, cfg.hidden_size, device="cuda", requires_grad=True)
        times = []
        for i in range(warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fn(x)
            out.float().sum().backward()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    t_stage, t_plain = timed(stage), timed(run_plain)
    flops = 3 * cfg.num_layers * cfg.layer_forward_flops(mb)
    tflops = flops / t_stage / 1e12
    peak = catalog_peak(torch.cuda.get_device_name(0))
    of_peak = f", {tflops * 1e12 / peak:.0%} of the catalog's {peak / 1e12:.0f}" if peak else ""
    ratio = t_stage / t_plain
    return Row("stage speed vs plain PyTorch blocks", "cuda:0", "PASS" if ratio <= 1.10 else "FAIL",
               f"{t_stage * 1e3:.1f} ms vs {t_plain * 1e3:.1f} ms ({ratio:.2f}x); {tflops:.1f} TFLOP/s{of_peak}",
               "stage <= 1.10 x plain")


def catalog_peak(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the local GPU from the catalog (None when it is not listed)."""
    from lightning_hexiscale.config import catalog
    from lightning_hexiscale.lightning.device_check import gpu_mismatch

    for name in catalog.known_names():
        spec = catalog.lookup(name)
        if not name.startswith("CPU") and gpu_mismatch(name, spec.memory_bytes, device_name, spec.memory_bytes) is None:
            return spec.peak_flops
    return None


# ---- 2+ GPUs: spawned NCCL ranks under a watchdog ----------------------------------------------------
def plans() -> dict:
    from lightning_hexiscale.planner.plan import Plan

    def plan(pipelines, schedule="1f1b", sharding="ddp"):
        return Plan.from_dict({"num_layers": 4, "schedule": schedule, "recompute": False, "dp_sharding": sharding,
                               "pipelines": [{"batch_size": b, "micro_batch_size": m,
                                              "stages": [{"devices": d, "layers": list(lr)} for d, lr in st]}
                                             for b, m, st in pipelines]})

    two_pipes = [(3, 1, [([0], (0, 4))]), (1, 1, [([1], (0, 4))])]
    return {"1F1B, 2 stages, NCCL": plan([(4, 1, [([0], (0, 2)), ([1], (2, 4))])]),
            "TP-2 stage, NCCL": plan([(4, 2, [([0, 1], (0, 4))])]),
            "ddp, 2 pipelines, NCCL": plan(two_pipes),
            "zero2, 2 pipelines, NCCL": plan(two_pipes, sharding="zero2"),
            "zero3, 2 pipelines, NCCL": plan(two_pipes, sharding="zero3")}


def _engine_rank(rank: int, world: int, port: int, plan_dict: dict, steps: int, timeout: float, cuda: bool,
                 out) -> None:
    """One spawned rank (NCCL on cuda:rank; gloo on the CPU for the recipe's own test): train
    ``steps`` AdamW steps in float64, report losses and shards."""
    import torch.distributed as dist

    from lightning_hexiscale.planner.plan import Plan
    from lightning_hexiscale.runtime.engine import PipelineEngine

    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(rank)  # batch_isend_irecv on NCCL needs the current device set
        torch.set_num_threads(1)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                device_id=device if cuda else None)
        plan, cfg = Plan.from_dict(plan_dict), tiny_config()
        engine = PipelineEngine(plan, cfg, seed=SEED, device=device, dtype=torch.float64)
        opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
        losses = []
        for step in range(steps):
            tok, tgt = make_batch(cfg.vocab_size, cfg.seq_len, plan.global_batch, step)
            losses.append(engine.train_step(tok.to(device), tgt.to(device)))
            opt.step()
        shards = {k: (t.cpu(), d, s, e) for k, (t, d, s, e) in engine.local_shards().items()}
        buf = io.BytesIO()  # plain bytes: a tensor through the queue would need this process alive
        torch.save((losses, shards), buf)
        out.put((rank, "ok", buf.getvalue()))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the parent)
        out.put((rank, "error", traceback.format_exc()))


def _sleep_rank(rank: int, world: int, port: int, seconds: float, out) -> None:
    """A rank that hangs (watchdog self-test)."""
    if rank == 0:
        out.put((rank, "ok", None))
    time.sleep(seconds)


def run_spawned(target, world: int, args: tuple, timeout: float, start_method: str = "spawn") -> tuple[str, dict]:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` new processes (spawned: CUDA does
    not survive fork). Returns ("ok", {rank: value}), ("error", {rank: traceback}) or ("hang",
    {rank: None for the missing ranks}) after killing every rank still alive at the deadline."""
    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, status, value = out.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) and not errors:
                time.sleep(1.0)  # a rank died without reporting: give the others a moment, then stop
                break
            continue
        (results if status == "ok" else errors)[rank] = value
        if errors:
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    if errors:
        return "error", errors
    missing = [r for r in range(world) if r not in results]
    if missing:
        return "hang", dict.fromkeys(missing)
    return "ok", results


def reference(plan, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from lightning_hexiscale.models.llama import Llama

    cfg = tiny_config()
    model = Llama(cfg).to(torch.float64).init_weights(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tok, tgt = make_batch(cfg.vocab_size, cfg.seq_len, plan.global_batch, step)
        opt.zero_grad()
        loss = model.loss(model(tok), tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def check_nccl(name: str, plan, steps: int, timeout: float, cuda: bool = True) -> Row:
    """Equivalence of ``plan`` on spawned NCCL ranks (``cuda=False``: forked gloo CPU ranks, for the
    recipe's own test) with the float64 CPU reference, under the watchdog."""
    criterion = f"every param, every rank: atol {ATOL:g} (float64)"
    devices = f"cuda:0-{plan.world_size - 1}" if cuda else "cpu"
    status, values = run_spawned(_engine_rank, plan.world_size, (plan.to_dict(), steps, timeout, cuda), timeout,
                                 start_method="spawn" if cuda else "fork")
    if status == "hang":
        return Row(name, devices, "HANG", f"{name}: ranks {sorted(values)} did not finish in {timeout:.0f} s; killed",
                   criterion)
    if status == "error":
        rank, tb = sorted(values.items())[0]
        return Row(name, devices, "FAIL", f"rank {rank}: {tb.strip().splitlines()[-1][:120]}", criterion)
    ref_losses, ref_state = reference(plan, steps)
    err = 0.0
    for blob in values.values():
        losses, shards = torch.load(io.BytesIO(blob), weights_only=False)
        err = max([err] + [abs(a - b) for a, b in zip(losses, ref_losses)])
        for pname, (t, dim, start, end) in shards.items():
            want = ref_state[pname] if dim is None else ref_state[pname].narrow(dim, start, end - start)
            err = max(err, (t - want).abs().max().item())
    return Row(name, devices, "PASS" if err < ATOL else "FAIL", f"max error {err:.1e}", criterion)


# ---- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see the module docstring / README")
    parser.add_argument("--timeout", type=float, default=180.0, help="watchdog per multi-GPU check, seconds")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of the NCCL equivalence checks")
    parser.add_argument("--speed-steps", type=int, default=10, help="timed steps of the speed check")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing to check. "
              "Run it on a GPU node: python recipes/check_gpu.py")
        return 0
    n = torch.cuda.device_count()
    print(f"check_gpu: {n} CUDA device(s): {', '.join(torch.cuda.get_device_name(i) for i in range(n))}; "
          f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    rows: list[Row] = []
    for kernel in ("SDPA", "flash-attn"):
        rows.append(_guarded(lambda k=kernel: check_stage_accuracy(k), f"stage bf16 {kernel} vs float64 CPU"))
    rows.append(_guarded(lambda: check_stage_speed(args.speed_steps, 3), "stage speed vs plain PyTorch blocks"))
    for name, plan in plans().items():
        if n < plan.world_size:
            rows.append(Row(name, "-", "SKIP", f"needs {plan.world_size} GPUs, found {n}", ""))
        else:
            rows.append(check_nccl(name, plan, args.steps, args.timeout))
        print(f"  {rows[-1].check}: {rows[-1].result}", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 1 if any(r.result in ("FAIL", "HANG") for r in rows) else 0


def _guarded(fn, name: str) -> Row:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (one failing check must not hide the others)
        return Row(name, "cuda:0", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", "")


if __name__ == "__main__":
    sys.exit(main())
