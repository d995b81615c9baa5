"""Everything in this project that needs CUDA, run on whatever GPUs are present, in one table.

    python recipes/check_gpu.py --json outputs/check_gpu.json     # on a GPU node; a few minutes

Needs torch (a CUDA build), lightning and omegaconf (``estimate()`` and the strategy read configs
through it); not Hydra, not pymetis. Exit status 1 when any row FAILs or HANGs, and also when torch
is a CPU-only build (it says so and prints the pip command for the CUDA build) or when a CUDA build
sees no GPU (driver, ``CUDA_VISIBLE_DEVICES``). Rows whose dependency is missing say SKIP and why.

On 1 GPU (in this process; the rows are in lightning_hexiscale/bench/gpu_checks.py, which documents each):

- **accuracy**: the runtime's stage in bf16 autocast through the runtime's own ``attention()``
  dispatch (as training runs it, then SDPA and flash-attn forced through the same dispatch) against
  the float64 CPU Llama: |loss diff| <= 3e-3, logits and gradient cosine >= 0.99 (a non-causal or a
  (B, H, T, D) / (B, T, H, D)-swapped attention misses both by 20x; tests/runtime/test_check_gpu_recipe.py);
- **speed**: bf16 matmul >= 40 % and a runtime stage's forward + backward >= 25 % of the catalog's peak
  FLOP/s for the detected GPU; the stage <= 1.10 x the same blocks as plain modules;
- **engine memory**: a world-size-1 engine, bf16-mixed, 4 micro-batches, recompute off and on:
  ``torch.cuda.max_memory_reserved`` at most 15 % above ``estimate()``'s peak (less its reserve and NCCL
  buffers; one-sided: over-estimates pass);
- **Lightning**: 20 steps under the strategy in bf16-mixed, checkpoint at 10, resumed run continues.

On 2+ GPUs (spawned ranks, NCCL, ``torch.cuda.set_device`` per rank, AdamW, 3 steps against the
float64 CPU reference of the same global batches):

- float64, every parameter of every rank, atol 1e-6: **1F1B, 2 stages** (4 micro-batches), **TP-2 stage**,
  **ddp / zero2 / zero3, 2 pipelines** (batches 3 and 1: different numbers of micro-batches);
- bf16-mixed (float32 weights, bf16 autocast), 1F1B, TP-2, zero2: every rank's losses within 2e-2
  relative and every parameter shard's update at cosine >= 0.9 with the reference's.

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
import re
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_hexiscale.bench import gpu_checks
from lightning_hexiscale.bench.gpu_checks import SEED, Row, make_batch, table  # noqa: F401 (Row/table: this recipe's API)
from lightning_hexiscale.runtime.host import collect_before_fork

ATOL = 1e-6
BF16_RTOL = 2e-2
"""bf16-mixed multi-GPU rows: every loss within this relative error of the float64 reference."""
BF16_UPDATE_COS = 0.9
"""bf16-mixed multi-GPU rows: cosine of every parameter shard's update (after - initial) with the
float64 reference's. The losses alone cannot fail a missing gradient sync (2e-3 off after 3 steps)."""
CUDA_INDEX = "https://download.pytorch.org/whl/cu130"


# ---- models and data ------------------------------------------------------------------------------
def tiny_config():
    from lightning_hexiscale.models.config import LlamaConfig

    return LlamaConfig(name="check_tiny", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=128, vocab_size=256, seq_len=32)


# ---- 2+ GPUs: spawned NCCL ranks under a watchdog ----------------------------------------------------
def plans() -> dict:
    from lightning_hexiscale.planner import Plan

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


BF16_PLANS = ("1F1B, 2 stages, NCCL", "TP-2 stage, NCCL", "zero2, 2 pipelines, NCCL")
"""The plans also run in bf16-mixed (float32 weights, bf16 autocast) on 2+ GPUs."""


