"""`hexiscale estimate`: iteration time, throughput and memory of a plan file (Appendix B cost model)."""

from __future__ import annotations

import argparse
import json
import warnings

from lightning_hexiscale.cli.common import (apply_train_overrides, compose_plan_config, explicit, given_value,
                                           plan_source, subcommand)
from lightning_hexiscale.cli.plan import add_table_flag, estimate_document, overrides_of, sources_lines


def _estimate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", metavar="PLAN.yaml", help="plan file (YAML or JSON), e.g. conf/plans/*.yaml; or the "
                   "override plan=PLAN.yaml, as hexiscale train takes it")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    add_table_flag(p)
    p.description = (f"{p.description}\n\n"
                     "planner.* overrides (the search's settings; all but planner.allow_table_mismatch, which\n"
                     "pricing reads) change no estimate: a plan is priced as written. They are checked as\n"
                     "`hexiscale plan` checks them (planner.cut=abc is an error), and one warning line names them,\n"
                     "so that one override list serves both commands without a setting passing for applied.")


class SearchOnlyWarning(UserWarning):
    """``planner.*`` overrides that set the search only, given to ``hexiscale estimate`` (a fixed plan)."""

    cli_notice = True
    """Printed as one ``hexiscale estimate: warning: ...`` line."""


QUIET_KEYS = ("progress",)
"""``planner.*`` keys that no one reads as changing a result (the search's progress bar): not named."""


def warn_search_only(overrides: list[str], plan_path: str) -> None:
    """One warning line naming the ``planner.*`` overrides that only the search reads (every key but
    :data:`~lightning_hexiscale.cli.train_plan.PRICING_KEYS` and :data:`QUIET_KEYS`): a fixed plan is
    priced as written, and they were dropped without a word (``planner.iterations=3`` looked applied)."""
    from lightning_hexiscale.cli.train_plan import PRICING_KEYS

    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    search = [o.lstrip("+~") for o, k in zip(overrides, keys) if k.startswith("planner.")
              and k.split(".", 1)[1] not in PRICING_KEYS + QUIET_KEYS]
    if search:
        warnings.warn(f"{', '.join(search)}: set the planner's search, which a fixed plan skips: {plan_path} is priced "
                      f"as written, so they change nothing here; to use them, re-plan (hexiscale plan ... "
                      f"{' '.join(search)} --out PLAN.yaml) and estimate that plan", SearchOnlyWarning)


@subcommand("estimate", "estimate iteration time, throughput and memory of a plan (Appendix B cost model)", _estimate_args)
def cmd_estimate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.planner.cost.compute import warn_datasheet_pricing, warn_default_links
    from lightning_hexiscale.planner import Plan, SearchSettings, estimate, price_sources, workload_from_config
    from lightning_hexiscale.planner.plan import OtherClusterWarning, made_for_another_cluster

    path, key = plan_source(args)
    plan = Plan.load(path, key)
    cfg = compose_plan_config(overrides_of(args), plan, path)
    cluster = Cluster.from_config(cfg.cluster)
    given = given_value(args.overrides, "cluster")
    note = made_for_another_cluster(plan.meta, cluster, "priced", given) if given is not None else None
    if note:  # cluster= wins over the plan's meta, but not without a word
        warnings.warn(note, OtherClusterWarning)
    workload = workload_from_config(cfg)
    plan = apply_train_overrides(plan, cfg, args.overrides)
    # planner.* prices nothing here (but allow_table_mismatch), yet a bad value (planner.iterations=-1) is the
    # error `hexiscale plan` gives for it, not a silent pass: users give both commands one override list
    SearchSettings.from_config(cfg, dp_sharding_explicit=explicit(args.overrides, "train.dp_sharding"))
    warn_search_only(list(args.overrides), path)
    gb = cfg.train.global_batch if explicit(args.overrides, "train.global_batch") else None
    plan.validate(cluster, workload.model, global_batch=gb)
    plan.check_model(workload.model)
    warn_datasheet_pricing(cluster, workload)
    warn_default_links(cluster, plan.device_order)
    est = estimate(plan, cluster, workload)
    # what priced each device type; a layer table that does not match the run is refused here
    sources = price_sources(cluster, workload, plan)
    if args.json:
        print(json.dumps(estimate_document(plan, cluster, workload, est, path, sources), indent=2))
    else:
        print(cluster.summary())
        print()
        print(plan.table(cluster))
        print()
        print(est.summary())
        print(sources_lines(plan, sources))
    return 0
