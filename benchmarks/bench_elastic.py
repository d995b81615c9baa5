"""Elastic recovery on localhost: two torchrun agents (machines ``a`` and ``b`` of a two-machine CPU
cluster), ``kill -9`` of one agent and its worker mid-run, the other re-plans for itself and finishes.

    python benchmarks/bench_elastic.py                     # 24 steps, checkpoint every 4, kill a at step 10
    python benchmarks/bench_elastic.py --steps 40 --every 5 --kill-at 17 --sleep 0.2
    python benchmarks/bench_elastic.py --store agent --kill b   # the store in agent a (which must then survive)

The c10d rendezvous store runs in a process of its own (``hexiscale rendezvous-store``; the agents
are its clients, ``is_host=false``), so the agent killed may be any, the one that started first
(``a``, the default) included. With ``--store agent`` the first agent hosts the store, as torchrun
does without one: killing it ends the whole job, so only ``--kill b`` recovers.

Prints the time from the kill to the first new optimizer step (failure detection, torchrun's restart
and rendezvous, the workers' start, the re-plan and the checkpoint load), the steps redone (the last
step reached before the kill minus the checkpoint's step), and the throughput kept: estimated (the
planner's tokens/s for the new plan over the old one, from ``elastic.json``) and measured (optimizer
steps per second after the restart over before, from the steps' timestamps). Both agents use the
rendezvous settings of :data:`RDZV_CONF`; the worker is ``tests/lightning/elastic_job.py``.

The baseline is the same run before the kill (two machines), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "lightning" / "elastic_job.py"
RDZV_CONF = "join_timeout=120,last_call_timeout=1,close_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"
"""c10d rendezvous knobs: after the first node is in, wait 1 s for more (last_call); a dead node's
heartbeat is missed after 3 x 2 s (keep-alive), so a survivor's new round does not wait the default 15 s."""
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torch 2.13's c10d handler, sharing its TCP store with the workers, writes MASTER_ADDR only at a node's
first rendezvous (dynamic_rendezvous.py, next_rendezvous): when a node joins a running job and the
old rank 0 stays rank 0, the newcomer waits for a MASTER_ADDR never written in the new round (a
60 s timeout, then the agents fail). Without the sharing, rank 0 writes it every round."""
CLUSTER = """name: elastic2
description: two one-device CPU machines (the elastic test and benchmark)
machines:
  - {name: a, gpu: CPU-FAST, count: 1, intra_bandwidth: "10 GB/s"}
  - {name: b, gpu: CPU-FAST, count: 1, intra_bandwidth: "10 GB/s"}
