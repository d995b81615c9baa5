"""torch.compile of the stage on CPU: no graph breaks in a TP-1 block, compiled == eager.

Kept few and tiny (inductor writes and builds C++ per graph: about 45 s of CPU for one block's
forward and backward, measured): the structural checks trace with dynamo (``explain``) or the
``aot_eager`` backend (dynamo + AOT autograd, eager kernels: what the runtime hands inductor),
and ONE test runs inductor itself on one block.

Tolerances: aot_eager runs the same aten kernels, so float32 results agree to 1e-6 (decompositions
may reorder a reduction); inductor fuses and reorders reductions: float32 to 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_path import batch, grads_of, make_stage

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import RopeCache, TransformerBlock


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


@pytest.mark.timeout(300)
def test_tp1_block_has_no_graph_breaks():
    """The block a TP-1 stage compiles whole, with every other switch on (main grads' compute
    copies, the cast-once norm, fused RMSNorm, a fixed attention kernel), under bf16 autocast as a
    GPU runs it: one graph, zero breaks."""
    stage, info, _ = make_stage(FastPath(compile=False, main_grads=True, cast_once=True, fused_norm=True,
                                         attention="sdpa"), torch.float32, mixed=True)
    assert info.main_grads and info.cast_once
    block = stage.layers["0"]
    tok, _ = batch()
    x = stage.embed(tok).requires_grad_(True)
    cos, sin = stage.rope(tok.shape[1], x.device, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(block.forward)(x, cos, sin)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding, mode", [("ddp", "blocks"), ("zero3", "regions")])
def test_compiled_stage_matches_eager_aot(sharding, mode):
    """Whole blocks (TP 1) and regions (what TP and ZeRO-3 stages compile): two accumulated
    micro-batches, recomputation on, losses and gradients equal eager to 1e-6 relative (float32)."""
    eager, _, _ = make_stage(FastPath(compile=False), torch.float32, sharding=sharding)
    comp, info, _ = make_stage(FastPath(compile=True, compile_backend="aot_eager"), torch.float32, sharding=sharding)
    assert info.compile == mode
    for s in (eager, comp):
        s.recompute = True
    le, ge = grads_of(eager)
    lc, gc = grads_of(comp)
    assert lc == pytest.approx(le, rel=1e-6)
    assert _max_rel(ge, gc) < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inductor_block_matches_eager():
    """inductor itself, on one tiny block: output and input/weight gradients within 1e-4 relative
    (float32)."""
    cfg = LlamaConfig(name="c", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=48,
                      vocab_size=64, seq_len=8)
    block = TransformerBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    cos, sin = RopeCache(cfg)(8, torch.device("cpu"), torch.float32)
    x = torch.randn(2, 8, 32, generator=gen)

    def run(fn) -> dict[str, torch.Tensor]:
        xi = x.clone().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        out = fn(xi, cos, sin)
        out.square().sum().backward()
        return {"out": out.detach(), "dx": xi.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}}

    eager = run(block.forward)
    compiled = run(torch.compile(block.forward, backend="inductor"))
    assert _max_rel(eager, compiled) < 1e-4


def test_compile_switch_defaults_off_on_cpu():
    """Auto leaves compilation off on CPU (inductor's C++ builds would dominate a CPU run), on for CUDA."""
    _, info, _ = make_stage(FastPath(), torch.float32)
    assert info.compile == "off" and "compile off" in info.describe()
    assert FastPath().resolve("cuda", mixed=True).compile
