"""Shared NICs on the emulated cluster: stage boundaries across machines, measured against their price.

The emulator (``hexiscale emulate``) shapes one veth per emulated machine: all traffic from one
machine to another leaves through one shaped interface, i.e. a NIC at the cluster file's
inter-machine bandwidth (times --bw-scale). Four ranks on two machines (2 + 2, default
``emu_4to1``) run the runtime's own exchange (``PipelineExecutor.exchange``, the bytes training
sends) in three scenarios, each timed as a round trip on the sending stage (activation forward,
its gradient back: one Comm-PP-Hop, eq. 6):

  scatter   a TP-2 -> TP-2 boundary (devices 0,1 -> 2,3): TP rank r sends 1/2 of the activation to
            rank r, the receivers all-gather: two transfers through each NIC at once;
  alone     one TP-1 -> TP-1 leader hop (0 -> 2), nothing else on the link (the control: one
            transfer, priced alike with and without the NIC term);
  together  two pipelines' leader hops in the same phase (0 -> 2 and 1 -> 3) at once.

Each is priced by ``cost_model.comm_pp_hop_scatter`` / ``comm_pp_hop`` on the cluster file (links
scaled as the emulator scales them) with the NIC fair shares of ``planner/cost/nic.py`` (``with NIC``)
and with every transfer on a full link of its own (``per pair``, the model before the NIC term);
error = price / measured median - 1. Target: |error with NIC| <= 15 % for the scatter boundary.

    sudo .venv/bin/python benchmarks/check_nic.py                     # emu_4to1, 1-4 MiB activations
    sudo .venv/bin/python benchmarks/check_nic.py --bw-scale 2 --reps 9
    sudo .venv/bin/hexiscale emulate emu_4to1 -- .venv/bin/hexiscale profile --out outputs/emu4.yaml
    sudo .venv/bin/python benchmarks/check_nic.py --price-with outputs/emu4.yaml   # measured links and NICs
    .venv/bin/python benchmarks/check_nic.py --launcher local         # no root: unshaped, plumbing only

Needs root for the emulator (cgroups, network namespaces, tc); everything it creates is removed at
exit. Network-shaped times depend less on CPU load than compute does, but a rank throttled to a
fraction of a core still wakes late: note the host's load with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
TARGET = 0.15
SCENARIOS = ("scatter", "alone", "together")
MODEL = dict(name="nic_check", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=128,
             vocab_size=64, seq_len=16)
"""The exchange moves a flat tensor of the size asked; the model only has to admit TP 2 on two stages."""


# ---- the ranks ----------------------------------------------------------------------------------
def plans(global_batch: int = 2):
    """The two plans the ranks build: one pipeline TP-2 -> TP-2, and two pipelines of TP-1 -> TP-1."""
    from lightning_hexiscale.planner import Pipeline, Plan, Stage

    scatter = Plan((Pipeline(global_batch, 1, (Stage((0, 1), (0, 1)), Stage((2, 3), (1, 2)))),), 2)
    leaders = Plan(tuple(Pipeline(global_batch // 2, 1, (Stage((a,), (0, 1)), Stage((b,), (1, 2)))) for a, b in ((0, 2), (1, 3))), 2)
    return scatter, leaders


def round_trip(executor, first_stage: bool, n: int) -> float:
    """One activation of n float32 elements to the next stage and its gradient back, through the
    runtime's exchange; the seconds the sending stage spent (0 on the receiving stage)."""
    import torch

    from lightning_hexiscale.runtime.schedule import Exchange

    shape = (n,)
    if first_stage:
        t0 = time.perf_counter()
        executor.exchange(Exchange("next", send=("act", 0)), torch.ones(n), shape)
        executor.exchange(Exchange("next", recv=("grad", 0)), None, shape)
        return time.perf_counter() - t0
    got = executor.exchange(Exchange("prev", recv=("act", 0)), None, shape)
    executor.exchange(Exchange("prev", send=("grad", 0)), got, shape)
    return 0.0


def measure_rank(rank: int, world: int, job: dict) -> dict | None:
    """Collective over the 4 ranks: every scenario, size and repetition; rank 0 returns
    {scenario: {size: [round trip of each repetition, the slowest sending rank's]}}."""
    import torch.distributed as dist

    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.runtime.engine import PipelineEngine

    if world != 4:
        raise ValueError(f"the check runs on 4 ranks (2 machines of 2), got {world}")
    config = LlamaConfig(**job["model"])
    scatter, leaders = plans()
    engines = {"scatter": PipelineEngine(scatter, config, rank), "leaders": PipelineEngine(leaders, config, rank)}
    mine: dict[str, dict[int, list[float]]] = {s: {} for s in SCENARIOS}
    for size in job["sizes"]:
        n = size // 4
        for scenario in SCENARIOS:
            eng = engines["scatter" if scenario == "scatter" else "leaders"]
            active = scenario != "alone" or rank in (0, 2)
            for k in range(job["warmup"] + job["reps"]):
                dist.barrier()
                t = round_trip(eng.executor, eng.role.is_first, n) if active else 0.0
                if k >= job["warmup"]:
                    mine[scenario].setdefault(size, []).append(t)
    everything: list[dict] = [{}] * world
    dist.all_gather_object(everything, mine)
    if rank != 0:
        return None
    return {s: {size: [max(r[s][size][k] for r in everything) for k in range(job["reps"])] for size in job["sizes"]}
            for s in SCENARIOS}


