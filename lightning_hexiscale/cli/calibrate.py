"""`hexiscale calibrate` and `hexiscale check-estimate` (command-line side; the work is in :mod:`lightning_hexiscale.profiling`).

    hexiscale calibrate --local 2 cluster=outputs/cpu2.yaml model=llama_tiny
    hexiscale check-estimate --local 2 --plan my_plan.yaml cluster=outputs/cpu2.yaml model=llama_tiny

Both run real training steps with the runtime engine: on ``--local N`` forked CPU ranks, or under
torchrun / SLURM / Lightning's launcher (every rank runs the command; rank 0 prints and writes). They
measure in ``--precision`` or the ``trainer.precision=`` override (the run's; default 32-true on CPU
ranks, bf16-mixed on CUDA) and the estimates price that dtype.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from lightning_hexiscale.cli.common import (add_launch_args, add_precision_arg, apply_train_overrides,
                                            check_output_file, compose_plan_config, explicit, non_negative_int,
                                            plan_override, plan_source, positive_int, resolve_precision, subcommand)
from lightning_hexiscale.cli.profile import (LAYER_MICRO_BATCHES, LAYER_REPS, add_layer_time_args,
                                             check_layer_time_flags)
from lightning_hexiscale.config.schema import is_file
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.profiling.check import STATS


def _measure_args(p: argparse.ArgumentParser) -> None:
    add_launch_args(p)
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--stat", choices=STATS, default="min",
                   help="step times -> one time: min (fastest step; load from other jobs only adds time; "
                        "default) or median (typical step; use on a dedicated machine)")
    add_precision_arg(p)


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    _measure_args(p)
    p.add_argument("--micro-batch", type=positive_int, default=2, help="sequences per micro-batch (default 2)")
    p.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches per step (default 2)")
    p.add_argument("--recompute", action="store_true", help="calibrate with activation recomputation on")
    p.add_argument("--out", default=None, metavar="PATH.yaml",
                   help="write the calibrated cluster here (default: update the cluster file in place)")
    p.add_argument("--layer-times", action="store_true",
                   help="also measure the model's layer times per device type, TP degree and micro-batch size "
                        "(as `hexiscale profile --model`), write them into the cluster file, and fit with them")
    add_layer_time_args(p)


def _cluster_file(overrides: list[str]) -> Path:
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "cluster":
            if is_file(value):
                return Path(value)
            break
    raise ConfigError("cluster", next((o.split("=", 1)[1] for o in overrides if o.startswith("cluster=")), None),
                      "calibrate writes its fit into a cluster FILE", "pass cluster=PATH.yaml (e.g. from `hexiscale profile`)")


def _check_calibratable(path: Path, cluster) -> None:
    """The fit goes into a profiled cluster file: each device type's ``gpu_types.<type>.efficiency`` and
    the sync latency in its ``matrix_file``; checked before any rank starts (a hand-written or preset
    YAML measured for the whole run, then failed with a KeyError traceback)."""
    import yaml

    doc = yaml.safe_load(path.read_text()) or {}
    types = sorted({d.gpu_type for d in cluster.devices} - set(doc.get("gpu_types") or {}))
    missing = ([f"gpu_types entries for {', '.join(types)}"] if types else []) + \
              ([] if doc.get("matrix_file") else ["a matrix_file"])
    if missing:
        raise ConfigError("cluster", str(path), f"calibrate stores its fit in a profiled cluster file (each device "
                          f"type's efficiency under gpu_types, the sync latency in its matrix_file); this file lacks "
                          f"{' and '.join(missing)}", "profile the cluster first, e.g. hexiscale profile --local "
                          f"{cluster.num_devices} --out c.yaml (or hexiscale discover --out c.yaml), then calibrate "
                          "cluster=c.yaml")


def _check_step_overrides(args: argparse.Namespace, cfg) -> None:
    """calibrate times steps of its own (--micro-batch, --recompute): a train.micro_batch_size or
    train.recompute given beside them that disagrees was dropped without a word (the fit measured
    other steps than the run's). The same override list, agreeing, passes."""
    from lightning_hexiscale.planner.search.settings import recompute_setting

    mb = cfg.train.micro_batch_size if explicit(args.overrides, "train.micro_batch_size") else None
    if mb is not None and mb != args.micro_batch:
        raise ConfigError("train.micro_batch_size", mb, f"calibrate times steps of its own, of --micro-batch "
                          f"{args.micro_batch} sequences", f"pass --micro-batch {mb} to calibrate with the run's "
                          "micro-batch (or drop train.micro_batch_size=)")
    recompute = recompute_setting(cfg.train.recompute) if explicit(args.overrides, "train.recompute") else "auto"
    if recompute != "auto" and recompute != args.recompute:
        raise ConfigError("train.recompute", cfg.train.recompute, f"calibrate times steps of its own, with "
                          f"recomputation {'on' if args.recompute else 'off'} (--recompute "
                          f"{'given' if args.recompute else 'not given'})",
                          f"{'add' if recompute else 'drop'} --recompute to calibrate as the run recomputes "
                          "(or drop train.recompute=)")


@subcommand("calibrate", "fit efficiency per device type, sync latency and theta_ddp to measured training steps; "
                         "store them in the cluster file", _calibrate_args)
def cmd_calibrate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.profiling.calibrate import calibrate, with_calibration
    from lightning_hexiscale.profiling.writer import (copy_cluster, previous_sync_latency, update_calibration,
                                                      update_layer_tables)

    given = plan_override(args.overrides)
    if given is not None:  # was ignored: the fit was made on calibrate's own steps, the plan never read
        raise ConfigError("plan", given, "hexiscale calibrate fits the cluster file to training steps of its own "
                          "(--micro-batch, --micro-batches), not to a plan's",
                          f"to compare the plan's estimate with its measured steps: hexiscale check-estimate "
                          f"plan={given} with the same overrides; to calibrate: drop plan=")
    check_layer_time_flags(args, "--layer-times", args.layer_times)
    path = _cluster_file(args.overrides)
    if args.out is not None and args.local:  # before minutes of measuring (external launches: at the write)
        check_output_file("--out", args.out, "cluster.yaml", kind="cluster")
    cfg = compose(args.overrides)
    _check_step_overrides(args, cfg)
    # Fit against the measured link latencies: take out a delta an earlier calibration added.
    cluster = with_calibration(Cluster.from_config(cfg.cluster), sync_latency_s=-previous_sync_latency(path))
    _check_calibratable(path, cluster)
    model = LlamaConfig.from_config(cfg.model)
    precision = resolve_precision(args, cfg.trainer.precision)  # --precision or trainer.precision=
    layer_opts = None
    if args.layer_times:
        model.check_measured_tp(args.layer_tp or [])
        layer_opts = dict(micro_batches=args.layer_micro_batches or list(LAYER_MICRO_BATCHES),
                          tp_degrees=args.layer_tp,
                          reps=args.layer_reps or LAYER_REPS, stat=args.stat)
    res = calibrate(cluster, model, args.micro_batch, args.micro_batches, args.recompute, args.steps, args.warmup,
                    args.local, args.timeout, args.stat, precision, layer_opts)
    if res is None:
        return 0
    print(f"measured in {precision}")
    print(res.summary())
    out = Path(args.out) if args.out else path
    if out.resolve() != path.resolve():  # the copy gets a matrix file of its own: the fit rewrites it
        check_output_file("--out", str(out), "cluster.yaml", kind="cluster")  # an external launch's first check
        out = copy_cluster(path, out)
    update_calibration(out, {"theta_ddp": res.theta_ddp}, res.efficiency, res.sync_latency_s)
    if res.layer_tables:
        update_layer_tables(out, res.layer_tables)
        print(f"layer times: {', '.join(f'{t.gpu} ({len(t.rows)} rows)' for t in res.layer_tables)}")
    Cluster.load(str(out))  # the written file must still load
    print(f"wrote calibration to {out}")
    return 0


def _check_args(p: argparse.ArgumentParser) -> None:
    _measure_args(p)
    p.add_argument("--plan", metavar="PLAN.yaml", help="plan file to run and estimate (or the override plan=PLAN.yaml)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


@subcommand("check-estimate", "run a plan for a few steps; print measured iteration time and peak memory "
                              "per rank beside the cost model's estimate", _check_args)
def cmd_check_estimate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Plan
    from lightning_hexiscale.planner.cost.estimate import whole_bytes
    from lightning_hexiscale.profiling.check import check, comparison_table, deviation

    path, key = plan_source(args)
    plan = Plan.load(path, key)
    cfg = compose_plan_config(args.overrides, plan, path)
    cluster = Cluster.from_config(cfg.cluster)
    model = LlamaConfig.from_config(cfg.model)
    # train.schedule / recompute / dp_sharding / micro_batch_size change the plan, as for estimate and train
    # (they ran the plan as written without a word); a train.global_batch it does not have is refused
    plan = apply_train_overrides(plan, cfg, args.overrides)
    if explicit(args.overrides, "train.global_batch"):  # the rest of validate runs in check(), before any rank
        plan.validate(cluster, model, global_batch=cfg.train.global_batch)
    if plan.dp_sharding != "ddp":
        print(f"note: the runtime all-reduces gradients (DDP); the plan says {plan.dp_sharding}, estimated as ddp")
        plan = replace(plan, dp_sharding="ddp")
    precision = resolve_precision(args, cfg.trainer.precision)  # --precision or trainer.precision=
    res = check(plan, cluster, model, args.steps, args.warmup, args.local, args.timeout, precision)
    if res is None:
        return 0
    est, m = res
    if args.json:
        t = m.iteration_s(args.stat)
        doc = {"plan_file": path, "cluster": cluster.name, "model": model.name, "stat": args.stat,
               "precision": precision, "estimated_s": est.iteration_time_s, "measured_s": t,
               "deviation": deviation(est.iteration_time_s, t), "steps_s": m.steps_s, "optimizer_s": m.optimizer_s,
               "step_s_per_rank": m.step_s_per_rank, "peak_bytes_per_rank": m.peak_bytes_per_rank,
               "estimated_peak_bytes_per_stage": [[s.peak_memory_bytes for s in p.stages] for p in est.pipelines]}
        print(json.dumps(whole_bytes(doc), indent=2))  # byte counts as whole numbers, times as floats
    else:
        print(plan.table(cluster))
        print()
        print(comparison_table(plan, est, m))
    return 0
