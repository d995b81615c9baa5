"""The planned plan's MEASURED speedup on an emulated heterogeneous cluster, and the cost model against it.

On one machine, each rank of ``--cluster`` runs as a genuinely unequal device
(:class:`lightning_hexiscale.emulate.EmulatedCluster`: a CPU quota per rank in proportion to its
device's FLOP/s, one network namespace per machine, shaped links between them). In ONE run, on the
same cluster, model and global batch:

1. ``hexiscale profile`` runs inside the emulated cluster (each rank's matmul FLOP/s under its
   quota, alpha/beta of every pair through the shaped links) and writes OUT/profiled.yaml;
2. calibration (as ``hexiscale calibrate``: efficiency per device type, sync latency, theta_ddp) runs
   inside it too and is written into that file, with ``--cal-micro-batches`` micro-batches per rank
   so that no benchmarked plan is a calibration run;
3. from the profiled cluster file the plans are made: the §4 search's (``search``), the best
   symmetric plan (``megatron``: Megatron's (dp, tp, pp) space ranked by the profiled cluster),
   ``galvatron`` (same space, free layer split), ``metis`` and plain data parallelism with equal
   batches (``dp-equal``); all with the same micro-batch size, no recomputation and DDP
   (``--dp-sharding``: the calibration fits theta_ddp but leaves the ZeRO thetas at 1, and the
   runtime waits for ZeRO-3's per-use gathers where Appendix B overlaps them with compute, so a
   ZeRO-3 plan's estimate would say nothing about the planner);
4. all plans train in one launch of the ranks, interleaved (``--rounds`` rounds; round k runs every
   plan once, in an order rotated by k: :mod:`lightning_hexiscale.profiling.rounds`), ``--warmup``
   untimed and ``--steps`` timed steps per plan and round. A step: barrier, train_step, SGD step;
   its time is the slowest rank's. The calibration's measurements take their turn in every round too
   (``--cal-steps`` timed steps each) and the estimates are priced on the calibration refitted to
   them, i.e. under the load the plans ran under (``--cal-steps 0``: on the one of step 2).

Printed per plan: measured min / median / max step time, the search plan's measured speedup over it
(median / median), the estimate (planner/estimate.py on the profiled, calibrated cluster), estimate /
measured median; then PASS/FAIL against the targets: speedup over ``megatron`` >= 1.5x; every estimate
within 15 % of its measured median; the estimate orders the plans as the measurement does, where a
pair the rounds order both ways is a measured tie (:data:`TIE_RULE`).
Writes OUT/results.json (everything), OUT/plans/NAME.yaml, OUT/profiled.yaml (default OUT=outputs/bench_hetero).

    sudo python recipes/bench_hetero.py --cores 1.5     # emulated conf/cluster/emu_4to1.yaml, 7 rounds; ~13 min on 2 cores
    python recipes/bench_hetero.py --launcher local --cluster cpu_hetero4 --no-profile   # plain local processes: no emulation

``--launcher local`` runs the same worker processes on this host with torchrun's environment but
without quotas or namespaces (for tests and machines without root); ``--no-profile`` estimates with
the cluster YAML's own figures instead of a profile. Ranks run ``python recipes/bench_hetero.py --worker JOB.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, HexiScaleError, InfeasiblePlan, RankFailure
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.plan import Plan

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
PLAN_NAMES = ("search", "megatron", "galvatron", "metis", "dp-equal")
SPEEDUP_TARGET = 1.5
"""Measured speedup of the search's plan over the best symmetric plan (megatron) on a 4:1 cluster."""
ESTIMATE_TARGET = 0.15
"""|estimate / measured median - 1| for every plan."""


