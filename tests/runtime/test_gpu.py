"""GPU-only paths: the NCCL backend choice, flash-attn, and the engine on CUDA. Skipped without CUDA.

The engine test runs in a fresh interpreter (subprocess + spawn), never in a process forked from
pytest: CUDA does not survive fork once the parent has touched the driver.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_hexiscale.models.llama import attention, flash_attn_available
from lightning_hexiscale.runtime.tensor_parallel import default_backend
from lightning_hexiscale.models.llama import sdpa_attention
from grad_step import train_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_backend_choice():
    assert default_backend("cpu") == "gloo"
    assert default_backend("cuda") == "nccl"
    assert default_backend(torch.device("cuda", 0)) == "nccl"


def test_attention_falls_back_to_sdpa_on_cpu():
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 8, 16, dtype=torch.bfloat16)
    assert torch.equal(attention(q, k, k), sdpa_attention(q, k, k))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
def test_flash_attention_matches_sdpa_with_gqa():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = attention(q, k, v)  # flash-attn path
    ref = sdpa_attention(q.float(), k.float(), v.float())
    assert torch.allclose(out.float(), ref, atol=2e-2)


_ENGINE_SCRIPT = textwrap.dedent('''
    import os, sys, datetime
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.models.llama import Llama
    from lightning_hexiscale.planner.plan import Plan
    from lightning_hexiscale.runtime.engine import PipelineEngine

    CFG = LlamaConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=96, vocab_size=256, seq_len=32)

    def batch():
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, 256, (4, 33), generator=g)
        return seq[:, :-1], seq[:, 1:]

    def worker(rank, world, port, out):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        devices = list(range(world))
        plan = Plan.from_dict({"num_layers": 2, "pipelines": [
            {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": devices, "layers": [0, 2]}]}]})
        engine = PipelineEngine(plan, CFG, seed=3, device=f"cuda:{rank}", dtype=torch.float32)
        tok, tgt = batch()
        loss = train_step(engine, tok.cuda(), tgt.cuda())
        out.put((rank, loss))
        dist.destroy_process_group()

    if __name__ == "__main__":
        world = min(torch.cuda.device_count(), 2)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, world, int(sys.argv[1]), q)) for r in range(world)]
        for p in procs: p.start()
        losses = dict(q.get(timeout=120) for _ in range(world))
        for p in procs: p.join(30)
        model = Llama(CFG).init_weights(3)
        tok, tgt = batch()
        ref = model.loss(model(tok), tgt).item()
        assert all(abs(v - ref) < 1e-4 for v in losses.values()), (losses, ref)
        print("OK", losses, ref)
''')


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_engine_on_cuda_with_nccl(tmp_path):
    """A TP plan over min(#GPUs, 2) GPUs with NCCL: loss equals the float32 CPU reference."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "engine_cuda.py"
    script.write_text(_ENGINE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
