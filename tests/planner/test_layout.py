"""planner/layout.py: for many plans (1-3 pipelines of 1-3 stages, TP 1-3, uneven layer cuts, device
ids out of order, idle devices), the rank layout's lists equal what the code before it computed
(``layout_reference.py``: the old expressions, verbatim), in the same order: NCCL needs every rank
to create the same groups in the same order. Plus the torch-free parameter table equals the runtime's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layout_reference as ref
from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, RankLayout, Stage
from lightning_hexiscale.planner.layout import param_specs
from lightning_hexiscale.runtime import topology

NUM_LAYERS = 6
MHA = LlamaConfig(name="tiny_mha", hidden_size=64, num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=4,
                  ffn_hidden_size=100, vocab_size=256, seq_len=16)
CONFIGS = {
    "mha": MHA,  # TP 3 splits heads 2,1,1 and the FFN 34,33,33: holder sets no TP 2 stage has
    "mha_tied": dataclasses.replace(MHA, name="tiny_mha_tied", tie_word_embeddings=True),
    "gqa": LlamaConfig(name="tiny_gqa", hidden_size=96, num_layers=NUM_LAYERS, num_heads=6, num_kv_heads=3,
                       ffn_hidden_size=99, vocab_size=250, seq_len=16),
}


@st.composite
def plans(draw, min_idle: int = 0) -> Plan:
    """A valid plan: per pipeline 1-3 stages with TP 1-3 over random layer cuts, its batch and
    micro-batch; the devices a random permutation of ids (so rank order != stage order), idle ones
    from the same ids, and maybe unused ids above them (gaps in the launch order)."""
    shapes = []
    for _ in range(draw(st.integers(1, 3))):
        stages = draw(st.integers(1, 3))
        cuts = sorted(draw(st.sets(st.integers(1, NUM_LAYERS - 1), min_size=stages - 1, max_size=stages - 1)))
        tps = [draw(st.integers(1, 3)) for _ in range(stages)]
        batch, micro = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (3, 3)]))
        shapes.append((batch, micro, list(zip(tps, zip([0, *cuts], [*cuts, NUM_LAYERS])))))
    used = sum(t for _, _, stages in shapes for t, _ in stages)
    idle = draw(st.integers(min_idle, 2))
    ids = draw(st.permutations(range(used + idle + draw(st.integers(0, 2)))))
    take = iter(ids)
    pipes = tuple(Pipeline(b, mb, tuple(Stage(tuple(next(take) for _ in range(t)), lr) for t, lr in stages))
                  for b, mb, stages in shapes)
    return Plan(pipes, NUM_LAYERS, idle_devices=tuple(sorted(ids[used:used + idle]))).validate()


def _worlds(plan: Plan) -> list[int]:
    return [plan.world_size] + ([len(plan.launch_order)] if plan.idle_devices else [])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(), name=st.sampled_from(sorted(CONFIGS)))
def test_layout_lists_equal_the_old_expressions(plan, name):
    config = CONFIGS[name]
    layout = RankLayout.of(plan)
    assert [list(p) for p in layout.stage_ranks] == ref.stage_rank_lists(plan)
    assert [dataclasses.asdict(r) for r in layout.roles] == [ref.role_fields(plan, r) for r in range(plan.world_size)]
    batches = [p.batch_size for p in plan.pipelines]
    assert layout.batch_offsets == tuple(sum(batches[:i]) for i in range(plan.num_pipelines))
    assert list(layout.link_pairs) == ref.link_pairs(plan)
    assert [(s.name, s.shard_dim, s.start, s.end, s.ranks) for s in layout.segments(config)] == \
        ref.sync_segments(plan, config)
    # the creation order of every process group, and the cost model's count of them
    assert list(layout.group_ranks(config)) == ref.group_ranks(plan, config)
    assert set(layout.dp_groups(config)) == ref.data_parallel_groups(plan, config)
    for world in _worlds(plan):
        launched = RankLayout.of(plan, world)
        assert launched.ranks == ref.rank_map(plan, world)
        assert [launched.devices[g] for g in launched.ranks] == list(plan.device_order)
        assert [launched.devices[g] for g in launched.idle] == sorted(plan.idle_devices) * (world > plan.world_size)
        assert [launched.plan_rank(g) for g in range(world)] == \
            [ref.rank_map(plan, world).index(g) if g in ref.rank_map(plan, world) else None for g in range(world)]


SHIPPED = sorted((Path(__file__).parents[2] / "conf" / "plans").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_shipped_plans_layouts_equal_the_old_expressions(path):
    plan = Plan.load(path)
    config = LlamaConfig.load(plan.meta["model"])  # full-size models: 40-60 layers, TP up to 8
    layout = RankLayout.of(plan)
    assert [dataclasses.asdict(r) for r in layout.roles] == [ref.role_fields(plan, r) for r in range(plan.world_size)]
    assert list(layout.group_ranks(config)) == ref.group_ranks(plan, config)
    assert [(s.name, s.shard_dim, s.start, s.end, s.ranks) for s in layout.segments(config)] == \
        ref.sync_segments(plan, config)


@settings(max_examples=20, deadline=None)
@given(plan=plans(), name=st.sampled_from(sorted(CONFIGS)))
def test_the_runtime_functions_keep_their_types(plan, name):
    """runtime/topology.py's pure functions read the layout and return what they always did (lists
    where they returned lists), so every caller and test of them runs unchanged."""
    config = CONFIGS[name]
    assert topology.stage_rank_lists(plan) == ref.stage_rank_lists(plan)
    assert topology.link_pairs(plan) == ref.link_pairs(plan)
    assert topology.group_ranks(plan, config) == ref.group_ranks(plan, config)
    for world in _worlds(plan):
        assert topology.rank_map(plan, world) == ref.rank_map(plan, world)


def test_the_runtime_uses_the_torch_free_parameter_table():
    """One table: the runtime's names are the layout's objects, not a copy to keep equal."""
    from lightning_hexiscale.planner import layout
    from lightning_hexiscale.runtime import parallelize

    assert parallelize.ParamSpec is layout.ParamSpec and parallelize.param_specs is layout.param_specs
    assert parallelize.stage_holds is layout.stage_holds


def test_a_world_that_fits_neither_launch_names_the_key_and_both_counts():
    plan = Plan((Pipeline(2, 1, (Stage((2,), (0, 4)),)), Pipeline(2, 1, (Stage((3,), (0, 4)),))), 4,
                idle_devices=(0, 1))
    assert RankLayout.of(plan, 4).ranks == (2, 3) and RankLayout.of(plan, 4).idle == (0, 1)
    with pytest.raises(PlanError, match=r"world_size.*3.*exactly 2 processes.*or 4, one per device"):
        RankLayout.of(plan, 3)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_layout_imports_no_torch():
    """`hexiscale plan` and the cost model read the layout: importing it must not load torch."""
    code = "import sys, lightning_hexiscale.planner.layout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"



@settings(max_examples=30, deadline=None)
@given(plan=plans())
def test_the_samplers_cut_each_pipeline_at_the_layouts_batch_offset(plan):
    """data/ sits below the planner and cannot import the layout; its per-pipeline slice of a full
    global batch must still start where the layout (and so the engine's Role) says."""
    from lightning_hexiscale.data.samplers import PlanBatchSampler

    layout, sizes = RankLayout.of(plan), [p.batch_size for p in plan.pipelines]
    for i, (off, b) in enumerate(zip(layout.batch_offsets, sizes)):
        first = next(iter(PlanBatchSampler(2 * plan.global_batch, sizes, i, shuffle=False)))
        assert first == list(range(off, off + b))
