"""Unit tests of every Appendix B term, and of their composition into an Estimate."""

import dataclasses
import json

import numpy as np
import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost.wire import local_matrix_params
from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate

L13 = LlamaConfig.load("llama2_13b")


def links(bw, lat=0.0, n=2):
    b = np.full((n, n), float(bw))
    a = np.full((n, n), float(lat))
    np.fill_diagonal(b, np.inf)
    np.fill_diagonal(a, 0.0)
    return b, a


# ---- §3.1 case-study figures -----------------------------------------------------------------
def test_case_study_tp_over_ethernet_is_1_88_s_per_layer():
    """Plan 2 of §3.1: TP 2 across the 1 GB/s Ethernet, Llama-2 13B, batch 24 -> 1.88 s per layer."""
    c = Cluster.load("case_study")
    msg = 24 * L13.seq_len * L13.hidden_size * 2  # B * S * H * B_type
    t = cm.comm_tp([0, 3], msg, c.bandwidth, c.latency)  # an A800 and a 4090, different machines
    assert round(t, 2) == 1.88


def test_case_study_tp_over_nvlink_is_0_01_s_per_layer():
    c = Cluster.load("case_study")
    msg = 24 * L13.seq_len * L13.hidden_size * 2
    assert round(cm.comm_tp([0, 1], msg, c.bandwidth, c.latency), 2) == 0.01


# ---- individual terms ---------------------------------------------------------------------------
def test_comm_tp_formula():
    bw, lat = links(1e9, 1e-5, n=4)
    assert cm.comm_tp([0], 1e6, bw, lat) == 0.0
    # 4 * (t-1) * (alpha + M / (t * beta)) for a uniform group of t = 4
    assert cm.comm_tp([0, 1, 2, 3], 1e6, bw, lat) == pytest.approx(4 * 3 * (1e-5 + 1e6 / (4 * 1e9)))
    bw[0, 3] = bw[3, 0] = 1e8  # one slow link: the max over devices picks an endpoint of it
    slow = 4 * (2 * (1e-5 + 1e6 / 4e9) + (1e-5 + 1e6 / 4e8))
    assert cm.comm_tp([0, 1, 2, 3], 1e6, bw, lat) == pytest.approx(slow)


def test_comp_terms():
    flops = L13.layer_forward_flops(2)
    f = cm.comp_layer_fwd(flops, 1 / 4, 312e12)
    assert f == pytest.approx(flops / (4 * 312e12))
    assert cm.comp_layer_bwd(f) == pytest.approx(2 * f)
    assert cm.layer_time_fwd(f, 0.5) == pytest.approx(f + 0.5)
    assert cm.layer_time_bwd(f, 0.5, recompute=False) == pytest.approx(2 * f + 0.5)
    # recomputation re-runs the forward and 1 of its 2 TP all-reduces (torch's checkpoint stops early)
    assert cm.layer_time_bwd(f, 0.5, recompute=True) == pytest.approx(3 * f + 0.75)


def test_comm_dp_reduces_to_paper_formula_with_tp1():
    bw, lat = links(2e9, 1e-5, n=3)
    layer_bytes = 12 * 5120**2 * 2
    partners = [(0, 1, 1.0), (0, 2, 1.0)]
    expect = 2 * (1e-5 + layer_bytes / (3 * 2e9))
    assert cm.comm_dp(partners, layer_bytes, 3, bw, lat) == pytest.approx(expect)
    assert cm.comm_dp([], layer_bytes, 1, bw, lat) == 0.0
    # a TP-2 partner holds half of what we exchange with each of its two ranks
    half = [(0, 1, 0.5), (0, 2, 0.5)]
    assert cm.comm_dp(half, layer_bytes, 2, bw, lat) == pytest.approx(2e-5 + layer_bytes / (2 * 2e9))


