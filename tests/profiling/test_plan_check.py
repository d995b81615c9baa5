"""The comparison behind the training-time plan check (profiling/check.py: compare_run, RunCheck): the
step and per-stage times against the plan's estimate, the stage furthest from its price, the 25 %
warning and what it tells the user to do, the JSON fields, and the strategy's plan_check setting."""

from __future__ import annotations

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload, estimate
from lightning_hexiscale.profiling.check import compare_run

TINY = LlamaConfig.load("llama_tiny")
CLUSTER = Cluster.load("cpu_hetero4")
# pipeline 0: devices 0 -> 1 (two stages); pipeline 1: devices 2 and 3 as one TP-2 stage
PLAN = Plan.from_dict({"num_layers": 4, "schedule": "1f1b", "recompute": False, "pipelines": [
    {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [0], "layers": [0, 2]},
                                                        {"devices": [1], "layers": [2, 4]}]},
    {"batch_size": 4, "micro_batch_size": 2, "stages": [{"devices": [2, 3], "layers": [0, 4]}]}]})
EST = estimate(PLAN, CLUSTER, Workload.from_precision(TINY, "32-true", device="cpu"))


def priced(i: int, j: int) -> float:
    s = EST.pipelines[i].stages[j]
    return s.compute_s + s.tp_comm_s


def times(step_scale: float, busy_scale: dict[tuple[int, int], float]):
    """Per rank (plan rank order = devices 0-3): 3 steps of wall time, and busy time per stage."""
    where = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 0)}
    step = [[EST.iteration_time_s * step_scale * f for f in (1.0, 1.1, 0.9)] for _ in range(4)]
    busy = [[priced(*where[r]) * busy_scale.get(where[r], 1.0)] * 3 for r in range(4)]
    return step, busy


def test_on_price_no_warning_and_the_line_names_the_furthest_stage():
    step, busy = times(1.1, {(0, 1): 1.3, (1, 0): 0.95})
    r = compare_run(PLAN, EST, step, busy, warmup_steps=5)
    assert r.measured_step_s == pytest.approx(EST.iteration_time_s * 1.1)  # median of the slowest rank's steps
    assert (r.worst.pipeline, r.worst.stage) == (0, 1) and r.worst.ratio == pytest.approx(1.3)
    assert not r.off and r.warning("llama_tiny") is None
    line = r.line()
    assert line.startswith("hexiscale plan check (3 steps after 5 warm-up): step estimated")
    assert "(1.10x)" in line and "pipeline 0 stage 1 (devices [1], TP 1)" in line and "\n" not in line


def test_more_than_25_percent_off_warns_with_the_stage_and_the_fix():
    step, busy = times(1.4, {(1, 0): 0.4, (0, 0): 1.5})  # 0.4x is further from 1 than 1.5x
    r = compare_run(PLAN, EST, step, busy, warmup_steps=5)
    assert r.off and (r.worst.pipeline, r.worst.stage) == (1, 0)
    text = r.warning("llama_tiny")
    for words in ("40 % slower than priced", "more than 25% off", "pipeline 1 stage 0 on devices [2, 3]",
                  "hexiscale discover --rediscover", "hexiscale profile --model llama_tiny"):
        assert words in text, (words, text)
    assert compare_run(PLAN, EST, *times(0.7, {}), warmup_steps=5).warning().count("faster than priced") == 1
    assert not compare_run(PLAN, EST, *times(1.24, {}), warmup_steps=5).off


def test_the_fix_follows_what_priced_the_furthest_stage():
    """Declared or datasheet figures: measure the machine (cluster=auto / discover --out), not
    ``--rediscover`` of a cluster that was never discovered; measured tables: measure again."""
    from lightning_hexiscale.planner.cost.sources import PriceSource

    r = compare_run(PLAN, EST, *times(1.4, {(1, 0): 0.4}), warmup_steps=5)  # worst: devices [2, 3]
    declared = PriceSource("CPU-SMALL", "declared", "40 GFLOPS")
    table = PriceSource("CPU-BIG", "layer table", "llama_tiny")
    text = r.warning("llama_tiny", {0: table, 1: table, 2: declared, 3: declared})
    for words in ("CPU-SMALL (declared)", "cluster=auto", "hexiscale discover --model llama_tiny --out cluster.yaml",
                  "hexiscale profile --model llama_tiny"):
        assert words in text, (words, text)
    assert "--rediscover" not in text and "CPU-BIG" not in text
    measured = r.warning("llama_tiny", {d: table for d in range(4)})
    assert "hexiscale discover --rediscover" in measured and "cluster=auto" not in measured


def test_the_document_has_every_stage_priced_and_measured():
    r = compare_run(PLAN, EST, *times(1.0, {(0, 0): 2.0}), warmup_steps=2)
    doc = r.to_dict()
    assert doc["worst_stage"] == {"pipeline": 0, "stage": 0} and doc["warmup_steps"] == 2
    assert [(s["pipeline"], s["stage"], s["devices"]) for s in doc["stages"]] == [(0, 0, [0]), (0, 1, [1]),
                                                                                   (1, 0, [2, 3])]
    assert doc["stages"][0]["measured_s"] == pytest.approx(2 * doc["stages"][0]["estimated_s"])


def test_ranks_must_report_alike():
    step, busy = times(1.0, {})
    step[2] = step[2][:2]
    with pytest.raises(ValueError, match="same"):
        compare_run(PLAN, EST, step, busy, warmup_steps=5)


def test_plan_check_setting():
    from lightning_hexiscale.lightning.plan_check import DEFAULT_WARMUP, plan_check_setting

    assert plan_check_setting(True) == DEFAULT_WARMUP == 5 and plan_check_setting(None) is None
    assert plan_check_setting(False) is None and plan_check_setting(0) == 0 and plan_check_setting(7) == 7
    for bad in (-1, 2.5, "5"):
        with pytest.raises(ConfigError) as e:
            plan_check_setting(bad)
        assert e.value.key == "HexiScaleStrategy(plan_check)"