# ---- launchers: the emulated cluster, or plain local processes with the same environment -----------
class LocalLauncher:
    """One plain process per rank of ``cluster`` on this host, with the environment EmulatedCluster
    gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT,
    OMP_NUM_THREADS=1, HEXISCALE_MACHINE, HEXISCALE_DEVICE_TYPE) but no quotas, no namespaces, no
    shaped links; the same ``launch`` / ``wait``, for tests and machines without root."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:  # a failed or interrupted run leaves no rank behind
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def launch(self, argv: list[str], *, env: dict[str, str] | None = None, master_port: int, stdout=None,
               stderr=None) -> list[subprocess.Popen]:
        procs = []
        for m in self.cluster.machines:
            for local, d in enumerate(m.devices):
                e = {**os.environ, **(env or {}), "RANK": str(d), "WORLD_SIZE": str(self.cluster.num_devices),
                     "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(len(m.devices)), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1", "HEXISCALE_MACHINE": m.name,
                     "HEXISCALE_DEVICE_TYPE": m.gpu_type}
                procs.append(subprocess.Popen(argv, env=e, stdout=stdout, stderr=stderr, cwd=REPO))
        self._procs += procs
        return procs

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[int]:
        """Exit codes (all 0); the first failure or the deadline kills the others and raises."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        codes = [p.returncode for p in procs]
        if any(c != 0 for c in codes):
            raise RankFailure(f"ranks exited with codes {codes} (deadline {timeout:.0f} s)")
        return codes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_launcher(args, cluster: Cluster):
    if args.launcher == "local":
        return LocalLauncher(cluster)
    from lightning_hexiscale.emulate import EmulatedCluster

    return EmulatedCluster(cluster, cores=args.cores, bw_scale=args.bw_scale)