def _engine_rank(rank: int, world: int, port: int, plan_dict: dict, steps: int, timeout: float, cuda: bool,
                 bf16: bool, out) -> None:
    """One spawned rank (NCCL on cuda:rank; gloo on the CPU for the recipe's own test): train
    ``steps`` AdamW steps in float64 (``bf16``: float32 weights under bf16 autocast, as bf16-mixed),
    report losses and shards."""
    import torch.distributed as dist

    from lightning_hexiscale.planner import Plan
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
        engine = PipelineEngine(plan, cfg, seed=SEED, device=device, dtype=torch.float32 if bf16 else torch.float64,
                                autocast_dtype=torch.bfloat16 if bf16 else None)
        opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
        losses = []
        for step in range(steps):
            tok, tgt = make_batch(cfg.vocab_size, cfg.seq_len, plan.global_batch, step)
            # Trainer.fit's step without clipping: the reference below does not clip
            losses.append(engine.fit_step(tok.to(device), tgt.to(device), opt).loss)
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
    if start_method == "fork":  # no child may free a process group it inherited
        collect_before_fork()
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


def check_nccl(name: str, plan, steps: int, timeout: float, cuda: bool = True, bf16: bool = False) -> Row:
    """Equivalence of ``plan`` on spawned NCCL ranks (``cuda=False``: forked gloo CPU ranks, for the
    recipe's own test) with the float64 CPU reference, under the watchdog. float64: every loss and
    parameter element within :data:`ATOL`; ``bf16`` (bf16-mixed): every loss within :data:`BF16_RTOL`
    relative and the cosine of every parameter shard's update with the reference's >= :data:`BF16_UPDATE_COS`
    (AdamW's sign-like first steps flip elements whose gradient bf16 rounds across zero, so elements
    are not compared one by one; a missing gradient sync turns whole updates)."""
    if bf16:
        name = name.replace("NCCL", "NCCL bf16-mixed")
    criterion = (f"losses rel {BF16_RTOL:g}, cosine of every param's update >= {BF16_UPDATE_COS} (vs float64)" if bf16
                 else f"every param, every rank: atol {ATOL:g} (float64)")
    devices = f"cuda:0-{plan.world_size - 1}" if cuda else "cpu"
    status, values = run_spawned(_engine_rank, plan.world_size, (plan.to_dict(), steps, timeout, cuda, bf16), timeout,
                                 start_method="spawn" if cuda else "fork")
    if status == "hang":
        return Row(name, devices, "HANG", f"{name}: ranks {sorted(values)} did not finish in {timeout:.0f} s; killed",
                   criterion)
    if status == "error":
        rank, tb = sorted(values.items())[0]
        return Row(name, devices, "FAIL", f"rank {rank}: {tb.strip().splitlines()[-1][:120]}", criterion)
    ref_losses, ref_state = reference(plan, steps)
    init = _initial_state() if bf16 else None
    err, update_cos = 0.0, 1.0
    for blob in values.values():
        losses, shards = torch.load(io.BytesIO(blob), weights_only=False)
        if bf16:
            err = max([err] + [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)])
        else:
            err = max([err] + [abs(a - b) for a, b in zip(losses, ref_losses)])
        for pname, (t, dim, start, end) in shards.items():
            want, start_value = ref_state[pname], init[pname] if bf16 else None
            if dim is not None:
                want = want.narrow(dim, start, end - start)
                start_value = start_value.narrow(dim, start, end - start) if bf16 else None
            if bf16:
                update_cos = min(update_cos, torch.nn.functional.cosine_similarity(
                    (t.double() - start_value).reshape(1, -1), (want - start_value).reshape(1, -1)).item())
            else:
                err = max(err, (t - want).abs().max().item())
    if bf16:
        ok = err <= BF16_RTOL and update_cos >= BF16_UPDATE_COS
        return Row(name, devices, "PASS" if ok else "FAIL", f"max loss rel error {err:.1e}, min update cosine "
                   f"{update_cos:.4f}", criterion)
    return Row(name, devices, "PASS" if err < ATOL else "FAIL", f"max error {err:.1e}", criterion)


def _initial_state() -> dict[str, torch.Tensor]:
    from lightning_hexiscale.models.llama import Llama

    return {k: v.detach() for k, v in Llama(tiny_config()).to(torch.float64).init_weights(SEED).state_dict().items()}


# ---- CUDA present? -----------------------------------------------------------------------------------
def pinned_torch() -> str:
    """The torch version this project pins (constraints.txt at the repository root), else the
    installed one without its local tag."""
    constraints = Path(__file__).resolve().parents[1] / "constraints.txt"
    if constraints.is_file():
        m = re.search(r"^\s*torch\s*==\s*([0-9][^\s;#+]*)", constraints.read_text(), re.MULTILINE)
        if m:
            return m.group(1)
    return torch.__version__.split("+")[0]


