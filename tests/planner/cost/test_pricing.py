"""Priced as it runs: the roofline of uncalibrated CUDA compute, the FP32 rate of 32-true, ZeRO-2's
post-step all-gather, ZeRO-3's serves and post-backward reduce-scatter, the datasheet notice. Each
test fails on the planner that priced compute at FLOPs / peak and ZeRO as Appendix B eq. 5 has it
(the modules new with these terms are imported inside the tests that need them, so that the others
run, and fail, against that planner too)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload, estimate
from lightning_hexiscale.planner.cost.estimate import layer_step, layer_times

M13 = LlamaConfig.load("llama2_13b")


def one_type(gpu: str, count: int = 2, **gpu_fields) -> Cluster:
    return Cluster.from_config({"name": f"two_{gpu}", "machines": [{"gpu": gpu, "count": count, "intra_bandwidth": "400 GB/s"}],
                                "inter_machine": {"bandwidth": "10 GB/s"},
                                "gpu_types": {gpu: gpu_fields} if gpu_fields else {}})


# ---- roofline ----------------------------------------------------------------------------------------
def test_uncalibrated_cuda_layer_is_priced_by_the_roofline():
    from lightning_hexiscale.planner.cost import roofline as rf

    c, w = one_type("H100"), Workload.from_precision(M13, "bf16-mixed")
    t_f, t_b, comp_f, tp_f = layer_times(c, w, [0], 1, recompute=False)
    T = M13.seq_len
    flops = M13.layer_forward_flops(1)
    fwd_bytes = rf.layer_forward_bytes(M13, T, 1, 2, 4, True)
    want_f = flops / (989e12 * rf.DEFAULT_GEMM_EFFICIENCY) + fwd_bytes / (3.35e12 * rf.DEFAULT_HBM_EFFICIENCY)
    assert tp_f == 0.0 and t_f == pytest.approx(want_f)
    bwd_bytes = rf.layer_backward_bytes(M13, T, 1, 2, 4, True, 1.0)
    assert t_b == pytest.approx(2 * flops / (989e12 * 0.7) + bwd_bytes / (3.35e12 * 0.8))
    # FLOPs / peak (Appendix B at efficiency 1) is what the planner priced before: far below
    assert t_f > 1.4 * flops / 989e12


def test_roofline_narrows_the_h800_to_h20_ratio():
    """989 : 148 TFLOP/s is 6.7 : 1 by FLOPs alone; the H20's 4.0 TB/s against the H800's 3.35 makes
    its memory-bound work cheaper, so a layer takes well under 6.7x as long on it."""
    c, w = Cluster.load("h800_h20_16"), Workload.from_precision(M13, "bf16-mixed")
    h800 = next(d.id for d in c.devices if d.gpu_type == "H800")
    h20 = next(d.id for d in c.devices if d.gpu_type == "H20")
    ratio = sum(layer_times(c, w, [h20], 1, True)[:2]) / sum(layer_times(c, w, [h800], 1, True)[:2])
    assert 3.0 < ratio < 5.5, ratio


def test_probe_fractions_and_calibration_override_the_defaults():
    w = Workload.from_precision(M13, "bf16-mixed")
    base = layer_times(one_type("H100"), w, [0], 1, False)[0]
    slow_gemm = layer_times(one_type("H100", gemm_efficiency=0.35), w, [0], 1, False)[0]
    gemm = M13.layer_forward_flops(1) / 989e12
    assert slow_gemm - base == pytest.approx(gemm / 0.35 - gemm / 0.7)
    # a calibrated efficiency means FLOPs / (peak x efficiency), no roofline
    cal = layer_times(one_type("H100", efficiency=0.5), w, [0], 1, False)[0]
    assert cal == pytest.approx(gemm / 0.5)


def test_cpu_workloads_keep_flops_pricing():
    from lightning_hexiscale.planner.cost import compute as C

    c = Cluster.load("cpu_demo")
    w = Workload.from_precision(LlamaConfig.load("llama_demo"), "32-true", device="cpu")
    t_f = layer_times(c, w, [0], 2, False)[0]
    assert t_f == pytest.approx(w.model.layer_forward_flops(2) / 160e9)  # cpu_demo: CPU-BIG at 160 GFLOPS
    assert C.datasheet_types(c, w) == []


def test_32_true_on_uncalibrated_cuda_is_slower_than_fp32_peak():
    """An A100 does 19.5 TFLOP/s in FP32 (no TF32 in the runtime), not its 312 bf16 tensor TFLOP/s."""
    c, w = one_type("A100-80G"), Workload.from_precision(M13, "32-true")
    assert layer_times(c, w, [0], 1, False)[0] > M13.layer_forward_flops(1) / 19.5e12


def test_32_true_on_cuda_runs_at_the_fp32_rate():
    c = one_type("A100-80G", efficiency=1.0)  # calibrated at 1.0: FLOPs / rate, the rate is the question
    fp32 = Workload.from_precision(M13, "32-true")
    t_f = layer_times(c, fp32, [0], 1, False)[0]
    assert t_f == pytest.approx(M13.layer_forward_flops(1) / 19.5e12)
    tf32 = dataclasses.replace(fp32, allow_tf32=True)
    assert layer_times(c, tf32, [0], 1, False)[0] == pytest.approx(M13.layer_forward_flops(1) / 156e12)
    bf16 = Workload.from_precision(M13, "bf16-mixed")
    assert layer_times(c, bf16, [0], 1, False)[0] == pytest.approx(M13.layer_forward_flops(1) / 312e12)


def test_catalog_gpus_carry_datasheet_rates_and_bandwidth():
    from lightning_hexiscale.config.catalog import CATALOG

    for name, g in CATALOG.items():
        if name.startswith("CPU"):
            continue
        assert g.datasheet and g.efficiency is None
        assert g.fp32_flops <= g.tf32_flops < g.peak_flops and 5e11 < g.memory_bandwidth_Bps < 6e12, name


# ---- ZeRO as the runtime runs it ---------------------------------------------------------------------
THETA = (1.0, 1.0, 1.0, 1.0)


def test_zero2_all_gather_after_the_step_is_exposed():
    """Compute-bound (T_b >> T_comm): eq. 5 hid both collectives under the backward; the runtime's
    all-gather follows the optimizer step."""
    step, exposed = layer_step(1.0, 2.0, 0.1, "zero2", THETA)
    assert step == 3.0 and exposed == pytest.approx(0.1)
    assert layer_step(1.0, 2.0, 0.1, "ddp", THETA)[1] == 0.0
    # comm-bound: the reduce-scatter beyond the backward, plus the all-gather
    assert layer_step(1.0, 1.0, 3.0, "zero2", THETA)[1] == pytest.approx(2.0 + 3.0)


def test_zero3_serves_and_reduce_scatter_are_priced():
    step, exposed = layer_step(1.0, 2.0, 0.1, "zero3", THETA)
    assert step == pytest.approx(1.0 + 2.0 + 2 * 0.1) and exposed == pytest.approx(0.1)


def _two_pipelines(sharding: str) -> Plan:
    return Plan.from_dict({"num_layers": 4, "schedule": "1f1b", "recompute": False, "dp_sharding": sharding,
                           "pipelines": [{"batch_size": 8, "micro_batch_size": 2, "stages": [{"devices": [i], "layers": [0, 4]}]}
                                         for i in (0, 1)]})


def _pair() -> tuple[Cluster, Workload]:
    """Two single-A100 machines 50 GB/s apart (1 GB/s inside, where nothing talks) and a 4-layer 7B:
    the two pipelines of :func:`_two_pipelines` sync across machines."""
    model = dataclasses.replace(LlamaConfig.load("llama2_7b"), num_layers=4)
    c = Cluster.from_config({"name": "pair", "machines": [{"gpu": "A100-80G", "count": 1, "intra_bandwidth": "1 GB/s",
                                                           "repeat": 2}],
                             "inter_machine": {"bandwidth": "50 GB/s", "latency": "0us"}})
    return c, Workload(model)


def test_estimate_prices_the_zero_terms():
    """Two single-device pipelines, compute-bound (T_b > 2 T_comm, the head's sync hidden under the
    last stage's backward): ZeRO-2 costs DDP's time plus the layers' all-gathers and the head's;
    ZeRO-3 plus two serves per layer and micro-batch, the reduce-scatters and the head's sync."""
    from lightning_hexiscale.planner.cost import estimate as E

    c, w = _pair()
    est = {sh: estimate(_two_pipelines(sh), c, w) for sh in ("ddp", "zero2", "zero3")}
    assert all(e.feasible for e in est.values())
    t_b = layer_times(c, w, [0], 2, False)[1]
    tc = E.dp_terms(_two_pipelines("ddp"), c, w)[0][(0, 0)][0][1]
    t_head = E.dp_edge_all(_two_pipelines("ddp"), c, w)[(0, 0)][1]
    L, n = 4, 4
    assert t_b > 2 * tc and t_head < L * t_b  # the regime the figures below assume
    ddp, z2, z3 = (est[s].iteration_time_s for s in ("ddp", "zero2", "zero3"))
    assert z2 - ddp == pytest.approx(L * tc + t_head / 2, rel=1e-6)
    assert z3 - ddp == pytest.approx(n * L * 2 * tc + L * tc + t_head, rel=1e-6)


def test_zero3_dp_comm_counts_the_partners_uses_served():
    """A ZeRO-3 rank serves each use of its partner pipeline's micro-batches (runtime/zero3.py;
    tests/runtime/test_zero3_wire.py counts them on the wire): pipeline 0's communication time grows
    with pipeline 1's micro-batch count, by 2 T_comm per layer and extra partner micro-batch, while
    its own gathers stay (they were charged 2 n_mb of its own pipeline for the serves before)."""
    from lightning_hexiscale.planner.cost import estimate as E

    c, w = _pair()

    def plan(partner_batch: int) -> Plan:
        d = _two_pipelines("zero3").to_dict()
        d["pipelines"][1]["batch_size"] = partner_batch  # micro-batch 2: n_mb = batch / 2
        return Plan.from_dict(d)

    tc = E.dp_terms(plan(8), c, w)[0][(0, 0)][0][1]
    assert tc > 0
    row = {b: estimate(plan(b), c, w).pipelines[0].stages[0].dp_comm_s for b in (4, 8, 16)}
    L = 4
    assert row[16] - row[8] == pytest.approx(L * 2 * (8 - 4) * tc, rel=1e-9)
    assert row[8] - row[4] == pytest.approx(L * 2 * (4 - 2) * tc, rel=1e-9)


# ---- the datasheet notice ----------------------------------------------------------------------------
@pytest.fixture
def first_notice(monkeypatch):
    """``first_notice(preset, names)``: the compute module, with its once-per-process notice reset, and
    the preset's cluster and a 7B workload, after the first notice said for them (naming ``names``)."""
    from lightning_hexiscale.planner.cost import compute as C

    monkeypatch.setattr(C, "_WARNED", set())

    def said(preset: str, names: str):
        c, w = Cluster.load(preset), Workload(LlamaConfig.load("llama2_7b"))
        with pytest.warns(C.DatasheetPricingWarning, match=f"{names}: priced from datasheet"):
            C.warn_datasheet_pricing(c, w)
        return C, c, w
    return said


def test_one_warning_when_cuda_types_are_priced_from_datasheets(first_notice):
    C, c, w = first_notice("hetero2", "RTX3080Ti, RTX3090, RTX4090, A800")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert C.warn_datasheet_pricing(c, w) is None  # once per process
        # calibrated, probed or CPU: nothing to say
        assert C.datasheet_types(one_type("H100", efficiency=0.4), w) == []
        assert C.datasheet_types(one_type("H100", gemm_efficiency=0.6), w) == []
        assert C.datasheet_types(c, dataclasses.replace(w, device="cpu")) == []


def test_the_datasheet_notice_names_each_type_once_whatever_subsets_are_priced(first_notice):
    """``hexiscale plan --baselines`` prices subsets of the machines (leave-out, symmetric-best): the
    notice was said once per SET of types, four times for case_study (each subset's own types), where
    the cost-model page promises one warning. Now a type named once is not named again; a type not
    yet named still is."""
    C, c, w = first_notice("case_study", "A800, RTX4090, RTX3090")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for devices in ([0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7], [0, 1, 2, 6, 7]):  # machines left out
            assert C.warn_datasheet_pricing(c.subset(devices), w) is None
    with pytest.warns(C.DatasheetPricingWarning, match=r"^H100: priced from datasheet"):
        C.warn_datasheet_pricing(one_type("H100"), w)
