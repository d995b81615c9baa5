"""Calibration fits on synthetic data, and check-estimate / calibrate end to end on 2 CPU ranks."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import yaml

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.cluster import Calibration, Cluster
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import estimate
from lightning_hexiscale.profiling.calibrate import (CalibrationSteps, current_efficiency, fit_calibration,
                                                     fit_efficiency, fit_sync_latency, fit_theta, pure_dp_plan,
                                                     single_device_plan, tp_pairs_plan, with_calibration)
from lightning_hexiscale.profiling.check import PlanMeasurement, cpu_workload, deviation
from lightning_hexiscale.profiling.writer import ProfileResult, previous_sync_latency, update_calibration, write_cluster

MODEL = LlamaConfig(name="cal", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                    vocab_size=128, seq_len=32)


def two_type_cluster(tmp_path) -> Cluster:
    n = 4
    bw = np.full((n, n), 1e9)
    np.fill_diagonal(bw, np.inf)
    lat = np.full((n, n), 50e-6)
    np.fill_diagonal(lat, 0)
    p = ProfileResult(hostnames=["h"] * n, device_types=["FAST", "FAST", "SLOW", "SLOW"], flops=[2e11, 2e11, 1e11, 1e11],
                      memory_bytes=[2**30] * n, bandwidth_Bps=bw, latency_s=lat, fit_rel_rms=np.zeros((n, n)),
                      sizes_bytes=[1, 2])
    return Cluster.load(str(write_cluster(p, tmp_path / "c.yaml")[0]))


def test_fit_efficiency_recovers_the_hidden_factor_per_type(tmp_path):
    """Synthetic 'measurements': the true compute rates are 40 % (FAST) and 70 % (SLOW) of the
    profiled matmul rates, with +-2 % noise per rank; the fit recovers them within the noise and
    the refitted cluster then predicts each rank's compute time."""
    c = two_type_cluster(tmp_path)
    truth = {"FAST": 0.4, "SLOW": 0.7}
    one = single_device_plan(MODEL, 2, 3, recompute=True)
    pred = [estimate(one, c.subset([r]), cpu_workload(MODEL)).iteration_time_s for r in range(4)]
    noise = [1.02, 0.98, 1.01, 0.99]
    meas = [p / truth[d.gpu_type] * k for p, d, k in zip(pred, c.devices, noise)]
    eff = fit_efficiency([d.gpu_type for d in c.devices], pred, meas, current_efficiency(c))
    assert eff["FAST"] == pytest.approx(0.4, rel=0.02) and eff["SLOW"] == pytest.approx(0.7, rel=0.02)
    fitted = with_calibration(c, eff)
    for r in range(4):
        t = estimate(one, fitted.subset([r]), cpu_workload(MODEL)).iteration_time_s
        assert abs(deviation(t, meas[r])) < 0.03
    # Multiplicative on top of an existing efficiency: a second fit on the same data changes nothing.
    again = fit_efficiency([d.gpu_type for d in c.devices],
                           [estimate(one, fitted.subset([r]), cpu_workload(MODEL)).iteration_time_s for r in range(4)],
                           meas, current_efficiency(fitted))
    assert again == pytest.approx(eff, rel=1e-9)


def test_fit_theta_recovers_theta_ddp(tmp_path):
    """A pure-DP 'measurement' generated with theta_ddp = 2.5 on a slow link: the fit finds 2.5."""
    c = with_calibration(two_type_cluster(tmp_path), {"FAST": 0.5, "SLOW": 0.5})
    plan = pure_dp_plan(4, MODEL, 2, 2, recompute=False)

    def predict(theta):
        return estimate(plan, with_calibration(c, calibration=replace(c.calibration, theta_ddp=theta)),
                        cpu_workload(MODEL)).iteration_time_s

    assert predict(2.5) > predict(1.0)  # the estimate does depend on theta here
    assert fit_theta(predict, predict(2.5)) == pytest.approx(2.5, rel=0.02)


def test_fit_theta_flat_estimate_prefers_one():
    assert fit_theta(lambda th: 1.0, 0.5) == 1.0
    assert fit_theta(lambda th: 1.0 + max(0.0, th - 2.0), 1.0) == 1.0
    assert fit_theta(lambda th: th, 50.0) == pytest.approx(20.0)  # clamped to the range


def test_with_calibration_keeps_links_and_sets_theta(tmp_path):
    c = two_type_cluster(tmp_path)
    d = with_calibration(c, {"SLOW": 0.5}, Calibration(theta_ddp=1.7))
    assert d.devices[0].flops == c.devices[0].flops and d.devices[2].flops == pytest.approx(0.5e11)
    assert d.calibration.theta_ddp == 1.7 and (d.bandwidth == c.bandwidth).all()