def test_comm_dp_is_paced_by_the_slowest_link():
    """A ring all-reduce moves M/N through every link at each of its N-1 steps: two devices on each
    of two machines (fast 100 GB/s inside, 1 GB/s between) pay 2 * 3/4 * M / 1 GB/s for the
    all-reduce, 1.5x the per-link sum of eq. 4 as written (M/4 * (1/100 + 2/1) GB/s^-1 per phase)."""
    bw = np.array([[np.inf, 100e9, 1e9, 1e9], [100e9, np.inf, 1e9, 1e9],
                   [1e9, 1e9, np.inf, 100e9], [1e9, 1e9, 100e9, np.inf]])
    lat = np.zeros((4, 4))
    m = 1e9
    partners = [(0, 1, 1.0), (0, 2, 1.0), (0, 3, 1.0)]
    ring = cm.comm_dp(partners, m, 4, bw, lat)
    assert 2 * ring == pytest.approx(2 * 3 / 4 * m / 1e9)
    per_link = m / 4 * (1 / 100e9 + 2 / 1e9)
    assert ring / per_link == pytest.approx(1.5, rel=1e-2)
    # latencies still add up per partner; a DP group inside one machine is not slowed by the other
    lat = np.full((4, 4), 1e-3)
    assert cm.comm_dp(partners, m, 4, bw, lat) == pytest.approx(3e-3 + 3 / 4 * m / 1e9)
    assert cm.comm_dp([(2, 3, 1.0)], m, 2, bw, lat) == pytest.approx(1e-3 + m / (2 * 100e9))


@pytest.mark.parametrize("sharding,expect", [
    ("ddp", 4 * 1.0 + 3 * 2.0 + 1.1 * max(2.0, 2 * 1.5)),
    ("zero2", 4 * 1.0 + 3 * 2.0 + 1.2 * max(2.0, 2 * 1.5)),
    ("zero3", 4 * 1.3 * max(1.0, 1.5) + 3 * 1.4 * max(2.0, 1.5) + 1.4 * max(2.0, 3.0)),
])
def test_dp_overhead_layer(sharding, expect):
    got = cm.dp_overhead_layer(4, 1.0, 2.0, 1.5, sharding, theta=(1.1, 1.2, 1.3, 1.4))
    assert got == pytest.approx(expect)


def test_dp_overhead_hides_comm_behind_backward():
    # T_comm small: the last backward hides the all-reduce, overhead = n_mb * (T_f + T_b)
    assert cm.dp_overhead_layer(3, 1.0, 2.0, 0.1, "ddp") == pytest.approx(9.0)
    with pytest.raises(ValueError):
        cm.dp_overhead_layer(3, 1.0, 2.0, 0.1, "zero9")


def test_comm_pp_hop():
    bw, lat = links(1e9, 1e-5, n=4)
    m = 4e6
    assert cm.comm_pp_hop([0], [1], m, bw, lat) == pytest.approx(2 * (1e-5 + m / 1e9))
    # receiving TP group of 3: leader receives, then broadcasts M/3 to each of the other two
    expect = 2 * ((1e-5 + m / 1e9) + 2 * (1e-5 + m / (3 * 1e9)))
    assert cm.comm_pp_hop([0], [1, 2, 3], m, bw, lat) == pytest.approx(expect)
    bw[0, 1] = bw[1, 0] = 1e8  # the min over pairs avoids a slow pair; fixed leaders do not
    assert cm.comm_pp_hop([0], [1, 2, 3], m, bw, lat) == pytest.approx(expect)
    assert cm.comm_pp_hop([0], [1, 2, 3], m, bw, lat, leaders=(0, 1)) > expect


def test_pipeline_and_total_time():
    assert cm.pipeline_time([1.0, 2.0, 3.0], [0.5, 0.5, 0.0], 4) == pytest.approx(7.0 + 3 * 3.0)
    assert cm.pipeline_time([2.0], [0.0], 1) == 2.0
    assert cm.total_time([3.0, 5.0, 4.0]) == 5.0


