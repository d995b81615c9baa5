"""The search stays inside the TP degrees a cluster's layer tables measured (planner/cost/sources.py,
``StageRule``): a type whose table has layer rows at TP 2 only is planned with TP-2 stages (before,
the search picked a TP-1 stage, and its own plan was then refused naming
``plan.pipelines[0].stages[0].tp`` and "use a plan with TP in [2]", with no plan given by the user);
a type whose machines hold too few devices for any measured degree is a ConfigError before the
search; ``planner.allow_table_mismatch`` still lifts the restriction (unmeasured degrees priced
from FLOP/s with a warning); without tables nothing is restricted (no rule, no extra work)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.planner import SearchSettings, Workload, search
from lightning_hexiscale.planner.baselines import metis, megatron, uniform_tp
from lightning_hexiscale.planner.cost import sources
from lightning_hexiscale.planner.cost.sources import TableMismatchWarning
from lightning_hexiscale.planner.search.two_phase import SearchRun
from tests.planner.cost.test_layer_table import TINY, _shape

MODEL = dataclasses.replace(TINY, num_layers=2)  # 4 heads, 2 KV heads
W = Workload.from_precision(MODEL, "32-true", device="cpu")
FAST = SearchSettings(iterations=4, progress=False)


def _rows(tp: int) -> list[dict]:
    """Layer, head and embedding rows at TP ``tp`` only, micro-batch 1 (as the profiling page's example)."""
    return [{"part": "layer", "tp": tp, "micro_batch": 1, "forward": "12.1 ms", "backward": "32.9 ms",
             "backward_recompute": "22.7 ms"},
            {"part": "head", "tp": tp, "micro_batch": 1, "forward": "6.67 ms", "backward": "3.43 ms"},
            {"part": "embedding", "tp": tp, "micro_batch": 1, "forward": "0.9 ms", "backward": "1.2 ms"}]


def _doc(tp: int = 2, counts=(2, 2), model=MODEL, other: int = 0) -> dict:
    """Machines of ``counts`` CPU devices (with a table at TP ``tp``), plus a machine of ``other``
    CPU-SLOW devices priced from FLOP/s (no table)."""
    machines = [{"name": f"m{i}", "gpu": "CPU", "count": n, "intra_bandwidth": "10 GB/s"} for i, n in enumerate(counts)]
    types = {"CPU": {"flops": "50 GFLOPS", "memory": "4 GiB"}}
    if other:
        machines.append({"name": "slow", "gpu": "CPU-SLOW", "count": other, "intra_bandwidth": "10 GB/s"})
        types["CPU-SLOW"] = {"flops": "20 GFLOPS", "memory": "4 GiB"}
    return {"name": "tabled", "machines": machines, "inter_machine": {"bandwidth": "1 GB/s"}, "gpu_types": types,
            "layer_times": [{"gpu": "CPU", "precision": "32-true", "model": _shape(model), "rows": _rows(tp)}]}


def _cpu_tps(plan, cluster: Cluster) -> set[int]:
    return {st.tp for p in plan.pipelines for st in p.stages if cluster.devices[st.devices[0]].gpu_type == "CPU"}


@pytest.mark.parametrize("counts,batch", [((2,), 32), ((2, 2), 8), ((3, 2), 8)])
def test_a_table_with_only_tp2_rows_plans_tp2_stages(counts, batch):
    c = Cluster.from_config(_doc(2, counts))
    for s in (FAST, dataclasses.replace(FAST, use_all_devices=True) if counts == (2, 2) else FAST):
        r = search(c, W, batch, s)  # was: ConfigError plan.pipelines[0].stages[0].tp ... use a plan with TP in [2]
        assert _cpu_tps(r.plan, c) == {2}, r.plan
        assert [x.kind for x in r.sources] == ["layer table"]
    if counts == (3, 2):  # the third device of m0 has no TP-2 partner inside its machine: idle
        assert len(r.plan.idle_devices) == 1


def test_other_types_keep_every_degree_beside_a_restricted_one():
    c = Cluster.from_config(_doc(2, (2,), other=2))
    r = search(c, W, 16, FAST)
    assert _cpu_tps(r.plan, c) <= {2}
    rule = sources.stage_rule(c, W)
    assert rule((2,)) and rule((2, 3)) and rule((0, 1)) and not rule((0,)) and not rule((1,))
    assert not rule((1, 2))  # a table type beside another: no row prices it (rule 3; was allowed, FLOP/s)


def test_the_pasted_example_table_plans_no_tp_group_across_machines():
    """The profiling page's table (TP 1 and 2, llama_tiny, 32-true) pasted into a cluster of two
    3-device CPU machines at 50 GFLOP/s joined at 1 GB/s: every TP group across machines was priced
    from FLOP/s (about 6x faster than the table's own rows), so the search paired devices across the
    slow link beside the table-priced pairs (0.025 s on paper vs 0.76 s on one machine). Rule 3 of
    planner/cost/sources.py: every stage now stays inside a machine and is priced by the table."""
    page = (Path(__file__).parents[3] / "docs" / "guide" / "profiling.md").read_text()
    tables = yaml.safe_load(re.search(r"```yaml\n(layer_times:.*?)```", page, re.S).group(1))["layer_times"]
    c = Cluster.from_config({
        "name": "pasted", "inter_machine": {"bandwidth": "1 GB/s"}, "layer_times": tables,
        "machines": [{"name": f"m{i}", "gpu": "CPU", "count": 3, "intra_bandwidth": "10 GB/s"} for i in range(2)],
        "gpu_types": {"CPU": {"flops": "50 GFLOPS", "memory": "4 GiB"}}})
    w = Workload.from_precision(TINY, "32-true", device="cpu")  # the table's shape: llama_tiny, 4 layers
    r = search(c, w, 8, dataclasses.replace(FAST, iterations=10))
    machines = [{c.devices[d].machine for d in st.devices} for p in r.plan.pipelines for st in p.stages]
    assert all(len(m) == 1 for m in machines), r.plan.table(c)  # was: three TP-2 pairs across m0 and m1
    assert "across machines" not in r.sources[0].detail
    assert r.estimate.iteration_time_s > 0.3  # the table's scale (0.45 s), not FLOP/s' (0.025 s)


def test_a_type_measured_at_no_degree_its_machines_can_form_is_refused_before_the_search():
    model = dataclasses.replace(MODEL, num_kv_heads=4)
    w = Workload.from_precision(model, "32-true", device="cpu")
    c = Cluster.from_config(_doc(4, (2,), model=model))
    with pytest.raises(ConfigError) as e:
        search(c, w, 8, FAST)
    assert e.value.key == "cluster.layer_times", str(e.value)
    for words in ("CPU: layer rows at TP [4]", "at most 2 CPU device", "m0: 2", "measure TP [1, 2] on CPU",
                  "hexiscale profile --model llama_tiny --layer-tp 1,2", "allow_table_mismatch"):
        assert words in str(e.value), (words, str(e.value))


def test_allow_table_mismatch_still_lets_the_search_use_any_degree():
    allowed = dataclasses.replace(W, allow_table_mismatch=True)
    c = Cluster.from_config(_doc(2, (2,)))
    assert sources.stage_rule(c, allowed) is None
    with pytest.warns(TableMismatchWarning, match="CPU at TP 1"):
        r = search(c, allowed, 32, FAST)
    assert _cpu_tps(r.plan, c) == {1}  # as before: TP 1 priced from FLOP/s is faster on paper
    model = dataclasses.replace(MODEL, num_kv_heads=4)
    w4 = dataclasses.replace(Workload.from_precision(model, "32-true", device="cpu"), allow_table_mismatch=True)
    with pytest.warns(TableMismatchWarning, match="TP \\[4\\] only"):  # no error: priced from FLOP/s
        search(Cluster.from_config(_doc(4, (2,), model=model)), w4, 8, FAST)


def test_no_table_no_rule():
    """Clusters without tables: the search checks nothing (its time unchanged)."""
    doc = _doc(2, (2, 2))
    del doc["layer_times"]
    c = Cluster.from_config(doc)
    assert sources.stage_rule(c, W) is None
    pinned = dataclasses.replace(FAST, recompute=True)
    assert SearchRun(c, W, 8, pinned).ev.stage_ok is None
    assert SearchRun(c, W, 8, dataclasses.replace(pinned, tp_degrees=(2,))).ev.stage_ok is not None


def test_baselines_stay_inside_the_measured_degrees():
    c = Cluster.from_config(_doc(2, (2, 2)))
    for fn in (megatron, metis, uniform_tp):
        res = fn(c, W, 8, FAST)
        assert res.plan is not None, (fn.__name__, res.note)
        assert _cpu_tps(res.plan, c) == {2}, (fn.__name__, res.plan)


def test_the_strategy_plans_inside_the_measured_degrees():
    """HexiScaleStrategy's in-process plan (plan_resolution.plan_for, its one door) goes through the
    same search, so the same restriction."""
    from lightning_hexiscale.lightning.plan_resolution import plan_for

    c = Cluster.from_config(_doc(2, (2,)))
    plan = plan_for(None, c, W, 32, {}, iterations=4)
    assert _cpu_tps(plan, c) == {2}


@pytest.mark.parametrize("recompute", [True, "auto"])
def test_the_tables_are_read_once_per_search(monkeypatch, recompute):
    """search() reads the measured TP degrees once (check_measured_tp) and hands them to every
    SearchRun's StageRule: the subset search runs one per machine subset, ``recompute: auto`` two
    searches. Before, every SearchRun read the tables again (3 reads where one suffices on this
    cluster: check_measured_tp, the whole cluster, one subset)."""
    calls = []
    real = sources.measured_tp_degrees

    def counted(cluster, workload):
        calls.append(cluster.num_devices)
        return real(cluster, workload)

    monkeypatch.setattr(sources, "measured_tp_degrees", counted)
    c = Cluster.from_config(_doc(2, (2, 2), other=2))
    r = search(c, W, 8, dataclasses.replace(FAST, recompute=recompute))
    assert sum(t.status == "searched" for t in r.subsets.trials) > 1  # several SearchRuns
    assert calls == [c.num_devices], calls  # in check_measured_tp, for every run
