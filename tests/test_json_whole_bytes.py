"""Byte counts in the JSON documents other programs read are JSON integers: ``hexiscale estimate --json``
and ``plan --json`` wrote ``"peak_memory_bytes": 1090011264.0`` (the cost model's float arithmetic),
and ``check-estimate --json`` its peaks likewise, so a consumer's ``isinstance(x, int)`` failed. Times
stay floats; counts (batches, layers, TP degrees, devices) were and stay integers."""

from __future__ import annotations

import json

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.planner.cost.estimate import whole_bytes

COUNTS = ("global_batch", "batch", "micro_batch", "num_micro_batches", "tp", "layers", "devices", "bottleneck_pipeline",
          "batch_size", "micro_batch_size", "idle_devices", "device")


def leaves(doc, key=""):
    """(key, value) of every number in ``doc``, the key of a list's items being the list's."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from leaves(v, k)
    elif isinstance(doc, list):
        for v in doc:
            yield from leaves(v, key)
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield key, doc


def check_types(doc) -> int:
    seen = 0
    for key, value in leaves(doc):
        if "bytes" in key.split("_") or key in COUNTS:
            assert isinstance(value, int), (key, value)
            seen += "bytes" in key.split("_")
        if key.endswith("_s"):
            assert isinstance(value, float), (key, value)
    return seen


def test_estimate_json_writes_byte_counts_as_integers(capsys):
    assert main(["estimate", "--plan", "tests/bad_configs/good_tiny_plan.yaml", "cluster=cpu_hetero4",
                 "model=llama_tiny", "--json"]) == 0
    assert check_types(json.loads(capsys.readouterr().out)) >= 2


def test_plan_json_writes_byte_counts_as_integers(capsys):
    assert main(["plan", "cluster=cpu_hetero4", "model=llama_tiny", "train.global_batch=8", "planner.iterations=2",
                 "--json"]) == 0
    assert check_types(json.loads(capsys.readouterr().out)) >= 2


def test_whole_bytes_rounds_every_byte_count_and_nothing_else():
    doc = {"out_of_memory": [{"device": 3, "needed_bytes": 5.5e9, "available_bytes": 4294967296.0}],
           "peak_bytes_per_rank": [1.0e6, 2.5], "estimated_peak_bytes_per_stage": [[3.0e9, 7.0]],
           "time_s": 2.0, "pflops": 1.0, "huge_bytes": float("inf")}
    out = whole_bytes(doc)
    assert out["out_of_memory"] == [{"device": 3, "needed_bytes": 5500000000, "available_bytes": 4294967296}]
    assert out["peak_bytes_per_rank"] == [1000000, 2] and out["estimated_peak_bytes_per_stage"] == [[3000000000, 7]]
    assert all(isinstance(v, int) for v in out["peak_bytes_per_rank"])
    assert isinstance(out["time_s"], float) and isinstance(out["pflops"], float)
    assert out["huge_bytes"] == float("inf")  # the writer nulls or refuses it, as before
