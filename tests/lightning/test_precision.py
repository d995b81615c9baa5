"""Every precision the strategy accepts trains in its dtype on every rank (issue 20, "Precision honoured").

``LlamaLitModule`` builds its model in float32 (its default ``dtype``); the Trainer's precision must
decide what the ranks train in, as it does on one device:

- 64-true / ddp, bf16-true / zero2, 64-true / zero3: parameters, optimizer state, the compute of
  every linear layer and the saved checkpoint in float64 / bfloat16 on every rank of a plan with TP,
  PP and DP (4 fork ranks, gloo);
- bf16-mixed / zero2: float32 parameters, optimizer state and checkpoint, bfloat16 compute;
- 16-true / ddp: float16 throughout; a precision plugin with no cost-model dtype is refused before launch;
- the bytes on the wire: every activation / gradient p2p and every gradient or parameter collective
  of the runtime (NCCL-semantics trace) has the element size of the run's wire dtype (8 bytes under
  64-true, 2 under bf16);
- through ``recipes/train.py`` (fork launcher, llama_tiny, 4 ranks) in 64-true: the checkpoint's
  weights equal a single-process plain-torch float64 run of the same data, initialisation, AdamW,
  warm-up and global-norm clipping, within 1e-9 (measured 4e-14; the float32 run of main missed by
  7e-5: the checker can fail).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from omegaconf import OmegaConf
from strategy_helpers import PG_TIMEOUT, TINY, hexiscale_trainer, loader, plan_of, read_ranks
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import nccl_semantics
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.runtime import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"

# pipeline 0: one TP-2 stage; pipeline 1: two stages (PP) - DP across TP-asymmetric pipelines.
PLAN = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], cluster="cpu_hetero4")

RUNTIME_FILES = ("schedule.py", "grad_sync.py", "zero.py", "zero3.py", "tensor_parallel.py", "tied_embeddings.py")
"""Where the runtime's own activation, gradient and parameter traffic is issued from (the trace's
``where``); Lightning's and the loss's float32 scalars are not part of what the cost model prices."""

# (precision, dp_sharding, parameter / optimizer-state / checkpoint dtype, compute dtype, wire dtype)
CASES = [("64-true", "ddp", torch.float64, torch.float64, "float64"),
         ("bf16-true", "zero2", torch.bfloat16, torch.bfloat16, "bfloat16"),
         ("64-true", "zero3", torch.float64, torch.float64, "float64"),
         ("bf16-mixed", "zero2", torch.float32, torch.bfloat16, "bfloat16"),
         ("16-true", "ddp", torch.float16, torch.float16, "float16")]


class DtypeProbe(pl.Callback):
    """Writes ``out_dir/dtypes{rank}.pt``: the dtypes of this rank's parameters and optimizer state,
    and of the outputs of every ``nn.Linear`` forward during training (the compute dtype)."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.compute: set[torch.dtype] = set()
        self.handles = []

    def on_train_start(self, trainer, module):
        for m in module.model.engine.stage.modules():
            if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear"):
                self.handles.append(m.register_forward_hook(lambda _m, _i, out: self.compute.add(out.dtype)))

    # The trace's phases: training traffic is what runs between a batch's start and end (a
    # checkpoint save or the Recorder's parameter copy gathers the exact parameter-dtype ZeRO masters).
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        nccl_semantics.current().mark("train")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        nccl_semantics.current().mark("other")

    def on_train_end(self, trainer, module):
        for h in self.handles:
            h.remove()
        params = {n: p.dtype for n, p in module.model.engine.stage.named_parameters()}
        engine = module.model.engine
        # under ZeRO the user's optimizer keeps no state: the inner optimizers of the owned chunks do
        opts = engine.sharded_optimizer.inner if engine.zero is not None else trainer.optimizers
        state = {t.dtype for opt in opts for s in opt.state.values() for k, t in s.items()
                 if torch.is_tensor(t) and k != "step"}
        torch.save({"params": params, "state": state, "compute": self.compute},
                   self.out_dir / f"dtypes{trainer.global_rank}.pt")


