"""The planned plan's MEASURED speedup on an emulated heterogeneous cluster, and the cost model against it.

On one machine, each rank of ``--cluster`` runs as a genuinely unequal device
(:class:`lightning_hexiscale.emulate.EmulatedCluster`: a CPU quota per rank in proportion to its
device's FLOP/s, one network namespace per machine, shaped links between them). In ONE run, on the
same cluster, model and global batch:

0. the host's load is measured (other work's share of the CPUs over ``--load-window`` seconds) and
   printed; above 10 % the bench refuses (``--allow-load`` measures anyway, and the run is then void
   under the pre-registered rules). It is measured again all through the run and printed at the end;
1. the emulated quotas are trimmed until every rank's measured matmul rate stands in the declared
   ratio, and TP-2 all-reduces (over a socket, :mod:`lightning_hexiscale.emulate.fidelity`, and
   through gloo in this bench's worker) are measured against the declared latency;
2. ``hexiscale profile`` runs inside the emulated cluster and writes OUT/profiled.yaml; its compute
   ratio must be within 10 % of the declared one (else the bench refuses, as for load);
3. the calibration (efficiency per device type, sync latency, theta_ddp: :data:`CALIBRATION` in
   lightning_hexiscale/bench/hetero_plans.py, a fixed set of measurements none of which has a compared plan's
   structure) runs inside it too and is written into that file;
4. from the profiled, calibrated cluster the planner makes the compared plans, a fixed list
   (:data:`COMPARED`: the search's, the best leave-out plans (a strict machine subset: what a user
   does without this project), symmetric-best, the uniform-TP search, megatron and
   galvatron on all devices, two held-out TP plans with a hop across machines); one it cannot make
   is listed as unavailable, with the reason;
5. all plans train in one launch of the ranks, interleaved (``--rounds`` rounds; round k runs every
   plan once, in an order rotated by k), ``--warmup`` untimed and ``--steps`` timed steps per plan and
   round; a step's time is the slowest rank's. The calibration's measurements take their turn in
   every round too (``--cal-steps``), and the estimates are priced on the calibration refitted to
   them (same load as the plans; ``--cal-steps 0``: on the one of step 3). The cost model's form
   (a hash of its source) is printed and recorded, frozen for the run.

Printed per plan: estimate, measured min / median / max, estimate / median, the search's measured
speedup over it, the paired test's p-value against the search. Then the pre-registered targets of
lightning_hexiscale/bench/hetero_rules.py (worth it: speedup over the best leave-out plan; every estimate within 15 %;
the search's plan best or tied), each PASS / FAIL / NOT JUDGED, and whether the run meets the
pre-registered conditions (every compared plan ran, enough rounds, quiet host, emulation within 10 %,
cost model unmodified). Writes OUT/results.json, OUT/plans/NAME.yaml, OUT/profiled.yaml, OUT/logs/.

    sudo python benchmarks/bench_hetero.py --cluster emu_headroom --cores 1.6   # 25 rounds; needs a quiet host
    sudo python benchmarks/bench_hetero.py --cores 1.5                          # emu_4to1
    python benchmarks/bench_hetero.py --launcher local --cluster cpu_hetero4 --no-profile   # plain processes

``--launcher local`` runs the same worker processes on this host with torchrun's environment but
without quotas or namespaces (for tests and machines without root; no load refusal, no emulation
checks); ``--no-profile`` estimates with the cluster YAML's own figures. Ranks run ``python -m
lightning_hexiscale.bench.hetero_run JOB.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lightning_hexiscale.bench import hetero_rules as rules
from lightning_hexiscale.bench.hetero_plans import (CALIBRATION, COMPARED, COMPARED_NAMES, HELD_OUT,
                                                    calibration_structures, cost_model_form, fitted_constants,
                                                    in_sample, make_plans)
from lightning_hexiscale.bench.hetero_rules import compare  # noqa: F401 (this benchmark's API)
from lightning_hexiscale.bench.hetero_run import (CAL_COMPUTE, CAL_DP, CAL_TP, LocalLauncher,  # noqa: F401
                                                  machine_pairs, make_launcher, profiled_cluster, refit,
                                                  run_worker_job, split_calibration)
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, HexiScaleError
from lightning_hexiscale.models.config import LlamaConfig


class Refused(HexiScaleError, RuntimeError):
    """The bench will not measure: the host's load, or an emulation off its declared ratios, would
    distort what it measures."""


ALLOW_LOAD_FIX = ("run when other work uses under 10 % of the CPUs (`uptime`, `top`), or pass --allow-load to "
                  "measure anyway (the run is then void under the pre-registered rules)")


# ---- the host and the emulation, before anything is measured ------------------------------------------
def load_before(args):
    """The host's load with nothing of this run running; refuses above the limit (emulated runs)."""
    from lightning_hexiscale.emulate.hostload import load_refusal, sample_load

    sample = sample_load(args.load_window)
    print(f"host load before the run: {sample.text()}", flush=True)
    why = load_refusal(sample)
    if why and args.launcher == "emulate":
        if not args.allow_load:
            raise Refused(f"{why}. Fix: {ALLOW_LOAD_FIX}")
        print("  --allow-load: measuring anyway; the run is void under the pre-registered rules", flush=True)
    return sample