def test_hop_charges_split_each_link_between_its_neighbours_under_1f1b():
    hops = [0.4, 0.2, 0.0]  # Hop_0 (stage 0 -> 1), Hop_1 (1 -> 2), none after the last stage
    assert cm.hop_charges(hops, "gpipe") == [0.4, 0.2, 0.0]  # Appendix B: the sender pays both directions
    assert cm.hop_charges(hops, "1f1b") == pytest.approx([0.2, 0.3, 0.1])  # (Hop_{j-1} + Hop_j) / 2
    for schedule in ("gpipe", "1f1b"):  # the fill (sum) is the same: every hop crossed both ways once
        assert sum(cm.hop_charges(hops, schedule)) == pytest.approx(sum(hops))
    assert cm.hop_charges([0.0], "1f1b") == [0.0]
    # arrays along an axis give the same charges, and pipelines laid end to end stay apart
    two = np.array([[0.4, 0.2, 0.0], [0.8, 0.0, 0.0]])  # (pipelines, stages)
    assert cm.hop_charges(two, "1f1b", axis=1) == pytest.approx(np.array([[0.2, 0.3, 0.1], [0.4, 0.4, 0.0]]))
    assert cm.hop_charges(two.ravel(), "1f1b") == pytest.approx(np.array([0.2, 0.3, 0.1, 0.4, 0.4, 0.0]))
    assert cm.hop_charges(two, "gpipe", axis=1) == pytest.approx(two)
    # a fast first stage that sends to a slow one: 1F1B's pace no longer charges it both directions
    stage = [1.0, 0.5]
    fused = cm.pipeline_time(stage, cm.hop_charges([0.2, 0.0], "1f1b"), 5)
    assert fused == pytest.approx(1.7 + 4 * 1.1)
    assert cm.pipeline_time(stage, cm.hop_charges([0.2, 0.0], "gpipe"), 5) == pytest.approx(1.7 + 4 * 1.2)


def test_memory_terms():
    assert cm.mem_layer_paper(1024, 2, 1, 8, 2) == pytest.approx(48 * 1024**2 * 2 / 2 + 8 * 1024 * 2)
    assert cm.state_bytes_per_param("ddp", 4, 2, 12) == 16
    assert cm.state_bytes_per_param("zero2", 4, 2, 12) == pytest.approx(2 + 14 / 4)
    assert cm.state_bytes_per_param("zero3", 4, 2, 12) == pytest.approx(4)
    assert cm.inflight_micro_batches("1f1b", 4, 0, 8) == 4
    assert cm.inflight_micro_batches("1f1b", 4, 3, 8) == 1
    assert cm.inflight_micro_batches("1f1b", 4, 0, 2) == 2
    assert cm.inflight_micro_batches("gpipe", 4, 3, 8) == 8
    assert cm.activation_bytes_layer(1, 10, 8, 1, 2) == pytest.approx(10 * 8 * 17 * 2)


# ---- composition ---------------------------------------------------------------------------------
def at_peak(c: Cluster) -> Cluster:
    """Appendix B's arithmetic: compute at FLOPs / datasheet peak (efficiency 1.0 set, so the
    uncalibrated roofline of planner/cost/compute.py does not apply)."""
    from lightning_hexiscale.profiling.calibrate import with_calibration

    return with_calibration(c, {d.gpu_type: 1.0 for d in c.devices})


def single_device_plan(layers: int, batch: int, mb: int) -> Plan:
    return Plan((Pipeline(batch, mb, (Stage((0,), (0, layers)),)),), layers, recompute=False)


def test_estimate_single_device_by_hand():
    model = dataclasses.replace(LlamaConfig.load("llama2_7b"), num_layers=8)  # fits one A800
    c = at_peak(Cluster.load("homo_a800_2x8_eth").subset([0]))
    plan = single_device_plan(model.num_layers, 4, 1)
    est = estimate(plan, c, Workload(model))
    c_d = 312e12
    per_mb = model.num_layers * 3 * model.layer_forward_flops(1) / c_d + 3 * model.head_forward_flops(1) / c_d
    assert est.iteration_time_s == pytest.approx(4 * per_mb)
    assert est.pflops == pytest.approx(model.model_flops_per_iteration(4) / est.iteration_time_s / 1e15)
    assert est.tokens_per_s == pytest.approx(4 * model.seq_len / est.iteration_time_s)
    assert est.feasible and est.cost == est.iteration_time_s


