"""The plan picture is readable on its own (cli/picture.py): each pipeline row says its batch and
micro-batch in words, each stage box its devices (machine and ids), TP degree and layers, and the
bottleneck stage (slowest stage of the slowest pipeline) is marked; a PNG carries that description."""

from __future__ import annotations

import pytest

from lightning_hexiscale.cli.picture import batch_words, bottleneck, describe, draw_plan, id_ranges, plan_title, read_description
from lightning_hexiscale.cli.train_plan import write_picture
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan, Workload, estimate

PLAN = Plan.from_dict({"num_layers": 4, "pipelines": [
    {"batch_size": 15, "micro_batch_size": 15, "stages": [{"devices": [0], "layers": [0, 4]}]},
    {"batch_size": 17, "micro_batch_size": 1, "stages": [{"devices": [1], "layers": [0, 3]},
                                                          {"devices": [2, 3], "layers": [3, 4]}]}]})


def test_words_and_ids():
    assert id_ranges([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9" and id_ranges([5]) == "5"
    assert batch_words(17, 1) == "batch 17 = 17 micro-batches of 1" and batch_words(15, 15) == "batch 15 = 1 micro-batch of 15"


def test_picture_says_devices_layers_batches_and_the_bottleneck(tmp_path):
    cluster = Cluster.load("cpu_demo")
    est = estimate(PLAN, cluster, Workload.for_cluster(LlamaConfig.load("llama_demo"), cluster))
    doc = describe(PLAN, cluster, est, "t")
    assert doc["rows"] == ["pipeline 0: batch 15 = 1 micro-batch of 15", "pipeline 1: batch 17 = 17 micro-batches of 1"]
    assert doc["boxes"][1][1] == "small: devices 2-3\n2xCPU-SMALL, TP 2\nlayer 3"
    assert doc["boxes"][0][0] == "big: device 0\n1xCPU-BIG, TP 1\nlayers 0-3"
    i = est.bottleneck_pipeline
    times = [s.time_per_micro_batch_s for s in est.pipelines[i].stages]
    assert doc["bottleneck"] == [i, times.index(max(times))] == list(bottleneck(est))
    path = tmp_path / "plan.png"
    draw_plan(PLAN, cluster, path, title="t", estimate=est)
    assert read_description(path) == doc
    draw_plan(PLAN, cluster, tmp_path / "plan.svg", title="t")  # SVG: drawn, without the PNG description
    assert (tmp_path / "plan.svg").stat().st_size > 0
    with pytest.raises(Exception, match="PNG or SVG"):
        draw_plan(PLAN, cluster, tmp_path / "plan.jpg")


def test_the_recipe_and_hexiscale_plan_title_the_picture_alike(tmp_path):
    cluster, model = Cluster.load("cpu_demo"), LlamaConfig.load("llama_demo")
    est = estimate(PLAN, cluster, Workload.for_cluster(model, cluster))
    assert write_picture(PLAN, cluster, model, est, tmp_path / "plan.png") == f"plan picture written to {tmp_path / 'plan.png'}"
    title = read_description(tmp_path / "plan.png")["title"]
    assert title == plan_title(model.name, cluster.name, est)
    assert title.startswith("llama_demo on cpu_demo: ") and "/iteration (estimated), " in title
