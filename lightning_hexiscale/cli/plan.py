"""`hexiscale plan`: run the §4 search (and optionally the baselines) and report the plan.

    hexiscale plan cluster=hetero3 model=llama_30b train.global_batch=256 planner.iterations=50 \\
        [--baselines] [--out plan.yaml] [--picture plan.png|plan.svg] [--json]
    hexiscale plan cluster=cpu_hetero4 model=llama_demo --optimum     # + the true optimum (<= 8 devices)
    hexiscale plan -m cluster=hetero1,hetero2 model=llama2_7b,llama2_13b --baselines [--sweep-dir DIR]

A multirun (``-m``) takes the cartesian product of comma-separated override values (Hydra's
basic sweeper syntax), plans each combination and writes one summary table, ``summary.csv`` and
``summary.md``, plus each plan's YAML, into the sweep directory; the markdown is printed too.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from lightning_hexiscale.cli.common import (axis_points, check_output_file, explicit, plan_override, subcommand,
                                           sweep_axes, with_cluster_file)
from lightning_hexiscale.cli.picture import (check_picture_path, check_replaced_picture, draw_plan,  # noqa: F401 (also importable from here)
                                            plan_title)
from lightning_hexiscale.config.recipe import check_output_dir
from lightning_hexiscale.config.units import format_flops, format_seconds
from lightning_hexiscale.errors import ConfigError, HexiScaleError


def add_table_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-table-mismatch", action="store_true",
                   help="a layer table measured on another model shape or precision, or without a TP degree the "
                   "plan uses, warns and prices that device type from FLOP/s instead of stopping "
                   "(planner.allow_table_mismatch=true)")


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of the command line, with ``--allow-table-mismatch`` as its planner key."""
    extra = ["planner.allow_table_mismatch=true"] if getattr(args, "allow_table_mismatch", False) else []
    return list(args.overrides) + extra