def test_estimate_pure_dp_comm():
    model = LlamaConfig.load("llama_tiny")
    c = Cluster.load("cpu2")
    plan = Plan((Pipeline(2, 1, (Stage((0,), (0, 4)),)), Pipeline(2, 1, (Stage((1,), (0, 4)),))), 4)
    est = estimate(plan, c, Workload(model))
    def t_comm(params):  # one reduce-scatter or all-gather of `params` bf16 elements over 2 pipelines
        return c.latency[0, 1] + params * 2 / (2 * c.bandwidth[0, 1])

    # the 4 layers, the embedding and the final norm + LM head, each all-reduced (2 x T_comm)
    expect = 4 * 2 * t_comm(model.layer_params) + 2 * t_comm(model.embedding_params) + 2 * t_comm(model.head_params)
    assert est.pipelines[0].stages[0].dp_comm_s == pytest.approx(expect)


def test_faster_network_never_slower():
    model = LlamaConfig.load("llama2_7b")
    plan = Plan((Pipeline(8, 1, (Stage((0,), (0, 16)), Stage((8,), (16, 32)))),
                 Pipeline(8, 1, (Stage((1,), (0, 16)), Stage((9,), (16, 32))))), 32, dp_sharding="zero2")
    slow = Cluster.load("homo_a800_2x8_eth")
    fast = Cluster.load("homo_a800_2x8_rdma")
    assert estimate(plan, fast, Workload(model)).iteration_time_s < estimate(plan, slow, Workload(model)).iteration_time_s


def test_out_of_memory_names_device_and_shortfall():
    model = LlamaConfig.load("llama2_70b")
    c = Cluster.load("case_study").subset([3])  # one 24 GiB RTX 4090
    est = estimate(single_device_plan(80, 1, 1), c, Workload(model))
    assert not est.feasible and est.cost == float("inf")
    oom = est.out_of_memory[0]
    assert oom.device == 0 and oom.gpu_type == "RTX4090" and oom.needed_bytes > 1e12
    assert "short by" in str(oom) and "RTX4090" in est.summary()


def test_zero_sharding_lowers_memory():
    model = LlamaConfig.load("llama2_13b")
    c = Cluster.load("case_study")
    base = Plan.load("conf/plans/case_study_llama2_13b.yaml")
    mem = {s: estimate(dataclasses.replace(base, dp_sharding=s), c, Workload(model)).pipelines[1].stages[0].peak_memory_bytes
           for s in ("ddp", "zero2", "zero3")}
    # ZeRO shards the optimizer states; the runtime keeps the local gradient whole until the
    # reduce-scatter, so ZeRO-2 and ZeRO-3 end up close to each other (cost_model.runtime_state_bytes_per_param)
    assert mem["ddp"] > 1.5 * mem["zero2"] and mem["ddp"] > 1.5 * mem["zero3"]


def test_recompute_trades_time_for_memory():
    model = LlamaConfig.load("llama2_7b")
    c = Cluster.load("homo_a800_2x8_rdma")
    on = Plan((Pipeline(8, 1, (Stage((0,), (0, 16)), Stage((1,), (16, 32)))),), 32, recompute=True)
    off = dataclasses.replace(on, recompute=False)
    e_on, e_off = estimate(on, c, Workload(model)), estimate(off, c, Workload(model))
    assert e_on.iteration_time_s > e_off.iteration_time_s
    assert e_on.pipelines[0].stages[0].peak_memory_bytes < e_off.pipelines[0].stages[0].peak_memory_bytes


