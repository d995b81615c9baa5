"""The search's batch timer and ``estimate()`` price a plan alike (issue 42, item 5): both compose
the stage terms through one function (planner/cost/compose.py), so for any plan and batches the
timer's pipeline times are ``estimate()``'s, bit for bit, and its best split is priced by
``estimate()`` at exactly the cost it reports. The vectorised large-cluster path
(``BatchTimer.abc_all``) sums the same terms in another order: equal to float rounding.

Plans: random layouts (devices, pipelines, stages, TP groups, layer splits, micro-batches, per
pipeline recomputation) under every sharding and schedule, on hand-made clusters and presets."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate
from lightning_hexiscale.planner.search.batching import BatchTimer, with_batches

from planner_clusters import STRAGGLER, two_islands

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # datasheet pricing

SHARDINGS = ("ddp", "zero2", "zero3")
SCHEDULES = ("1f1b", "gpipe")


def _clusters() -> dict[str, Cluster]:
    return {"islands": two_islands(), "straggler": Cluster.from_config(STRAGGLER),
            "hetero1": Cluster.load("hetero1"), "cpu_hetero8": Cluster.load("cpu_hetero8")}


CLUSTERS = _clusters()
WORKLOADS = {"tiny": Workload(LlamaConfig.load("llama_tiny")),
             "tiny_cuda_buffers": Workload(LlamaConfig.load("llama_tiny"), device="cuda"),
             # the first/last-stage exchange of a tied embedding (estimate.tied_exchange_s)
             "tiny_tied": Workload(dataclasses.replace(LlamaConfig.load("llama_tiny"), tie_word_embeddings=True))}


def random_plan(rng: random.Random, cluster: Cluster, num_layers: int) -> Plan:
    """A valid-shaped plan: a random subset of devices in 1-3 pipelines of 1-num_layers stages,
    TP groups of 1 or 2 devices, each stage >= 1 layer, micro-batches 1-2 x 1-4, sharding,
    schedule and per-pipeline recomputation drawn."""
    devices = list(range(cluster.num_devices))
    rng.shuffle(devices)
    P = rng.randint(1, min(3, len(devices)))
    pipes = []
    for i in range(P):
        S, groups = rng.randint(1, num_layers), []
        while len(groups) < S and len(devices) > P - 1 - i:  # a device left for each later pipeline
            tp = 2 if len(devices) - (P - 1 - i) >= 2 and rng.random() < 0.3 else 1
            groups.append(tuple(devices.pop() for _ in range(tp)))
        cuts = sorted(rng.sample(range(1, num_layers), len(groups) - 1))
        bounds = [0, *cuts, num_layers]
        stages = tuple(Stage(g, (bounds[j], bounds[j + 1])) for j, g in enumerate(groups))
        m, n = rng.randint(1, 2), rng.randint(1, 4)
        pipes.append(Pipeline(m * n, m, stages, rng.random() < 0.5))
    return Plan(tuple(pipes), num_layers, schedule=rng.choice(SCHEDULES), recompute=None,
                dp_sharding=rng.choice(SHARDINGS))


def _timer_pipeline_times(timer: BatchTimer, plan: Plan) -> list[float]:
    dp, edges = timer.dp(plan), timer.edges(plan)
    out = []
    for i, p in enumerate(plan.pipelines):
        A, B, C = timer.abc(plan, i, dp, edges, p.micro_batch_size)
        out.append((A + (p.num_micro_batches - 1) * B) + C)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), cluster=st.sampled_from(sorted(CLUSTERS)),
       work=st.sampled_from(sorted(WORKLOADS)))
def test_the_batch_timer_prices_every_pipeline_as_estimate_does(seed, cluster, work):
    c, w = CLUSTERS[cluster], WORKLOADS[work]
    plan = random_plan(random.Random(seed), c, w.model.num_layers)
    est = estimate(plan, c, w)
    timer = BatchTimer(c, w, plan.global_batch)
    assert _timer_pipeline_times(timer, plan) == [p.time_s for p in est.pipelines]  # bit for bit
    A, B, C = timer.abc_all(plan, timer.dp(plan), timer.edges(plan), 1)
    scalar = [timer.abc(plan, i, timer.dp(plan), timer.edges(plan), 1) for i in range(plan.num_pipelines)]
    np.testing.assert_allclose(np.stack([A, B, C], axis=1), np.array(scalar), rtol=1e-12, atol=0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), cluster=st.sampled_from(sorted(CLUSTERS)))
def test_the_best_split_is_priced_by_estimate_at_the_timers_cost(seed, cluster):
    c, w = CLUSTERS[cluster], WORKLOADS["tiny"]
    layout = random_plan(random.Random(seed), c, w.model.num_layers)
    G = max(layout.global_batch, layout.num_pipelines)
    cost, best = BatchTimer(c, w, G, [1, 2, 4]).best(layout)
    if best is None:
        assert cost == float("inf")
        return
    assert best.global_batch == G
    assert estimate(best, c, w).iteration_time_s == cost  # bit for bit


@pytest.mark.parametrize("name,model,gb", [("hetero3", "llama_30b", 128), ("homo_a800_2x8_rdma", "llama2_7b", 64)])
def test_presets_plans_from_the_search_are_priced_alike(name, model, gb):
    """A few layouts on presets with the paper's models: every batch split the timer reports."""
    c, w = Cluster.load(name), Workload(LlamaConfig.load(model))
    rng = random.Random(7)
    timer = BatchTimer(c, w, gb, [1, 2, 4])
    for _ in range(6):
        layout = random_plan(rng, c, w.model.num_layers)
        layout = with_batches(layout, [1] * layout.num_pipelines, [1] * layout.num_pipelines)
        assert _timer_pipeline_times(timer, layout) == [p.time_s for p in estimate(layout, c, w).pipelines]
        cost, best = timer.best(layout)
        if best is not None:
            assert estimate(best, c, w).iteration_time_s == cost