def _refuse_unless_allowed(args, what: str) -> None:
    if not args.allow_load:
        raise Refused(f"{what}. Fix: {ALLOW_LOAD_FIX}")
    print(f"  --allow-load: {what}; measuring anyway, the run is void under the pre-registered rules", flush=True)


def emulation_checks(emu, args, out: Path) -> dict:
    """Trim the quotas (unless --no-trim), measure the TP-2 all-reduces; refuses when the trimmed
    ratios stay off by more than 10 %."""
    from lightning_hexiscale.emulate.fidelity import RATE_TOLERANCE, check_exchange, trim

    doc: dict = {}
    if args.trim:
        result = trim(emu)
        print(result.text(), flush=True)
        doc["trim"] = {"checks": [asdict(c) for c in result.checks], "worst": result.final.worst,
                       "cores": list(result.final.cores)}
        if not result.final.passes(RATE_TOLERANCE):
            _refuse_unless_allowed(args, f"the emulated compute ratios stay {result.final.worst * 100:.0f} % off the "
                                         f"declared ones after trimming (limit {RATE_TOLERANCE * 100:.0f} %)")
    pairs = check_exchange(emu)
    for p in pairs:
        print(p.text(), flush=True)
    doc["tp_sync"] = [{**asdict(p), "overhead_s": p.overhead_s, "passes": p.passes} for p in pairs]
    doc["tp_sync_gloo"] = gloo_tp_check(emu, args, out)
    return doc


def gloo_tp_check(emu, args, out: Path) -> list[dict]:
    """The same TP-2 check through gloo, in the bench's worker (what the runtime's TP all-reduces use):
    per pair, cycle minus the work at the quota, against the declared latency (printed, recorded)."""
    from lightning_hexiscale.emulate.fidelity import TP_WAIT_LIMIT_S

    pairs = machine_pairs(emu.cluster)
    if not pairs:
        return []
    reps = 100
    job = {"kind": "tp-allreduce", "model": model_config(args).to_dict(), "pairs": pairs, "reps": reps,
           "work_mflop": 60.0}
    per_rank = run_worker_job(emu, job, out / "jobs" / "tp_allreduce.json", args.timeout)
    rows = []
    for a, b in pairs:
        cycle = max(per_rank[a]["wall_s"], per_rank[b]["wall_s"]) / reps
        fluid = max(per_rank[a]["cpu_s"] / emu.ranks[a].cores, per_rank[b]["cpu_s"] / emu.ranks[b].cores) / reps
        latency = float(emu.cluster.latency[a, b])
        ok = cycle - fluid <= latency + TP_WAIT_LIMIT_S
        print(f"TP-2 ranks {a}-{b} through gloo: cycle {cycle * 1e3:.2f} ms, work at the quota {fluid * 1e3:.2f} ms, so "
              f"{(cycle - fluid) * 1e3:.2f} ms per all-reduce against the declared latency {latency * 1e6:.0f} us: "
              f"{'PASS' if ok else 'FAIL'} (limit latency + {TP_WAIT_LIMIT_S * 1e3:g} ms)", flush=True)
        rows.append({"ranks": [a, b], "cycle_s": cycle, "fluid_s": fluid, "declared_latency_s": latency, "passes": ok})
    return rows


