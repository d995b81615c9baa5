"""One GPU: ``Trainer(strategy=HexiScaleStrategy())`` with its defaults against the same model in a
plain, compiled torch loop, in one process, on the same batches.

    python benchmarks/bench_one_gpu.py                     # one GPU: Llama-3.2-1B shape, 8 x 2048, bf16-mixed
    python benchmarks/bench_one_gpu.py --smoke             # CPU, tiny shape, seconds (the suite runs it)
    python benchmarks/bench_one_gpu.py --json outputs/one_gpu.json

Both sides train the same shape on the same global batch (``--batch`` sequences of ``--seq`` tokens)
with AdamW, gradient clipping at the recipe's default and, on a GPU, bf16 autocast over float32
weights:

- **strategy**: ``LlamaLitModule`` under ``Trainer(strategy=HexiScaleStrategy(), devices=1)``, no
  other argument: the plan (micro-batches, recomputation, fast path) is what the strategy decides.
- **plain loop** (the baseline a user has without this project): the same model in a ``for`` loop,
  one forward and backward of the whole batch, ``torch.compile`` on a GPU, fused AdamW. Two models
  are timed when ``transformers`` is importable: this package's plain ``Llama`` and Hugging Face's
  ``LlamaForCausalLM`` (its ``sdpa`` attention); the ratio is taken against the FASTER of them.

Time per step = median over ``--steps`` timed steps after ``--warmup`` untimed ones (compilation
happens in the warm-up); for the Trainer, the time between consecutive ``on_train_batch_start``
calls, so everything the Trainer runs per step is counted. MFU = model FLOPs of one step (3 x the
forward FLOPs of ``LlamaConfig.model_flops_per_iteration``, no recomputation counted) / time / the
catalog's dense bf16 peak.

Target (issue 40, fixed before any measurement): on one GPU, strategy time / best plain-loop time
<= 1.05 (printed PASS/FAIL; ``n/a`` with ``--smoke``, where CPU timings of a tiny model say nothing).
Exit status 1 when the target fails on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

TARGET_RATIO = 1.05
"""Strategy step time over the best plain loop's, at most (on a GPU)."""


def shape(smoke: bool, seq: int):
    """Llama-3.2-1B's shape (llama_tiny with ``--smoke``) at ``seq`` tokens per sequence."""
    import dataclasses

    from lightning_hexiscale.models.config import LlamaConfig

    cfg = LlamaConfig.load("llama_tiny" if smoke else "llama3_2_1b")
    return dataclasses.replace(cfg, seq_len=seq)


def batches(vocab: int, batch: int, seq: int, count: int) -> list[torch.Tensor]:
    """``count`` (batch, seq + 1) token batches, the same for every side (seeded)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
"""AdamW's settings on both sides (LlamaLitModule's betas and weight decay)."""


def plain_loop(cfg, data: list[torch.Tensor], device: torch.device, warmup: int, compile_: bool,
               reference: str) -> tuple[float, list[float]]:
    """(median seconds per step, loss of every step) of the plain loop on ``reference``
    ("hexiscale": this package's plain Llama, initialised as the strategy initialises it; "hf")."""
    from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
    from lightning_hexiscale.models.llama import Llama, causal_lm_loss

    model = _hf_model(cfg) if reference == "hf" else Llama(cfg).init_weights(0)
    model = model.to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=cuda)

    def logits_of(tokens):
        out = model(tokens)
        return out.logits if reference == "hf" else out

    step_fn = torch.compile(logits_of) if compile_ else logits_of
    times, losses = [], []
    for i, b in enumerate(data):
        b = b.to(device, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = causal_lm_loss(step_fn(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), DEFAULT_GRADIENT_CLIP_VAL)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())  # after the clock: .item() would synchronise inside the step
    del model, opt
    _free(device)
    return statistics.median(times), losses