def run_job(launcher, argv: list[str], name: str, timeout: float, log_dir: Path) -> None:
    """Start one process per rank running ``argv`` and wait for all of them. The ranks' output goes
    to ``log_dir/NAME.log``; a failed rank raises, with the end of that log in the message."""
    print(f"[{time.strftime('%H:%M:%S')}] {name}: starting the ranks (output in {log_dir / (name + '.log')})", flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.log", "w") as log:
        procs = launcher.launch(argv, env={"PYTHONPATH": _pythonpath()}, master_port=free_port(), stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            launcher.wait(procs, timeout)
        except Exception as e:
            tail = "\n".join((log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-30:])
            raise RankFailure(f"{name}: {e}\n--- last lines of {log_dir / (name + '.log')} ---\n{tail}") from None


def _pythonpath() -> str:
    """The repository first, so that every rank imports this checkout's package."""
    return os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def run_worker_job(launcher, job: dict, path: Path, timeout: float) -> dict:
    """Write ``job`` to ``path``, run the worker on every rank, return rank 0's result."""
    result = path.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    path.write_text(json.dumps({**job, "result": str(result), "timeout_s": timeout}))
    run_job(launcher, [sys.executable, str(HERE), "--worker", str(path)], path.stem, timeout, path.parent.parent / "logs")
    return json.loads(result.read_text())


# ---- the worker (one per rank) ---------------------------------------------------------------------
def worker(job_path: str) -> int:
    """One rank of a job: join the launcher's process group, measure, rank 0 writes the result."""
    from lightning_hexiscale.profiling.launch import run_from_env

    job = json.loads(Path(job_path).read_text())
    config = LlamaConfig(**job["model"])
    if job["kind"] == "rounds":
        result = run_from_env(_rounds_rank, job["plans"], config, job["steps"], job["warmup"], job["rounds"],
                              job.get("calibrate"), timeout_s=job["timeout_s"])
    elif job["kind"] == "calibrate":
        from lightning_hexiscale.profiling.calibrate import measure_calibration

        steps = measure_calibration(int(os.environ["WORLD_SIZE"]), config, job["micro_batch"], job["micro_batches"],
                                    False, job["steps"], job["warmup"], local=None, timeout_s=job["timeout_s"])
        result = None if steps is None else asdict(steps)
    else:
        raise ValueError(f"unknown job kind {job['kind']!r}")
    if result is not None:
        tmp = Path(job["result"] + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(job["result"])
    return 0


CAL_COMPUTE, CAL_TP, CAL_DP = "~cal-compute", "~cal-tp", "~cal-dp"
"""Names of the calibration's three measurements when they take turns in the rounds (no plan name
starts with ``~``)."""


def calibration_extras(rank: int, world: int, config: LlamaConfig, cal: dict) -> dict:
    """The calibration's measurements (:mod:`lightning_hexiscale.profiling.calibrate`: compute alone,
    TP-2 pairs, pure DP; ``cal``: micro_batch, micro_batches, steps, warmup) as extras of
    :func:`~lightning_hexiscale.profiling.rounds.measure_plans_rank`; each returns this rank's step seconds."""
    from lightning_hexiscale.profiling.calibrate import measure_compute_rank, pure_dp_plan, tp_pairs_plan
    from lightning_hexiscale.profiling.check import measure_plan_rank

    mb, n, steps, warmup = cal["micro_batch"], cal["micro_batches"], cal["steps"], cal["warmup"]
    tp = tp_pairs_plan(world, config, mb, n, False).to_dict()
    dp = pure_dp_plan(world, config, mb, n, False).to_dict()
    extra = {CAL_COMPUTE: lambda: measure_compute_rank(rank, world, config, mb, n, False, steps, warmup, "32-true"),
             CAL_DP: lambda: measure_plan_rank(rank, world, dp, config, steps, warmup, "32-true")["step_s"]}
    if world > 1:
        extra[CAL_TP] = lambda: measure_plan_rank(rank, world, tp, config, steps, warmup, "32-true")["step_s"]
    return extra


def _rounds_rank(rank: int, world: int, plans: dict, config: LlamaConfig, steps: int, warmup: int, rounds: int,
                 calibrate: dict | None = None):
    from lightning_hexiscale.profiling.rounds import gather_to_rank0, measure_plans_rank

    extra = calibration_extras(rank, world, config, calibrate) if calibrate else None
    return gather_to_rank0(measure_plans_rank(rank, world, plans, config, steps, warmup, rounds, extra=extra))


def split_calibration(per_rank: list[dict]) -> tuple[list[dict], object]:
    """The rounds' per-rank times without the calibration's, and the calibration's as
    :class:`~lightning_hexiscale.profiling.calibrate.CalibrationSteps` (None when it did not run):
    compute alone per rank (all its rounds' steps), TP pairs and pure DP per step as the slowest rank's."""
    from lightning_hexiscale.profiling.calibrate import CalibrationSteps
    from lightning_hexiscale.profiling.rounds import slowest_rank

    cal_names = (CAL_COMPUTE, CAL_TP, CAL_DP)
    plans = [{n: t for n, t in r.items() if n not in cal_names} for r in per_rank]
    if CAL_COMPUTE not in per_rank[0]:
        return plans, None
    slow = slowest_rank([{n: r[n] for n in (CAL_TP, CAL_DP) if n in r} for r in per_rank])
    compute = [[t for rnd in r[CAL_COMPUTE] for t in rnd] for r in per_rank]
    tp = slow[CAL_TP].steps_s if CAL_TP in slow else []
    return plans, CalibrationSteps(compute, tp, slow[CAL_DP].steps_s)


# ---- the cluster the cost model sees ----------------------------------------------------------------
def profiled_cluster(launcher, cluster: Cluster, config: LlamaConfig, args, out: Path) -> tuple[Cluster, Path, Cluster]:
    """Profile and calibrate inside the launcher's ranks; the calibrated cluster, its file and the
    profiled cluster before calibration (to refit on the calibration measured in the rounds)."""
    from lightning_hexiscale.profiling.calibrate import CalibrationSteps, fit_calibration
    from lightning_hexiscale.profiling.writer import update_calibration

    path = out / "profiled.yaml"
    # min per message size: a rank throttled by its quota wakes up late, the fastest ping-pong is the link's
    argv = [sys.executable, "-m", "lightning_hexiscale.cli", "profile", "--out", str(path), "--link-stat", "min",
            "--reps", str(args.profile_reps), "--timeout", str(args.timeout)]
    if args.matmul_time is not None:  # else the profile's own default (longer inside the emulator)
        argv += ["--matmul-time", str(args.matmul_time)]
    run_job(launcher, argv, "profile", args.timeout, out / "logs")
    raw = Cluster.load(str(path))
    if raw.num_devices != cluster.num_devices:
        raise RankFailure(f"the profile found {raw.num_devices} ranks, the cluster has {cluster.num_devices}")
    job = {"kind": "calibrate", "model": config.to_dict(), "micro_batch": args.micro_batch,
           "micro_batches": args.cal_micro_batches, "steps": args.steps, "warmup": args.warmup}
    steps = CalibrationSteps(**run_worker_job(launcher, job, out / "jobs" / "calibrate.json", args.timeout))
    cal = fit_calibration(raw, config, steps, args.micro_batch, args.cal_micro_batches, False, "median")
    print(cal.summary())
    update_calibration(path, {"theta_ddp": cal.theta_ddp}, cal.efficiency, cal.sync_latency_s)
    return Cluster.load(str(path)), path, raw


def refit(raw: Cluster, config: LlamaConfig, steps, args) -> tuple[Cluster, object]:
    """``raw`` calibrated (fit_calibration, medians) on the calibration steps measured in the rounds."""
    from lightning_hexiscale.profiling.calibrate import fit_calibration, with_calibration

    cal = fit_calibration(raw, config, steps, args.micro_batch, args.cal_micro_batches, False, "median")
    return with_calibration(raw, cal.efficiency, replace(raw.calibration, theta_ddp=cal.theta_ddp),
                            cal.sync_latency_s), cal


# ---- plans -------------------------------------------------------------------------------------------
def equal_dp_plan(cluster: Cluster, config: LlamaConfig, global_batch: int, micro_batch: int) -> Plan:
    """One single-device pipeline per device, all layers, equal batches (global_batch / N each)."""
    n = cluster.num_devices
    if global_batch % (n * micro_batch):
        raise ConfigError("--global-batch", global_batch, f"dp-equal needs a multiple of devices x micro-batch "
                          f"= {n} x {micro_batch}", f"use e.g. --global-batch {n * micro_batch * 3}")
    return Plan.from_dict({"num_layers": config.num_layers, "schedule": "1f1b", "recompute": False,
                           "dp_sharding": "ddp", "meta": {"planner": "dp-equal"},
                           "pipelines": [{"batch_size": global_batch // n, "micro_batch_size": micro_batch,
                                          "stages": [{"devices": [d], "layers": [0, config.num_layers]}]}
                                         for d in range(n)]})


def make_plans(cluster: Cluster, config: LlamaConfig, args) -> dict[str, tuple[Plan | None, str]]:
    """name -> (plan or None when none fits, a note) for the names of ``args.plans``."""
    from lightning_hexiscale.planner import baselines
    from lightning_hexiscale.planner.search import search
    from lightning_hexiscale.planner.search_settings import SearchSettings
    from lightning_hexiscale.profiling.check import cpu_workload

    work = cpu_workload(config)
    s = SearchSettings(iterations=args.iterations, seed=0, recompute=False, micro_batch_size=args.micro_batch,
                       dp_sharding=None if args.dp_sharding == "own" else args.dp_sharding)
    G = args.global_batch
    out: dict[str, tuple[Plan | None, str]] = {}
    for name in args.plans:
        if name == "search":
            try:
                r = search(cluster, work, G, s)
                out[name] = (r.plan, f"{r.plan.num_pipelines} pipelines, {r.plan.dp_sharding}")
            except InfeasiblePlan as e:
                out[name] = (None, str(e))
        elif name in ("megatron", "galvatron"):
            fn = getattr(baselines, name)
            b = fn(cluster, work, G, s, aware=not args.faithful_baselines)
            out[name] = (b.plan, b.note)
        elif name == "metis":
            b = baselines.metis(cluster, work, G, s)
            out[name] = (b.plan, b.note)
        else:
            sharding = "ddp" if args.dp_sharding == "own" else args.dp_sharding
            out[name] = (replace(equal_dp_plan(cluster, config, G, args.micro_batch), dp_sharding=sharding),
                         f"equal batches, {sharding}")
    return out


# ---- comparison --------------------------------------------------------------------------------------
TIE_RULE = ("two plans are ordered by the measurement only if every round's median orders them the same way "
            "(a sign test over the paired rounds: equal plans do so with probability 2^(1-rounds)); a pair the "
            "rounds order both ways is a measured tie, and the estimate may order it either way")


def settled(round_medians_a: list[float], round_medians_b: list[float]) -> bool:
    """True when every round's median orders the two plans the same way (see :data:`TIE_RULE`).

    Rounds are paired: round k ran both plans under the same load, at rotated positions, so if the
    plans took equal time each round's order would be a fair coin and all R rounds would agree with
    probability 2^(1-R) (6 % at R = 5). Rounds ordering them both ways mean the machine's noise is as
    large as the difference: the measurement does not say which plan is faster."""
    return len({x > y for x, y in zip(round_medians_a, round_medians_b)}) <= 1

def compare(estimates: dict[str, float], measured: dict[str, dict]) -> dict:
    """Rows (per plan), the ranking check and the targets, from estimates (s) and measured stats (s).

    speedup_of_search = measured median of the plan / measured median of ``search`` (>1: the search's
    plan is faster); ratio = estimate / measured median; ranking: plans sorted by estimate and by
    measured median, with every pair the two orders disagree on.
    """
    names = [n for n in measured if n in estimates]
    base = measured.get("search", {}).get("median_s")
    rows = {}
    for n in names:
        m = measured[n]
        rows[n] = {**m, "estimate_s": estimates[n], "ratio": estimates[n] / m["median_s"],
                   "speedup_of_search": (m["median_s"] / base) if base else None,
                   "estimated_speedup_of_search": (estimates[n] / estimates["search"]) if "search" in estimates else None}
    by_est = sorted(names, key=lambda n: estimates[n])
    by_meas = sorted(names, key=lambda n: measured[n]["median_s"])
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    # Equal estimates (e.g. two planners returning the same plan) order nothing: such a pair is a
    # tie, listed apart, not a disagreement.
    discordant = [(a, b) for a, b in pairs
                  if (estimates[a] - estimates[b]) * (measured[a]["median_s"] - measured[b]["median_s"]) < 0]
    ties = [(a, b) for a, b in pairs if estimates[a] == estimates[b]]
    # TIE_RULE: a disagreement the measurement itself does not settle (the rounds order the pair both
    # ways) is a measured tie, not a miss of the estimate.
    unsettled = [(a, b) for a, b in discordant if not settled(measured[a]["round_medians_s"], measured[b]["round_medians_s"])]
    missed = [p for p in discordant if p not in unsettled]
    targets = {}
    if base and "megatron" in rows:
        sp = rows["megatron"]["speedup_of_search"]
        targets["speedup_over_megatron"] = {"value": sp, "target": f">= {SPEEDUP_TARGET}", "pass": sp >= SPEEDUP_TARGET}
    worst = max((abs(r["ratio"] - 1.0) for r in rows.values()), default=0.0)
    targets["estimate_within_15pct"] = {"value": worst, "target": f"<= {ESTIMATE_TARGET}", "pass": worst <= ESTIMATE_TARGET}
    targets["same_ranking"] = {"value": not missed, "target": "True (pairs the rounds leave unordered are ties)",
                               "pass": not missed}
    return {"rows": rows, "order_by_estimate": by_est, "order_by_measured": by_meas,
            "discordant_pairs": discordant,
            "unsettled_pairs": unsettled, "estimated_ties": ties, "targets": targets}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def report(result: dict, notes: dict[str, str]) -> str:
    hdr = ("plan", "est.", "meas. min", "median", "max", "est./meas.", "search speedup (meas.)", "(est.)", "plan")
    rows = [hdr]
    for n, r in result["rows"].items():
        rows.append((n, _ms(r["estimate_s"]), _ms(r["min_s"]), _ms(r["median_s"]), _ms(r["max_s"]), f"{r['ratio']:.3f}",
                     "-" if r["speedup_of_search"] is None else f"{r['speedup_of_search']:.2f}x",
                     "-" if r["estimated_speedup_of_search"] is None else f"{r['estimated_speedup_of_search']:.2f}x",
                     notes.get(n, "")))
    w = [max(len(x[c]) for x in rows) for c in range(len(hdr))]
    lines = ["  ".join(v.ljust(x) if c in (0, 8) else v.rjust(x) for c, (v, x) in enumerate(zip(row, w)))
             for row in rows]
    est = {n: r["estimate_s"] for n, r in result["rows"].items()}
    order = result["order_by_estimate"]
    lines.append("order by estimate: " + order[0] + "".join(
        (" = " if est[b] == est[a] else " < ") + b for a, b in zip(order, order[1:])) if order else "")
    lines.append(f"order by measured: {' < '.join(result['order_by_measured'])}"
                 + (f"  (disagree on {result['discordant_pairs']}" if result["discordant_pairs"] else ""))
    if result["discordant_pairs"]:
        lines[-1] += (f"; the rounds' own medians order {result['unsettled_pairs']} differently from round to round: "
                      "measured ties)" if result["unsettled_pairs"] else "; every round orders them so)")
        lines.append(f"tie rule: {TIE_RULE}")
    for key, t in result["targets"].items():
        v = t["value"]
        shown = f"{v:.3f}" if isinstance(v, float) else str(v)
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'}  {key}: {shown} (target {t['target']})")
    return "\n".join(lines)


# ---- entry point -------------------------------------------------------------------------------------
def model_config(args) -> LlamaConfig:
    return LlamaConfig(name="bench_hetero", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                       num_kv_heads=args.heads, ffn_hidden_size=(8 * args.hidden // 3 + 63) // 64 * 64,
                       vocab_size=args.vocab, seq_len=args.seq)


def _plan_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PLAN_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown plan(s) {bad or text!r}; choose from {', '.join(PLAN_NAMES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="JOB.json", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", default="emu_4to1", help="cluster preset or YAML to emulate [emu_4to1]")
    ap.add_argument("--launcher", choices=("emulate", "local"), default="emulate",
                    help="emulate: quotas + namespaces + shaped links (root); local: plain processes [emulate]")
    ap.add_argument("--cores", type=float, default=None, help="cores the quotas share (default: all)")
    ap.add_argument("--bw-scale", type=float, default=1.0, help="factor on the YAML's inter-machine bandwidths [1]")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="estimate with the cluster YAML's own figures (no profile, no calibration)")
    ap.add_argument("--plans", type=_plan_names, default=list(PLAN_NAMES), help=f"[{','.join(PLAN_NAMES)}]")
    ap.add_argument("--faithful-baselines", action="store_true",
                    help="megatron/galvatron rank their candidates on a homogeneous belief of the cluster, as the "
                         "real systems do (default: on the profiled cluster, i.e. the best plan of their space)")
    ap.add_argument("--dp-sharding", choices=("ddp", "zero2", "zero3", "own"), default="ddp",
                    help="data-parallel sharding of every plan [ddp]; own: each system's own (Appendix G: Megatron "
                         "and Metis ddp, Galvatron zero3), the search tries all three. The ZeRO thetas are not "
                         "calibrated (see the README)")
    ap.add_argument("--iterations", type=int, default=50, help="search iterations [50]")
    ap.add_argument("--hidden", type=int, default=192, help="model width H [192]")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers [8]")
    ap.add_argument("--heads", type=int, default=6, help="attention heads (= KV heads) [6]")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary [512]")
    ap.add_argument("--seq", type=int, default=128, help="sequence length [128]")
    ap.add_argument("--global-batch", type=int, default=24, help="sequences per step, every plan [24]")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch, every plan [2]")
    ap.add_argument("--cal-micro-batches", type=int, default=2,
                    help="micro-batches per rank when calibrating [2] (dp-equal has global batch / ranks / micro-batch = 3)")
    ap.add_argument("--cal-steps", type=int, default=2,
                    help="timed steps of each calibration measurement in every round; the estimates are priced on "
                         "the calibration refitted to them (0: on the calibration measured before the rounds) [2]")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per plan and round [4]")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per plan and round [1]")
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved rounds [7]: two equal plans are ordered alike by all rounds with probability "
                         "2^(1-rounds), and the median over rounds x steps is what the estimate is held against")
    ap.add_argument("--profile-reps", type=int, default=10, help="ping-pongs per size when profiling [10]")
    ap.add_argument("--matmul-time", type=float, default=None,
                    help="seconds of matmuls per rank when profiling (default: the profile's own)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="deadline per launch in seconds [1800]")
    ap.add_argument("--out", default="outputs/bench_hetero", help="output folder [outputs/bench_hetero]")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # one rank: leave without the interpreter shutdown that can abort a gloo rank
        from lightning_hexiscale.profiling.launch import exit_process

        exit_process(worker(args.worker))
    try:
        return bench(args)
    except HexiScaleError as e:  # bad input, no emulation support, a failed rank: the message says what and why
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
    for name in ("cores", "bw_scale", "timeout", "matmul_time"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(flag, value, "must be a positive number", f"pass a positive {flag} or leave it out")


def bench(args) -> int:
    check_args(args)
    cluster = Cluster.load(args.cluster)
    config = model_config(args)
    # bad sizes fail here, before any process starts
    if args.global_batch % args.micro_batch:
        raise ConfigError("--global-batch", args.global_batch, f"every plan uses micro-batches of {args.micro_batch} "
                          "sequences, so the global batch must be a multiple of --micro-batch",
                          f"use e.g. --global-batch {args.micro_batch * cluster.num_devices * 3}")
    if "dp-equal" in args.plans:
        equal_dp_plan(cluster, config, args.global_batch, args.micro_batch)
    out = Path(args.out).resolve()
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    print(f"cluster {cluster.name}: {cluster.num_devices} ranks on {len(cluster.machines)} machines; launcher "
          f"{args.launcher}; model {config.total_params / 1e6:.2f} M parameters (H={config.hidden_size}, "
          f"L={config.num_layers}, S={config.seq_len}), global batch {args.global_batch}, micro-batch {args.micro_batch}",
          flush=True)
    t_start = time.monotonic()
    with make_launcher(args, cluster) as launcher:
        emulated = launcher.describe() if hasattr(launcher, "describe") else "not emulated (--launcher local)"
        print(emulated, flush=True)
        if args.profile:
            cost, cost_path, raw = profiled_cluster(launcher, cluster, config, args, out)
        else:
            cost, cost_path, raw = cluster, Path(args.cluster), None
        print(cost.summary(), flush=True)
        planned = make_plans(cost, config, args)
        from lightning_hexiscale.planner.estimate import estimate
        from lightning_hexiscale.profiling.check import cpu_workload

        plans = {n: p for n, (p, _) in planned.items() if p is not None}
        notes = {n: note for n, (_, note) in planned.items()}
        for n, (p, note) in planned.items():
            if p is None:
                print(f"{n}: no plan ({note})")
                continue
            p.save(out / "plans" / f"{n}.yaml")
            print(f"--- {n}: {note}\n{p.table(cost)}")
        estimates = {n: estimate(p, cost, cpu_workload(config)).iteration_time_s for n, p in plans.items()}
        job = {"kind": "rounds", "model": config.to_dict(), "plans": {n: p.to_dict() for n, p in plans.items()},
               "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
        if raw is not None and args.cal_steps > 0:  # the calibration takes its turn in every round too
            job["calibrate"] = {"micro_batch": args.micro_batch, "micro_batches": args.cal_micro_batches,
                                "steps": args.cal_steps, "warmup": 1}
        from lightning_hexiscale.profiling.launch import HostLoad

        with HostLoad() as load:  # CPU time other jobs took while the plans ran (noise, for the record)
            per_rank = run_worker_job(launcher, job, out / "jobs" / "rounds.json", args.timeout)
    from lightning_hexiscale.profiling.rounds import slowest_rank

    per_rank, cal_steps = split_calibration(per_rank)
    before = dict(estimates)
    refitted = None
    if cal_steps is not None:
        # The plans were made on the calibration measured before the rounds; their estimates are priced
        # on the one measured in the rounds, under the load the plans themselves ran under.
        cost_rounds, refitted = refit(raw, config, cal_steps, args)
        print("calibration measured in the rounds (the estimates below use it):\n" + refitted.summary())
        estimates = {n: estimate(p, cost_rounds, cpu_workload(config)).iteration_time_s for n, p in plans.items()}
    measured = {n: t.to_dict() for n, t in slowest_rank(per_rank).items()}
    result = compare(estimates, measured)
    print()
    print(report(result, notes))
    print(f"other processes took {load.others_fraction * 100:.0f} % of this host's CPU time while the plans ran")
    doc = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "model": config.to_dict(),
           "cluster": args.cluster, "emulated": emulated, "cost_cluster": str(cost_path), "per_rank_steps_s": per_rank,
           "plans": {n: p.to_dict() for n, p in plans.items()}, "notes": notes, "wall_s": time.monotonic() - t_start,
           "others_cpu_fraction": load.others_fraction, "estimates_before_rounds_s": before,
           "calibration_in_rounds": None if refitted is None else {
               "steps_s": asdict(cal_steps), "efficiency": refitted.efficiency,
               "sync_latency_s": refitted.sync_latency_s, "theta_ddp": refitted.theta_ddp},
           **result}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {out / 'results.json'} ({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