inter_machine: {bandwidth: "1 GB/s", latency: "50us"}
"""


LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child job, without the launch variables of :data:`LAUNCH_VARS`.

    Why: Lightning's launchers write ``MASTER_ADDR``/``MASTER_PORT`` into the *parent's* ``os.environ``
    (launchers/multiprocessing.py, utilities/distributed.py ``_init_dist_connection``), so after any
    in-process fit (e.g. an earlier test of the same pytest run) a child inherits a fixed port: two
    single-process children started together then both bind it, and one fails with EADDRINUSE in
    ``TCPStore``. Without it each child's Lightning picks a free port of its own."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("localhost", port)) == 0


def store_process(port: int, out: Path) -> subprocess.Popen:
    """``hexiscale rendezvous-store`` on ``port``: the rendezvous outside the elastic set."""
    log = open(out / "store.log", "w")
    return subprocess.Popen([sys.executable, "-m", "lightning_hexiscale.cli", "rendezvous-store", "--port", str(port),
                             "--host", "127.0.0.1"], env=child_env(), cwd=str(ROOT), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def agent(machine: str, port: int, out: Path, steps: int, every: int, sleep_s: float,
          external_store: bool = True) -> subprocess.Popen:
    """One torchrun agent (``--nnodes=1:2``) for ``machine``, in its own session (killable as a group);
    a client of the external store (``is_host=false``) or, without one, a candidate host of the store."""
    conf = RDZV_CONF + (",is_host=false" if external_store else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=elastic-bench",
           f"--rdzv-conf={conf}", "--max-restarts=3", "--monitor-interval=0.2",
           str(WORKER), str(out), str(out / "cluster.yaml"), str(steps), str(every), str(sleep_s)]
    env = child_env(HEXISCALE_MACHINE=machine, HEXISCALE_HOLD_FILE=str(out / HOLD_FILE), **AGENT_ENV)
    log = open(out / f"agent-{machine}.log", "w")
    return subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rows(out: Path) -> list[dict]:
    p = out / "losses.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the agent's session (the agent and any worker it started), if still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def latest_worker(out: Path, machine: str) -> int:
    """Pid of ``machine``'s newest worker (``pid-<machine>-<restart>``: a join restarts them)."""
    files = sorted(out.glob(f"pid-{machine}-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))
    return int(files[-1].read_text())


HOLD_FILE = "hold-solo"
"""While this file is in the output folder, a worker that trains alone before any restart waits up to
``elastic_job.HOLD_S`` at the end of each step: the second agent then joins while the first trains.
The agents hand its path to their workers as ``HEXISCALE_HOLD_FILE``."""


def stop_workers(out: Path) -> None:
    """SIGKILL every worker the agents started that is still running (torchrun starts each worker in
    a session of its own, so killing an agent's session leaves them; their pids are in ``pid-*``)."""
    for f in out.glob("pid-*"):
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def run(out: Path, steps: int = 24, every: int = 4, kill_at: int = 10, sleep_s: float = 0.0,
        timeout_s: float = 240.0, kill: str = "a", store: str = "external") -> dict:
    """The store, both agents (``a`` first), the kill of agent ``kill`` and its worker, the survivor to
    the end. Returns the figures (see the module doc) and ``survivor``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.yaml").write_text(CLUSTER)
    port = free_port()
    deadline = time.time() + timeout_s
    external = store == "external"
    server = store_process(port, out) if external else None
    agents: dict[str, subprocess.Popen] = {}
    survivor = "b" if kill == "a" else "a"
    hold = out / HOLD_FILE
    hold.write_text("a's workers wait at each step while alone (at most HOLD_S each) until b's worker starts\n")
    try:
        if server is not None:
            wait_for(lambda: listening(port), deadline, server, f"the rendezvous store did not open (see {out}/store.log)")
        agents["a"] = agent("a", port, out, steps, every, sleep_s, external)
        # a is the agent that started first: without an external store it hosts the rendezvous store
        # (it binds the port); with one, it has rendezvoused alone and started its worker
        first = (lambda: (out / "pid-a-0").exists()) if external else (lambda: listening(port))
        wait_for(first, deadline, agents["a"], f"agent a did not start (see {out}/agent-a.log)")
        agents["b"] = agent("b", port, out, steps, every, sleep_s, external)
        # a trains alone, held at each step (tests/lightning/elastic_job.py), until b's first worker
        # runs: on a loaded host b's start took longer than a's whole run (CI), and then no join came
        wait_for(lambda: any(out.glob("pid-b-*")), deadline, list(agents.values()),
                 f"agent b did not start a worker (see {out}/agent-b.log)")
        hold.unlink(missing_ok=True)
        wait_for(lambda: any(r["world"] == 2 and r["step"] >= kill_at for r in rows(out)), deadline,
                 list(agents.values()), f"the two-agent run did not reach step {kill_at} (see {out}/agent-*.log)")
        worker = latest_worker(out, kill)
        t_kill = time.time()
        os.killpg(agents[kill].pid, signal.SIGKILL)  # the agent, then its worker (a session of its own): a machine gone
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
        agents[kill].wait()
        agents[survivor].wait(timeout=max(1.0, deadline - time.time()))
    finally:
        hold.unlink(missing_ok=True)
        for p in agents.values():
            stop(p)
        stop_workers(out)
        if server is not None:
            stop(server)
    if agents[survivor].returncode != 0:
        raise RuntimeError(f"agent {survivor} exited with {agents[survivor].returncode} (see {out}/agent-{survivor}.log)")
    return {**figures(out, t_kill, sleep_s, survivor), "survivor": survivor}


def wait_for(done, deadline: float, procs, message: str) -> None:
    """Poll ``done()`` until true; RuntimeError(message) at the deadline or when a process in ``procs`` ended."""
    procs = procs if isinstance(procs, list) else [procs]
    while not done():
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(message)
        time.sleep(0.05)


def figures(out: Path, t_kill: float, sleep_s: float, survivor: str = "a") -> dict:
    allrows = rows(out)
    before = [r for r in allrows if r["time"] <= t_kill]
    after = [r for r in allrows if r["time"] > t_kill]
    record = json.loads((out / "ckpt" / "elastic.json").read_text())
    report = (out / f"agent-{survivor}.log").read_text()
    old_est = None
    for line in report.splitlines():
        if "estimated throughput:" in line and "->" in line:
            old_est = float(line.split(":", 1)[1].split("->")[0].replace(",", "").split()[0])

    def rate(rs: list[dict]) -> float:
        """Optimizer steps per second between the first and the last row, without the added sleeps."""
        busy = rs[-1]["time"] - rs[0]["time"] - (len(rs) - 1) * sleep_s if len(rs) > 2 else 0.0
        return (len(rs) - 1) / busy if busy > 0 else float("nan")

    reached = max(r["step"] for r in before)
    return {"recovery_s": after[0]["time"] - t_kill, "restart_ready_s": record["start_time"] - t_kill,
            "resumed_step": record["resumed_step"], "reached_step": reached,
            "steps_redone": reached - record["resumed_step"],
            "estimated_kept": record["tokens_per_s"] / old_est if old_est else float("nan"),
            "measured_kept": rate(after) / rate([r for r in before if r["time"] <= t_kill and r["world"] == 2]),
            "before": before, "after": after, "final_step": max(r["step"] for r in after), "record": record}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    ap.add_argument("--kill-at", type=int, default=10, help="kill agent b once step N is reached")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds added to every step (left out of the rates)")
    ap.add_argument("--kill", choices=("a", "b"), default="a", help="the agent killed (a started first)")
    ap.add_argument("--store", choices=("external", "agent"), default="external",
                    help="the c10d store in a process of its own (hexiscale rendezvous-store), or in agent a")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_elastic_"))
    f = run(out, args.steps, args.every, args.kill_at, args.sleep, timeout_s=args.timeout, kill=args.kill,
            store=args.store)
    print(f"elastic recovery, 2 -> 1 CPU machines, tiny Llama, checkpoint every {args.every} steps, store "
          f"{args.store} (files in {out})")
    print(f"  kill -9 of machine {args.kill} at step {f['reached_step']}; resumed from the checkpoint of step "
          f"{f['resumed_step']}: "
          f"{f['steps_redone']} step(s) redone")
    print(f"  time from the kill to the first new step: {f['recovery_s']:.1f} s (of which {f['restart_ready_s']:.1f} s "
          f"until the new workers had re-planned and loaded the checkpoint)")
    print(f"  throughput kept: estimated {f['estimated_kept']:.0%}, measured {f['measured_kept']:.0%} "
          f"(steps/s after / before, same run)")
    print(f"  finished at step {f['final_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
