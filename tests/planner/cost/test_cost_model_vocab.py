"""The cost of the vocabulary-parallel LM head, loss and embedding (cost_model.vocab_parallel_*), and
how estimate() uses it: a TP-t last stage computes 1/t of the head, pays its all-reduces, and holds
V/t rows of the head and of the fp32 logits; a tied head is counted once on a one-stage pipeline."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner import Plan, Workload, estimate
from lightning_hexiscale.planner.cost.estimate import stage_memory_at

ALPHA, BETA = 1e-5, 1e10


def _links(n: int) -> tuple[np.ndarray, np.ndarray]:
    bw = np.full((n, n), BETA)
    lat = np.full((n, n), ALPHA)
    np.fill_diagonal(lat, 0.0)
    return bw, lat


def _ar(t: int, m: float) -> float:
    """Ring all-reduce on uniform links: 2 * (t-1) * (alpha + M / (t * beta))."""
    return 2 * (t - 1) * (ALPHA + m / (t * BETA))


def test_vocab_parallel_head_formula():
    bw, lat = _links(4)
    B, S, H, V, bt, c = 2, 128, 512, 32000, 2, 1e14
    fwd = 2.0 * B * S * H * V
    comp, comm = cm.vocab_parallel_head(fwd, 1.0, c, [0], B * S, H, bt, bw, lat)
    assert comp == pytest.approx(3 * fwd / c) and comm == 0.0
    comp, comm = cm.vocab_parallel_head(fwd, 0.25, c, [0, 1, 2, 3], B * S, H, bt, bw, lat)
    assert comp == pytest.approx(3 * fwd / (4 * c))
    assert comm == pytest.approx(_ar(4, 4 * B * S) + _ar(4, 8 * B * S) + _ar(4, B * S * H * bt))
    assert cm.vocab_parallel_embedding([0, 1], B * S * H * bt, bw, lat) == pytest.approx(_ar(2, B * S * H * bt))
    assert cm.vocab_parallel_embedding([3], B * S * H * bt, bw, lat) == 0.0
    # one all-reduce is half of comm_tp's four-per-layer unit of two
    assert cm.allreduce_time([0, 1, 2], 1e6, bw, lat) == pytest.approx(0.5 * cm.comm_tp([0, 1, 2], 1e6, bw, lat))


MODEL = LlamaConfig(name="m", hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, ffn_hidden_size=2816,
                    vocab_size=128256, seq_len=512)


def _cluster() -> Cluster:
    # efficiency 1.0 declared: Appendix B's FLOPs / peak (not the roofline of an uncalibrated type)
    return Cluster.from_config({"name": "four", "machines": [{"gpu": "A100-80G", "count": 4, "intra_bandwidth": "200 GB/s"}],
                                "inter_machine": {"bandwidth": "10 GB/s"}, "gpu_types": {"A100-80G": {"efficiency": 1.0}}})


def _plan(last_tp: int) -> Plan:
    last = list(range(1, 1 + last_tp))
    return Plan.from_dict({"num_layers": 4, "schedule": "1f1b", "recompute": False, "pipelines": [
        {"batch_size": 4, "micro_batch_size": 1, "stages": [{"devices": [0], "layers": [0, 2]},
                                                            {"devices": last, "layers": [2, 4]}]}]})


def test_estimate_splits_the_head_over_the_last_stage():
    c = _cluster()
    w = Workload(MODEL, dtype="bf16")
    one, two = estimate(_plan(1), c, w), estimate(_plan(2), c, w)
    s1, s2 = one.pipelines[0].stages[1], two.pipelines[0].stages[1]
    layer_comp = lambda tp: 2 * 3 * MODEL.layer_forward_flops(1) * MODEL.max_shard_fraction(tp) / c.devices[1].flops
    head = 3 * MODEL.head_forward_flops(1) / c.devices[1].flops
    n_mb = 4
    assert s1.compute_s == pytest.approx(n_mb * (layer_comp(1) + head))
    assert s2.compute_s == pytest.approx(n_mb * (layer_comp(2) + head / 2))
    # memory: the head's rows and the logits are halved. What grows with the vocabulary grows half as
    # fast on the TP-2 stage; on one device each head row carries its weights, gradient and Adam
    # states (cost_model.runtime_state_bytes_per_param, 16 B/param in bf16) and each token V fp32
    # logits, three times (cost_model.logits_bytes: the plain loss; the fast path's chunked loss is
    # test_fast_path_memory.py's), at the backward's peak
    V, H = MODEL.vocab_size, MODEL.hidden_size
    big = dataclasses.replace(MODEL, vocab_size=2 * V)
    plain = FastPath(chunked_loss=False)

    def grows(tp: int) -> float:
        def peak(model: LlamaConfig) -> float:
            return estimate(_plan(tp), c, Workload(model, dtype="bf16", fast_path=plain)).pipelines[0].stages[1] \
                .peak_memory_bytes
        return peak(big) - peak(MODEL)

    spp = cm.runtime_state_bytes_per_param("ddp", 1, 2, w.optimizer_bytes_per_param, "backward")
    assert grows(1) == pytest.approx(V * H * spp + cm.logits_bytes(MODEL.seq_len, V), rel=1e-9)
    assert grows(2) == pytest.approx(grows(1) / 2, rel=1e-9)
    assert s2.peak_memory_bytes < s1.peak_memory_bytes
    assert s2.tp_comm_s > n_mb * 2 * 2 * cm.comm_tp([1, 2], 512 * 1024 * 2, c.bandwidth, c.latency)  # + the head's


def test_estimate_counts_a_tied_head_once_per_stage():
    c = _cluster()
    tied = dataclasses.replace(MODEL, tie_word_embeddings=True)
    one_stage = Plan.from_dict({"num_layers": 4, "pipelines": [
        {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [0], "layers": [0, 4]}]}]})
    untied_mem = estimate(one_stage, c, Workload(MODEL, "bf16")).pipelines[0].stages[0].peak_memory_bytes
    tied_mem = estimate(one_stage, c, Workload(tied, "bf16")).pipelines[0].stages[0].peak_memory_bytes
    # the untied head's V x H parameters, in every memory phase (estimate.stage_memory_at): their
    # states (16 B/param in bf16), plus in the optimizer step on CUDA one fp32 Adam temporary each
    VH = MODEL.vocab_size * MODEL.hidden_size
    phases = [stage_memory_at(Workload(m, "bf16"), "ddp", 1, True, True, True, 1, 1, 1).phases for m in (MODEL, tied)]
    for (f_untied, _), (f_tied, _), phase in zip(*phases, ("backward", "step")):
        per_param = cm.runtime_state_bytes_per_param("ddp", 1, 2, 12, phase) + (4 if phase == "step" else 0)
        assert f_untied - f_tied == pytest.approx(VH * per_param)
    assert VH * 16 <= untied_mem - tied_mem <= VH * 20 * (1 + 1e-9)
    # two stages: the last stage holds a copy of the tied matrix, as an untied head would
    two = [estimate(_plan(1), c, Workload(m, "bf16")).pipelines[0].stages[1].peak_memory_bytes for m in (MODEL, tied)]
    assert two[0] == pytest.approx(two[1])
    assert tied.total_params == MODEL.total_params - MODEL.vocab_size * MODEL.hidden_size


@pytest.mark.parametrize("sharding, phases", [("ddp", 1), ("zero2", 2)])
def test_tied_embedding_exchange_is_priced(sharding, phases):
    """Llama 3.2 1B (tied) in one pipeline of two stages on two machines, 1 GB/s between them: each
    step the stages exchange the embedding's gradient rows (both ways at once) and, under ZeRO, the
    first sends the updated rows to the last, V*H float32 master elements each time (bf16-mixed):
    about 1.05 s per transfer, fully exposed after the backward."""
    from lightning_hexiscale.planner.cost import estimate as E

    model = dataclasses.replace(LlamaConfig.load("llama3_2_1b"), num_layers=4, seq_len=1024)
    cluster = Cluster.from_config({"name": "two", "machines": [{"gpu": "H100", "count": 1, "repeat": 2}],
                                   "inter_machine": {"bandwidth": "1 GB/s", "latency": "0us"}})
    w = Workload.from_precision(model, "bf16-mixed")
    plan = Plan.from_dict({"num_layers": 4, "dp_sharding": sharding, "pipelines": [
        {"batch_size": 2, "micro_batch_size": 1, "stages": [{"devices": [0], "layers": [0, 2]},
                                                            {"devices": [1], "layers": [2, 4]}]}]})
    transfer = model.vocab_size * model.hidden_size * 4 / 1e9
    assert E.dp_edge_all(plan, cluster, w)[(0, 0)][0] == pytest.approx(phases * transfer)
    assert E.dp_edge_times(plan, 0, 0, cluster, w)[0] == pytest.approx(phases * transfer)
    first = estimate(plan, cluster, w).pipelines[0].stages[0]
    assert first.dp_exposed_s == pytest.approx(phases * transfer)
    # an untied model exchanges nothing between the stages of one pipeline
    untied = Workload.from_precision(dataclasses.replace(model, tie_word_embeddings=False), "bf16-mixed")
    assert E.dp_edge_all(plan, cluster, untied) == {}