def test_plan_measurement_statistics():
    per_rank = [{"step_s": [1.0, 2.0, 3.0], "optimizer_s": [0.1] * 3, "peak_bytes": 10.0},
                {"step_s": [1.5, 1.0, 4.0], "optimizer_s": [0.2] * 3, "peak_bytes": 20.0}]
    m = PlanMeasurement.from_ranks(per_rank)
    assert m.steps_s == [1.5, 2.0, 4.0]  # the slowest rank per step
    assert m.iteration_s("min") == 1.5 and m.iteration_s("median") == 2.0 and m.optimizer_s == 0.2
    assert m.spread == pytest.approx(2.5 / 2.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_calibrate_and_check_estimate_cli_on_two_ranks(tmp_path, capsys):
    """Profile -> calibrate (writes theta_ddp and efficiency) -> check-estimate --json, 2 CPU ranks."""
    prof = tmp_path / "p.yaml"
    assert main(["profile", "--local", "2", "--out", str(prof), "--sizes", "1KiB,1MiB,8MiB", "--reps", "3",
                 "--matmul-size", "256", "--matmul-time", "0.2"]) == 0
    model = [f"model.{k}={v}" for k, v in MODEL.to_dict().items() if k not in ("rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "max_position_embeddings")]
    assert main(["calibrate", "--local", "2", "--steps", "2", f"cluster={prof}", *model]) == 0
    doc = yaml.safe_load(prof.read_text())
    assert 0 < doc["gpu_types"]["CPU"]["efficiency"] < 10 and 0.1 <= doc["calibration"]["theta_ddp"] <= 20
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(pure_dp_plan(2, MODEL, 2, 1, False).to_dict()))
    capsys.readouterr()
    assert main(["check-estimate", "--local", "2", "--steps", "2", "--plan", str(plan), "--json",
                 f"cluster={prof}", *model]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_s"] > 0 and out["estimated_s"] > 0 and len(out["peak_bytes_per_rank"]) == 2
    assert out["deviation"] == pytest.approx((out["estimated_s"] - out["measured_s"]) / out["measured_s"])


def test_check_estimate_wrong_rank_count(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(pure_dp_plan(2, MODEL, 1, 1, False).to_dict()))
    model = [f"model.{k}={v}" for k, v in MODEL.to_dict().items() if k not in ("rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "max_position_embeddings")]
    assert main(["check-estimate", "--local", "3", "--plan", str(plan), "cluster=cpu2", *model]) == 2
    assert "--local 2" in capsys.readouterr().err


def test_fit_sync_latency_recovers_delta(tmp_path):
    """A TP-2 'measurement' generated with 1.5 ms extra latency per message: the fit finds it."""
    c = with_calibration(two_type_cluster(tmp_path), {"FAST": 0.5, "SLOW": 0.5})
    plan = tp_pairs_plan(4, MODEL, 2, 3, recompute=False)
    assert [p.stages[0].devices for p in plan.pipelines] == [(0, 1), (2, 3)]

    def predict(delta):
        return estimate(plan, with_calibration(c, sync_latency_s=delta), cpu_workload(MODEL)).iteration_time_s

    assert predict(1.5e-3) > predict(0.0)
    assert fit_sync_latency(predict, predict(1.5e-3)) == pytest.approx(1.5e-3, abs=25e-6)
    assert fit_sync_latency(predict, predict(0.0) * 0.5) == 0.0  # cannot go below the link latency


def test_fit_calibration_on_synthetic_steps(tmp_path):
    """Steps generated by the cost model itself with efficiency 0.3, delta 0.8 ms, theta 1.6 are fitted
    back (2 ranks of one type)."""
    c = two_type_cluster(tmp_path).subset([0, 1])
    truth = with_calibration(c, {"FAST": 0.3}, Calibration(theta_ddp=1.6), 0.8e-3)
    w = cpu_workload(MODEL)
    alone = with_calibration(truth, calibration=Calibration())  # a rank alone overlaps nothing: theta 1
    one = estimate(single_device_plan(MODEL, 2, 3, False), alone.subset([0]), w).iteration_time_s
    tp = estimate(tp_pairs_plan(2, MODEL, 2, 3, False), truth, w).iteration_time_s
    dp = estimate(pure_dp_plan(2, MODEL, 2, 3, False), truth, w).iteration_time_s
    steps = CalibrationSteps([[one * 1.1, one], [one, one * 1.2]], [tp, tp * 1.3], [dp * 1.05, dp])
    res = fit_calibration(c, MODEL, steps, 2, 3, False, stat="min")
    assert res.efficiency["FAST"] == pytest.approx(0.3, rel=1e-6)
    assert res.sync_latency_s == pytest.approx(0.8e-3, abs=50e-6)
    assert res.theta_ddp == pytest.approx(1.6, rel=0.03)
    assert res.dp_predicted_s[1] == pytest.approx(dp, rel=0.01) and res.tp_predicted_s[1] == pytest.approx(tp, rel=0.01)
    assert "sync latency" in res.summary()


def test_efficiency_is_fitted_on_the_flops_path_whatever_prices_the_case(tmp_path):
    """With measured layer times in the steps (``calibrate --layer-times``) the efficiency is still
    the FLOPs path's factor, fitted without the table (the same 0.3 as without one), while the rest
    of the fit prices with the table."""
    from lightning_hexiscale.config.layer_table import LayerTable, LayerTimeRow, ModelShape

    c = two_type_cluster(tmp_path).subset([0, 1])
    truth = with_calibration(c, {"FAST": 0.3}, Calibration(theta_ddp=1.6), 0.8e-3)
    w = cpu_workload(MODEL)
    alone = with_calibration(truth, calibration=Calibration())
    one = estimate(single_device_plan(MODEL, 2, 3, False), alone.subset([0]), w).iteration_time_s
    tp = estimate(tp_pairs_plan(2, MODEL, 2, 3, False), truth, w).iteration_time_s
    dp = estimate(pure_dp_plan(2, MODEL, 2, 3, False), truth, w).iteration_time_s
    table = LayerTable("FAST", "32-true", ModelShape.of(MODEL), (LayerTimeRow("layer", 1, 2, 1e-4, 2e-4),
                                                                  LayerTimeRow("layer", 2, 2, 0.6e-4, 1.2e-4)))
    steps = CalibrationSteps([[one], [one]], [tp], [dp], (table,))
    res = fit_calibration(c, MODEL, steps, 2, 3, False, stat="min")
    assert res.efficiency["FAST"] == pytest.approx(0.3, rel=1e-6) and res.layer_tables == (table,)
    # the TP and DP plans were priced with the table: layer times far below the FLOPs figures
    assert res.tp_predicted_s[0] < estimate(tp_pairs_plan(2, MODEL, 2, 3, False), with_calibration(c, {"FAST": 0.3}), w
                                            ).iteration_time_s


def test_sync_latency_is_written_to_the_matrix_and_replaced_on_recalibration(tmp_path):
    path = tmp_path / "c.yaml"
    two_type_cluster(tmp_path)
    link = Cluster.load(str(path)).latency.copy()
    update_calibration(path, {"theta_ddp": 1.2}, {}, sync_latency_s=1e-3)
    assert previous_sync_latency(path) == 1e-3
    np.testing.assert_allclose(Cluster.load(str(path)).latency, link + 1e-3 * (1 - np.eye(4)))
    update_calibration(path, {}, {}, sync_latency_s=2e-4)  # replaces delta, does not add to it
    np.testing.assert_allclose(Cluster.load(str(path)).latency, link + 2e-4 * (1 - np.eye(4)))
    assert Cluster.load(str(path)).calibration.theta_ddp == 1.2


# ---- measured in the run's precision (issue 20) ---------------------------------------------------
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")


def _matmul_dtypes_rank(rank: int, world: int, precision: str | None) -> dict:
    """Per measurement (profile, calibration compute, a TP plan as check-estimate and calibrate run
    it): the dtypes of the first input of every matmul / attention kernel the rank ran, recorded by
    a dispatch mode (below autocast: what the kernels really got)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_hexiscale.profiling.calibrate import measure_compute_rank
    from lightning_hexiscale.profiling.check import measure_plan_rank
    from lightning_hexiscale.profiling.measure import profile_process_group

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in MATMULS:
                self.dtypes.add(next(a for a in args if isinstance(a, torch.Tensor)).dtype)
            return func(*args, **(kwargs or {}))

    tp = tp_pairs_plan(world, MODEL, 1, 2, False).to_dict()
    runs = {"profile": lambda: profile_process_group(sizes=[1024, 1 << 20, 8 << 20], reps=3, matmul_n=32, matmul_time_s=0.01,
                                                     precision=precision),
            "compute": lambda: measure_compute_rank(rank, world, MODEL, 1, 2, False, 1, 0, precision),
            "plan": lambda: measure_plan_rank(rank, world, tp, MODEL, 1, 0, precision)}
    out = {}
    for name, run in runs.items():
        with Kernels() as k:
            res = run()
        out[name] = k.dtypes
        if name == "profile" and rank == 0:
            out["flops_dtype"] = res.flops_dtype
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision,dtype", [(None, "float32"), ("64-true", "float64"), ("bf16-mixed", "bfloat16"),
                                             ("bf16-true", "bfloat16")])
def test_profile_calibrate_and_check_measure_in_the_runs_dtype(precision, dtype):
    """On main the profile measured bf16 on CUDA while calibration and check-estimate trained float32;
    now all three run their matmuls in the requested precision's compute dtype (default on CPU: 32-true)."""
    import torch

    from lightning_hexiscale.profiling.launch import run_local

    want = getattr(torch, dtype)
    results = run_local(2, _matmul_dtypes_rank, precision, timeout_s=50)
    for rank, got in enumerate(results):
        for name in ("profile", "compute", "plan"):
            assert got[name] == {want}, (rank, name, got[name])
    assert results[0]["flops_dtype"] == dtype


def test_cli_passes_the_precision_and_its_default(monkeypatch, tmp_path, capsys):
    """--precision reaches the measurement and the estimate of profile, calibrate and check-estimate;
    without it, --local CPU ranks measure in 32-true; a bad value is an argparse error naming the rule."""
    import lightning_hexiscale.profiling.calibrate as cal
    import lightning_hexiscale.profiling.check as chk
    import lightning_hexiscale.profiling.launch as launch

    seen = {}
    monkeypatch.setattr(launch, "run_local", lambda n, fn, opts, *rest, **kw: seen.update(profile=opts["precision"]) or [None])
    monkeypatch.setattr(cal, "calibrate", lambda *a: seen.update(calibrate=a[10]))  # (..., stat, precision, layer_opts)
    monkeypatch.setattr(chk, "check", lambda *a: seen.update(check=a[-1]))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(pure_dp_plan(2, MODEL, 1, 1, False).to_dict()))
    model = [f"model.{k}={v}" for k, v in MODEL.to_dict().items() if k not in ("rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "max_position_embeddings")]
    prof = tmp_path / "c.yaml"
    two_type_cluster(tmp_path)
    for extra, want in (([], "32-true"), (["--precision", "64-true"], "64-true")):
        seen.clear()
        main(["profile", "--local", "2", *extra])  # (the stub's None reads as "not rank 0": nothing written)
        main(["calibrate", "--local", "4", *extra, f"cluster={prof}", *model])
        main(["check-estimate", "--local", "2", *extra, "--plan", str(plan), "cluster=cpu2", *model])
        assert seen == {"profile": want, "calibrate": want, "check": want}
    with pytest.raises(SystemExit):
        main(["calibrate", "--local", "2", "--precision", "16-mixed", f"cluster={prof}"])
    assert "needs a gradient scaler" in capsys.readouterr().err
    assert chk.cpu_workload(MODEL, "64-true").dtype == "fp64"
    assert chk.cpu_workload(MODEL, "64-true").optimizer_bytes_per_param == 16  # AdamW m, v in float64


def _fitted(sync_latency_s: float):
    from lightning_hexiscale.profiling.calibrate import CalibrationResult

    return CalibrationResult({"FAST": 0.5, "SLOW": 0.5}, sync_latency_s, 1.5, [1.0] * 4, [1.0] * 4, 1.0, (1.0, 1.0),
                             1.0, (1.0, 1.0))


@pytest.mark.parametrize("folder_exists", [True, False])
def test_calibrate_out_leaves_the_source_and_its_matrix_alone(folder_exists, monkeypatch, tmp_path, capsys):
    """--out into a new folder: the copy gets its own matrix file, which takes the fitted sync
    latency; the source's files stay byte for byte. Before: a FileNotFoundError traceback after the
    measurement (missing folder), and with an existing folder the fit rewrote the SOURCE's matrix."""
    import lightning_hexiscale.profiling.calibrate as cal

    two_type_cluster(tmp_path)
    src, msrc = tmp_path / "c.yaml", tmp_path / "c.matrix.yaml"
    before = (src.read_bytes(), msrc.read_bytes(), Cluster.load(str(src)).latency.copy())
    monkeypatch.setattr(cal, "calibrate", lambda *a: _fitted(1e-3))
    out = tmp_path / "new" / "cal.yaml"
    if folder_exists:
        out.parent.mkdir()
    assert main(["calibrate", "--local", "4", "--out", str(out), f"cluster={src}"]) == 0
    assert (src.read_bytes(), msrc.read_bytes()) == before[:2]
    assert yaml.safe_load(out.read_text())["matrix_file"] == str(tmp_path / "new" / "cal.matrix.yaml")
    calibrated = Cluster.load(str(out))
    np.testing.assert_allclose(calibrated.latency, before[2] + 1e-3 * (1 - np.eye(4)))
    assert calibrated.calibration.theta_ddp == 1.5 and previous_sync_latency(out) == 1e-3


def test_calibrate_refuses_a_bad_out_before_measuring(monkeypatch, tmp_path, capsys):
    import lightning_hexiscale.profiling.calibrate as cal

    two_type_cluster(tmp_path)
    ran = []
    monkeypatch.setattr(cal, "calibrate", lambda *a: ran.append(a) or _fitted(0.0))
    assert main(["calibrate", "--local", "4", "--out", str(tmp_path), f"cluster={tmp_path / 'c.yaml'}"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a directory" in err and "Traceback" not in err and not ran


@pytest.mark.parametrize("command", ["calibrate", "check-estimate"])
def test_a_negative_warmup_is_refused_before_any_rank_starts(command, tmp_path, capsys):
    """--warmup -1 ran warmup + steps steps and timed them all: one step fewer than --steps, and with
    --steps 1 none, a StatisticsError traceback from every rank ('no median for empty data')."""
    two_type_cluster(tmp_path)
    extra = ["--plan", str(tmp_path / "p.yaml")] if command == "check-estimate" else []
    with pytest.raises(SystemExit) as e:
        main([command, "--local", "4", "--warmup", "-1", "--steps", "1", *extra, f"cluster={tmp_path / 'c.yaml'}"])
    assert e.value.code == 2 and "argument --warmup: must be >= 0, got -1" in capsys.readouterr().err


def test_a_cluster_file_that_cannot_take_the_fit_is_refused_before_measuring(monkeypatch, tmp_path, capsys):
    """A preset-style YAML (no gpu_types, no matrix_file): calibrate measured for the whole run, then
    died with "KeyError: device type 'CPU-FAST' is not under gpu_types"."""
    import shutil

    import lightning_hexiscale.profiling.calibrate as cal
    from lightning_hexiscale.config import conf_dir

    own = tmp_path / "cpu2.yaml"
    shutil.copyfile(conf_dir() / "cluster" / "cpu2.yaml", own)
    ran = []
    monkeypatch.setattr(cal, "calibrate", lambda *a: ran.append(a) or _fitted(0.0))
    assert main(["calibrate", "--local", "2", f"cluster={own}"]) == 2
    err = capsys.readouterr().err
    assert f"cluster = '{own}'" in err and "lacks gpu_types entries for CPU-FAST and a matrix_file" in err
    assert "hexiscale profile --local 2" in err and not ran


def test_the_trainer_precision_override_is_what_they_measure_in(monkeypatch, tmp_path, capsys):
    """calibrate and check-estimate compose the run's configuration, and their --help offers
    trainer.precision=...; it was ignored (\"measured in 32-true\" for trainer.precision=64-true)."""
    import lightning_hexiscale.profiling.calibrate as cal
    import lightning_hexiscale.profiling.check as chk

    seen = {}
    monkeypatch.setattr(cal, "calibrate", lambda *a: seen.update(calibrate=a[10]))  # (..., stat, precision, layer_opts)
    monkeypatch.setattr(chk, "check", lambda *a: seen.update(check=a[-1]))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(pure_dp_plan(2, MODEL, 1, 1, False).to_dict()))
    two_type_cluster(tmp_path)
    main(["calibrate", "--local", "4", f"cluster={tmp_path / 'c.yaml'}", "trainer.precision=64-true"])
    # the plan has no meta: model= names the model it is checked on (without it: refused, not the default)
    main(["check-estimate", "--local", "2", "--plan", str(plan), "cluster=cpu2", "model=llama_demo",
          "trainer.precision=64-true"])
    assert seen == {"calibrate": "64-true", "check": "64-true"}
    assert main(["check-estimate", "--local", "2", "--precision", "32-true", "--plan", str(plan), "cluster=cpu2",
                 "model=llama_demo", "trainer.precision=64-true"]) == 2
    assert "--precision = '32-true': differs from trainer.precision=64-true" in capsys.readouterr().err
