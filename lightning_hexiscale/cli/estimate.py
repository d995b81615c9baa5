"""`hexiscale estimate`: iteration time, throughput and memory of a plan file (Appendix B cost model)."""

from __future__ import annotations

import argparse
import json

from lightning_hexiscale.cli.common import apply_train_overrides, compose_for_plan, explicit, subcommand


def _estimate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, metavar="PLAN.yaml", help="plan file (YAML or JSON), e.g. conf/plans/*.yaml")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


@subcommand("estimate", "estimate iteration time, throughput and memory of a plan (Appendix B cost model)", _estimate_args)
def cmd_estimate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.planner.cost.compute import warn_datasheet_pricing
    from lightning_hexiscale.planner.cost.estimate import estimate, workload_from_config
    from lightning_hexiscale.planner.plan import Plan

    plan = Plan.load(args.plan)
    overrides = compose_for_plan(args.overrides, plan.meta)
    cfg = compose(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    workload = workload_from_config(cfg)
    plan = apply_train_overrides(plan, cfg, args.overrides)
    gb = cfg.train.global_batch if explicit(args.overrides, "train.global_batch") else None
    plan.validate(cluster, workload.model, global_batch=gb)
    warn_datasheet_pricing(cluster, workload)
    est = estimate(plan, cluster, workload)
    if args.json:
        doc = {"plan_file": args.plan, "cluster": cluster.name, "model": workload.model.name,
               "global_batch": plan.global_batch, "dp_sharding": plan.dp_sharding, "schedule": plan.schedule,
               "recompute": plan.recompute, **est.to_dict()}
        print(json.dumps(doc, indent=2))
    else:
        print(cluster.summary())
        print()
        print(plan.table(cluster))
        print()
        print(est.summary())
    return 0