def _checkpoint_dtypes(path: Path) -> dict[str, torch.dtype]:
    """Saved tensor name -> dtype, from the DCP metadata (the model's and the optimizer's tensors)."""
    reader = ckpt.RangeReader(str(path))
    md = reader.read_metadata().state_dict_metadata
    return {k: v.properties.dtype for k, v in md.items()
            if isinstance(v, TensorStorageMetadata) and not k.startswith("optim.step.")}  # AdamW's counters


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("precision,sharding,param_dtype,compute_dtype,wire", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_rank_trains_in_the_trainers_dtype(tmp_path, precision, sharding, param_dtype, compute_dtype, wire):
    plan = dataclasses.replace(PLAN, dp_sharding=sharding)
    saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, save_top_k=0)
    module = LlamaLitModule(TINY, init_seed=3, lr=1e-2)  # its model is float32: the Trainer decides
    trainer = hexiscale_trainer(plan, tmp_path, callbacks=[DtypeProbe(tmp_path), saver], enable_checkpointing=True,
                                precision=precision, max_steps=1 if precision == "16-true" else 2)
    # (16-true: pure float16, AdamW's eps=1e-8 rounds to 0 and the second step is NaN, as on one device)
    trainer.fit(module, loader(plan.global_batch * 2, plan.global_batch))
    read_ranks(tmp_path, plan.world_size)  # replays the traces under NCCL's rules
    for rank in range(plan.world_size):
        got = torch.load(tmp_path / f"dtypes{rank}.pt", weights_only=False)
        assert got["params"] and set(got["params"].values()) == {param_dtype}, (rank, got["params"])
        assert got["state"] == {param_dtype}, (rank, got["state"])
        assert got["compute"] == {compute_dtype}, (rank, got["compute"])

    saved = _checkpoint_dtypes(tmp_path / "ckpt" / "last.ckpt")
    model_keys = [k for k in saved if k.startswith(ckpt.model_fqn(""))]
    assert model_keys and len(model_keys) < len(saved)  # the model's tensors and the optimizer's
    assert set(saved.values()) == {param_dtype}, {k: v for k, v in saved.items() if v != param_dtype}
    full = ckpt.load_llama_state_dict(tmp_path / "ckpt" / "last.ckpt")
    assert {t.dtype for t in full.values()} == {param_dtype}

    # Bytes on the wire: the runtime's traffic in the run's wire dtype (element size 8 or 2). The
    # vocabulary-parallel cross-entropy's per-token scalars are in max(wire, float32), as
    # planner/cost/wire.py prices them (loss_bytes); every other step is in the wire dtype.
    size = nccl_semantics._ESIZE[wire]
    seen: dict[str, set[int]] = {}
    for rank in range(plan.world_size):
        for step in torch.load(tmp_path / f"trace{rank}.pt", weights_only=False):
            where = step.where.split(":")[0]
            if step.phase != "train" or where not in RUNTIME_FILES or (step.kind == "coll" and (step.numel or 0) <= 1):
                continue  # not the runtime's, or the logged loss scalar (global_loss)
            dtypes = {o.dtype for o in step.ops} if step.kind != "coll" else {step.dtype}
            sizes = {nccl_semantics._ESIZE[d] for d in dtypes if d in ("float64", "float32", "bfloat16", "float16")}
            allowed = {size, max(size, 4)} if where == "tensor_parallel.py" and step.kind == "coll" else {size}
            assert sizes <= allowed, f"rank {rank}: {step}"
            seen.setdefault("p2p" if step.kind != "coll" else where, set()).update(sizes)
    # activations (p2p), TP activations and the DP gradient sync were all seen in the wire dtype
    assert seen["p2p"] == {size} and size in seen["tensor_parallel.py"], seen
    assert seen["zero.py" if sharding != "ddp" else "grad_sync.py"] == {size}, seen


class Int8Precision(Precision):
    """A precision plugin the cost model has no dtype for."""

    precision = "int8-true"