def profiled_ratio(emu, raw: Cluster, args) -> dict:
    """The profile's FLOP/s against the declared ones; refuses beyond 10 % (unless --allow-load)."""
    from lightning_hexiscale.emulate.fidelity import RATE_TOLERANCE, rate_check

    check = rate_check(emu, [d.flops for d in raw.devices])
    print(f"compute as profiled: {check.text()}", flush=True)
    if not check.passes(RATE_TOLERANCE):
        _refuse_unless_allowed(args, f"the profiled compute ratios are {check.worst * 100:.0f} % off the declared "
                                     f"ones (limit {RATE_TOLERANCE * 100:.0f} %)")
    return {**asdict(check), "worst": check.worst, "passes": check.passes(RATE_TOLERANCE)}


def training_ratio(cluster: Cluster, cal_steps) -> str:
    """The calibration's compute-alone steps (whole model, every rank at once) as a speed ratio of the
    fastest to the slowest device type, against the declared FLOP/s (for the record)."""
    import statistics

    from lightning_hexiscale.emulate.fidelity import RateCheck

    speed = [1.0 / statistics.median(t) for t in cal_steps.compute_s]
    check = RateCheck(tuple(d.flops for d in cluster.devices), tuple(speed), (),
                      tuple(d.gpu_type for d in cluster.devices))
    r = check.type_ratio()
    spread = f"worst rank {check.worst * 100:.1f} % off its declared share"
    return f"{r[2]} {r[0]:.2f}:1 (declared {r[1]:.2f}:1); {spread}" if r else spread


