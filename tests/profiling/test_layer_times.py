"""Measuring layer times on the ranks (profiling/layer_times.py): a local 2-rank CPU run, the table
the cost model reads from it, the CLI path (``hexiscale profile --model``) and its bad input."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Workload
from lightning_hexiscale.planner.cost.estimate import layer_times
from lightning_hexiscale.profiling.launch import run_local
from lightning_hexiscale.profiling.layer_times import default_tp_degrees, measure_layer_tables, tp_groups

SMALL = dataclasses.replace(LlamaConfig.load("llama_tiny"), seq_len=32, vocab_size=64)


def _measure(rank: int, world: int):
    return measure_layer_tables(SMALL, [1, 2], "32-true", tp_degrees=[1, 2], reps=2, warmup=1,
                                types=["CPU"] * world, machines=[[0, 1]])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_cpu_ranks_measure_every_part_tp_degree_and_micro_batch():
    (table,) = run_local(2, _measure, timeout_s=100)[0]
    assert table.gpu == "CPU" and table.precision == "32-true" and table.model_name == "llama_tiny"
    cases = {(r.part, r.tp, r.micro_batch) for r in table.rows}
    assert cases == {(p, t, m) for p in ("layer", "head", "embedding") for t in (1, 2) for m in (1, 2)}
    for r in table.rows:
        assert 0 < r.forward_s < 5 and 0 < r.backward_s < 5, r
        assert (r.backward_recompute_s is not None) == (r.part == "layer"), r
    # the cost model prices those cases from it: a cluster of these two ranks with the table
    c = Cluster.from_config({"name": "two", "machines": [{"gpu": "CPU", "count": 2, "intra_bandwidth": "1 GB/s"}],
                             "gpu_types": {"CPU": {"flops": "1 GFLOPS", "memory": "1 GiB", "efficiency": 1.0}},
                             "layer_times": [table.to_config()]})
    w = Workload.from_precision(SMALL, "32-true", device="cpu")
    row = next(r for r in table.rows if (r.part, r.tp, r.micro_batch) == ("layer", 2, 2))
    # the cluster file holds the times to 6 significant digits ("{ms:.6g} ms"): up to 5e-6 relative
    # off the measured float, more than pytest.approx's default 1e-6 for some measured values
    assert layer_times(c, w, [0, 1], 2, False)[:2] == (pytest.approx(row.forward_s, rel=1e-5),
                                                       pytest.approx(row.backward_s, rel=1e-5))


def test_tp_degrees_and_groups():
    assert default_tp_degrees([8, 8, 4], 8) == [1, 2, 4, 8]
    assert default_tp_degrees([6], 32) == [1, 2, 4, 6]
    assert default_tp_degrees([8], 2) == [1, 2]  # a TP rank needs a KV head
    assert tp_groups([[0, 1, 2], [3, 4, 5, 6]], 2) == [(0, 1), (3, 4), (5, 6)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_profile_with_a_model_writes_the_table(tmp_path, capsys):
    out = tmp_path / "measured.yaml"
    rc = main(["profile", "--local", "2", "--out", str(out), "--sizes", "1KiB,1MiB,8MiB", "--reps", "3",
               "--matmul-size", "64", "--matmul-time", "0.05", "--model", "llama_tiny", "--seq-len", "32",
               "--layer-micro-batches", "1", "--layer-tp", "1,2", "--layer-reps", "1", "--timeout", "100"])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    (table,) = Cluster.load(str(out)).layer_tables
    assert table.gpu == "CPU" and table.shape.seq_len == 32
    assert {(r.part, r.tp) for r in table.rows} == {(p, t) for p in ("layer", "head", "embedding") for t in (1, 2)}


@pytest.mark.parametrize("argv", [
    ["profile", "--local", "2", "--out", "never.yaml", "--model", "llama_tiny"],
    ["discover", "--local", "2", "--out", "never.yaml", "--model", "llama_tiny"],
])
def test_a_tp_degree_the_heads_do_not_allow_stops_before_any_rank_starts(capsys, tmp_path, monkeypatch, argv):
    """The fix names other degrees to measure: it said "use a stage with at most 2 devices", a plan's fix,
    to a flag that names no stage (``calibrate --layer-tp`` checks alike: ``LlamaConfig.check_measured_tp``)."""
    monkeypatch.chdir(tmp_path)
    rc = main([*argv, "--layer-tp", "1,4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--layer-tp = 4" in err and "2 KV heads" in err, err
    assert "Fix: measure TP degrees between 1 and 2, e.g. --layer-tp 1,2" in err and "stage" not in err, err
    assert not (tmp_path / "never.yaml").exists()