@pytest.mark.timeout(30)
def test_unknown_precision_is_refused_before_launch(monkeypatch):
    import torch.multiprocessing

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were started before the precision was checked")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", no_launch)
    trainer = pl.Trainer(strategy=HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT),
                         accelerator="cpu", devices=PLAN.world_size, plugins=[Int8Precision()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, max_steps=1)
    with pytest.raises(ConfigError, match=r"Trainer\(precision\).*int8-true.*must be one of"):
        trainer.fit(LlamaLitModule(TINY), loader(PLAN.global_batch, PLAN.global_batch))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fp16_true_names_adams_eps_underflow_and_its_fix_works(tmp_path):
    """16-true with AdamW's default eps=1e-8 (0 in float16) turns parameters into inf/NaN in the first
    update; the stop names that cause and the fix, and the fix (an eps float16 holds) trains."""
    from lightning_hexiscale.errors import NonFiniteError

    plan = plan_of([(2, 1, [([0], (0, 4))]), (2, 2, [([1], (0, 4))])], cluster="cpu_hetero4")
    data = loader(plan.global_batch * 3, plan.global_batch)
    # torch's plain AdamW (the fast path's fused AdamW computes its update in float32, where 1e-8 holds)
    plain = {"fast_path": {"fused_adamw": False}}
    with pytest.raises(NonFiniteError, match=r"float16 and AdamW's eps=1e-08 rounds to 0 .*Fix: train in bf16-mixed "
                                             r"or bf16-true.*eps=1e-4"):
        hexiscale_trainer(plan, tmp_path, precision="16-true", max_steps=3,
                          strategy_kw=plain).fit(LlamaLitModule(TINY, lr=1e-2), data)
    trainer = hexiscale_trainer(plan, tmp_path, precision="16-true", max_steps=3, strategy_kw=plain)
    trainer.fit(LlamaLitModule(TINY, lr=1e-2, eps=1e-4), data)
    losses = read_ranks(tmp_path, plan.world_size)[0]["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.parametrize("precision", ["16-mixed", 16])
def test_fp16_mixed_is_refused_on_cpu_too(precision):
    """Lightning replaces 16-mixed by bf16-mixed on CPU (a warning) before a strategy sees it; the
    strategy refuses it there as on GPUs, when the Trainer is built, with the reason and the fix."""
    with pytest.raises(ConfigError, match=r"Trainer\(precision\) = '16-mixed': float16 mixed precision needs a "
                                          r"gradient scaler.*Fix: use bf16-mixed"):
        pl.Trainer(strategy=HexiScaleStrategy(plan=PLAN, start_method="fork"), accelerator="cpu",
                   devices=PLAN.world_size, precision=precision, logger=False)


@pytest.mark.parametrize("short, full", [("32", "32-true"), (32, "32-true"), ("64", "64-true"), ("bf16", "bf16-mixed")])
def test_the_recipe_names_the_full_name_of_lightnings_short_precision_names(short, full):
    """``Trainer(precision=32)`` takes the short names; the recipe's ``trainer.precision=32`` was
    refused with 'use 32-true or bf16-mixed', whichever short name was written."""
    from lightning_hexiscale.config.recipe import precision_dtype

    with pytest.raises(ConfigError, match=rf"^trainer\.precision = '?{short}'?: must be one of .*Fix: write its full "
                                          rf"name, {full} \(Lightning reads {short} as {full}\)$"):
        precision_dtype(short)
    assert precision_dtype(full) in ("fp32", "fp64", "bf16")
    with pytest.raises(ConfigError, match=r"^trainer\.precision = '16': Lightning reads 16 as 16-mixed: float16 mixed "
                                          r"precision needs a gradient scaler"):
        precision_dtype("16")


# ---- through the recipe, against one device in float64 ----------------------------------------
RECIPE_PLAN = plan_of([(4, 2, [([0, 1], (0, 2)), ([2], (2, 4))]), (4, 2, [([3], (0, 4))])], cluster="cpu_hetero4")
STEPS, WARMUP, CLIP, LR, SEED = 3, 2, 0.5, 1e-2, 5


def _recipe_run(tmp_path: Path, precision: str) -> Path:
    out = tmp_path / precision
    out.mkdir()
    RECIPE_PLAN.save(out / "given_plan.yaml")
    args = ["cluster=cpu_hetero4", "model=llama_tiny", "model.seq_len=16", f"plan={out / 'given_plan.yaml'}",
            f"trainer.precision={precision}", "trainer.launcher=fork", f"trainer.max_steps={STEPS}",
            f"trainer.warmup_steps={WARMUP}", f"trainer.gradient_clip_val={CLIP}", f"trainer.lr={LR}",
            f"trainer.seed={SEED}", "trainer.val_every=0", "trainer.progress_bar=false", "trainer.timeout_s=60",
            "data.num_samples=40", f"hydra.run.dir={out}"]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    res = subprocess.run([sys.executable, str(TRAIN), *args], cwd=out, env=env, capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0, res.stderr[-3000:]
    assert OmegaConf.load(out / "config.yaml").trainer.precision == precision
    return out


def _initial(config):
    """The plain Llama in float64 with the recipe's initialisation (``init_weights(trainer.seed)``)."""
    from lightning_hexiscale.models.llama import Llama

    with torch.device("meta"):
        model = Llama(config)
    return model.to(torch.float64).init_weights(SEED)


def _reference(cfg_dir: Path) -> dict[str, torch.Tensor]:
    """One process, plain torch, float64: the recipe's data in the recipe's order (seeded shuffle),
    the model's own initialisation, AdamW, linear warm-up and clipping by the global norm."""
    from lightning_hexiscale.cli.train_fit import make_data

    cfg = OmegaConf.load(cfg_dir / "config.yaml")
    config = _model_config(cfg_dir)
    torch.manual_seed(SEED)  # pl.seed_everything(trainer.seed) in the recipe
    train_dl, _ = make_data(cfg, config, RECIPE_PLAN.global_batch)
    model = _initial(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=float(cfg.trainer.weight_decay))
    for step, batch in zip(range(STEPS), train_dl):
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, (step + 1) / WARMUP)
        opt.zero_grad()
        model.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recipe_in_64_true_equals_one_device_float64(tmp_path):
    out = _recipe_run(tmp_path, "64-true")
    ref = _reference(out)
    got = ckpt.load_llama_state_dict(out / "checkpoints" / "last.ckpt")
    assert set(got) == set(ref)
    assert {t.dtype for t in got.values()} == {torch.float64}
    init = _initial(_model_config(out)).state_dict()
    assert max((ref[k] - init[k]).abs().max().item() for k in ref) > 1e-3  # training moved the weights
    err = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert err < 1e-9, err


def _model_config(cfg_dir: Path):
    from lightning_hexiscale.models.config import LlamaConfig

    return LlamaConfig.from_config(OmegaConf.load(cfg_dir / "config.yaml").model)
