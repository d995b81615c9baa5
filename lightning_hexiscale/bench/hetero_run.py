"""The machinery of benchmarks/bench_hetero.py: launchers, the per-rank worker, the calibration.

- :class:`LocalLauncher` runs one plain process per rank with torchrun's environment (tests, no root);
  the emulated launcher is :class:`lightning_hexiscale.emulate.EmulatedCluster`.
- :func:`worker` is one rank of a job (``python -m lightning_hexiscale.bench.hetero_run JOB.json``): the
  interleaved rounds (:mod:`lightning_hexiscale.profiling.rounds`) with the calibration's three
  measurements taking their turn in every round, or the calibration alone.
- :func:`profiled_cluster` profiles and calibrates inside the launcher's ranks; :func:`refit` prices
  on the calibration measured in the rounds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import RankFailure
from lightning_hexiscale.models.config import LlamaConfig

REPO = Path(__file__).resolve().parents[2]
"""The checkout (or site-packages) this package is imported from: the ranks' working directory and
first PYTHONPATH entry, so that every rank imports the same package."""
WORKER = "lightning_hexiscale.bench.hetero_run"
"""The module a rank runs (``python -m``) to be one rank of a job: :func:`worker`."""


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

    def pids(self) -> list[int]:
        """The ranks still running (their time is this run's, not other work's)."""
        return [p.pid for p in self._procs if p.poll() is None]

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
    run_job(launcher, [sys.executable, "-m", WORKER, str(path)], path.stem, timeout, path.parent.parent / "logs")
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
    elif job["kind"] == "tp-allreduce":
        result = run_from_env(tp_allreduce_rank, job["pairs"], job["reps"], job["work_mflop"], timeout_s=job["timeout_s"])
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


def tp_allreduce_rank(rank: int, world: int, pairs: list[list[int]], reps: int, work_mflop: float):
    """The emulator's TP-2 check through gloo (:func:`lightning_hexiscale.emulate.fidelity.check_exchange`
    does it over a plain socket): each pair does the same ``work_mflop`` MFLOP of 128 x 128 matmuls, then
    all-reduces 256 floats in its process group, ``reps`` times. Rank 0 gets every rank's (wall s,
    CPU s) of the timed repetitions; (0, 0) for a rank in no pair."""
    import torch
    import torch.distributed as dist

    from lightning_hexiscale.profiling.rounds import gather_to_rank0

    groups = [dist.new_group(p) for p in pairs]  # collective: every rank creates every group, in order
    mine = next((g for p, g in zip(pairs, groups) if rank in p), None)
    a = torch.randn(128, 128)
    b, c, x = a.clone(), torch.empty(128, 128), torch.zeros(256)
    k = max(1, round(work_mflop * 1e6 / (2 * 128 ** 3)))
    dist.barrier()
    wall = cpu = 0.0
    if mine is not None:
        for rep in range(reps + 1):  # rep 0 untimed
            if rep == 1:
                wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(k):
                torch.mm(a, b, out=c)
            dist.all_reduce(x, group=mine)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    dist.barrier()
    return gather_to_rank0({"wall_s": wall, "cpu_s": cpu})


def machine_pairs(cluster: Cluster) -> list[list[int]]:
    """The ranks of each machine in pairs by local rank (0-1, 2-3, ...), as TP-2 groups are."""
    return [list(m.devices[i:i + 2]) for m in cluster.machines for i in range(0, len(m.devices) - 1, 2)]


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


if __name__ == "__main__":  # one rank of a job (run_worker_job)
    from lightning_hexiscale.bench.hetero_run import worker as _worker
    from lightning_hexiscale.profiling.launch import exit_process

    # leave without the interpreter shutdown that can abort a gloo rank
    exit_process(_worker(sys.argv[1]))