def worker(job_path: str) -> int:
    """One rank under the emulator: join its process group, measure, rank 0 writes the result."""
    from lightning_hexiscale.profiling.launch import run_from_env

    job = json.loads(Path(job_path).read_text())
    result = run_from_env(measure_rank, job, timeout_s=job["timeout_s"])
    if result is not None:
        Path(job["result"]).write_text(json.dumps(result))
    return 0


# ---- pricing ------------------------------------------------------------------------------------
def scaled(cluster, bw_scale: float):
    """The cluster as the emulator plays it: links between machines x bw_scale, their latency / bw_scale,
    NICs x bw_scale; links inside a machine (loopback) as written."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.nics import Nic

    cross = cluster.machine_of[:, None] != cluster.machine_of[None, :]
    bw = np.where(cross, cluster.bandwidth * bw_scale, cluster.bandwidth)
    lat = np.where(cross, cluster.latency / bw_scale, cluster.latency)
    nics = [Nic(n.machine, n.bandwidth_Bps * bw_scale, n.devices) for n in cluster.nics]
    return Cluster(cluster.name, list(cluster.devices), list(cluster.machines), bw, lat, cluster.calibration,
                   cluster.description, nics)


def prices(cluster, size: int) -> dict[str, tuple[float, float]]:
    """{scenario: (with NIC, per pair)}: Comm-PP-Hop of ``size`` bytes, both directions one after the
    other (the round trip: GPipe's counting, one direction per phase)."""
    from lightning_hexiscale.planner.cost import model as cm
    from lightning_hexiscale.planner.cost import nic

    bw, lat = cluster.bandwidth, cluster.latency
    src, dst = (0, 1), (2, 3)
    caps = nic.hop_alone_caps(cluster, src, dst, "gpipe")
    out = {"scatter": (cm.comm_pp_hop_scatter(src, dst, size, bw, lat, caps),
                       cm.comm_pp_hop_scatter(src, dst, size, bw, lat))}
    alone = nic.hop_alone_caps(cluster, (0,), (2,), "gpipe")
    out["alone"] = (cm.comm_pp_hop((0,), (2,), size, bw, lat, leaders=(0, 2), send_cap=alone[0] if alone else np.inf),
                    cm.comm_pp_hop((0,), (2,), size, bw, lat, leaders=(0, 2)))
    both = nic.hop_caps(cluster, [[(0,), (2,)], [(1,), (3,)]], "gpipe").get((0, 0), ())
    out["together"] = (cm.comm_pp_hop((0,), (2,), size, bw, lat, leaders=(0, 2), send_cap=both[0] if both else np.inf),
                       cm.comm_pp_hop((0,), (2,), size, bw, lat, leaders=(0, 2)))
    return out


def report(measured: dict, cluster, sizes: list[int]) -> tuple[str, dict]:
    """The table of measured medians, prices and errors, and the figures as a dict."""
    lines = [f"{'scenario':<9} {'activation':>10} {'measured':>10} {'with NIC':>10} {'error':>8} {'per pair':>10} "
             f"{'error':>8}"]
    rows = []
    for scenario in SCENARIOS:
        for size in sizes:
            times = measured[scenario][str(size)] if str(size) in measured[scenario] else measured[scenario][size]
            med = statistics.median(times)
            nic_s, pair_s = prices(cluster, size)[scenario]
            e_nic, e_pair = nic_s / med - 1, pair_s / med - 1
            rows.append(dict(scenario=scenario, bytes=size, measured_s=med, spread_s=[min(times), max(times)],
                             with_nic_s=nic_s, error_with_nic=e_nic, per_pair_s=pair_s, error_per_pair=e_pair))
            lines.append(f"{scenario:<9} {size / 2**20:>7.2f} MiB {med * 1e3:>8.1f}ms {nic_s * 1e3:>8.1f}ms "
                         f"{e_nic:>+7.1%} {pair_s * 1e3:>8.1f}ms {e_pair:>+7.1%}")
    worst = max(abs(r["error_with_nic"]) for r in rows if r["scenario"] == "scatter")
    worst_pair = max(abs(r["error_per_pair"]) for r in rows if r["scenario"] == "scatter")
    lines.append(f"TP-2 -> TP-2 boundary across the machines: worst |error| {worst:.1%} with the NIC term "
                 f"({'within' if worst <= TARGET else 'OUTSIDE'} the {TARGET:.0%} target), {worst_pair:.1%} "
                 "with every transfer on a link of its own")
    return "\n".join(lines), dict(rows=rows, worst_scatter_error_with_nic=worst, worst_scatter_error_per_pair=worst_pair)


# ---- the driver ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_line() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"host load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min) on {os.cpu_count()} CPUs"
    except OSError:
        return "host load unknown"


def run(args) -> dict:
    from lightning_hexiscale.config.cluster import Cluster

    cluster = Cluster.load(args.cluster)
    if cluster.num_devices != 4 or sorted(len(m.devices) for m in cluster.machines) != [2, 2]:
        raise SystemExit(f"{args.cluster}: the check needs 2 machines of 2 devices (e.g. emu_4to1), "
                         f"got {[len(m.devices) for m in cluster.machines]}")
    job = dict(model=MODEL, sizes=args.sizes, reps=args.reps, warmup=args.warmup, timeout_s=args.timeout)
    print(load_line(), flush=True)
    shaped = True
    if args.launcher == "local":
        from lightning_hexiscale.profiling.launch import run_local

        measured = run_local(4, measure_rank, job, timeout_s=args.timeout)[0]
        priced = cluster
    else:
        from lightning_hexiscale.emulate import EmulatedCluster

        with tempfile.TemporaryDirectory(prefix="check_nic_") as tmp:
            path = Path(tmp) / "job.json"
            result = Path(tmp) / "result.json"
            path.write_text(json.dumps({**job, "result": str(result)}))
            port = args.master_port or free_port()
            with EmulatedCluster(cluster, cores=args.cores, bw_scale=args.bw_scale) as emu:
                print(emu.describe(), flush=True)
                env = {"PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
                with open(Path(tmp) / "ranks.log", "w") as log:
                    procs = emu.launch([sys.executable, str(HERE), "--worker", str(path)], env=env,
                                       master_port=port, stdout=log, stderr=subprocess.STDOUT)
                    try:
                        emu.wait(procs, timeout=args.timeout)
                    except Exception:
                        print((Path(tmp) / "ranks.log").read_text()[-4000:], file=sys.stderr)
                        raise
                shaped = bool(emu.network and emu.network.latency_shaped)
            measured = json.loads(result.read_text())
        priced = scaled(cluster, args.bw_scale)
        if args.price_with:  # e.g. a profile taken inside the same emulated cluster (its links as measured)
            priced = Cluster.load(args.price_with)
            print(f"prices from {args.price_with} (its measured links and NICs)")
        elif not shaped:
            alpha = float(priced.latency[0, 2])
            print(f"note: this kernel shapes no latency (no sch_netem): the links' alpha is the veth's own (tens of "
                  f"microseconds), the prices keep the cluster file's {alpha * 1e3:.3g} ms (two per round trip)")
    print(load_line(), flush=True)
    text, figures = report(measured, priced, args.sizes)
    print(text)
    return dict(cluster=args.cluster, bw_scale=args.bw_scale, launcher=args.launcher, load=load_line(),
                latency_shaped=shaped, **figures)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="emu_4to1", help="2 machines of 2 devices (preset or YAML; default emu_4to1)")
    p.add_argument("--sizes", default="1048576,2097152,4194304",
                   help="activation sizes in bytes (default 1, 2, 4 MiB; even multiples of 8)")
    p.add_argument("--reps", type=int, default=7, help="timed round trips per scenario and size (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed round trips first (default 2)")
    p.add_argument("--bw-scale", type=float, default=1.0, help="scale of the emulated links (default 1)")
    p.add_argument("--cores", type=float, default=None, help="CPU cores the ranks' quotas sum to (default: all)")
    p.add_argument("--launcher", choices=("emulate", "local"), default="emulate",
                   help="emulate (root; shaped links) or local (plain forked ranks, unshaped: plumbing only)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    p.add_argument("--master-port", type=int, default=None, help="rank 0's rendezvous port (default: a free one)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--price-with", default=None, metavar="CLUSTER.yaml",
                   help="price with this cluster file instead of CLUSTER scaled, e.g. the file `hexiscale profile` "
                        "wrote inside the same emulated cluster (same device ids)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is None:
        a.sizes = [int(x) for x in str(a.sizes).split(",")]
        if any(s <= 0 or s % 8 for s in a.sizes):
            p.error(f"--sizes {a.sizes}: each must be a positive multiple of 8 bytes (two float32 halves)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a.worker)
    figures = run(a)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
