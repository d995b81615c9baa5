"""Sharded checkpoints (torch.distributed.checkpoint) at the runtime level: memory and bytes read.

Plan A has a TP-3 stage in a 3-stage pipeline (TP 3, 1, 2) next to a one-rank replica; plan B is
one pipeline of a TP-2 and a TP-3 stage (another TP layout everywhere). A 6.7 M-parameter fp32
LLaMA with AdamW (80 MB of state) trains one step under A, saves, and resumes under B:

- every rank's peak memory (CPU: growth of the resident set, VmHWM reset through
  /proc/self/clear_refs; CUDA: ``max_memory_allocated``) during the save and during the load stays
  within its own shard bytes + ``SLACK``; a rank that materialised the full state (what a gather to
  a leader amounts to) is shown to break that bound with the same meter;
- a loading rank reads exactly the bytes of its own shards (the reader's log), although plan B cuts
  every layer differently from A: a reader of whole saved chunks (DCP's default) would read more;
- what each rank loaded equals the checkpoint read back by DCP's stock ``FileSystemReader`` (the
  files are standard DCP), and that equals what plan A held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_equivalence import make_batch, plan_of

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan
from lightning_hexiscale.profiling.check import peak_memory, reset_peak_memory
from lightning_hexiscale.runtime import checkpoint as ckpt
from lightning_hexiscale.runtime.checkpoint_io import _runs
from lightning_hexiscale.runtime.checkpoint_layout import (flat_range_boxes, own_bytes, read_model_pieces,
                                                           read_optimizer_targets, saved_optimizer_keys)
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.parallelize import param_specs
from lightning_hexiscale.torch_compat import dcp_load
from grad_step import train_step

MIB = 2**20
SLACK = 16 * MIB
"""The stated constant of the memory bound: allocator slack, DCP's plans and metadata, Python objects."""

CFG = LlamaConfig(name="ckpt_mem", hidden_size=288, num_layers=6, num_heads=6, num_kv_heads=3,
                  ffn_hidden_size=768, vocab_size=2048, seq_len=16)
PLAN_A = plan_of([(4, 2, [([0, 1, 2], (0, 2)), ([3], (2, 4)), ([4, 5], (4, 6))]), (2, 1, [([6], (0, 6))])], 6)
PLAN_B = plan_of([(6, 2, [([0, 1], (0, 3)), ([2, 3, 4], (3, 6))])], 6)
PLAN_B2 = plan_of([(4, 2, [([0, 1], (0, 3)), ([2, 3, 4], (3, 6))]), (2, 1, [([5], (0, 6))])], 6)  # ZeRO: 2 pipelines


def _device() -> torch.device:
    return torch.device("cpu")  # gloo ranks; on CUDA the same meter reads max_memory_allocated