def install_command() -> str:
    return f'python -m pip install "torch=={pinned_torch()}+cu130" --index-url {CUDA_INDEX}'


def cuda_problem() -> str | None:
    """Why this process cannot run the GPU checks, or None. A CPU-only torch build
    (``torch.version.cuda`` is None: what the pinned install gives) and a CUDA build that sees no
    device are told apart: the fixes differ."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"check_gpu: torch {torch.__version__} is a CPU-only build (torch.version.cuda is None): it "
                f"cannot use a GPU, whatever the machine has. Install the CUDA build:\n    {install_command()}\n"
                "(cu130 needs an NVIDIA driver >= 580; pick another index, e.g. cu128, for an older driver)")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (f"check_gpu: torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU "
                "(torch.cuda.is_available() is False). Check `nvidia-smi` (driver loaded, new enough for CUDA "
                f"{torch.version.cuda}) and CUDA_VISIBLE_DEVICES (now "
                f"{__import__('os').environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}).")
    return None


# ---- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see the module docstring / README")
    parser.add_argument("--timeout", type=float, default=180.0, help="watchdog per multi-GPU check, seconds")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of the NCCL equivalence checks")
    parser.add_argument("--speed-steps", type=int, default=10, help="timed steps of the speed checks")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(problem)
        _write_json(args.json, [], problem)
        return 1
    n = torch.cuda.device_count()
    print(f"check_gpu: {n} CUDA device(s): {', '.join(torch.cuda.get_device_name(i) for i in range(n))}; "
          f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        print(f"  {row.check}: {row.result}  {row.measured}", flush=True)

    for kernel in ("auto", "sdpa", "flash"):
        add(_guarded(lambda k=kernel: gpu_checks.check_accuracy(k), f"stage bf16 attention={kernel} vs float64"))
    matmul = [0.0]

    def matmul_row() -> Row:
        row, matmul[0] = gpu_checks.check_matmul_speed(args.speed_steps)
        return row

    add(_guarded(matmul_row, "bf16 matmul TFLOP/s"))
    try:
        for row in gpu_checks.check_stage_speed(args.speed_steps, 3, matmul[0]):
            add(row)
    except Exception as e:  # noqa: BLE001
        add(_failed("stage speed", e))
    for recompute in (False, True):
        add(_guarded(lambda r=recompute: gpu_checks.check_engine_memory(r), f"engine memory, recompute {recompute}"))
    torch.cuda.empty_cache()
    add(_guarded(gpu_checks.check_lightning_resume, "Lightning resume"))
    if gpu_checks.missing_omegaconf():
        add(Row("NCCL rows (1F1B, TP-2, ddp/zero2/zero3; bf16-mixed)", "-", "SKIP", gpu_checks.missing_omegaconf(), ""))
        runs = []
    else:
        runs = [(name, plan, False) for name, plan in plans().items()]
        runs += [(name, plans()[name], True) for name in BF16_PLANS]
    for name, plan, bf16 in runs:
        if n < plan.world_size:
            label = name.replace("NCCL", "NCCL bf16-mixed") if bf16 else name
            add(Row(label, "-", "SKIP", f"needs {plan.world_size} GPUs, found {n}", ""))
        else:
            add(check_nccl(name, plan, args.steps, args.timeout, bf16=bf16))
    print(table(rows))
    _write_json(args.json, rows, None)
    failed = [r.check for r in rows if r.result in ("FAIL", "HANG")]
    skipped = [r.check for r in rows if r.result == "SKIP"]
    print(f"check_gpu: {len(failed)} of {len(rows)} rows failed" + (f": {', '.join(failed)}" if failed else "")
          + (f"; {len(skipped)} skipped (see their 'measured' column)" if skipped else ""))
    return 1 if failed else 0


def _write_json(path: str | None, rows: list[Row], problem: str | None) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = {"torch": torch.__version__, "cuda": torch.version.cuda, "problem": problem,
           "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if problem is None else [],
           "rows": [asdict(r) for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def _failed(name: str, e: Exception) -> Row:
    return Row(name, "cuda:0", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", "")


def _guarded(fn, name: str) -> Row:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (one failing check must not hide the others)
        traceback.print_exc()
        return _failed(name, e)


if __name__ == "__main__":
    sys.exit(main())