def test_tab7_estimate_is_in_the_papers_range():
    """Paper (Tab. 11): HexiScale reaches 2.54 PFLOPS on hetero3 with Llama-30B; the estimate of its
    Tab. 7 plan is 2.56 (the embedding and LM-head gradients crossing the 5.6 Gbps links
    included). Memory, with Appendix B's 16-bit parameters and gradients and K = 12 (``Workload``'s
    defaults): the plan's 8-stage pipeline keeps 8 micro-batches in flight on its first stage (RTX
    4090s, 18 layers at TP 4); with this runtime's ZeRO-2 (the local gradient stays whole until the
    reduce-scatter) it needs more than its 24 GiB, and only it. Under the runtime's bf16-mixed
    (float32 parameters and gradients, bf16 weight casts per micro-batch) every RTX 4090 stage is out
    of memory; under bf16-true (16-bit parameters, gradients and AdamW states) the plan fits."""
    plan, c = Plan.load("conf/plans/hetero3_llama30b_tab7.yaml"), at_peak(Cluster.load("hetero3"))
    model = LlamaConfig.load("llama_30b")
    est = estimate(plan, c, Workload(model))
    # 2.56 when every stage paid both directions of its outgoing hop; under 1F1B's fused exchanges
    # (cost_model.hop_charges) a stage pays half of each adjacent hop, so the last stages of pipelines
    # 1-2 (A800s behind a 5.6 Gbps link) take half of that hop and become the bottleneck
    assert 1.5 < est.pflops < 3.5 and round(est.pflops, 2) == 2.47
    times = [p.time_s for p in est.pipelines]
    assert max(times) / min(times) < 1.3  # the paper's batches balance the pipelines
    assert {o.device for o in est.out_of_memory} == set(plan.pipelines[3].stages[0].devices)
    rtx4090 = {d for d in range(c.num_devices) if c.devices[d].gpu_type == "RTX4090"}
    mixed = estimate(plan, c, Workload.from_precision(model, "bf16-mixed"))
    assert {o.device for o in mixed.out_of_memory} == rtx4090
    assert estimate(plan, c, Workload.from_precision(model, "bf16-true")).feasible
    # what it lacks is no more than the unsharded gradient (B * (1 - 1/N_dp) per local parameter)
    short = max(o.needed_bytes - o.available_bytes for o in est.out_of_memory)
    local = 18 * model.layer_params / 4 + model.embedding_params
    assert short < local * 2 * (1 - 1 / 4)


def test_case_study_asymmetric_plan_beats_megatron_plan():
    """§3.1: HexiScale's plan is ~1.6x faster than Megatron's plan 3 (25.55 s vs 41.52 s)."""
    c, w = Cluster.load("case_study"), Workload(L13)
    hexi = estimate(Plan.load("conf/plans/case_study_llama2_13b.yaml"), c, w)
    mega = estimate(Plan.load("conf/plans/case_study_llama2_13b_megatron.yaml"), c, w)
    assert hexi.feasible and not mega.feasible  # the paper's case study ignores memory
    assert 1.3 < mega.iteration_time_s / hexi.iteration_time_s < 2.0