def _fresh_pages_for_tensors() -> None:
    """glibc: serve allocations >= 64 KiB by a fresh mmap. Otherwise a forked rank reuses heap
    memory its parent freed, whose pages are already resident (shared after the fork): a write
    there copies the page without growing the resident set, and the meter would miss it (the
    control allocation below showed 0.1 MiB for 80 MB once, in a long pytest process). Free heap
    chunks inherited from the parent are released by ``reset_peak_memory`` (``malloc_trim``)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: the control below still checks the meter
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _engine(plan_dict: dict, sharding: str):
    plan = dataclasses.replace(Plan.from_dict(plan_dict), dp_sharding=sharding)
    engine = PipelineEngine(plan, CFG, seed=0, device=_device())
    opt = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    return plan, engine, getattr(opt, "user", opt), opt


def _save_worker(rank: int, world: int, plan_dict: dict, sharding: str, path: str) -> dict:
    _fresh_pages_for_tensors()
    plan, engine, user, opt = _engine(plan_dict, sharding)
    tokens, targets = make_batch(CFG, plan.global_batch, 0)
    train_step(engine, tokens, targets)
    opt.step()
    ckpt.save(f"{path}/warm", engine, user)  # one-time lazy initialisation of DCP's code paths
    own = own_bytes(engine, user)
    base = reset_peak_memory(_device())
    ckpt.save(f"{path}/ckpt", engine, user, lightning_state={"global_step": 1})
    grown = peak_memory(_device()) - base
    control = None
    if rank == 0:  # the meter sees a full copy of the state, and the bound excludes it
        full = sum(math.prod(s.shape) for s in param_specs(CFG)) * 4 * 3  # fp32 params + exp_avg + exp_avg_sq
        base = reset_peak_memory(_device())
        buf = torch.ones(full // 4)
        control = (full, peak_memory(_device()) - base)
        del buf
    return {"own": own, "grown": grown, "control": control}


def _load_worker(rank: int, world: int, plan_dict: dict, sharding: str, path: str) -> dict:
    _fresh_pages_for_tensors()
    plan, engine, user, _opt = _engine(plan_dict, sharding)
    ckpt.load_model(f"{path}/warm", engine)  # lazy initialisation (parameters only: the optimizer stays fresh)
    base = reset_peak_memory(_device())
    model_reader = ckpt.load_model(f"{path}/ckpt", engine)
    optim_reader = ckpt.load_optimizer(f"{path}/ckpt", engine, user)
    grown = peak_memory(_device()) - base
    # What this rank needed: its read pieces (recomputed after the measurement).
    tensors = {fqn: (tuple(md.size), md.properties.dtype)
               for fqn, md in optim_reader.read_metadata().state_dict_metadata.items()}
    names = [n for n, _ in engine.stage.named_parameters()]
    optim = read_optimizer_targets(engine, user, saved_optimizer_keys(tensors, names))
    pieces = read_model_pieces(engine) + optim.pieces
    log = [(f, o, n) for f, o, n, kind in model_reader.log + optim_reader.log if kind == "data"]
    index_reads = sum(n for _f, _o, n, kind in model_reader.log + optim_reader.log if kind == "index")
    state = {}
    if engine.zero is None:
        params = dict(engine.stage.named_parameters())
        state = {n: {k: v.clone() for k, v in user.state[p].items()} for n, p in params.items()}
    return {"own": own_bytes(engine, user), "grown": grown, "needed": sum(p.nbytes for p in pieces),
            "boxes": [(p.fqn, p.offsets, tuple(p.tensor.shape)) for p in pieces], "log": log,
            "index_reads": index_reads, "shards": engine.local_shards(), "optim": state}


def _stock_full(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Full tensors ``<prefix>.<name>`` read with DCP's own FileSystemReader and default planner."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {fqn: torch.empty(m.size, dtype=m.properties.dtype) for fqn, m in md.items()
             if fqn.startswith(prefix + ".")}
    dcp_load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return {fqn[len(prefix) + 1:]: t for fqn, t in state.items()}


def _saved_chunks(path: str) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]]:
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {fqn: [(tuple(c.offsets), tuple(c.sizes), m.properties.dtype.itemsize) for c in m.chunks]
            for fqn, m in md.items()}


def _overlaps(a_off, a_size, b_off, b_size) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("save_as,resume_as,plan_b", [("ddp", "ddp", PLAN_B), ("zero2", "zero3", PLAN_B2)],
                         ids=["ddp", "zero2->zero3"])
def test_memory_and_bytes_read_are_the_ranks_own(run_ranks, tmp_path, save_as, resume_as, plan_b):
    saved = run_ranks(PLAN_A.world_size, _save_worker, PLAN_A.to_dict(), save_as, str(tmp_path), timeout=200)
    for rank, r in enumerate(saved):
        assert r["grown"] <= r["own"] + SLACK, (
            f"save: rank {rank} grew by {r['grown'] / MIB:.1f} MiB > own {r['own'] / MIB:.1f} MiB + slack")
    full, seen = saved[0]["control"]
    assert seen >= 0.9 * full  # the meter sees a full-state allocation...
    assert all(full > r["own"] + SLACK for r in saved[:6])  # ...which breaks every pipeline-0 rank's bound

    loaded = run_ranks(plan_b.world_size, _load_worker, plan_b.to_dict(), resume_as, str(tmp_path), timeout=200)
    path = str(tmp_path / "ckpt")
    chunks = _saved_chunks(path)
    whole_chunk_reader = []
    for rank, r in enumerate(loaded):
        assert r["grown"] <= r["own"] + SLACK, (
            f"load: rank {rank} grew by {r['grown'] / MIB:.1f} MiB > own {r['own'] / MIB:.1f} MiB + slack")
        # Exactly its own bytes, each byte once: the reads are disjoint and add up to the pieces.
        assert sum(n for _f, _o, n in r["log"]) == r["needed"], f"rank {rank} read other ranks' bytes"
        spans = sorted(r["log"])
        for (f1, o1, n1), (f2, o2, _n2) in zip(spans, spans[1:]):
            assert f1 != f2 or o1 + n1 <= o2, f"rank {rank} read {f1}@{o2} twice"
        assert r["index_reads"] <= 2048 * sum(len(c) for c in chunks.values())
        whole_chunk_reader.append(sum(math.prod(c_size) * item for fqn, off, size in r["boxes"]
                                      for c_off, c_size, item in chunks[fqn] if _overlaps(off, size, c_off, c_size)))
    # Plan B cuts the layers elsewhere: reading whole saved chunks (DCP's default reader) would
    # read bytes that belong to other ranks, so the check above can fail.
    assert any(w > r["needed"] for w, r in zip(whole_chunk_reader, loaded))

    model = _stock_full(path, "model")
    for rank, r in enumerate(loaded):
        for name, (t, dim, start, end) in r["shards"].items():
            want = model[name] if dim is None else model[name].narrow(dim, start, end - start)
            assert torch.equal(t, want), f"rank {rank}: {name}"
    if resume_as == "ddp":
        for key in ("exp_avg", "exp_avg_sq"):
            full = _stock_full(path, f"optim.{key}")
            for rank, r in enumerate(loaded):
                for name, (_t, dim, start, end) in r["shards"].items():
                    want = full[name] if dim is None else full[name].narrow(dim, start, end - start)
                    assert torch.equal(r["optim"][name][key], want), f"rank {rank}: {key} of {name}"


# ---- the box arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 6), (5, 1)])
def test_flat_range_boxes_tile_the_range(shape):
    n = math.prod(shape)
    flat = torch.arange(n).view(shape)
    for start, end in itertools.combinations(range(n + 1), 2):
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= 2 * len(shape) - 1
        got = []
        for off, size, first in boxes:
            box = flat[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
            assert box[0].item() == first and torch.equal(box, torch.arange(first, first + box.numel()))
            got += box.tolist()
        assert got == list(range(start, end)), (shape, start, end)


def test_runs_of_a_sub_box_are_its_row_major_bytes():
    saved = (4, 5, 6)
    flat = torch.arange(math.prod(saved)).view(saved)
    for offs in itertools.product(range(2), range(3), range(4)):
        for lengths in [(2, 2, 2), (1, 5 - offs[1], 6 - offs[2]), (2, 2, 6 - offs[2])]:
            run, starts = _runs(saved, offs, lengths)
            got = torch.cat([torch.arange(s, s + run) for s in starts])
            want = flat[tuple(slice(o, o + n) for o, n in zip(offs, lengths))].reshape(-1)
            assert torch.equal(got, want)


# ---- conversion out of the sharded format ---------------------------------------------------------
def _tiny_save_worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig, path: str) -> dict:
    plan = Plan.from_dict(plan_dict)
    engine = PipelineEngine(plan, config, seed=5, dtype=torch.float64)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    tokens, targets = make_batch(config, plan.global_batch, 0)
    train_step(engine, tokens, targets)
    opt.step()
    ckpt.save(path, engine, opt, lightning_state={"global_step": 1, "epoch": 0})
    return engine.local_shards()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_consolidate_command_writes_the_plain_models_state_dict(run_ranks, tmp_path, tiny_mha, capsys):
    from lightning_hexiscale.cli.main import main
    from lightning_hexiscale.models.llama import Llama
    from lightning_hexiscale.runtime.parallelize import assemble_full_state_dict

    plan = plan_of([(2, 1, [([0, 1, 2], (0, 4))]), (1, 1, [([3], (0, 2)), ([4], (2, 4))])], 4)
    shards = run_ranks(plan.world_size, _tiny_save_worker, plan.to_dict(), tiny_mha, str(tmp_path / "ck"))
    want = assemble_full_state_dict(shards, tiny_mha)  # independent of the checkpoint code
    out = tmp_path / "llama.pt"
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)
    Llama(tiny_mha).to(torch.float64).load_state_dict(state)  # loads as is into the plain model
    assert main(["checkpoint", "info", str(tmp_path / "ck")]) == 0
    printed = capsys.readouterr().out
    assert "step         1" in printed and "torch.optim.sgd.SGD" in printed and "5 ranks, 2 pipeline(s)" in printed
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out)]) == 2  # exists, no --force
    assert main(["checkpoint", "consolidate", str(tmp_path / "nowhere"), str(tmp_path / "x.pt")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def _foreign_optimizer_worker(rank: int, world: int, plan_dict: dict, config: LlamaConfig, path: str) -> str:
    from lightning_hexiscale.errors import ConfigError

    engine = PipelineEngine(Plan.from_dict(plan_dict), config, seed=0)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([*engine.parameters(), extra], lr=1e-3)
    try:
        ckpt.save(path, engine, opt)
    except ConfigError as e:
        return str(e)
    return "saved"


@pytest.mark.slow
def test_optimizer_over_foreign_tensors_is_refused(run_ranks, tmp_path, tiny_gqa):
    plan = plan_of([(1, 1, [([0], (0, 4))])], 4)
    (msg,) = run_ranks(1, _foreign_optimizer_worker, plan.to_dict(), tiny_gqa, str(tmp_path / "ck"))
    assert msg.startswith("configure_optimizers = ") and "Fix: optimise self.parameters()" in msg


def test_saved_optimizer_keys_split_key_and_name():
    names = ["layers.1.attn.q_proj.weight", "layers.11.attn.q_proj.weight", "norm.weight"]
    f32 = torch.float32
    tensors = {"optim.exp_avg.layers.11.attn.q_proj.weight": ((4, 4), f32), "optim.step.norm.weight": ((), f32),
               "optim_py.my.key.layers.1.attn.q_proj.weight": ((), torch.int64), "model.norm.weight": ((4,), f32),
               "optim.exp_avg.layers.2.mlp_norm.weight": ((4,), f32)}
    got = saved_optimizer_keys(tensors, names)
    assert got == {"layers.1.attn.q_proj.weight": {"my.key": (True, (), torch.int64)},
                   "layers.11.attn.q_proj.weight": {"exp_avg": (False, (4, 4), f32)},
                   "norm.weight": {"step": (False, (), f32)}}


def _reused_heap_worker(rank: int, world: int, nbytes: int) -> float:
    base = reset_peak_memory(_device())
    buf = torch.ones(nbytes // 4)
    grown = peak_memory(_device()) - base
    del buf
    return grown


@pytest.mark.slow
def test_meter_sees_allocations_served_from_an_inherited_free_heap(run_ranks):
    """The failure the meter once had in a long pytest process, forced: the parent leaves 256 MB of
    freed, still-resident heap (no trim, no mmap); a forked rank's 64 MB allocation reuses it.
    Without malloc_trim in reset_peak_memory the meter read ~4 MB of growth here."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: freed heap stays resident
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 1 MB chunks come from the heap
    try:
        chunks = [torch.ones(2**18) for _ in range(256)]  # 256 x 1 MiB
        del chunks
        nbytes = 64 * MIB
        grown = run_ranks(1, _reused_heap_worker, nbytes)[0]
    finally:
        libc.mallopt(-1, 128 * 1024)  # glibc's defaults back (the dynamic thresholds restart from them)
        libc.mallopt(-3, 128 * 1024)
        libc.malloc_trim(0)
    assert grown >= 0.9 * nbytes
