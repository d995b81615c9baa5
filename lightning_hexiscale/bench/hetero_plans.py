"""The plans benchmarks/bench_hetero.py compares and the plans it calibrates on, both fixed here.

**Compared plans** (:data:`COMPARED`, in this order, every one made by the planner from the profiled,
calibrated cluster, with the bench's micro-batch size, no recomputation and DDP):

- ``search``: the §4 search on the whole cluster;
- ``leave-out-search``, ``leave-out-symmetric``: what a user does without this project, train on
  the fast machine(s) and leave the slow ones out: the best plan on a STRICT machine subset (at
  least one machine idle), made by the search (``planner.baselines.leave_out(style="search")``) or
  the best Megatron/Galvatron-style symmetric plan (``style="symmetric"``);
- ``symmetric-best``: the best symmetric plan (either style, every dp sharding) on ANY machine
  subset, the whole cluster included (``planner.baselines.symmetric_best``): the strongest
  symmetric opponent for the "best plan" rule;
- ``uniform-tp``: the search restricted to one TP degree in every stage (``planner.baselines.uniform_tp``);
- ``megatron``, ``galvatron``: their spaces on all devices (``planner.baselines``);
- ``held-out-fast-first``, ``held-out-slow-first``: one pipeline through every machine, each machine
  one tensor-parallel stage (TP = its devices, at most the model's heads allow), fastest machine
  first or last; layers and leaders chosen by the planner (:func:`held_out_plans`). They have TP >= 2
  and a pipeline hop across machines, and no planner picked them for being fast: held out for the
  accuracy target.

A compared plan the planner cannot make yet (a baselines function that does not exist, or one whose
arguments differ) is listed as unavailable with the reason, never dropped in silence and never
replaced by something else.

**Calibration plans** (:data:`CALIBRATION`, :mod:`lightning_hexiscale.profiling.calibrate`): every
rank trains the whole model alone (no communication: the efficiency per device type), TP-2 stages
over rank pairs (0, 1), (2, 3), ... with all layers (the sync latency), and data parallelism over
all ranks, one device per pipeline with all layers (theta_ddp); ``--cal-micro-batches`` micro-batches
of the bench's micro-batch size per rank. :func:`structure` is what "structurally equal" means: the
same pipelines, each the same stages with the same devices and layer ranges, batch sizes aside; a
compared plan with a calibration plan's structure is marked in-sample.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import Plan

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Compared:
    """One compared plan: its name, where it comes from (``search``, ``held-out`` or
    ``baselines.<function>``), keyword arguments for that function, and what it stands for."""

    name: str
    source: str
    kwargs: tuple[tuple[str, object], ...] = ()
    role: str = ""


COMPARED = (
    Compared("search", "search", role="the §4 search on the whole cluster"),
    Compared("leave-out-search", "baselines.leave_out", (("style", "search"),),
             "the search on a strict machine subset: at least one machine left out"),
    Compared("leave-out-symmetric", "baselines.leave_out", (("style", "symmetric"),),
             "the best Megatron/Galvatron-style symmetric plan on a strict machine subset"),
    Compared("symmetric-best", "baselines.symmetric_best", (),
             "the best Megatron/Galvatron-style symmetric plan, every dp sharding, on any machine subset, the "
             "whole cluster included (issue 28's fast-only-*, renamed: it may use every machine)"),
    Compared("uniform-tp", "baselines.uniform_tp", (), "the search with one TP degree in every stage"),
    Compared("megatron", "baselines.megatron", (), "Megatron's (dp, tp, pp) space on all devices"),
    Compared("galvatron", "baselines.galvatron", (), "Megatron's space with a free layer split, all devices"),
    Compared("held-out-fast-first", "held-out", (("fast_first", True),),
             "held out: one pipeline, a TP stage per machine, fastest machine first"),
    Compared("held-out-slow-first", "held-out", (("fast_first", False),),
             "held out: one pipeline, a TP stage per machine, slowest machine first"),
)
COMPARED_NAMES = tuple(c.name for c in COMPARED)
HELD_OUT = tuple(c.name for c in COMPARED if c.source == "held-out")

CALIBRATION = ("compute alone: every rank trains all layers by itself, no communication",
               "TP-2 pairs: one TP-2 stage over rank pairs (0,1), (2,3), ... with all layers, a pipeline per pair",
               "data parallel: one single-device pipeline per rank with all layers, gradients all-reduced")
"""The calibration's measurements, in the order they are fitted (efficiency, sync latency, theta_ddp)."""
PRICING_ROOTS = ("lightning_hexiscale/planner/cost/estimate.py", "lightning_hexiscale/profiling/calibrate.py")
"""The cost model and its calibration; with every planner module they import, their source is the
cost model's form that :func:`cost_model_form` fingerprints."""