def sources_lines(plan, sources) -> str:
    """What priced each device type, and how recomputation was chosen (the text reports)."""
    lines = [f"  {s}" for s in sources]
    choice = plan.meta.get("recompute")
    return "\n".join(["priced by:"] + lines + ([f"recompute: {choice}"] if choice else []))


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baselines", action="store_true", help="also run megatron, galvatron, metis, random, "
                   "symmetric-best (the best megatron/galvatron plan on any machine subset, the whole cluster "
                   "included), leave-out (the best plan of any style, the search's included, that leaves at "
                   "least one machine out: what a user does without this project) and uniform-tp (the search "
                   "with one TP degree in every stage), time "
                   "their plans with the same cost model on the real cluster and print a comparison with each "
                   "plan's compute ceiling (cluster FLOP/s over the FLOP/s of the devices it uses). By default "
                   "megatron and galvatron choose their plan heterogeneity-unaware, as the real "
                   "systems do: ranked on a homogeneous belief of the cluster (mean FLOP/s, smallest memory, "
                   "median intra/inter links), then timed on the true cluster")
    p.add_argument("--aware-baselines", action="store_true", help="with --baselines: let megatron and galvatron rank their "
                   "candidates with the true (heterogeneous) cluster: the best plan of their restricted space, "
                   "a stronger opponent than the real systems (metis is heterogeneity-aware either way)")
    p.add_argument("--like-for-like", action="store_true", help="with --baselines: give the baselines every dp sharding the search "
                   "may use (default: their own, as the paper ran them: Megatron/Metis DDP, Galvatron ZeRO-3)")
    p.add_argument("--optimum", action="store_true", help="also compute the true optimum of the whole plan "
                   "space (planner/oracle/exact.py, exhaustive branch and bound; clusters of up to 8 devices) and "
                   "print how close the search's plan is to it")
    p.add_argument("--optimum-time-limit", type=float, default=None, metavar="SECONDS",
                   help="with --optimum: stop the optimum search after this long and report it incomplete, with "
                   f"the best plan found and a proven lower bound (default {OPTIMUM_TIME_LIMIT_S:g})")
    p.add_argument("--out", metavar="PLAN.yaml", help="write the plan (YAML, or JSON for a .json path)")
    p.add_argument("--picture", metavar="PLAN.png", help="draw the plan (PNG or SVG by extension; needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    add_table_flag(p)
    p.add_argument("-m", "--multirun", action="store_true",
                   help="sweep: comma-separated override values, cartesian product, one summary table")
    p.add_argument("--sweep-dir", metavar="DIR", help="multirun output folder (default outputs/plan-sweep-<timestamp>)")


OPTIMUM_TIME_LIMIT_S = 60.0
"""How long ``--optimum`` searches when ``--optimum-time-limit`` is not given."""

DEPENDENT_FLAGS = (("aware_baselines", "--aware-baselines", "baselines",
                    "ranks the baselines' candidates with the true cluster, but the baselines run only with --baselines"),
                   ("like_for_like", "--like-for-like", "baselines",
                    "widens the baselines' dp sharding, but the baselines run only with --baselines"),
                   ("optimum_time_limit", "--optimum-time-limit", "optimum",
                    "limits the search for the true optimum, which runs only with --optimum"))
"""(attribute, flag, the attribute of the flag it modifies, the rule): a modifier given without that flag
changed nothing (``--aware-baselines`` without ``--baselines`` ran no baselines, exit 0): refused."""


def check_flag_pairs(args: argparse.Namespace) -> None:
    """Refuse, before any work, a modifier flag given without the flag it modifies, and a
    ``--optimum-time-limit`` that is no positive number of seconds."""
    limit = args.optimum_time_limit
    if limit is not None and not limit > 0:  # -1, 0 and nan: nothing would be searched
        raise ConfigError("--optimum-time-limit", limit, "must be a positive number of seconds",
                          f"use e.g. --optimum-time-limit {OPTIMUM_TIME_LIMIT_S:g}")
    for attr, flag, parent_attr, rule in DEPENDENT_FLAGS:
        value, parent = getattr(args, attr), f"--{parent_attr}"
        if value not in (None, False) and not getattr(args, parent_attr):
            raise ConfigError(flag, f"without {parent}" if value is True else value, f"{rule}: alone it changes nothing",
                              f"add {parent}, or drop {flag}")


def plan_once(overrides: list[str], with_baselines: bool, progress: bool | None = None,
              like_for_like: bool = False, aware: bool = False,
              optimum_time_limit: float | None = None, worth: bool = True) -> dict[str, Any]:
    """Compose, search, validate; returns everything the reports need. ``optimum_time_limit``: also
    run the oracle (the true optimum) for at most that many seconds. ``worth``: also the best plan
    without each machine (unless ``planner.use_all_devices``)."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.planner import SearchSettings, search, workload_from_config
    from lightning_hexiscale.planner.plan import check_global_batch_bound

    cfg = compose(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    workload = workload_from_config(cfg)
    changes = {} if progress is None else {"progress": progress}
    settings = SearchSettings.from_config(cfg, dp_sharding_explicit=explicit(overrides, "train.dp_sharding"), **changes)
    gb = int(cfg.train.global_batch)
    check_global_batch_bound(gb)  # the search's arithmetic overflowed on 2**70
    if optimum_time_limit is not None:
        from lightning_hexiscale.planner.oracle.exact import MAX_BATCH, MAX_DEVICES

        if cluster.num_devices > MAX_DEVICES:
            raise ConfigError("--optimum", f"cluster {cluster.name} ({cluster.num_devices} devices)",
                              f"the true optimum enumerates every plan; it covers clusters of at most {MAX_DEVICES} "
                              "devices", "drop --optimum, or plan a smaller cluster")
        if gb > MAX_BATCH:  # before the search, as the device count
            raise ConfigError("--optimum", f"train.global_batch={gb}", f"the true optimum enumerates every batch "
                              f"split; it covers global batches of at most {MAX_BATCH:,} sequences",
                              "drop --optimum, or give the global batch in sequences, not tokens")
        if not optimum_time_limit > 0:
            raise ConfigError("--optimum-time-limit", optimum_time_limit, "must be a positive number of seconds",
                              "use e.g. --optimum-time-limit 60")
    result = search(cluster, workload, gb, settings, worth=worth)
    result.plan.validate(cluster, workload.model, global_batch=gb)
    out: dict[str, Any] = {"cfg": cfg, "cluster": cluster, "workload": workload, "result": result,
                           "global_batch": gb, "settings": settings}
    if with_baselines:
        from lightning_hexiscale.planner import run_baselines

        out["baselines"] = run_baselines(cluster, workload, gb, settings, like_for_like=like_for_like, aware=aware)
    if optimum_time_limit is not None:
        from lightning_hexiscale.planner.oracle.exact import oracle

        if settings.progress:  # the oracle has no progress bar: say what the wait is for
            print(f"true optimum: exhaustive search, at most {optimum_time_limit:g} s ...", file=sys.stderr, flush=True)
        out["optimum"] = oracle(cluster, workload, gb, settings, time_limit_s=optimum_time_limit,
                                incumbent=result.plan)
    return out


def optimum_document(found_s: float, best) -> dict[str, Any]:
    """The oracle's answer beside the search's: status (optimal / infeasible / incomplete), the
    optimum's iteration time, a proven lower bound, and the search's throughput as a fraction of
    the optimum's (optimum time / search time; 1.0: the search found an optimal plan)."""
    t = best.estimate.iteration_time_s if best.estimate is not None else None
    return {"status": best.status, "complete": best.complete, "iteration_time_s": t,
            "lower_bound_s": _finite(best.lower_bound_s), "time_s": best.time_s,
            "search_fraction_of_optimum": (t / found_s) if t is not None else None,
            "plan": best.plan.to_dict() if best.plan is not None else None}


def estimate_document(plan, cluster, workload, est, plan_file: str | None, sources=None) -> dict[str, Any]:
    """The same document ``hexiscale estimate --json`` prints for this plan: with ``price_sources``
    (per device type: gpu_type, kind, detail; :mod:`planner.cost.sources`), ``recompute_per_pipeline``
    (one flag per pipeline; ``recompute`` is null when they differ) and ``recompute_choice``
    (how ``recompute: auto`` decided, null when pinned or given by the plan file)."""
    if sources is None:
        from lightning_hexiscale.planner import price_sources

        sources = price_sources(cluster, workload, plan)
    return {"plan_file": plan_file, "cluster": cluster.name, "model": workload.model.name,
            "global_batch": plan.global_batch, "dp_sharding": plan.dp_sharding, "schedule": plan.schedule,
            # recompute: the plan's common flag, null when its pipelines differ (then per pipeline)
            "recompute": plan.recompute, "recompute_per_pipeline": list(plan.recomputes),
            "recompute_choice": plan.meta.get("recompute"),
            "price_sources": [s.to_dict() for s in sources], **est.to_dict()}


def baseline_rows(best_time: float, baselines: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: {iteration_time_s, pflops, feasible, speedup, ...}}: speedup = baseline time / search
    time."""
    rows = {}
    for name, b in baselines.items():
        feasible = b.estimate is not None and b.estimate.feasible
        t = b.estimate.iteration_time_s if feasible else math.inf
        loose = b.ignoring_memory
        rows[name] = {"iteration_time_s": t if feasible else None,
                      "pflops": b.estimate.pflops if feasible else 0.0, "feasible": feasible,
                      "speedup": (t / best_time) if feasible else None, "note": b.note,
                      "iteration_time_ignoring_memory_s": loose.iteration_time_s if loose is not None else None,
                      "compute_ceiling": b.compute_ceiling if feasible else None,
                      "idle_devices": list(b.plan.idle_devices) if feasible else None}
    return rows


def comparison_table(best, rows: dict[str, dict[str, Any]], ceiling: float = 1.0) -> str:
    """Search and baselines side by side; ``ceiling``: the search plan's compute ceiling."""
    w = max([12] + [len(n) for n in rows])
    lines = [f"{'system':<{w}} {'iteration':>11} {'FLOP/s':>12} {'search speedup':>15} {'compute ceiling':>16}",
             f"{'hexiscale':<{w}} {format_seconds(best.iteration_time_s, ''):>11} {format_flops(best.pflops * 1e15):>12} {'1.00x':>15} "
             f"{ceiling:>15.2f}x"]
    for name, r in rows.items():
        if r["feasible"]:
            lines.append(f"{name:<{w}} {format_seconds(r['iteration_time_s'], ''):>11} {format_flops(r['pflops'] * 1e15):>12} "
                         f"{r['speedup']:>14.2f}x {r['compute_ceiling']:>15.2f}x"
                         + (f"  {r['note']}" if name in ("symmetric-best", "leave-out", "uniform-tp") else ""))
        else:
            loose = r["iteration_time_ignoring_memory_s"]
            extra = (f"; ignoring memory (as the paper's case study does) its best is {format_seconds(loose)}, "
                     f"{loose / best.iteration_time_s:.2f}x the search's time") if loose else ""
            lines.append(f"{name:<{w}} {'OOM':>11} {'-':>8} {'-':>15}  {r['note']}{extra}")
    return "\n".join(lines)


@subcommand("plan", "search an asymmetric parallel plan (§4 two-phase graph partitioning) and report it", _args)
def cmd_plan(args: argparse.Namespace) -> int:
    given = plan_override(args.overrides)
    if given is not None:  # was ignored: a new plan was searched, the file never read
        raise ConfigError("plan", given, "hexiscale plan searches a new plan; a plan file is priced by "
                          "hexiscale estimate (and run by hexiscale train)",
                          f"to price that file: hexiscale estimate plan={given} with the same overrides; "
                          "to search: drop plan=")
    check_flag_pairs(args)
    if args.multirun:
        if args.optimum:
            raise ConfigError("--optimum", "with -m", "the true optimum is computed for one plan, not a sweep",
                              "run `hexiscale plan ... --optimum` for each cluster you want checked")
        for flag, value in (("--out", args.out), ("--picture", args.picture)):
            if value is not None:  # --out '' was ignored silently here (a single run refuses it)
                raise ConfigError(flag, value, "a sweep (-m) writes one plan file per run into its sweep directory",
                                  "use --sweep-dir DIR, or plan one configuration without -m")
        if args.sweep_dir is not None:  # '' swept into the default folder silently; a file was mkdir's traceback
            fix = "give a folder to create or fill, e.g. --sweep-dir outputs/my-sweep (or leave it out)"
            if not args.sweep_dir.strip():
                raise ConfigError("--sweep-dir", args.sweep_dir, "is empty; this option names the sweep's folder", fix)
            check_output_dir("--sweep-dir", args.sweep_dir, fix)
        return _sweep(args)
    if args.sweep_dir is not None:  # was ignored: one plan was searched and nothing written there
        raise ConfigError("--sweep-dir", args.sweep_dir, "names the folder of a sweep (-m); without -m one "
                          "configuration is planned and nothing is written there",
                          "add -m to sweep, or write the plan with --out PLAN.yaml")
    if args.out is not None:  # --out '' wrote nothing, silently
        check_output_file("--out", args.out, "plan.yaml")
        check_plan_out(args.out, overrides_of(args), args.picture)
    if args.picture is not None:
        check_output_file("--picture", args.picture, "plan.png")
        check_picture_path(args.picture)
        check_replaced_picture(args.picture)  # notes or a photo under a .png name: what it holds would be lost
    # --json too: the bar goes to stderr, and only on a terminal (two_phase.progress_kind), never into the JSON
    run = plan_once(overrides_of(args), args.baselines,
                    like_for_like=args.like_for_like, aware=args.aware_baselines,
                    optimum_time_limit=(OPTIMUM_TIME_LIMIT_S if args.optimum_time_limit is None
                                        else args.optimum_time_limit) if args.optimum else None)
    cluster, workload, res = run["cluster"], run["workload"], run["result"]
    plan, est = with_cluster_file(with_model_shape(res.plan, workload.model), overrides_of(args)), res.estimate
    if args.out:
        _write_file("--out", args.out, lambda: plan.save(args.out))
    if args.picture:
        _write_file("--picture", args.picture, lambda: draw_plan(
            plan, cluster, args.picture, title=plan_title(workload.model.name, cluster.name, est), estimate=est))
    rows = baseline_rows(est.iteration_time_s, run["baselines"]) if args.baselines else None
    if args.json:
        doc = {"plan": plan.to_dict(), "estimate": estimate_document(plan, cluster, workload, est, args.out, res.sources),
               "search_time_s": res.search_time_s,
               "log": [{"iteration": e.iteration, "num_pipelines": e.num_pipelines, "cut": e.cut,
                        "cost_s": _finite(e.cost_s), "best_s": _finite(e.best_s)} for e in res.log]}
        if rows is not None:
            doc["baselines"] = rows
        if res.subsets is not None:
            doc["subsets"] = subsets_document(res.subsets, plan, cluster)
        if "optimum" in run:
            doc["optimum"] = optimum_document(est.iteration_time_s, run["optimum"])
        print(json.dumps(doc, indent=2))
        return 0
    print(cluster.summary())
    print()
    if plan.idle_devices:
        print(idle_banner(plan, cluster) + "\n")
    print(plan.table(cluster))
    print()
    print(est.summary())
    print(sources_lines(plan, res.sources))
    print(f"\nsearch: {len(res.log)} iterations in {res.search_time_s:.2f} s" + (
        f" (device subsets: {subsets_line(res.subsets)})" if res.subsets is not None else ""))
    if res.subsets is not None and res.subsets.without:
        print("\n" + worth_table(res.subsets, est.iteration_time_s, cluster))
    if rows is not None:
        reading = ("ranked with the true cluster (--aware-baselines)" if args.aware_baselines else
                   "chosen under a homogeneous belief of the cluster, as the real systems do")
        print(f"\nbaselines timed on the true cluster; megatron and galvatron {reading}")
        print(comparison_table(est, rows, compute_ceiling(plan, cluster)))
    if "optimum" in run:
        print("\n" + optimum_line(est.iteration_time_s, run["optimum"]))
    if args.out:
        print(f"plan written to {args.out}")
    if args.picture:
        print(f"picture written to {args.picture}")
    return 0


def with_model_shape(plan, model):
    """The plan with ``meta.model_shape`` (the model's shape), which ``estimate`` checks a model
    against (:meth:`Plan.check_model`; the name in ``meta.model`` does not carry ``model.*`` overrides)."""
    from dataclasses import replace

    from lightning_hexiscale.planner.plan import model_shape

    return replace(plan, meta={**plan.meta, "model_shape": model_shape(model)})


def check_plan_out(out: str, overrides: list[str], picture: str | None = None) -> None:
    """``--out PATH`` replaces what is at PATH (a temporary file, then a rename): refused before the search
    when that would lose what is there: the ``cluster=`` / ``model=`` file the plan is made from (the
    cluster file was replaced by the plan), a file that is no plan (notes, a config: a previous plan is
    replaced, as re-planning does), or the ``--picture`` path (one write replaced the other).
    :func:`check_output_file` has refused a directory and a FIFO or device already."""
    import os

    from lightning_hexiscale.config.recipe import check_replaced_kind

    path = Path(out)
    if not path.exists():
        if picture and Path(picture).absolute() == path.absolute():
            raise ConfigError("--out", out, "is also the --picture path: one file would replace the other",
                              "give the plan and the picture different paths (plan.yaml, plan.png)")
        return
    for key in ("cluster", "model"):
        given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+~") == key), "")
        if given and Path(given).is_file() and os.path.samefile(given, path):
            raise ConfigError("--out", out, f"is the {key} file this plan is made from ({key}={given}): writing "
                              f"the plan there would replace it", "give the plan its own path, e.g. --out plan.yaml")
    if picture and Path(picture).exists() and os.path.samefile(picture, path):
        raise ConfigError("--out", out, "is also the --picture path: one file would replace the other",
                          "give the plan and the picture different paths (plan.yaml, plan.png)")
    check_replaced_kind("--out", out, "plan")  # notes or a config: what it holds would be lost


def _write_file(flag: str, path: str, write) -> None:
    """Create the missing folders of ``path``, then ``write()``; an OSError that check_output_file could
    not foresee (/proc, a full disk) is a ConfigError naming the option."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write()
    except OSError as e:
        raise ConfigError(flag, path, f"cannot write it ({e.strerror})", "give a path in a writable directory") from None
    except ConfigError as e:  # Plan.save's own refusal (write_atomically), named by the option given
        if e.key != "Plan.save(path)":
            raise
        raise ConfigError(flag, path, e.rule, e.fix) from None


def idle_banner(plan, cluster) -> str:
    """The lines that say, above the plan, which devices it leaves idle and what using them costs."""
    n, idle = len(plan.idle_devices), set(plan.idle_devices)
    parts = []
    for mach in cluster.machines:
        ids = [d for d in mach.devices if d in idle]
        if ids:
            whole = "all " if len(ids) == len(mach.devices) else ""
            parts.append(f"{whole}{len(ids)}x{mach.gpu_type} of machine {mach.name} [{','.join(map(str, ids))}]")
    lines = [f"IDLE DEVICES: this plan gives {n} of {cluster.num_devices} devices no work: {'; '.join(parts)}"]
    reason = plan.meta.get("idle_reason")
    if reason:
        lines.append(f"  why: {reason}")
    if "all_devices_time_s" in plan.meta and plan.meta["all_devices_time_s"] is None:  # no plan gave them all work
        lines.append("  planner.use_all_devices=true would be refused: no plan found gives every device work")
    else:
        lines.append("  planner.use_all_devices=true plans with every device")
    return "\n".join(lines)


def subsets_line(report) -> str:
    counts: dict[str, int] = {}
    for t in report.trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    return report.mode + ", " + ", ".join(f"{n} {k}" for k, n in counts.items())


def worth_table(report, best_s: float, cluster) -> str:
    """Per machine: the best iteration time found without it, and how it compares with the plan's."""
    rows = [("machine", "GPUs", "best plan without it", "vs this plan")]
    for m, mach in enumerate(cluster.machines):
        if m not in report.without:
            continue
        t = report.without[m]
        kinds = f"{len(mach.devices)}x{mach.gpu_type}"
        if math.isfinite(t):
            rows.append((mach.name, kinds, f"{t:.4g} s", f"{100 * (t / best_s - 1):+.1f} %"))
        else:
            rows.append((mach.name, kinds, "nothing fits", "-"))
    w = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["what each machine is worth (the best plan the search finds without it):"]
    lines += ["  " + "  ".join(v.ljust(x) if c < 2 else v.rjust(x) for c, (v, x) in enumerate(zip(r, w))) for r in rows]
    return "\n".join(lines)


def subsets_document(report, plan, cluster) -> dict[str, Any]:
    """``subsets`` in ``--json``: the idle devices and why, and per machine the best time without it."""
    return {"mode": report.mode, "idle_devices": list(plan.idle_devices),
            "idle_reason": plan.meta.get("idle_reason"), "all_devices_time_s": _finite(report.all_devices_s),
            "machines": [{"name": mach.name, "gpus": len(mach.devices), "gpu_type": mach.gpu_type,
                          "best_without_s": _finite(report.without[m]) if m in report.without else None}
                         for m, mach in enumerate(cluster.machines)],
            "trials": [{"devices": list(t.devices), "left_out": [cluster.machines[m].name for m in t.left_out],
                        "status": t.status, "time_s": _finite(t.time_s), "compute_bound_s": _finite(t.bound_s)}
                       for t in report.trials]}


def compute_ceiling(plan, cluster) -> float:
    from lightning_hexiscale.planner import compute_ceiling as ceiling

    return ceiling(plan, cluster)


def optimum_line(found_s: float, best) -> str:
    d = optimum_document(found_s, best)
    if best.status == "optimal":
        return (f"true optimum (planner/oracle/exact.py, {d['time_s']:.1f} s): {d['iteration_time_s']:.4f} s per iteration; "
                f"the search's plan reaches {d['search_fraction_of_optimum']:.3f} of its throughput")
    if best.status == "incomplete":
        return (f"true optimum: INCOMPLETE after {d['time_s']:.1f} s (--optimum-time-limit); the best plan found takes "
                f"{d['iteration_time_s']:.4f} s, the optimum at least {best.lower_bound_s:.4f} s")
    return "true optimum: no plan fits (proven)"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ---- multirun ----------------------------------------------------------------------------------
def sweep_overrides(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of the sweep's overrides (``key=a,b,c``, ``range(..)``, ``choice(..)``,
    ``glob(..)``: :func:`~lightning_hexiscale.cli.common.sweep_axes`), the order of keys kept."""
    return [list(combo) for combo in itertools.product(*sweep_axes(overrides))]


def _sweep(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.schema import compose

    # every value composes before the first search: a misspelled preset or key was the error of its
    # rows only, after the searches of the rows before it (an infeasible point is still a row's error)
    for point in axis_points(sweep_axes(overrides_of(args))):
        compose(point)
    combos = sweep_overrides(overrides_of(args))
    out_dir = Path(args.sweep_dir or f"outputs/plan-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = (["megatron", "galvatron", "metis", "random", "symmetric-best", "leave-out", "uniform-tp"]
             if args.baselines else [])
    header = ["overrides", "cluster", "model", "global_batch", "pipelines", "idle_devices", "iteration_time_s", "pflops",
              "search_time_s"] + [f"{n}_{k}" for n in names for k in ("time_s", "speedup")] + ["error"]
    rows = []
    for combo in combos:
        row: dict[str, Any] = {"overrides": " ".join(combo)}
        try:
            run = plan_once(combo, args.baselines, progress=False, like_for_like=args.like_for_like,
                            aware=args.aware_baselines, worth=False)
        except HexiScaleError as e:
            row["error"] = str(e).split(". Fix:")[0]
            rows.append(row)
            continue
        res, cl, wl = run["result"], run["cluster"], run["workload"]
        tag = "-".join(f"{o.split('=', 1)[1]}" for o in combo if "=" in o).replace("/", "_")
        with_cluster_file(with_model_shape(res.plan, wl.model), combo).save(out_dir / f"plan-{tag}.yaml")
        row.update(cluster=cl.name, model=wl.model.name, global_batch=run["global_batch"],
                   pipelines=res.plan.num_pipelines, idle_devices=len(res.plan.idle_devices),
                   iteration_time_s=round(res.estimate.iteration_time_s, 4),
                   pflops=round(res.estimate.pflops, 4), search_time_s=round(res.search_time_s, 3))
        if args.baselines:
            for n, r in baseline_rows(res.estimate.iteration_time_s, run["baselines"]).items():
                row[f"{n}_time_s"] = round(r["iteration_time_s"], 4) if r["feasible"] else "OOM"
                row[f"{n}_speedup"] = round(r["speedup"], 3) if r["feasible"] else "-"
        rows.append(row)
    with open(out_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in header})
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(r.get(k, "")) for k in header) + " |" for r in rows]
    (out_dir / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nsweep of {len(rows)} runs written to {out_dir}/summary.csv and summary.md")
    return 0 if all(not r.get("error") for r in rows) else 2
