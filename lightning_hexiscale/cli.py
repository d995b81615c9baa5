"""`hexiscale` command line: estimate plans, describe clusters, list presets (planning grows here too).

Every subcommand takes Hydra-style overrides after its options, composed over conf/config.yaml:
    hexiscale estimate --plan conf/plans/hetero3_llama30b_tab7.yaml cluster=hetero3 model=llama_30b
Bad input exits with status 2 and a one-paragraph message (key, value, rule, fix); no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_hexiscale.errors import HexiScaleError

EPILOG = """overrides (Hydra syntax, composed over conf/config.yaml):
  cluster=NAME|PATH.yaml   a preset of conf/cluster/ or a cluster file (e.g. from `hexiscale profile`)
  model=NAME|PATH.yaml     a preset of conf/model/
  train.global_batch=N     train.dtype=bf16|fp16|fp32  train.schedule=1f1b|gpipe
  train.recompute=true|false  train.dp_sharding=ddp|zero2|zero3
  cluster.inter_machine.bandwidth="10 Gbps"   any key of the cluster, model or train config
run `hexiscale list` for the presets."""

SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def subcommand(name: str, help_: str, configure: Callable[[argparse.ArgumentParser], None]):
    """Register ``fn(args) -> exit code`` as ``hexiscale NAME`` (other modules add theirs this way)."""
    def deco(fn: Callable[[argparse.Namespace], int]):
        SUBCOMMANDS[name] = (help_, configure, fn)
        return fn
    return deco


def _explicit(overrides: Sequence[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def compose_for_plan(overrides: list[str], plan_meta: dict) -> list[str]:
    """Default ``cluster=`` and ``model=`` to the ones a plan file names in its ``meta``."""
    out = list(overrides)
    for key in ("cluster", "model"):
        if not _explicit(out, key) and plan_meta.get(key):
            out.insert(0, f"{key}={plan_meta[key]}")
    return out


def apply_train_overrides(plan, cfg, overrides: Sequence[str]):
    """Explicit train.schedule / train.recompute / train.dp_sharding overrides replace the plan's values."""
    changes = {}
    for key in ("schedule", "recompute", "dp_sharding"):
        if _explicit(overrides, f"train.{key}"):
            changes[key] = cfg.train[key]
    return replace(plan, **changes) if changes else plan


# ---- estimate --------------------------------------------------------------------------------
def _estimate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, metavar="PLAN.yaml", help="plan file (YAML or JSON), e.g. conf/plans/*.yaml")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


@subcommand("estimate", "estimate iteration time, throughput and memory of a plan (Appendix B cost model)", _estimate_args)
def cmd_estimate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.cluster import Cluster
    from lightning_hexiscale.config import compose
    from lightning_hexiscale.planner.estimate import estimate, workload_from_config
    from lightning_hexiscale.planner.plan import Plan

    plan = Plan.load(args.plan)
    overrides = compose_for_plan(args.overrides, plan.meta)
    cfg = compose(overrides)
    cluster = Cluster.from_config(cfg.cluster)
    workload = workload_from_config(cfg)
    plan = apply_train_overrides(plan, cfg, args.overrides)
    gb = cfg.train.global_batch if _explicit(args.overrides, "train.global_batch") else None
    plan.validate(cluster, workload.model, global_batch=gb)
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


# ---- list / cluster ----------------------------------------------------------------------------
@subcommand("list", "list the cluster, model and plan presets under conf/", lambda p: None)
def cmd_list(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config import conf_dir, preset_names

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
    from lightning_hexiscale.cluster import Cluster
    from lightning_hexiscale.config import compose

    cfg = compose(args.overrides)
    print(Cluster.from_config(cfg.cluster).summary())
    return 0


# ---- entry point -------------------------------------------------------------------------------
def _load_plugins() -> None:
    """Import modules that register more subcommands (planner, profiler) when they exist."""
    import importlib

    for mod in ("lightning_hexiscale.planner.cli_plan", "lightning_hexiscale.profiler"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    parser = argparse.ArgumentParser(
        prog="hexiscale", description="Plan and estimate asymmetric parallel LLM training on heterogeneous GPU clusters.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, configure, _fn) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        configure(p)
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra-style config overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    bad = [e for e in extra if e.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    for o in args.overrides:
        if "=" not in o:
            print(f"hexiscale: error: override {o!r} is not KEY=VALUE. Fix: write e.g. cluster=hetero3", file=sys.stderr)
            return 2
    try:
        return SUBCOMMANDS[args.command][2](args)
    except HexiScaleError as e:
        print(f"hexiscale {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hexiscale ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