def structure(plan: Plan) -> frozenset:
    """What makes two plans structurally equal: the set of pipelines, each the tuple of its stages'
    (sorted devices, layer range); batch and micro-batch sizes, leaders and sharding aside."""
    return frozenset(tuple((tuple(sorted(s.devices)), tuple(s.layers)) for s in p.stages) for p in plan.pipelines)


def calibration_structures(world: int, config: LlamaConfig, micro_batch: int, micro_batches: int) -> dict[str, frozenset]:
    """The calibration plans' structures (compute alone has data parallelism's: the same stages, no sync)."""
    from lightning_hexiscale.profiling.calibrate import pure_dp_plan, tp_pairs_plan

    dp = structure(pure_dp_plan(world, config, micro_batch, micro_batches, False))
    out = {"compute alone": dp, "data parallel": dp}
    if world > 1:
        out["TP-2 pairs"] = structure(tp_pairs_plan(world, config, micro_batch, micro_batches, False))
    return out


def in_sample(plans: dict[str, Plan], cal: dict[str, frozenset]) -> dict[str, str]:
    """Compared plan -> the calibration plan it is structurally equal to."""
    out = {}
    for name, p in plans.items():
        same = [c for c, s in cal.items() if s == structure(p)]
        if same:
            out[name] = same[0]
    return out


def fitted_constants(cluster: Cluster) -> list[str]:
    """The constants the calibration fits: efficiency per device type, sync latency, theta_ddp."""
    types = list(dict.fromkeys(d.gpu_type for d in cluster.devices))
    return [f"efficiency {t}" for t in types] + ["sync latency", "theta_ddp"]


def held_out_plan(cluster: Cluster, config: LlamaConfig, work, global_batch: int, micro_batch: int,
                  fast_first: bool) -> tuple[Plan | None, str]:
    """One pipeline through every machine, each machine's devices one TP stage (split into TP groups of
    the largest degree in 8, 4, 2 dividing both its device count and the KV heads; 1 otherwise),
    machines by per-device FLOP/s, fastest first or last; the planner's leaders and layer split."""
    from lightning_hexiscale.planner.search.assemble import DraftContext, Evaluator, chain_draft, make_plan

    order = sorted(range(len(cluster.machines)), key=lambda m: (-cluster.devices[cluster.machines[m].devices[0]].flops, m))
    if not fast_first:
        order = order[::-1]
    stages = []
    for m in order:
        devs = list(cluster.machines[m].devices)
        tp = next((t for t in (8, 4, 2) if len(devs) % t == 0 and config.num_kv_heads % t == 0), 1)
        stages += [tuple(devs[i:i + tp]) for i in range(0, len(devs), tp)]
    if len(cluster.machines) < 2 or max(len(s) for s in stages) < 2:
        return None, "needs two machines and one with a TP group of 2 or more devices"
    n_mb = global_batch // micro_batch
    ev = Evaluator(cluster, work, "1f1b", recompute=False)
    draft = chain_draft(ev, stages, DraftContext(mb=micro_batch, sharding="ddp", num_pipelines=1, n_mb=n_mb))
    if draft is None:
        return None, f"stages {stages} do not fit (memory or more stages than layers)"
    plan = make_plan([draft], [n_mb], micro_batch, "ddp", "1f1b", False, config.num_layers,
                     {"planner": "held-out", "order": "fast-first" if fast_first else "slow-first"})
    return plan, f"1 pipeline, stages {[list(s) for s in draft.stages]}, layers {list(draft.layers)}"


def not_measurable(plan: Plan, cluster: Cluster) -> str | None:
    """Why the rounds cannot run ``plan`` on the bench's launch (one rank per device of ``cluster``,
    rank r on device r), or None when they can. A plan that leaves devices idle runs on the ranks of
    its used devices (``runtime.topology.rank_map``, ``profiling/rounds.py``) when its launch order
    (used and idle devices) is every device of the cluster."""
    if plan.launch_order == tuple(range(cluster.num_devices)):
        return None
    return (f"its devices, used and idle, are {list(plan.launch_order)}, and the rounds run a plan on one rank "
            f"per device of its launch order: all {cluster.num_devices} devices of {cluster.name}")