# ---- printing ----------------------------------------------------------------------------------------
def rules_text(cluster: Cluster) -> str:
    goal = rules.WORTH_IT_TARGETS.get(cluster.name)
    return "\n".join([
        "pre-registered rules (lightning_hexiscale/bench/hetero_rules.py; fixed before any full run):",
        f"  worth it: search's median / best leave-out median ({' or '.join(rules.LEAVE_OUT)}: a strict machine subset) "
        f"{'>= ' + str(goal) if goal else 'printed (no target for ' + cluster.name + ')'}"
        f" (targets: {', '.join(f'{k} >= {v}' for k, v in rules.WORTH_IT_TARGETS.items())})",
        f"  accuracy: every compared plan's |estimate / median - 1| <= {rules.ACCURACY_TARGET}, held-out plans included",
        f"  best plan: no compared plan (symmetric-best, megatron, galvatron on all devices included) faster than the search's at p < {rules.RANK_ALPHA} (exact Wilcoxon signed-rank on the "
        f"per-round log ratios); a {rules.RANK_DIFFERENCE * 100:.0f} % difference is detected with "
        f"{rules.RANK_POWER * 100:.0f} % power at {rules.RANKING_ROUNDS} rounds:",
        f"    {rules.RANKING_ARITHMETIC}"])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def report(result: dict, notes: dict[str, str], in_sample_of: dict[str, str] | None = None) -> str:
    """The table of plans, both orders and the targets."""
    in_sample_of = in_sample_of or {}
    hdr = ("plan", "est.", "meas. min", "median", "max", "est./meas.", "search speedup (meas.)", "(est.)", "p vs search",
           "kind")
    rows = [hdr]
    for n, r in result["rows"].items():
        kind = "held out" if r.get("held_out") else (f"in-sample ({in_sample_of[n]})" if n in in_sample_of else "")
        rows.append((n, _ms(r["estimate_s"]), _ms(r["min_s"]), _ms(r["median_s"]), _ms(r["max_s"]), f"{r['ratio']:.3f}",
                     "-" if r["speedup_of_search"] is None else f"{r['speedup_of_search']:.2f}x",
                     "-" if r["estimated_speedup_of_search"] is None else f"{r['estimated_speedup_of_search']:.2f}x",
                     "-" if r.get("p_vs_search") is None else f"{r['p_vs_search']:.3f}", kind))
    w = [max(len(x[c]) for x in rows) for c in range(len(hdr))]
    lines = ["  ".join(v.ljust(x) if c in (0, 9) else v.rjust(x) for c, (v, x) in enumerate(zip(row, w)))
             for row in rows]
    lines += [f"  {n}: {notes[n]}" for n in result["rows"] if notes.get(n)]
    est = {n: r["estimate_s"] for n, r in result["rows"].items()}
    order = result["order_by_estimate"]
    if order:
        lines.append("order by estimate: " + order[0] + "".join(
            (" = " if est[b] == est[a] else " < ") + b for a, b in zip(order, order[1:])))
    lines.append(f"order by measured: {' < '.join(result['order_by_measured'])}")
    if result["discordant_pairs"]:
        settled = [p for p in result["discordant_pairs"] if p not in result["unsettled_pairs"]]
        lines.append(f"  the orders disagree on {result['discordant_pairs']}; of these the rounds order "
                     f"{settled or 'none'} at p < {rules.RANK_ALPHA} (pairs they do not order are measured ties)")
    for key, t in result["targets"].items():
        v = t["value"]
        shown = f"{v:.3f}" if isinstance(v, float) else str(v)
        verdict = "NOT JUDGED" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        extra = "".join(f"; {k} {t[k]}" for k in ("against", "worst_plan", "beaten_by", "tied_with", "why")
                        if t.get(k) not in (None, []))
        if t.get("held_out_worst") is not None:
            extra += f"; held-out worst {t['held_out_worst']:.3f}"
        lines.append(f"{verdict}  {key}: {shown} (target {t['target']}{extra})")
    return "\n".join(lines)


def preregistered(args, cluster: Cluster, unavailable: list[str], before, during, form: dict, fidelity: dict,
                  in_sample_of: dict[str, str], substituted: list[str] = ()) -> list[str]:
    """Why this run is not one the pre-registered rules count (empty: it is)."""
    from lightning_hexiscale.emulate.fidelity import RATE_TOLERANCE
    from lightning_hexiscale.emulate.hostload import LOAD_LIMIT

    why = []
    if args.launcher != "emulate":
        why.append("not emulated (--launcher local)")
    if set(args.plans) != set(COMPARED_NAMES):
        why.append(f"only {len(args.plans)} of the {len(COMPARED_NAMES)} compared plans selected (--plans)")
    if unavailable:
        why.append(f"compared plans unavailable: {', '.join(unavailable)}")
    if substituted:
        why.append(f"measured in place of the compared plan: {', '.join(substituted)}")
    if args.rounds < rules.RANKING_ROUNDS:
        why.append(f"{args.rounds} rounds, fewer than the {rules.RANKING_ROUNDS} the ranking rule needs")
    if before.others_fraction > LOAD_LIMIT or (during is not None and during.others_fraction > LOAD_LIMIT):
        why.append("other work above the load limit before or during the run")
    if form["modified"]:
        why.append(f"the cost model's source differs from commit {form['commit']}: {', '.join(form['modified'])}")
    if fidelity.get("trim", {}).get("worst", 0.0) > RATE_TOLERANCE:
        why.append(f"the trimmed compute ratios are more than {RATE_TOLERANCE * 100:.0f} % off the declared ones")
    if not fidelity.get("profiled", {}).get("passes", True):
        why.append(f"the profiled compute ratios are more than {RATE_TOLERANCE * 100:.0f} % off the declared ones")
    if in_sample_of:
        why.append(f"compared plans with a calibration plan's structure: {sorted(in_sample_of)}")
    if cluster.name not in rules.WORTH_IT_TARGETS:
        why.append(f"no worth-it target for cluster {cluster.name}")
    return why


