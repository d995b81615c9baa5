"""Gradient-sync / ZeRO bucket memory = the cap or one whole segment, whichever is larger, within one
unit (planner/cost/memory.py), as the runtime packs them (runtime/zero_layout.build_buckets), with the cap
one constant both read (config/buffers.py)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload
from lightning_hexiscale.planner.cost.estimate import stage_memory_at


def test_zero_window_holds_the_largest_segment():
    """Llama-3-8B at TP 1: the MLP matrices are 4096 x 14336 = 58.7 M elements, one segment each, far
    above the 4 MiB cap; ZeRO-2's two buckets in flight (a flat input and an output each, bf16 on
    the wire, plus the float32 concatenation of mixed precision) hold two such segments, not 4 MiB."""
    model = LlamaConfig.load("llama3_8b")
    w = dataclasses.replace(Workload.from_precision(model, "bf16-mixed"), reserve_bytes=0.0, device="cpu")
    # a middle stage (no embedding, no head): the sync phase's fixed part is the bucket window alone
    terms = stage_memory_at(w, "zero2", 2, True, False, False, 1, 1, 1)
    segment = model.hidden_size * model.ffn_hidden_size
    assert terms.phases[1][0] == pytest.approx(2 * 2 * segment * 2 + segment * 4)


def test_small_layers_keep_one_layer_buckets():
    """A unit smaller than the cap is one bucket of the unit's size (no 4 MiB for a 0.2 M-element layer)."""
    model = LlamaConfig.load("llama_tiny")
    w = dataclasses.replace(Workload.from_precision(model, "32-true"), reserve_bytes=0.0, device="cpu")
    terms = stage_memory_at(w, "zero2", 2, True, False, False, 1, 1, 1)
    assert terms.phases[1][0] == pytest.approx(2 * 2 * model.layer_matmul_params * 4)  # the norms are buckets apart


@pytest.mark.parametrize("cap", [64 * 4, 4096 * 4, 1 << 22])
@pytest.mark.parametrize("tp", [1, 2])
def test_bucket_rule_matches_the_runtime_packing(cap, tp):
    """The largest bucket ``build_buckets`` packs on any rank of a two-pipeline plan equals
    ``bucket_elements`` of the rank's stage (first, middle and last stages; caps below, between and
    above the segment sizes)."""
    from lightning_hexiscale.planner.cost.memory import bucket_elements, stage_bucket_units
    from lightning_hexiscale.runtime.parallelize import stage_shards
    from lightning_hexiscale.runtime.topology import sync_segments
    from lightning_hexiscale.runtime.zero_layout import build_buckets

    model = dataclasses.replace(LlamaConfig.load("llama_tiny"), num_layers=3)
    devs = lambda base: list(range(base, base + tp))  # noqa: E731
    stages = lambda base: [{"devices": devs(base + k * tp), "layers": [k, k + 1]} for k in range(3)]  # noqa: E731
    plan = Plan.from_dict({"num_layers": 3, "dp_sharding": "zero2", "pipelines": [
        {"batch_size": 2, "micro_batch_size": 1, "stages": stages(0)},
        {"batch_size": 2, "micro_batch_size": 1, "stages": stages(3 * tp)}]})
    for j in range(3):
        for r in range(tp):
            rank = j * tp + r
            shards = stage_shards(model, (j, j + 1), j == 0, j == 2, tp, r)
            biggest = max(b.numel for b in build_buckets(sync_segments(plan, model), rank, shards, 4, cap))
            assert bucket_elements(cap, 4, stage_bucket_units(model, tp, j == 0, j == 2)) == biggest, (j, r)


def test_planner_and_runtime_read_one_cap():
    from lightning_hexiscale.config.buffers import BUCKET_CAP_BYTES
    from lightning_hexiscale.planner.cost import memory
    from lightning_hexiscale.runtime import grad_sync

    assert memory.BUCKET_CAP_BYTES is BUCKET_CAP_BYTES and grad_sync.DEFAULT_BUCKET_CAP_BYTES is BUCKET_CAP_BYTES