def test_estimate_json_document():
    est = estimate(Plan.load("conf/plans/case_study_llama2_13b.yaml"), Cluster.load("case_study"), Workload(L13))
    doc = json.loads(json.dumps(est.to_dict()))
    for key in ("feasible", "iteration_time_s", "tokens_per_s", "pflops", "pipelines"):
        assert key in doc
    p = doc["pipelines"][1]
    assert {"time_s", "batch", "micro_batch", "stages"} <= set(p)
    s = p["stages"][0]
    assert {"devices", "tp", "layers", "compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "peak_memory_bytes"} <= set(s)
    assert s["layers"] == [0, 17]


# ---- wire dtypes and paths (planner/cost/wire.py; the runtime side is tests/runtime/test_wire_bytes.py) ----
def test_reduce_dtype_is_priced():
    """fp32 gradient reduction under a bf16 workload: twice the DP bytes, more DP time; activations
    and TP traffic unchanged."""
    from lightning_hexiscale.planner.cost.wire import wire_bytes

    model = LlamaConfig.load("llama2_7b")
    plan = Plan((Pipeline(8, 1, (Stage((0, 1), (0, 16)), Stage((8,), (16, 32)))),
                 Pipeline(8, 1, (Stage((2,), (0, 16)), Stage((9,), (16, 32))))), 32, dp_sharding="ddp")
    fp32 = dataclasses.replace(plan, reduce_dtype="fp32")
    c = Cluster.load("homo_a800_2x8_eth")
    assert estimate(fp32, c, Workload(model)).pipelines[0].stages[0].dp_comm_s > \
        estimate(plan, c, Workload(model)).pipelines[0].stages[0].dp_comm_s
    a, b = wire_bytes(plan, model, 2), wire_bytes(fp32, model, 2, 4)
    for d in plan.device_order:
        assert b[d]["dp"] == pytest.approx(2 * a[d]["dp"]) and b[d]["pp"] == a[d]["pp"] and b[d]["tp"] == a[d]["tp"]
    # the TP-2 stage's leader also holds the replicated norms and embedding: it moves more than its peer
    assert a[0]["dp"] > a[1]["dp"] > 0


def test_equal_tp_boundary_is_priced_on_the_scatter_path():
    c = Cluster.load("homo_a800_2x8_eth")
    bw, lat = c.bandwidth, c.latency
    m = 1e8
    hop = cm.comm_pp_hop_scatter([0, 1], [2, 3], m, bw, lat)
    half = m / 2
    expect = 2 * ((lat[0, 2] + half / bw[0, 2]) + (lat[2, 3] + half / bw[2, 3]))
    assert hop == pytest.approx(expect)
    assert hop < cm.comm_pp_hop([0, 1], [2, 3], m, bw, lat, leaders=(0, 2))  # half the bytes per link
    model = LlamaConfig.load("llama2_7b")
    plan = Plan((Pipeline(8, 1, (Stage((0, 1), (0, 16)), Stage((2, 3), (16, 32)))),), 32)
    est = estimate(plan, c, Workload(model))
    hop = cm.comm_pp_hop_scatter([0, 1], [2, 3], 1 * model.seq_len * model.hidden_size * 2, bw, lat)
    # 1F1B (the default): each side of the link pays half of the hop per micro-batch (cost_model.hop_charges)
    assert [s.pp_comm_s for s in est.pipelines[0].stages] == pytest.approx([8 * hop / 2, 8 * hop / 2])
    gpipe = estimate(dataclasses.replace(plan, schedule="gpipe"), c, Workload(model))
    assert [s.pp_comm_s for s in gpipe.pipelines[0].stages] == pytest.approx([8 * hop, 0.0])


def test_dp_comm_prices_each_rank_its_own_uneven_share():
    """Llama 3 8B's 8 KV heads over TP 3 split 3,3,2: ranks 0 and 1 synchronise 2.4 % more than 1/3
    of a layer (rank 0 also the norms). T_comm of the TP-3 stage is its heaviest rank's bytes,
    (P-1)/P * n_local * B_type / beta, the bytes planner/cost/wire.py counts and the runtime moves;
    the pipeline-wide form and the per-stage reference agree."""
    from lightning_hexiscale.planner.cost import estimate as E
    from lightning_hexiscale.planner.cost.dp_comm import dp_comm_per_layer

    model = dataclasses.replace(LlamaConfig.load("llama3_8b"), num_layers=2)
    c = Cluster.from_config({"name": "one", "machines": [{"gpu": "H100", "count": 4, "intra_bandwidth": "100 GB/s",
                                                          "intra_latency": "0us"}],
                             "inter_machine": {"bandwidth": "10 GB/s"}})
    plan = Plan.from_dict({"num_layers": 2, "pipelines": [
        {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [0, 1, 2], "layers": [0, 2]}]},
        {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [3], "layers": [0, 2]}]}]})
    w = Workload(model)
    n_local = max(local_matrix_params(model, 3, r) + (2 * model.hidden_size if r == 0 else 0) for r in range(3))
    want = 0.5 * n_local * w.dtype_bytes / 100e9
    assert n_local > 1.02 * model.layer_params / 3
    assert E.dp_terms(plan, c, w)[0][(0, 0)] == [(2, pytest.approx(want, rel=1e-9))]
    ref = dp_comm_per_layer(plan, 0, plan.pipelines[0].stages[0], c, model.layer_params * w.dtype_bytes, model)
    assert ref == [(2, pytest.approx(want, rel=1e-9))]