def _hf_model(cfg):
    """Hugging Face's LlamaForCausalLM of the same shape (sdpa attention, float32 weights)."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    hf = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=max(cfg.seq_len, 128),
                  rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                  tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="sdpa")
    return LlamaForCausalLM(hf)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def strategy_run(cfg, data: list[torch.Tensor], device: torch.device, warmup: int,
                 workdir: Path) -> tuple[float, list[float]]:
    """(median seconds per step, loss of every step) of LlamaLitModule under ``HexiScaleStrategy()``
    (all defaults)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hexiscale.config.recipe import DEFAULT_GRADIENT_CLIP_VAL
    from lightning_hexiscale.lightning.example import LlamaLitModule
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    starts: list[float] = []
    losses: list[float] = []

    class StepClock(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            _sync(device)
            starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, module):
            _sync(device)
            starts.append(time.perf_counter())

    stacked = torch.cat(data)
    loader = DataLoader(stacked, batch_size=data[0].shape[0], shuffle=False)
    trainer = pl.Trainer(strategy=HexiScaleStrategy(), accelerator=device.type, devices=1,
                         precision="bf16-mixed" if device.type == "cuda" else "32-true", max_steps=len(data),
                         gradient_clip_val=DEFAULT_GRADIENT_CLIP_VAL, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(workdir), callbacks=[StepClock()])
    trainer.fit(LlamaLitModule(cfg, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY), loader)
    steps = [b - a for a, b in zip(starts, starts[1:])]
    del trainer
    _free(device)
    return statistics.median(steps[warmup:]), losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, no compile (seconds)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; smoke 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; smoke 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; smoke 1)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("bench_one_gpu: no CUDA device; run with --smoke on a CPU", file=sys.stderr)
        return 2
    batch, seq = args.batch or (4 if smoke else 8), args.seq or (32 if smoke else 2048)
    steps, warmup = args.steps or (2 if smoke else 10), args.warmup if args.warmup is not None else (1 if smoke else 5)
    device = torch.device("cpu" if smoke else "cuda")
    cfg = shape(smoke, seq)
    data = batches(cfg.vocab_size, batch, seq, warmup + steps)
    flops = cfg.model_flops_per_iteration(batch)  # forward + backward of one step, no recomputation

    references = ["hexiscale"]
    try:
        import transformers  # noqa: F401
        references.append("hf")
    except ImportError:
        pass
    rows, losses = {}, {}
    for ref in references:
        rows[f"plain/{ref}"], losses[f"plain/{ref}"] = plain_loop(cfg, data, device, warmup, compile_=not smoke,
                                                                  reference=ref)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        rows["strategy"], losses["strategy"] = strategy_run(cfg, data, device, warmup, Path(d))
    # Same work on both sides: the strategy and the plain Llama start from the same weights and see
    # the same batches, so their losses agree step by step (to rounding; bf16 on a GPU).
    gap = max(abs(a - b) for a, b in zip(losses["strategy"], losses["plain/hexiscale"]))
    best_ref = min((k for k in rows if k.startswith("plain/")), key=rows.get)
    ratio = rows["strategy"] / rows[best_ref]
    peak = _peak(device)
    report = {"smoke": smoke, "shape": cfg.name, "batch": batch, "seq": seq, "steps": steps, "warmup": warmup,
              "seconds_per_step": rows, "best_plain": best_ref, "ratio": ratio, "target": TARGET_RATIO,
              "losses": losses, "max_loss_gap_strategy_vs_plain": gap,
              "mfu": {k: (flops / t / peak if peak else None) for k, t in rows.items()},
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    ok = ratio <= TARGET_RATIO
    report["verdict"] = "n/a" if smoke else ("PASS" if ok else "FAIL")
    for k, t in rows.items():
        mfu = report["mfu"][k]
        print(f"{k:>16}: {t * 1e3:9.1f} ms/step" + (f"  MFU {mfu * 100:5.1f} %" if mfu else ""))
    print(f"largest loss difference, strategy vs plain/hexiscale, over {len(data)} steps: {gap:.2e}")
    print(f"strategy / {best_ref}: {ratio:.3f} (target <= {TARGET_RATIO}): {report['verdict']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if smoke or ok else 1


def _peak(device: torch.device) -> float | None:
    """The catalog's dense bf16 peak of this GPU (None on the CPU or for an unlisted GPU)."""
    if device.type != "cuda":
        return None
    from lightning_hexiscale.config import catalog

    name = catalog.name_of_device(torch.cuda.get_device_name())
    gpu = catalog.lookup(name) if name else None
    return gpu.peak_flops if gpu else None


if __name__ == "__main__":
    sys.exit(main())
