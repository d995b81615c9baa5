"""`hexiscale list` and `hexiscale cluster`: the presets under conf/ and one cluster's description."""

from __future__ import annotations

import argparse

from lightning_hexiscale.cli.common import compose_plan_config, plan_override, subcommand


@subcommand("list", "list the cluster, model and plan presets under conf/", lambda p: None,
            no_overrides="`hexiscale cluster cluster=NAME` describes one cluster")
def cmd_list(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.schema import conf_dir, preset_names

    for group in ("cluster", "model"):
        print(f"{group}:")
        for name in preset_names(group):
            first = (conf_dir() / group / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
            print(f"  {name:22s} {first}")
    print("plans:")
    for p in sorted((conf_dir() / "plans").glob("*.yaml")):
        print(f"  conf/plans/{p.name}")
    return 0


@subcommand("cluster", "describe a cluster: machines, GPUs, memory, links", lambda p: None)
def cmd_cluster(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.schema import compose

    given = plan_override(args.overrides)
    if given is None:
        cfg = compose(args.overrides)
    else:  # the plan's cluster (its meta), as estimate and train take it: it showed the default preset
        from lightning_hexiscale.planner import Plan

        cfg = compose_plan_config(args.overrides, Plan.load(given, "plan"), given, needs=("cluster",))
    print(Cluster.from_config(cfg.cluster).summary())
    return 0