# ---- entry point -------------------------------------------------------------------------------------
def model_config(args) -> LlamaConfig:
    return LlamaConfig(name="bench_hetero", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                       num_kv_heads=args.heads, ffn_hidden_size=(8 * args.hidden // 3 + 63) // 64 * 64,
                       vocab_size=args.vocab, seq_len=args.seq)


def _plan_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in COMPARED_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown plan(s) {bad or text!r}; choose from {', '.join(COMPARED_NAMES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="emu_4to1", help="cluster preset or YAML to emulate [emu_4to1]")
    ap.add_argument("--launcher", choices=("emulate", "local"), default="emulate",
                    help="emulate: quotas + namespaces + shaped links (root); local: plain processes [emulate]")
    ap.add_argument("--cores", type=float, default=None, help="cores the quotas share (default: all)")
    ap.add_argument("--bw-scale", type=float, default=1.0, help="factor on the YAML's inter-machine bandwidths [1]")
    ap.add_argument("--allow-load", action="store_true",
                    help="measure even when other work uses more than 10 %% of the CPUs or the emulated compute "
                         "ratios are more than 10 %% off (the run is then void under the pre-registered rules)")
    ap.add_argument("--load-window", type=float, default=3.0, help="seconds the load is sampled before the run [3]")
    ap.add_argument("--no-trim", dest="trim", action="store_false",
                    help="keep the quotas proportional to the declared FLOP/s (no trimming to measured rates)")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="estimate with the cluster YAML's own figures (no profile, no calibration)")
    ap.add_argument("--plan-only", action="store_true",
                    help="only plan, on the cluster YAML's figures: print every compared plan's estimate, the "
                         "search on the fastest machine alone and the compute ceiling, and exit (no processes)")
    ap.add_argument("--plans", type=_plan_names, default=list(COMPARED_NAMES),
                    help=f"a subset of the compared plans, for debugging (the run is then not pre-registered) "
                         f"[{','.join(COMPARED_NAMES)}]")
    ap.add_argument("--faithful-baselines", action="store_true",
                    help="megatron/galvatron rank their candidates on a homogeneous belief of the cluster, as the "
                         "real systems do (default: on the profiled cluster, i.e. the best plan of their space)")
    ap.add_argument("--dp-sharding", choices=("ddp", "zero2", "zero3", "own"), default="ddp",
                    help="data-parallel sharding of every plan [ddp]; own: each system's own. The ZeRO thetas are "
                         "not calibrated (see the README)")
    ap.add_argument("--iterations", type=int, default=50, help="search iterations [50]")
    ap.add_argument("--hidden", type=int, default=192, help="model width H [192]")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers [8]")
    ap.add_argument("--heads", type=int, default=6, help="attention heads (= KV heads) [6]")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary [512]")
    ap.add_argument("--seq", type=int, default=128, help="sequence length [128]")
    ap.add_argument("--global-batch", type=int, default=24, help="sequences per step, every plan [24]")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch, every plan [2]")
    ap.add_argument("--cal-micro-batches", type=int, default=2, help="micro-batches per rank when calibrating [2]")
    ap.add_argument("--cal-steps", type=int, default=2,
                    help="timed steps of each calibration measurement in every round; the estimates are priced on "
                         "the calibration refitted to them (0: on the calibration measured before the rounds) [2]")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per plan and round [4]")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per plan and round [1]")
    ap.add_argument("--rounds", type=int, default=rules.RANKING_ROUNDS,
                    help=f"interleaved rounds [{rules.RANKING_ROUNDS}: what the ranking rule needs to detect a 5 %% "
                         "difference with 80 %% power; fewer make the run not pre-registered]")
    ap.add_argument("--profile-reps", type=int, default=10, help="ping-pongs per size when profiling [10]")
    ap.add_argument("--matmul-time", type=float, default=None,
                    help="seconds of matmuls per rank when profiling (default: the profile's own)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="deadline per launch in seconds [3600]")
    ap.add_argument("--out", default="outputs/bench_hetero", help="output folder [outputs/bench_hetero]")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return bench(args)
    except HexiScaleError as e:  # bad input, a busy host, no emulation support, a failed rank: the message says why
        print(f"error: {e}", file=sys.stderr)
        return 2


# (option, smallest value, what it counts) of the counts and scales checked before any process starts
_LOWER_BOUNDS = (("rounds", 1, "interleaved rounds"), ("steps", 1, "timed steps per plan and round"),
                 ("warmup", 0, "untimed steps per plan and round"), ("cal_steps", 0, "timed calibration steps"),
                 ("cal_micro_batches", 1, "calibration micro-batches"), ("iterations", 1, "search iterations"),
                 ("micro_batch", 1, "sequences per micro-batch"), ("global_batch", 1, "sequences per step"),
                 ("profile_reps", 1, "ping-pongs per size"))


def check_args(args) -> None:
    """Bad counts, scales and deadlines as one clear error, before any process starts."""
    for name, low, what in _LOWER_BOUNDS:
        value = getattr(args, name)
        if value < low:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(flag, value, f"the {what} must be at least {low}", f"pass {flag} {low} or more")
    for name in ("cores", "bw_scale", "timeout", "matmul_time", "load_window"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(flag, value, "must be a positive number", f"pass a positive {flag} or leave it out")
    if args.global_batch % args.micro_batch:
        raise ConfigError("--global-batch", args.global_batch, f"every plan uses micro-batches of {args.micro_batch} "
                          "sequences, so the global batch must be a multiple of --micro-batch",
                          f"use e.g. --global-batch {args.micro_batch * 12}")


def bench(args) -> int:
    from lightning_hexiscale.emulate.hostload import LoadMonitor

    check_args(args)
    cluster = Cluster.load(args.cluster)
    config = model_config(args)
    out = Path(args.out).resolve()
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    print(f"cluster {cluster.name}: {cluster.num_devices} ranks on {len(cluster.machines)} machines; launcher "
          f"{args.launcher}; model {config.total_params / 1e6:.2f} M parameters (H={config.hidden_size}, "
          f"L={config.num_layers}, S={config.seq_len}), global batch {args.global_batch}, micro-batch {args.micro_batch}",
          flush=True)
    print(rules_text(cluster), flush=True)
    form = cost_model_form()
    print(f"cost model form {form['sha256']} ({len(form['files'])} source files at commit {form['commit']}, "
          f"{'modified: ' + ', '.join(form['modified']) if form['modified'] else 'unmodified'}); frozen for this run",
          flush=True)
    if args.plan_only:
        return plan_only(cluster, config, args, out)
    before = load_before(args)
    t_start = time.monotonic()
    fidelity: dict = {}
    with make_launcher(args, cluster) as launcher, LoadMonitor(ours=launcher.pids) as monitor:
        emulated = launcher.describe() if hasattr(launcher, "describe") else "not emulated (--launcher local)"
        print(emulated, flush=True)
        if args.launcher == "emulate":
            fidelity = emulation_checks(launcher, args, out)
        if args.profile:
            cost, cost_path, raw = profiled_cluster(launcher, cluster, config, args, out)
            if args.launcher == "emulate":
                fidelity["profiled"] = profiled_ratio(launcher, raw, args)
        else:
            cost, cost_path, raw = cluster, Path(args.cluster), None
        print(cost.summary(), flush=True)
        planned, plans, notes, unavailable = plan_all(cost, config, args, out, measurable=True)
        cal = calibration_structures(cluster.num_devices, config, args.micro_batch, args.cal_micro_batches)
        in_sample_of = in_sample(plans, cal)
        constants = fitted_constants(cluster) if args.profile else []
        print(f"calibration ({'fitted' if args.profile else 'not run: --no-profile'}): "
              + "; ".join(CALIBRATION) + f". {len(constants)} fitted constants ({', '.join(constants) or 'none'}) for "
              f"{len(plans)} compared plans, {sum(n in HELD_OUT for n in plans)} of them held out; in-sample: "
              f"{', '.join(f'{n} = {c}' for n, c in in_sample_of.items()) or 'none'}", flush=True)
        from lightning_hexiscale.planner import estimate
        from lightning_hexiscale.profiling.check import cpu_workload

        estimates = {n: estimate(p, cost, cpu_workload(config)).iteration_time_s for n, p in plans.items()}
        job = {"kind": "rounds", "model": config.to_dict(), "plans": {n: p.to_dict() for n, p in plans.items()},
               "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
        if raw is not None and args.cal_steps > 0:  # the calibration takes its turn in every round too
            job["calibrate"] = {"micro_batch": args.micro_batch, "micro_batches": args.cal_micro_batches,
                                "steps": args.cal_steps, "warmup": 1}
        per_rank = run_worker_job(launcher, job, out / "jobs" / "rounds.json", args.timeout)
    during = monitor.summary()
    from lightning_hexiscale.profiling.rounds import slowest_rank

    per_rank, cal_steps = split_calibration(per_rank)
    before_rounds = dict(estimates)
    refitted = None
    if cal_steps is not None:
        # The plans were made on the calibration measured before the rounds; their estimates are priced
        # on the one measured in the rounds, under the load the plans themselves ran under.
        cost_rounds, refitted = refit(raw, config, cal_steps, args)
        print("calibration measured in the rounds (the estimates below use it):\n" + refitted.summary())
        print(f"training-step compute ratio (compute alone, all ranks at once): {training_ratio(cluster, cal_steps)}")
        estimates = {n: estimate(p, cost_rounds, cpu_workload(config)).iteration_time_s for n, p in plans.items()}
    measured = {n: t.to_dict() for n, t in slowest_rank(per_rank).items()}
    result = compare(estimates, measured, cluster.name, held_out=HELD_OUT, in_sample=tuple(in_sample_of))
    print()
    print(report(result, notes, in_sample_of))
    sigma = rules.round_sigma(measured)
    if sigma is not None:
        print(f"round-to-round noise of this run: sigma {sigma:.3f} (the rule assumed {rules.PRIOR_ROUND_SIGMA})")
    print(f"host load during the run: {during.text() if during else 'not sampled (shorter than one sample)'}"
          + (f"; worst sample {monitor.worst_fraction * 100:.0f} %" if during else ""))
    void = preregistered(args, cluster, unavailable, before, during, form, fidelity, in_sample_of,
                        [n for n, note in notes.items() if "SUBSTITUTED" in note])
    print("pre-registered run: " + ("yes" if not void else "NO: " + "; ".join(void)))
    doc = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "model": config.to_dict(),
           "cluster": args.cluster, "emulated": emulated, "cost_cluster": str(cost_path), "per_rank_steps_s": per_rank,
           "plans": {n: p.to_dict() for n, p in plans.items()}, "notes": notes, "unavailable": unavailable,
           "wall_s": time.monotonic() - t_start, "load_before": asdict(before),
           "load_during": asdict(during) if during else None, "others_cpu_fraction": during.others_fraction
           if during else None, "cost_model_form": form, "emulation": fidelity, "fitted_constants": constants,
           "calibration_plans": list(CALIBRATION), "in_sample": in_sample_of, "held_out": list(HELD_OUT),
           "rules": {"worth_it_targets": rules.WORTH_IT_TARGETS, "leave_out": list(rules.LEAVE_OUT), "accuracy_target": rules.ACCURACY_TARGET,
                     "rank_alpha": rules.RANK_ALPHA, "ranking_rounds": rules.RANKING_ROUNDS,
                     "prior_round_sigma": rules.PRIOR_ROUND_SIGMA, "round_sigma": sigma},
           "not_preregistered_because": void, "estimates_before_rounds_s": before_rounds,
           "calibration_in_rounds": None if refitted is None else {
               "steps_s": asdict(cal_steps), "efficiency": refitted.efficiency,
               "sync_latency_s": refitted.sync_latency_s, "theta_ddp": refitted.theta_ddp},
           **result}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {out / 'results.json'} ({time.monotonic() - t_start:.0f} s)")
    return 0


def plan_only(cluster: Cluster, config: LlamaConfig, args, out: Path) -> int:
    """--plan-only: the compared plans' estimates on the YAML's figures, against the fastest machine alone."""
    from lightning_hexiscale.errors import InfeasiblePlan
    from lightning_hexiscale.planner import SearchSettings, estimate, search
    from lightning_hexiscale.profiling.check import cpu_workload

    work = cpu_workload(config)
    _, plans, _, unavailable = plan_all(cluster, config, args, out)
    est = {n: estimate(p, cluster, work).iteration_time_s for n, p in plans.items()}
    fastest = max(cluster.machines, key=lambda m: cluster.devices[m.devices[0]].flops)
    sub = cluster.subset(list(fastest.devices))
    ceiling = float(cluster.flops.sum() / sub.flops.sum())
    try:
        s = SearchSettings(iterations=args.iterations, seed=0, recompute=False, micro_batch_size=args.micro_batch,
                           dp_sharding="ddp")
        alone = search(sub, work, args.global_batch, s).estimate.iteration_time_s
    except InfeasiblePlan as e:
        alone = None
        print(f"the fastest machine alone holds no plan: {e}")
    print(f"\nestimates on {cluster.name}'s own figures (not measured); compute ceiling over machine {fastest.name} "
          f"alone: {ceiling:.2f}x")
    for n, t in sorted(est.items(), key=lambda kv: kv[1]):
        print(f"  {n:<26} {t:8.3f} s" + (f"   search's speedup {t / est['search']:.2f}x" if "search" in est else ""))
    refs = {f"(search on {fastest.name} alone)": alone}
    n = cluster.num_devices * args.micro_batch
    if args.global_batch % n == 0:  # the naive way to use every device: equal data parallelism
        from lightning_hexiscale.profiling.calibrate import pure_dp_plan

        dp = pure_dp_plan(cluster.num_devices, config, args.micro_batch, args.global_batch // n, False)
        refs["(equal DP on all ranks)"] = estimate(dp, cluster, work).iteration_time_s
    for name, t in refs.items():
        if t is not None and "search" in est:
            print(f"  {name:<26} {t:8.3f} s   search's speedup {t / est['search']:.2f}x (a reference, not a compared plan)")
    if unavailable:
        print(f"unavailable: {', '.join(unavailable)}")
    return 0


def plan_all(cost: Cluster, config: LlamaConfig, args, out: Path, measurable: bool = False):
    """Make the selected compared plans; print each (or why it is unavailable); save the plans.
    ``measurable``: the plans the rounds can run (``make_plans``)."""
    planned = make_plans(cost, config, args, tuple(args.plans), measurable=measurable)
    plans = {n: p for n, (p, _) in planned.items() if p is not None}
    notes = {n: note for n, (_, note) in planned.items()}
    unavailable = [n for n, (p, _) in planned.items() if p is None]
    roles = {c.name: c.role for c in COMPARED}
    for n, (p, note) in planned.items():
        if p is None:
            print(f"--- {n} ({roles[n]}): NO PLAN, not measured: {note}", flush=True)
            continue
        p.save(out / "plans" / f"{n}.yaml")
        print(f"--- {n} ({roles[n]}): {note}\n{p.table(cost)}", flush=True)
    return planned, plans, notes, unavailable


if __name__ == "__main__":
    sys.exit(main())