def make_plans(cluster: Cluster, config: LlamaConfig, args, names: tuple[str, ...] = COMPARED_NAMES,
               measurable: bool = False) -> dict[str, tuple[Plan | None, str]]:
    """name -> (plan, note) for every compared plan in ``names``; (None, why) when the planner has
    none: nothing fits, or it cannot make that plan yet. ``measurable``: only plans the rounds can
    run (:func:`not_measurable`; plans that leave devices idle included, the leave-out plans among
    them): another plan is unavailable, with the reason, except the search's, which is replaced by
    the search with ``use_all_devices`` and says so in its note (``SUBSTITUTED`` in the note: the
    run is then not a pre-registered one)."""
    from lightning_hexiscale.planner import baselines
    from lightning_hexiscale.planner import SearchSettings, search
    from lightning_hexiscale.profiling.check import cpu_workload

    work = cpu_workload(config)
    s = SearchSettings(iterations=args.iterations, seed=0, recompute=False, micro_batch_size=args.micro_batch,
                       dp_sharding=None if args.dp_sharding == "own" else args.dp_sharding)
    G = args.global_batch
    out: dict[str, tuple[Plan | None, str]] = {}
    for c in COMPARED:
        if c.name not in names:
            continue
        kw = dict(c.kwargs)
        if c.source == "search":
            try:
                r = search(cluster, work, G, s)
                note = f"{r.plan.num_pipelines} pipelines, {r.plan.dp_sharding}"
                why = not_measurable(r.plan, cluster) if measurable else None
                if why:
                    own = (f"SUBSTITUTED: the search's own plan cannot be measured (estimate "
                           f"{r.estimate.iteration_time_s:.3f} s): {why}; measured "
                           "instead: the search with planner.use_all_devices=true")
                    r = search(cluster, work, G, replace(s, use_all_devices=True))
                    note = f"{r.plan.num_pipelines} pipelines, {r.plan.dp_sharding}; {own}"
                out[c.name] = (r.plan, note)
            except InfeasiblePlan as e:
                out[c.name] = (None, f"no plan: {e}")
        elif c.source == "held-out":
            out[c.name] = held_out_plan(cluster, config, work, G, args.micro_batch, **kw)
        else:
            fn_name = c.source.split(".", 1)[1]
            fn = getattr(baselines, fn_name, None)
            if fn is None:
                out[c.name] = (None, f"UNAVAILABLE: lightning_hexiscale.planner.baselines has no `{fn_name}` yet "
                                     "(subset-aware planning, issue 27)")
                continue
            if fn_name in ("megatron", "galvatron"):
                kw["aware"] = not args.faithful_baselines
            try:
                b = fn(cluster, work, G, s, **kw)
            except TypeError as e:  # the function exists, but not with the arguments this bench passes
                out[c.name] = (None, f"UNAVAILABLE: baselines.{fn_name}(cluster, workload, global_batch, settings"
                                     f"{''.join(f', {k}={v!r}' for k, v in kw.items())}) failed: {e}")
                continue
            plan = b.plan
            if plan is not None:
                plan = replace(plan, meta={**plan.meta, "planner": c.name})
            out[c.name] = (plan, b.note if plan is not None else f"no plan: {b.note}")
        plan, note = out[c.name]
        why = not_measurable(plan, cluster) if measurable and plan is not None else None
        if why and c.source != "search":
            out[c.name] = (None, f"UNAVAILABLE: {why} ({note})")
    return out


def _pricing_files() -> list[Path]:
    """PRICING_ROOTS and every lightning_hexiscale.planner / config module they import, transitively."""
    import ast

    pkg = REPO / "lightning_hexiscale"
    todo, seen = [REPO / p for p in PRICING_ROOTS], set()
    while todo:
        f = todo.pop()
        if f in seen or not f.exists():
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a module or a name in it
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                if m.startswith(("lightning_hexiscale.planner", "lightning_hexiscale.config")):
                    rel = Path(*m.split(".")[1:])
                    for cand in (pkg / rel.with_suffix(".py"), pkg / rel / "__init__.py"):
                        if cand.exists():
                            todo.append(cand)
    return sorted(seen)


def cost_model_form() -> dict:
    """The cost model's form for this run: a sha256 over the source of the pricing modules
    (:data:`PRICING_ROOTS` and what they import), the commit, and which of them differ from it."""
    files = _pricing_files()
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    rel = [str(f.relative_to(REPO)) for f in files]

    def git(*a: str) -> str:
        try:
            # rstrip only: porcelain lines start with a status column that may be a space (" M path")
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    modified = [x for x in git("status", "--porcelain", "--", *rel).splitlines() if x.strip()]
    return {"sha256": h.hexdigest()[:16], "files": rel, "commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "modified": [x[3:] for x in modified]}
