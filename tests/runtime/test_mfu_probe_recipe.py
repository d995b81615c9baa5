"""recipes/mfu_probe.py: its CPU smoke mode runs every section end to end and writes the JSON a GPU
run writes (the GPU figures themselves need a GPU); its kernel classifier and MFU arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))
import mfu_probe  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_smoke_writes_every_section(tmp_path):
    out = tmp_path / "probe.json"
    p = subprocess.run([sys.executable, str(RECIPES / "mfu_probe.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=390)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and r["environment"]["torch"] and "clocks_before" in r["environment"]
    assert r["hbm_gbps"] > 0
    for shape in ("check", "llama3_8b_2layers"):
        assert len(r["gemm"][shape]) == 7 * 3 and all(g["tflops"] > 0 for g in r["gemm"][shape])
        stage = r["stage"][shape]
        assert {"eager/sdpa", "eager/sdpa_math", "compiled/auto", "compiled/sdpa"} <= set(stage)
        assert all(v["status"] == "ok" and v["mfu"] > 0 for v in stage.values())
        assert stage["compiled/auto"]["compile"] == "blocks" and stage["eager/sdpa"]["compile"] == "off"
        assert sum(r["profile"][shape].values()) > 0 and r["profile"][shape]["gemm"] > 0
        eng = r["engine"][shape]
        assert eng["mfu"] > 0 and eng["fused_adamw"] and "main grads" in eng["fast_path"]
        assert eng["estimate_bytes"] > 0
    assert [v["result"] for v in r["verdicts"]] == ["n/a"] * 4  # targets are for a GPU
    assert "target llama3_8b_2layers engine step" in p.stdout


def test_kernel_classes():
    c = mfu_probe.classify
    assert c("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas") == "gemm"
    assert c("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert c("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>") == "attention"
    assert c("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1") == "attention"
    assert c("triton_red_fused__to_copy_mean_pow_rsqrt_0") == "reduction"
    assert c("triton_poi_fused__to_copy_mul_silu_1") == "elementwise"
    assert c("void at::native::elementwise_kernel<128, 2, gpu_kernel_impl_nocast<direct_copy_kernel_cuda>>") == "copy"
    assert c("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>") == "elementwise"
    assert c("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float>>>") == "reduction"
    assert c("Memcpy DtoD (Device -> Device)") == "copy"
    assert c("some_unknown_kernel") == "other"


def test_causal_flops():
    """2 B S P_matmul + 2 B S^2 H per layer forward: Appendix B's count less half the attention scores."""
    cfg = mfu_probe.shapes(smoke=False)[1].config
    full = cfg.layer_forward_flops(1)
    assert mfu_probe.layer_flops_causal(cfg, 1) == pytest.approx(full - 2.0 * cfg.seq_len ** 2 * cfg.hidden_size)
    assert cfg.hidden_size == 4096 and cfg.ffn_hidden_size == 14336 and (cfg.num_heads, cfg.num_kv_heads) == (32, 8)
    assert cfg.seq_len == 8192 and cfg.num_layers == 2
