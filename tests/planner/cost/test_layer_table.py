"""Measured layer times in the cluster file (config/layer_table.py) and how the cost model uses them
(planner/cost/compute.py): round trip through YAML, interpolation in the micro-batch size and the stated
extrapolation, the cases a table does not cover, bad input, and one pricing for estimate(), the
search's fast paths and the oracle."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.layer_table import LayerTable, LayerTimeRow, ModelShape, interpolate
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload, estimate
from lightning_hexiscale.planner.cost.estimate import layer_times, stage_extra_times

TINY = LlamaConfig.load("llama_tiny")  # 4 heads, 2 KV heads


def _rows(scale: float = 1.0) -> list[dict]:
    """Layer rows at TP 1 (micro-batches 1, 2, 4) and TP 2 (micro-batch 2), a head and an embedding row."""
    ms = lambda x: f"{x * scale:g} ms"  # noqa: E731
    return [{"part": "layer", "tp": 1, "micro_batch": 1, "forward": ms(10), "backward": ms(20), "backward_recompute": ms(31)},
            {"part": "layer", "tp": 1, "micro_batch": 2, "forward": ms(16), "backward": ms(34)},
            {"part": "layer", "tp": 1, "micro_batch": 4, "forward": ms(28), "backward": ms(60), "backward_recompute": ms(90)},
            {"part": "layer", "tp": 2, "micro_batch": 2, "forward": ms(11), "backward": ms(23)},
            {"part": "head", "tp": 1, "micro_batch": 2, "forward": ms(5), "backward": ms(7)},
            {"part": "embedding", "tp": 1, "micro_batch": 2, "forward": ms(1), "backward": ms(2)}]


def _shape(model: LlamaConfig = TINY) -> dict:
    return {"name": model.name, **{f: getattr(model, f) for f in ModelShape.__dataclass_fields__}}


def cluster_doc(rows: list[dict] | None = None, precision: str = "32-true", gpu: str = "CPU-FAST") -> dict:
    return {"name": "measured", "machines": [{"name": "m0", "gpu": gpu, "count": 2, "intra_bandwidth": "1 GB/s"},
                                             {"name": "m1", "gpu": gpu, "count": 2, "intra_bandwidth": "1 GB/s"}],
            "inter_machine": {"bandwidth": "100 MB/s"},
            "layer_times": [{"gpu": gpu, "precision": precision, "model": _shape(), "rows": rows if rows is not None else _rows()}]}


W32 = Workload.from_precision(TINY, "32-true", device="cpu")


def test_round_trip_through_the_cluster_file(tmp_path):
    c = Cluster.from_config(cluster_doc())
    (table,) = c.layer_tables
    assert table.gpu == "CPU-FAST" and table.shape == ModelShape.of(TINY) and len(table.rows) == 6
    assert table.rows[0] == LayerTimeRow("layer", 1, 1, 0.010, 0.020, 0.031)
    # written back (as the profiler writes it) and loaded again: the same table
    doc = dict(cluster_doc(), layer_times=[t.to_config() for t in c.layer_tables])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    again = Cluster.load(str(path)).layer_tables
    assert again == c.layer_tables
    # and through the profiler's writer, which replaces the entry of the same type, precision and shape
    from lightning_hexiscale.profiling.writer import update_layer_tables

    faster = LayerTable(table.gpu, table.precision, table.shape, (LayerTimeRow("layer", 1, 1, 0.001, 0.002),), "llama_tiny")
    update_layer_tables(path, [faster])
    assert Cluster.load(str(path)).layer_tables == (faster,)


def test_interpolation_rule():
    mbs, vals = [1, 2, 4], [10.0, 16.0, 28.0]
    assert interpolate(mbs, vals, 2) == 16.0
    assert interpolate(mbs, vals, 3) == pytest.approx(22.0)  # linear between 2 and 4
    assert interpolate(mbs, vals, 8) == pytest.approx(56.0)  # above: the per-sequence time of 4
    assert interpolate([2, 4], [16.0, 28.0], 1) == pytest.approx(8.0)  # below: the per-sequence time of 2


def test_estimate_uses_the_table_where_it_covers_a_case():
    c = Cluster.from_config(cluster_doc())
    t_f, t_b, comp_f, tp_f = layer_times(c, W32, [0], 3, recompute=False)
    assert (t_f, t_b, tp_f) == (pytest.approx(0.022), pytest.approx(0.047), 0.0)
    # recomputation: the measured backward_recompute, interpolated where both neighbours have it ...
    assert layer_times(c, W32, [0], 1, True)[1] == pytest.approx(0.031)
    # ... else backward + forward (the rule for a row without it)
    assert layer_times(c, W32, [0], 2, True)[1] == pytest.approx(0.034 + 0.016)
    # TP 2 inside a machine: its row (collectives included); head and embedding: their rows
    assert layer_times(c, W32, [0, 1], 2, False)[:2] == (pytest.approx(0.011), pytest.approx(0.023))
    assert stage_extra_times(c, W32, [0], 2, first=True, last=True) == (pytest.approx(0.012 + 0.003), 0.0)


def test_cases_a_table_cannot_cover_are_computed():
    """A TP group across machines (a table is measured over one machine's links) and a head at a TP
    degree without head rows are computed, as without a table (and named by price_sources:
    tests/planner/cost/test_price_sources.py). Another shape or precision is refused (same file)."""
    c = Cluster.from_config(cluster_doc())
    flops = Cluster.from_config(dict(cluster_doc(), layer_times=[]))
    assert layer_times(c, W32, [0, 2], 2, False) == layer_times(flops, W32, [0, 2], 2, False)
    # TP 2 has no row at the head: computed (FLOPs + its all-reduces)
    assert stage_extra_times(c, W32, [0, 1], 2, False, True) == stage_extra_times(flops, W32, [0, 1], 2, False, True)


@pytest.mark.parametrize("change,key,words", [
    (lambda d: d["layer_times"][0]["rows"].append({"tp": 4, "micro_batch": 1, "forward": "1 ms", "backward": "2 ms"}),
     "cluster.layer_times[0].rows[6].tp", ["4", "at least one key/value head per rank", "llama_tiny has 2 KV heads",
                                           "between 1 and 2", "remove the row"]),
    (lambda d: d["layer_times"][0].update(gpu="A800"), "cluster.layer_times[0].gpu", ["A800", "no machine", "CPU-FAST"]),
    (lambda d: d["layer_times"][0]["rows"].append(dict(_rows()[0])), "cluster.layer_times[0].rows[6]", ["once"]),
    (lambda d: d["layer_times"][0]["rows"][4].update(backward_recompute="3 ms"),
     "cluster.layer_times[0].rows[4].backward_recompute", ["only layers"]),
    (lambda d: d["layer_times"][0]["rows"][0].update(forward="12"), "cluster.layer_times[0].rows[0].forward", ["12"]),
    (lambda d: d["layer_times"][0]["rows"][0].update(micro_batch=0), "cluster.layer_times[0].rows[0].micro_batch", ["0"]),
    (lambda d: d["layer_times"][0].update(precision="bf16"), "cluster.layer_times[0].precision", ["bf16", "32-true"]),
])
def test_bad_tables_name_key_value_rule_and_fix(change, key, words):
    doc = cluster_doc()
    change(doc)
    with pytest.raises(ConfigError) as e:
        Cluster.from_config(doc)
    assert e.value.key == key, str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_one_pricing_for_estimate_the_search_and_the_oracle():
    """With a table whose times differ from any FLOPs figure, the search's fast paths (Evaluator,
    BatchTimer) and the oracle price with it exactly as estimate() does: the search's plan costs
    what estimate() says, and the oracle's optimum is no better than the search's (2 + 2 devices)."""
    from lightning_hexiscale.planner.oracle.exact import oracle
    from lightning_hexiscale.planner import SearchSettings, search

    model = dataclasses.replace(TINY, num_layers=4)
    doc = cluster_doc(_rows(scale=0.01))  # a few times faster than FLOPs at 100 / 50 GFLOP/s: worth using
    doc["layer_times"][0]["model"] = _shape(model)
    doc["machines"][1]["gpu"] = "CPU-SLOW"
    doc["layer_times"].append({"gpu": "CPU-SLOW", "precision": "32-true", "model": _shape(model), "rows": _rows(scale=0.03)})
    c = Cluster.from_config(doc)
    w = Workload.from_precision(model, "32-true", device="cpu")
    settings = SearchSettings(iterations=4, progress=False, recompute=True)  # the oracle prices one setting
    found = search(c, w, 8, settings)
    assert found.plan is not None
    assert estimate(found.plan, c, w).iteration_time_s == pytest.approx(found.estimate.iteration_time_s, rel=1e-9)
    # the fast paths on the plan's own layout: the batch timer's exact split and the evaluator's terms
    from lightning_hexiscale.planner.search.assemble import Evaluator
    from lightning_hexiscale.planner.search.batching import BatchTimer

    for sharding in ("ddp", "zero2", "zero3"):
        layout = dataclasses.replace(found.plan, dp_sharding=sharding)
        cost, plan = BatchTimer(c, w, 8).best(layout)
        assert cost == pytest.approx(estimate(plan, c, w).iteration_time_s, rel=1e-9), sharding
    ev = Evaluator(c, w, found.plan.schedule, found.plan.recompute)
    for st in (s for p in found.plan.pipelines for s in p.stages):
        assert ev.layer_tb(st.devices, 2) == layer_times(c, w, tuple(sorted(st.devices)), 2, found.plan.recompute)[:2]
    best = oracle(c, w, 8, settings)
    assert best.complete and best.estimate.iteration_time_s <= found.estimate.iteration_time_s * (1 + 1e-9)
    assert found.estimate.iteration_time_s <= best.estimate.iteration_time_s / 0.97
    # and the table moved the choice: without it (FLOPs at 100 / 50 GFLOP/s) the times differ
    bare = Cluster.from_config(dict(doc, layer_times=[]))
    assert estimate(found.plan, bare, w).iteration_time_s != pytest.approx(found.estimate.iteration_time_s, rel=1e-3)
