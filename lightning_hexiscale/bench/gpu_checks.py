"""The single-GPU rows of recipes/check_gpu.py, each a function returning a :class:`Row`.

Every row says what it measured, the limit it was held to, and PASS/FAIL/SKIP. The functions take a
``device`` so that their logic (and the accuracy comparison's ability to fail) can be tested on the
CPU (tests/runtime/test_check_gpu_recipe.py); on a GPU node check_gpu.py runs them on ``cuda``.

- **accuracy** (:func:`compare_forward`): the runtime's stage (``runtime/parallelize.build_stage``)
  with the runtime's own attention dispatch (``models/attention.attention``; a kernel forced through
  the same dispatch, or any ``attention_fn`` in the tests) in bf16 autocast over float32 weights (as
  ``bf16-mixed``), against the plain Llama in float64 on the CPU with the eager kernel, same weights
  and batch. The LM head is scaled so that the logits have a spread of :data:`LOGIT_STD`
  nats: with the default init (std 0.02) every logit is ~0 and the loss is log V whatever the
  attention does, so no tolerance could catch a wrong kernel. Pass: |loss - ref| <= :data:`LOSS_TOL`,
  cosine(logits, ref) >= :data:`COS_TOL` and the smallest per-parameter gradient cosine >= COS_TOL.
  A non-causal attention or one reading (B, H, T, D) as (B, T, H, D) fails all three by far.
- **speed**: a bf16 matmul and a runtime stage's forward + backward in achieved TFLOP/s, against
  fractions of the catalog's peak for the detected GPU (``config/catalog.py``), so a slow kernel, a
  wrong dtype or a throttled GPU FAILs; and the stage against the same blocks as plain modules.
- **engine memory**: a world-size-1 :class:`PipelineEngine` in bf16-mixed (float32 weights, bf16
  autocast), AdamW, 4 micro-batches, recompute off and on: ``torch.cuda.max_memory_reserved`` (what
  the caching allocator holds from the device, so what runs out) over 3 steps against
  ``estimate()``'s peak for the same plan (what ``hexiscale estimate`` prints), less the terms the
  caching allocator never sees (the 1 GiB reserve and NCCL's buffers). One-sided
  (:func:`memory_verdict`): pass when the reserved peak is at most the estimate plus
  :data:`MEMORY_TOL`; an estimate above it only keeps a plan on the safe side.
- **Lightning resume**: 20 steps of ``LlamaLitModule`` under ``HexiScaleStrategy`` in bf16-mixed,
  a checkpoint at step 10, a fresh Trainer resumed from it: the resumed steps' losses equal the
  uninterrupted run's (the run continues) and the loss fell over the run.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import socket
import statistics
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SEED = 1234
LOGIT_STD = 1.5
"""Spread of the accuracy check's logits: its LM head is scaled by LOGIT_STD / (INIT_STD * sqrt(H))
(after the final RMSNorm the hidden state has unit RMS, so a logit's std is ||w_v|| = INIT_STD * sqrt(H))."""
LOSS_TOL = 3e-3
"""|loss(bf16 stage) - loss(float64 reference)| (nats). bf16 keeps 8 mantissa bits: ~2e-4 observed."""
COS_TOL = 0.99
"""cosine similarity of logits and of every gradient with the reference (bf16: ~0.9999)."""
MATMUL_FRACTION = 0.40
"""bf16 8192^3 matmul >= this fraction of the catalog peak (H100 SXM: ~70 % is typical)."""
STAGE_FRACTION = 0.25
"""runtime stage forward + backward >= this fraction of the catalog peak."""
PLAIN_RATIO = 1.10
"""runtime stage time <= this x the same blocks as plain modules."""
MEMORY_TOL = 0.15
"""reserved peak <= (1 + this) x estimated peak (one-sided: :func:`memory_verdict`)."""


def memory_verdict(reserved_peak_bytes: float, estimated_bytes: float, tol: float = MEMORY_TOL) -> tuple[bool, float]:
    """(pass, relative excess) of the engine-memory row: (reserved - estimated) / estimated, passing
    when it is at most ``tol``. One-sided because what a plan must fit is the memory the caching
    allocator reserves (allocations plus its rounding and fragmentation); an estimate above it
    only wastes some memory, one below it is an out-of-memory error the planner did not foresee."""
    excess = (reserved_peak_bytes - estimated_bytes) / estimated_bytes
    return excess <= tol, excess


@dataclass
class Row:
    check: str
    devices: str
    result: str
    """PASS, FAIL, HANG, SKIP."""
    measured: str
    criterion: str


def missing_omegaconf() -> str | None:
    """Why the rows that build a Plan, a Cluster or a Lightning run cannot run, or None: the
    planner and config packages read YAML through omegaconf (pure Python; Hydra is not needed)."""
    import importlib.util

    if importlib.util.find_spec("omegaconf") is not None:
        return None
    return ("needs omegaconf (plans and clusters are read through it): python -m pip install omegaconf, "
            "or put omegaconf and antlr4 on PYTHONPATH")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table(rows: list[Row]) -> str:
    head = ("check", "devices", "result", "measured", "criterion")
    cells = [head] + [(r.check, r.devices, r.result, r.measured, r.criterion) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def make_batch(vocab: int, seq: int, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    seqs = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def _where(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


# ---- accuracy ---------------------------------------------------------------------------------------
def accuracy_config(small: bool = False):
    """GQA 8/4 heads (4/2 when ``small``: the CPU tests), 2 layers."""
    from lightning_hexiscale.models.config import LlamaConfig

    if small:
        return LlamaConfig(name="check_acc_small", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           ffn_hidden_size=128, vocab_size=256, seq_len=32)
    return LlamaConfig(name="check_acc", hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
                       ffn_hidden_size=688, vocab_size=512, seq_len=128)


def compare_forward(attention_fn=None, device: str = "cuda", config=None, batch: int = 2) -> dict[str, float]:
    """The bf16-autocast runtime stage (float32 weights on ``device``; its attention is the model's
    default, the runtime's :func:`~lightning_hexiscale.models.attention.attention`, unless
    ``attention_fn`` replaces it) against the float64 CPU Llama with the eager kernel.

    Returns ``loss_diff`` = |loss - ref| (nats), ``logits_cos`` = cosine of the flattened logits,
    ``grad_cos`` = the smallest cosine of a parameter's gradient, and both losses."""
    from lightning_hexiscale.models.attention import kernel_fn
    from lightning_hexiscale.models.llama import INIT_STD, Llama, causal_lm_loss
    from lightning_hexiscale.runtime.parallelize import build_stage, load_full_state_dict

    cfg = config or accuracy_config()
    tokens, targets = make_batch(cfg.vocab_size, cfg.seq_len, batch, 0)
    ref = Llama(cfg).to(torch.float64).init_weights(SEED)
    with torch.no_grad():
        ref.lm_head.weight.mul_(LOGIT_STD / (INIT_STD * cfg.hidden_size ** 0.5))
    for block in ref.layers:
        block.attn.attention_fn = kernel_fn("eager")
    ref_logits = ref(tokens)
    ref_loss = causal_lm_loss(ref_logits, targets)
    ref_loss.backward()
    with torch.device("meta"):
        meta = Llama(cfg)
    stage = build_stage(meta, (0, cfg.num_layers), True, True, 1, 0, None, device=device, dtype=torch.float32,
                        seed=None)
    load_full_state_dict(stage, {k: v.detach().float() for k, v in ref.state_dict().items()})
    if attention_fn is not None:
        for block in stage.layers.values():
            block.attn.attention_fn = attention_fn
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        logits = stage(tokens.to(device))
        loss = causal_lm_loss(logits, targets.to(device))
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    grad_cos = min(F.cosine_similarity(p.grad.double().cpu().reshape(1, -1), ref_grads[n].grad.reshape(1, -1)).item()
                   for n, p in stage.named_parameters())
    logits_cos = F.cosine_similarity(logits.detach().double().cpu().reshape(1, -1),
                                     ref_logits.detach().reshape(1, -1)).item()
    return {"loss_diff": abs(loss.item() - ref_loss.item()), "logits_cos": logits_cos, "grad_cos": grad_cos,
            "loss": loss.item(), "ref_loss": ref_loss.item()}


def accuracy_ok(m: dict[str, float]) -> bool:
    return m["loss_diff"] <= LOSS_TOL and m["logits_cos"] >= COS_TOL and m["grad_cos"] >= COS_TOL


def check_accuracy(kernel: str = "auto", device: str = "cuda", config=None) -> Row:
    """One accuracy row: ``kernel`` ``auto`` leaves the model's dispatch alone (what training runs);
    ``sdpa``/``flash`` force that kernel through the same dispatch (``kernel_fn``)."""
    from lightning_hexiscale.models import attention as attn

    name = f"stage bf16 attention={kernel} vs float64"
    criterion = f"|loss diff| <= {LOSS_TOL:g}, logits & grad cosine >= {COS_TOL}"
    if kernel == "auto" and device == "cuda":
        chosen = "flash" if attn.flash_attn_supported(torch.cuda.current_device()) else "sdpa"
        name += f" (dispatch picks {chosen})"
    if kernel == "flash" and not (device == "cuda" and attn.flash_attn_supported(torch.cuda.current_device())):
        return Row(name, _where(device), "SKIP", "flash-attn not installed, does not import, or capability < 8.0",
                   criterion)
    m = compare_forward(None if kernel == "auto" else attn.kernel_fn(kernel), device, config)
    return Row(name, _where(device), verdict(accuracy_ok(m)),
               f"loss diff {m['loss_diff']:.1e}, logits cos {m['logits_cos']:.5f}, min grad cos {m['grad_cos']:.5f}",
               criterion)


# ---- speed ------------------------------------------------------------------------------------------
def catalog_entry(device_name: str):
    """The catalog's GpuType a CUDA name denotes (``NVIDIA H100 80GB HBM3`` -> H100;
    :func:`lightning_hexiscale.config.catalog.name_of_device`); None when unlisted."""
    from lightning_hexiscale.config import catalog

    name = catalog.name_of_device(device_name)
    return None if name is None else catalog.lookup(name)


def _cuda_time(fn, steps: int, warmup: int) -> float:
    """Median seconds of ``fn()`` by CUDA events."""
    return _cuda_times([fn], steps, warmup)[0]


def _cuda_times(fns, steps: int, warmup: int) -> list[float]:
    """Median seconds of each of ``fns``, timed by CUDA events in interleaved rounds (round i runs
    every function once), so that clock ramps and a neighbour's load fall on all of them alike
    instead of on whichever ran first (a ratio of two back-to-back medians read 1.10x here where
    the interleaved one reads 1.00x)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + steps):
        for k, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times[k].append(start.elapsed_time(end) / 1e3)
    return [statistics.median(t) for t in times]


def check_matmul_speed(steps: int = 10, n: int = 8192) -> tuple[Row, float]:
    """bf16 n x n x n matmul, 2 n^3 FLOPs; returns the row and the achieved FLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rate = 2 * n**3 / _cuda_time(lambda: a @ b, steps, 3)
    spec = catalog_entry(torch.cuda.get_device_name(0))
    name = f"bf16 matmul {n}^3 TFLOP/s"
    if spec is None:
        return Row(name, "cuda:0", "SKIP", f"{rate / 1e12:.0f} TFLOP/s; GPU not in config/catalog.py", ""), rate
    limit = MATMUL_FRACTION * spec.peak_flops
    return (Row(name, "cuda:0", verdict(rate >= limit), f"{rate / 1e12:.0f} ({rate / spec.peak_flops:.0%} of peak)",
                f">= {limit / 1e12:.0f} ({MATMUL_FRACTION:.0%} of {spec.name} {spec.peak_flops / 1e12:.0f})"), rate)


def check_stage_speed(steps: int, warmup: int, matmul_rate: float) -> list[Row]:
    """Forward + backward of a 4-layer runtime stage (H=2048, F=5632, S=2048, micro-batch 2, bf16
    autocast, the default fast path; recipes/mfu_probe.py times each variant): achieved TFLOP/s =
    3 x forward FLOPs (Appendix B count) / time against :data:`STAGE_FRACTION` of the catalog peak
    (of the measured matmul rate when the GPU is not listed), and time against the same blocks as plain modules."""
    from lightning_hexiscale.config.fast_path import FastPath
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.models.llama import Llama, RopeCache, TransformerBlock
    from lightning_hexiscale.runtime.fast_path import apply_fast_path
    from lightning_hexiscale.runtime.parallelize import build_stage

    cfg = LlamaConfig(name="check_speed", hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=16,
                      ffn_hidden_size=5632, vocab_size=32000, seq_len=2048)
    mb = 2
    with torch.device("meta"):
        meta = Llama(cfg)
    stage = build_stage(meta, (0, cfg.num_layers), False, False, 1, 0, None, device="cuda", dtype=torch.float32,
                        seed=SEED)
    # as a GPU run builds it: the default fast path (compiled blocks, fused norm, main grads, ...)
    apply_fast_path(stage, FastPath().resolve("cuda", mixed=True), compute_dtype=torch.bfloat16, mixed=True)
    plain = torch.nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers)).to("cuda")
    cos, sin = RopeCache(cfg)(cfg.seq_len, torch.device("cuda"), torch.float32)
    x = torch.randn(mb, cfg.seq_len, cfg.hidden_size, device="cuda", requires_grad=True)

    def run_plain(h):
        for block in plain:
            h = block(h, cos, sin)
        return h

    def step(fn):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fn(x)
            out.float().sum().backward()
        return run

    t_stage, t_plain = _cuda_times([step(stage), step(run_plain)], steps, warmup)
    rate = 3 * cfg.num_layers * cfg.layer_forward_flops(mb) / t_stage
    spec = catalog_entry(torch.cuda.get_device_name(0))
    peak, peak_name = (spec.peak_flops, f"{spec.name} peak") if spec else (matmul_rate, "measured matmul")
    limit = STAGE_FRACTION * peak
    ratio = t_stage / t_plain
    return [Row("stage fwd+bwd TFLOP/s (4 x H2048, S2048)", "cuda:0", verdict(rate >= limit),
                f"{rate / 1e12:.0f} ({rate / peak:.0%} of {peak_name}), {t_stage * 1e3:.1f} ms",
                f">= {limit / 1e12:.0f} ({STAGE_FRACTION:.0%} of {peak_name} {peak / 1e12:.0f})"),
            Row("stage vs plain PyTorch blocks", "cuda:0", verdict(ratio <= PLAIN_RATIO),
                f"{t_stage * 1e3:.1f} ms vs {t_plain * 1e3:.1f} ms ({ratio:.2f}x)", f"<= {PLAIN_RATIO:.2f}x plain")]


# ---- engine memory ----------------------------------------------------------------------------------
def memory_config():
    from lightning_hexiscale.models.config import LlamaConfig

    return LlamaConfig(name="check_mem", hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=8,
                       ffn_hidden_size=5632, vocab_size=32000, seq_len=2048)


def one_device_plan(num_layers: int, micro_batches: int, micro_batch_size: int, recompute: bool,
                    sharding: str = "ddp"):
    from lightning_hexiscale.planner import Plan

    return Plan.from_dict({"num_layers": num_layers, "schedule": "1f1b", "recompute": recompute,
                           "dp_sharding": sharding,
                           "pipelines": [{"batch_size": micro_batches * micro_batch_size,
                                          "micro_batch_size": micro_batch_size,
                                          "stages": [{"devices": [0], "layers": [0, num_layers]}]}]})


def catalog_cluster(gpu: str):
    """A one-device Cluster of the catalog type ``gpu`` (a composed-config path, as ``cluster=...``)."""
    from omegaconf import OmegaConf

    from lightning_hexiscale.config.cluster import Cluster

    return Cluster.from_config(OmegaConf.create({
        "name": f"check_gpu_{gpu}", "machines": [{"gpu": gpu, "count": 1, "intra_bandwidth": "100 GB/s"}],
        "inter_machine": {"bandwidth": "10 GB/s"}}))


def local_cluster(device: str = "cuda"):
    """This machine's device as a one-device Cluster: its catalog entry (H100's figures when the GPU
    is not listed: the checks use the cluster for the plan's shape and the memory terms, not its
    speed), CPU-FAST on the CPU. Passed to the strategy too, whose own local description refuses
    a GPU missing from the catalog."""
    if device == "cuda":
        return catalog_cluster((catalog_entry(torch.cuda.get_device_name(torch.cuda.current_device()))
                                or catalog_entry("H100")).name)
    return catalog_cluster("CPU-FAST")


def estimated_peak(plan, model_config, precision: str, device: str = "cuda", cluster=None) -> dict[str, float]:
    """The plan's peak bytes on its one device as ``hexiscale estimate`` computes them (a composed
    config through ``workload_from_config`` and ``estimate``), and that peak less the reserve and the
    communicator buffers (``allocator_bytes``: what ``torch.cuda.max_memory_allocated`` can see)."""
    from omegaconf import OmegaConf

    from lightning_hexiscale.planner import estimate, workload_from_config

    cluster = cluster or local_cluster(device)
    model = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
    machines = [{"gpu": cluster.devices[0].gpu_type, "count": 1, "intra_bandwidth": "100 GB/s"}]
    cfg = OmegaConf.create({"model": model, "trainer": {"precision": precision}, "train": {"memory_headroom": 0.0},
                            "cluster": {"name": cluster.name, "machines": machines,
                                        "inter_machine": {"bandwidth": "10 GB/s"}}})
    workload = workload_from_config(cfg)
    full = estimate(plan, cluster, workload).pipelines[0].stages[0].peak_memory_bytes
    bare = dataclasses.replace(workload, reserve_bytes=0.0, comm_buffer_bytes=0.0)
    seen = estimate(plan, cluster, bare).pipelines[0].stages[0].peak_memory_bytes
    return {"peak_bytes": full, "allocator_bytes": seen}


def _init_single_process_group(device: str) -> bool:
    """A world of one (NCCL on CUDA, gloo on CPU); False when one already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None)
    return True


def run_engine_steps(plan, config, device: str, steps: int = 3) -> list[float]:
    """``steps`` AdamW steps of a world-size-1 engine in bf16-mixed (float32 weights, bf16 autocast)."""
    import torch.distributed as dist

    from lightning_hexiscale.runtime.engine import PipelineEngine

    created = _init_single_process_group(device)
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    try:
        engine = PipelineEngine(plan, config, seed=SEED, device=where, dtype=torch.float32,
                                autocast_dtype=torch.bfloat16)
        opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
        losses = []
        for step in range(steps):
            tok, tgt = make_batch(config.vocab_size, config.seq_len, plan.global_batch, step)
            losses.append(engine.fit_step(tok.to(where), tgt.to(where), opt).loss)  # Trainer.fit's step, no clip
        return losses
    finally:
        # The engine sits in reference cycles (hooks close over their modules) that hold the group:
        # free it here, while the group's threads exist, not in some later forked child.
        engine = opt = None
        gc.collect()
        if created:
            dist.destroy_process_group()


def check_engine_memory(recompute: bool, micro_batches: int = 4, micro_batch_size: int = 2) -> Row:
    """max_memory_allocated of the world-size-1 engine (bf16-mixed, AdamW, 3 steps) vs estimate()."""
    name = f"engine ws1 bf16-mixed {micro_batches} mb, recompute {'on' if recompute else 'off'}: peak memory"
    criterion = f"reserved <= estimate() + {MEMORY_TOL:.0%}"
    if missing_omegaconf():
        return Row(name, "cuda:0", "SKIP", missing_omegaconf(), criterion)
    cfg = memory_config()
    plan = one_device_plan(cfg.num_layers, micro_batches, micro_batch_size, recompute)
    try:
        est = estimated_peak(plan, cfg, "bf16-mixed")
    except ImportError as e:
        return Row(name, "cuda:0", "SKIP", f"estimate() needs {e.name}: carry it (README, GPU check)", criterion)
    # The previous row's engine may still sit in reference cycles (autograd hooks that close over
    # their module): collect them first, or its ~GiBs count in ``base`` and hide this row's peak.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    allocated_base = torch.cuda.memory_allocated()
    losses = run_engine_steps(plan, cfg, "cuda")
    peak = torch.cuda.max_memory_reserved() - base
    allocated = torch.cuda.max_memory_allocated() - allocated_base
    want = est["allocator_bytes"]
    ok, err = memory_verdict(peak, want)
    finite = all(map(lambda v: v == v and abs(v) != float("inf"), losses))
    return Row(name, "cuda:0", verdict(ok and finite),
               f"reserved {peak / 2**30:.2f} GiB (allocated {allocated / 2**30:.2f}) vs {want / 2**30:.2f} GiB "
               f"({err:+.0%}); estimate incl. reserve+NCCL {est['peak_bytes'] / 2**30:.2f} GiB"
               + ("" if finite else "; loss not finite"), criterion)


# ---- Lightning: 20 steps, checkpoint, resume --------------------------------------------------------
def lightning_resume(device: str, precision: str, steps: int = 20, save_at: int = 10, config=None,
                     workdir: str | None = None) -> dict:
    """``steps`` steps of LlamaLitModule under HexiScaleStrategy (world size 1), a checkpoint at
    ``save_at``; then a fresh module and Trainer resumed from it up to ``steps``. Returns both loss
    lists (``full``: steps 0..steps-1; ``resumed``: the steps after the checkpoint) and the step the
    resumed Trainer started at."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_hexiscale.data import generated_corpus
    from lightning_hexiscale.lightning.example import LlamaLitModule
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
    from lightning_hexiscale.models.config import LlamaConfig

    cfg = config or LlamaConfig(name="check_lit", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                ffn_hidden_size=688, vocab_size=256, seq_len=128)
    batch = 4
    plan = one_device_plan(cfg.num_layers, 2, batch // 2, False)

    class Losses(Callback):
        def __init__(self):
            self.losses, self.first_step = [], None

        def on_train_batch_start(self, trainer, module, batch_, batch_idx):
            if self.first_step is None:
                self.first_step = trainer.global_step

        def on_train_batch_end(self, trainer, module, outputs, batch_, batch_idx):
            self.losses.append(float(outputs["loss"]))

    def trainer(out: str, record: Losses, ckpt: bool) -> pl.Trainer:
        callbacks = [record]
        if ckpt:
            callbacks.append(ModelCheckpoint(dirpath=out, every_n_train_steps=save_at, save_top_k=-1,
                                             filename="{step}"))
        strategy = HexiScaleStrategy(cluster=local_cluster(device), plan=plan, timeout=300)
        return pl.Trainer(strategy=strategy, accelerator=device, devices=1,
                          precision=precision, max_steps=steps, logger=False, enable_checkpointing=ckpt,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          callbacks=callbacks)

    def loader() -> DataLoader:
        return DataLoader(generated_corpus(batch * steps, cfg.seq_len, seed=3), batch_size=batch, shuffle=False)

    # Lightning leaves its one-process group and MASTER_*/LOCAL_RANK/NODE_RANK in os.environ after fit;
    # the rows after this one (and processes forked later) must not inherit them: a child that finds an
    # initialised default group and a stale MASTER_PORT hangs in its own rendezvous.
    import torch.distributed as dist

    had_group, env = dist.is_available() and dist.is_initialized(), dict(os.environ)
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as out:
            full, resumed = Losses(), Losses()
            trainer(out, full, True).fit(LlamaLitModule(cfg, lr=1e-3, init_seed=SEED), loader())
            trainer(out, resumed, False).fit(LlamaLitModule(cfg, lr=1e-3, init_seed=SEED), loader(),
                                             ckpt_path=f"{out}/step={save_at}.ckpt")
    finally:
        if not had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
    return {"full": full.losses, "resumed": resumed.losses, "resumed_from": resumed.first_step}


def resume_ok(r: dict, save_at: int = 10, rtol: float = 1e-2) -> tuple[bool, float]:
    """The resumed run starts at ``save_at`` and its losses equal the uninterrupted run's after the
    checkpoint (relative ``rtol``: bf16 kernels may differ in the last bits), and the loss fell."""
    tail = r["full"][save_at:]
    if r["resumed_from"] != save_at or len(r["resumed"]) != len(tail) or not tail:
        return False, float("inf")
    err = max(abs(a - b) / abs(b) for a, b in zip(r["resumed"], tail))
    return err <= rtol and r["full"][-1] < r["full"][0], err


def check_lightning_resume(device: str = "cuda", precision: str = "bf16-mixed") -> Row:
    name = f"Lightning {precision}: 20 steps, checkpoint at 10, resume"
    criterion = "resumes at step 10; losses 10-19 = uninterrupted run (rel 1e-2); loss falls"
    if missing_omegaconf():
        return Row(name, _where(device), "SKIP", missing_omegaconf(), criterion)
    try:
        r = lightning_resume(device, precision)
    except ImportError as e:
        return Row(name, _where(device), "SKIP", f"the strategy needs {e.name}: carry it (README, GPU check)",
                   criterion)
    ok, err = resume_ok(r)
    full = r["full"]
    return Row(name, _where(device), verdict(ok),
               f"from step {r['resumed_from']}, max rel diff {err:.1e}; loss {full[0]:.3f} -> {full[-1]:.3f}", criterion)
