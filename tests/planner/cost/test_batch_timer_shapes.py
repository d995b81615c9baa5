"""The batch timer memoises per-group terms by the group's shape (planner/search/batching.py,
``BatchTimer.shape``): groups of one shape must price alike, groups that differ in any input of
the terms must not share a memo entry. Each memoised term is compared with the direct pricing."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.cost import estimate as E
from lightning_hexiscale.planner.search.batching import BatchTimer

# two A800 machines of 4 (NVLink), a third of 4 A800s on PCIe, one machine of two RTX 4090s:
# pairs (0, 1) and (4, 5) have one shape; (8, 9) differs in links only, (12, 13) in figures only
# by type; (3, 4) spans two machines
MIXED = {
    "name": "shapes",
    "machines": [{"name": "a", "gpu": "A800", "count": 4, "intra_bandwidth": "200 GB/s"},
                 {"name": "b", "gpu": "A800", "count": 4, "intra_bandwidth": "200 GB/s"},
                 {"name": "c", "gpu": "A800", "count": 4, "intra_bandwidth": "16 GB/s"},
                 {"name": "d", "gpu": "RTX4090", "count": 2, "intra_bandwidth": "200 GB/s"}],
    "inter_machine": {"bandwidth": "1 GB/s", "latency": "50us"},
}
GROUPS = [(0, 1), (4, 5), (8, 9), (12, 13), (3, 4), (0, 1, 2, 3), (8, 9, 10, 11), (0,), (12,)]


@pytest.fixture(scope="module")
def timer():
    cluster = Cluster.from_config(MIXED)
    w = E.Workload(LlamaConfig.load("llama2_7b"))
    return BatchTimer(cluster, w, 16, [1, 2, 4])


def test_each_memoised_term_equals_the_direct_pricing(timer):
    c, w = timer.cluster, timer.w
    for m in (1, 2, 4):
        for g in GROUPS:
            assert timer.layer_tb(g, m, False) == E.layer_times(c, w, g, m, False)[:2], (g, m)
            for first, last in ((True, False), (False, True), (True, True)):
                comp, comm = E.stage_extra_times(c, w, g, m, first, last)
                assert timer.extra(g, m, first, last) == comp + comm, (g, m, first, last)
    hops = [((0, 1), (2, 3)), ((4, 5), (6, 7)), ((8, 9), (10, 11)), ((3,), (4,)), ((0,), (12,)), ((12, 13), (0, 1))]
    for m in (1, 4):
        for src, dst in hops:
            assert timer.hop(src, dst, m, ()) == E.hop_time(c, w, src, dst, m, ()), (src, dst, m)


def test_shapes_tell_apart_links_types_and_machines(timer):
    shape = timer.shape
    assert shape((0, 1)) == shape((4, 5))  # the same hardware on another machine: one entry
    assert shape((0, 1)) != shape((8, 9))  # same type, other links
    assert shape((0, 1)) != shape((12, 13))  # same links, other type
    assert shape((3, 4)) != shape((2, 3))  # across machines vs inside one
    # and the terms do differ where the shapes do (the memo would have hidden it)
    assert timer.layer_tb((0, 1), 2, False) != timer.layer_tb((8, 9), 2, False)
    assert timer.layer_tb((0, 1), 2, False) != timer.layer_tb((12, 13), 2, False)


def _one_pipeline(groups, num_layers: int):
    from lightning_hexiscale.planner import Pipeline, Plan, Stage

    cuts = [round(num_layers * k / len(groups)) for k in range(len(groups) + 1)]
    stages = tuple(Stage(g, (cuts[j], cuts[j + 1])) for j, g in enumerate(groups))
    return Plan((Pipeline(16, 1, stages, True),), num_layers, dp_sharding="ddp")


def test_whole_pipelines_are_memoised_by_shape_not_by_devices():
    """A pipeline dealt onto another machine of the same hardware reuses the memo entry; one whose
    stages differ in links, type or in the hop between them is priced anew, and every price is the
    one estimate() gives (bit for bit), with the memo shared across all these layouts."""
    from lightning_hexiscale.planner import estimate

    c = Cluster.from_config(MIXED)
    w = E.Workload(LlamaConfig.load("llama_tiny"))  # fits on every stage, the 4090s included
    timer = BatchTimer(c, w, 16, [1, 2, 4])
    cases = {
        "on a": [(0, 1), (2, 3)],
        "on b": [(4, 5), (6, 7)],  # the same hardware as on a: shares a's entry
        "on c": [(8, 9), (10, 11)],  # PCIe links inside the stages
        "a then d": [(0, 1), (12, 13)],  # another type in the second stage
        "across a and b": [(2, 3), (4, 5)],  # the hop between the stages crosses machines
        "one device a stage on a": [(0,), (1,)],
        "one device a stage on c": [(8,), (9,)],  # stages alike, the link between them is PCIe
    }
    costs = {}
    for name, groups in cases.items():
        before = len(timer._pipe)
        cost, plan = timer.best(_one_pipeline(groups, w.model.num_layers))
        assert plan is not None and estimate(plan, c, w).iteration_time_s == cost, name
        costs[name] = cost
        assert len(timer._pipe) == before + (name != "on b"), name
    assert costs["on a"] == costs["on b"]
    apart = ("on a", "on c", "a then d", "across a and b", "one device a stage on a", "one device a stage on c")
    assert len({costs[k] for k in apart}) == len(apart)
