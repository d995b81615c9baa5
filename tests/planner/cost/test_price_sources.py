"""What priced each device type (planner/cost/sources.py): the source named per type (layer table with
its model, precision, TP degrees and note; calibrated; datasheet; declared), and a layer table that does
not match the run refused with a ConfigError naming the mismatch, or, with
``planner.allow_table_mismatch``, a warning saying what prices it instead. Before, such a table was
skipped without a word and the type priced from FLOP/s."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, SearchSettings, Workload, estimate, price_sources, search
from lightning_hexiscale.planner.cost.estimate import layer_times
from lightning_hexiscale.planner.cost.sources import TableMismatchWarning
from tests.planner.cost.test_layer_table import TINY, W32, _shape, cluster_doc


def _tp1_only() -> dict:
    """The measured cluster with layer rows at TP 1 only (micro-batches 1 and 2)."""
    rows = [{"part": "layer", "tp": 1, "micro_batch": m, "forward": f"{5 * m} ms", "backward": f"{10 * m} ms"}
            for m in (1, 2)]
    doc = cluster_doc(rows)
    doc["layer_times"][0]["note"] = "hexiscale discover 2026-11-28T07:00:00, 2 reps"
    return doc


def _plan(tp: int, mb: int = 2) -> Plan:
    devices = list(range(tp))
    return Plan.from_dict({"num_layers": TINY.num_layers, "schedule": "1f1b", "recompute": False, "pipelines": [
        {"batch_size": 4, "micro_batch_size": mb, "stages": [{"devices": devices, "layers": [0, TINY.num_layers]}]}]})


def test_the_source_of_a_table_type_names_model_precision_tp_degrees_and_note():
    c = Cluster.from_config(_tp1_only())
    (src,) = price_sources(c, W32, _plan(1, mb=4))
    assert src.kind == "layer table" and src.gpu_type == "CPU-FAST"
    for words in ("llama_tiny", "hidden 128", "32-true", "TP [1]", "micro-batches [1, 2]", "2026-11-28T07:00:00",
                  "micro-batches [4] extrapolated", "head at TP [1] computed"):
        assert words in src.detail, (words, src.detail)


def test_calibrated_datasheet_and_declared_sources():
    doc = {"name": "mixed", "machines": [{"name": n, "gpu": g, "count": 1, "intra_bandwidth": "100 GB/s"}
                                         for n, g in (("a", "H100"), ("b", "A800"), ("c", "CPU-FAST"))],
           "inter_machine": {"bandwidth": "10 GB/s"}, "gpu_types": {"A800": {"efficiency": 0.5}}}
    c = Cluster.from_config(doc)
    w = Workload.from_precision(TINY, "bf16-mixed")
    kinds = {s.gpu_type: s for s in price_sources(c, w)}
    assert kinds["H100"].kind == "datasheet" and "roofline" in kinds["H100"].detail
    assert kinds["A800"].kind == "calibrated" and "efficiency 0.5" in kinds["A800"].detail
    assert kinds["CPU-FAST"].kind == "declared"


@pytest.mark.parametrize("change,words", [
    (lambda w: dataclasses.replace(w, dtype="fp64", param_dtype="fp64"), ["precision 32-true vs 64-true"]),
    (lambda w: Workload.from_precision(dataclasses.replace(TINY, seq_len=64), "32-true", device="cpu"),
     ["seq_len 128 vs 64"]),
    (lambda w: Workload.from_precision(dataclasses.replace(TINY, ffn_hidden_size=512), "32-true", device="cpu"),
     ["ffn_hidden_size 352 vs 512"]),
])
def test_a_table_for_another_shape_or_precision_is_refused(change, words):
    c = Cluster.from_config(cluster_doc())
    w = change(W32)
    for price in (lambda: layer_times(c, w, [0], 2, False), lambda: estimate(_plan(1), c, w),
                  lambda: search(c, w, 4, SearchSettings(iterations=2, progress=False))):
        with pytest.raises(ConfigError) as e:
            price()
        assert e.value.key == "cluster.layer_times" and e.value.value == "CPU-FAST", str(e.value)
        for word in words + ["llama_tiny", "hexiscale discover", "allow_table_mismatch"]:
            assert word in str(e.value), (word, str(e.value))


def test_allow_table_mismatch_warns_and_says_what_prices_it():
    c = Cluster.from_config(cluster_doc())
    bare = Cluster.from_config(dict(cluster_doc(), layer_times=[]))
    w = dataclasses.replace(W32, dtype="fp64", param_dtype="fp64", allow_table_mismatch=True, reserve_bytes=1.0)
    with pytest.warns(TableMismatchWarning, match="priced from FLOP/s"):
        got = estimate(_plan(1), c, w).iteration_time_s
    assert got == estimate(_plan(1), bare, w).iteration_time_s
    assert [s.kind for s in price_sources(c, w, _plan(1))] == ["declared"]


def test_a_plan_at_a_tp_degree_the_table_lacks_is_refused():
    c = Cluster.from_config(_tp1_only())
    price_sources(c, W32, _plan(1))  # covered
    with pytest.raises(ConfigError) as e:
        price_sources(c, W32, _plan(2))
    assert e.value.key == "plan.pipelines[0].stages[0].tp", str(e.value)
    for word in ("CPU-FAST at TP 2", "TP [1] only", "measure TP 2", "allow_table_mismatch"):
        assert word in str(e.value), (word, str(e.value))
    allowed = dataclasses.replace(W32, allow_table_mismatch=True)
    with pytest.warns(TableMismatchWarning, match="TP 2"):
        price_sources(c, allowed, _plan(2))


def test_a_tp_group_across_machines_of_a_table_type_is_refused():
    """Rule 3 (planner/cost/sources.py): the table was measured on TP groups inside one machine; a
    group across machines was priced from FLOP/s beside the measured stages (another scale) and only
    named in the source line. Now refused like an unmeasured degree; allow_table_mismatch warns."""
    c = Cluster.from_config(cluster_doc())  # m0: devices 0, 1; m1: devices 2, 3; TP 1 and 2 measured
    across = Plan.from_dict({"num_layers": TINY.num_layers, "schedule": "1f1b", "recompute": False, "pipelines": [
        {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [0, 2], "layers": [0, TINY.num_layers]}]}]})
    price_sources(c, W32, _plan(2))  # the same degree inside m0: measured
    with pytest.raises(ConfigError) as e:
        price_sources(c, W32, across)
    assert e.value.key == "plan.pipelines[0].stages[0].devices", str(e.value)
    for word in ("TP-2 group of CPU-FAST on m0, CPU-FAST on m1", "inside one machine", "across machines",
                 "allow_table_mismatch"):
        assert word in str(e.value), (word, str(e.value))
    allowed = dataclasses.replace(W32, allow_table_mismatch=True)
    with pytest.warns(TableMismatchWarning, match="across machines"):
        (src,) = price_sources(c, allowed, across)
    assert "TP groups across machines (TP [2]) computed" in src.detail


def test_the_search_names_its_sources_and_refuses_an_uncovered_tp_degree():
    """The search's plan comes with its sources; a table covering TP 1 only on machines of two
    devices, where TP 2 is faster by FLOP/s, is not mixed in silently: the search stays at TP 1
    (tests/planner/search/test_search_table_tp.py), and held to TP 2 it finds no plan, saying why."""
    model = dataclasses.replace(TINY, num_layers=2)
    doc = _tp1_only()
    doc["layer_times"][0]["model"] = _shape(model)
    w = Workload.from_precision(model, "32-true", device="cpu")
    r = search(Cluster.from_config(doc), w, 4, SearchSettings(iterations=3, progress=False, tp_degrees=(1,)))
    assert [s.kind for s in r.sources] == ["layer table"]
    assert {st.tp for p in r.plan.pipelines for st in p.stages} == {1}
    words = r"no stage at TP \[2\] can be priced.*CPU-FAST \(layer rows at TP \[1\]\)"
    with pytest.raises(InfeasiblePlan, match=words):
        search(Cluster.from_config(doc), w, 1, SearchSettings(iterations=3, progress=False, tp_degrees=(2,)))
