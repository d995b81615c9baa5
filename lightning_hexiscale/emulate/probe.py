"""What one rank of an emulated cluster delivers: its compute rate and its wait in a TP-2 exchange.

Run once per rank by :mod:`lightning_hexiscale.emulate.fidelity` (``python -m
lightning_hexiscale.emulate.probe MODE --out DIR``, inside the rank's cgroup and namespace); each
rank writes ``DIR/rank<R>.json``. numpy and sockets only, no torch: a rank under a quarter-core quota
starts in about a second instead of the tens of seconds ``import torch`` takes there.

- ``rate``: float32 matmuls of the sizes in :data:`RATE_SIZES`, taken in turn for ``--seconds``,
  timed in ``--windows`` equal windows; the rank's rate is the MEDIAN window's FLOP/s (2 n^3 FLOPs
  per n x n product). Every rank measures at the same time, as ranks compute during training.
- ``exchange``: the ranks of each machine are paired by local rank (0-1, 2-3, ...), as TP-2 groups
  are. Each repetition both ranks of a pair do the same fixed work (``--work-mflop`` MFLOP of
  128 x 128 matmuls), then all-reduce a small float32 vector (``--numel``): each sends its vector and
  adds the peer's, which for two ranks is the whole all-reduce. The time from the send to the peer's
  data is recorded. Both ranks of a pair run at the same emulated speed, so with a fluid quota they
  would arrive together and the exchange would take the link's latency and the software's; what
  more it takes is the wait for a peer that the quota throttled (up to one CFS period).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

RATE_SIZES = (96, 192, 384)
"""Matmul sizes of the rate probe: L1/L2-sized to L3-sized operands (110 KiB - 1.7 MiB for three
matrices), so that the rate is not that of one cache level only."""
EXCHANGE_N = 128
"""Matmul size of the exchange probe's fixed work."""
PORT_OFFSET = 7
"""A pair k listens on MASTER_PORT + PORT_OFFSET + k (inside its machine's namespace)."""


def _matmul_rate(seconds: float, windows: int) -> tuple[float, list[float]]:
    mats = [(np.random.default_rng(n).standard_normal((n, n), dtype=np.float32),
             np.random.default_rng(n + 1).standard_normal((n, n), dtype=np.float32), np.empty((n, n), np.float32))
            for n in RATE_SIZES]
    for a, b, c in mats:  # warm-up: page in, BLAS buffers
        np.matmul(a, b, out=c)
    rates = []
    for _ in range(windows):
        flops, t0 = 0.0, time.perf_counter()
        while True:
            for a, b, c in mats:
                np.matmul(a, b, out=c)
                flops += 2.0 * a.shape[0] ** 3
            if time.perf_counter() - t0 >= seconds / windows:
                break
        rates.append(flops / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the pair's peer closed the connection")
        buf += chunk
    return bytes(buf)


def _pair_socket(pair: int, lower: bool, port: int, timeout_s: float) -> socket.socket:
    addr = ("127.0.0.1", port + PORT_OFFSET + pair)
    deadline = time.monotonic() + timeout_s
    if lower:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(addr)
        srv.listen(1)
        srv.settimeout(timeout_s)
        s, _ = srv.accept()
        srv.close()
    else:
        while True:
            try:
                s = socket.create_connection(addr, timeout=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    s.settimeout(timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _exchange(reps: int, work_mflop: float, numel: int, timeout_s: float) -> dict:
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    pair_in_machine = local // 2
    if local_world % 2 and local == local_world - 1:
        return {"pair": None, "exchange_s": []}  # the odd rank out of its machine
    # a global pair index, so that plain local processes (no namespaces) do not share ports
    first_rank = int(os.environ["RANK"]) - local
    pair = first_rank // 2 + pair_in_machine
    s = _pair_socket(pair, local % 2 == 0, int(os.environ["MASTER_PORT"]), timeout_s)
    n = EXCHANGE_N
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b, c = a.copy(), np.empty((n, n), np.float32)
    k = max(1, round(work_mflop * 1e6 / (2.0 * n ** 3)))
    mine = np.ones(numel, np.float32)
    size = mine.nbytes
    times = []
    for rep in range(reps + 1):  # rep 0 untimed: connection warm-up
        if rep == 1:
            wall0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(k):
            np.matmul(a, b, out=c)
        t0 = time.perf_counter()
        s.sendall(mine.tobytes())
        theirs = np.frombuffer(_recv_exactly(s, size), np.float32)
        total = mine + theirs
        if rep:
            times.append(time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s.sendall(struct.pack("!I", 0))  # a last message before closing, so neither side reads EOF early
    _recv_exactly(s, 4)
    s.close()
    if float(total[0]) != 2.0:  # the all-reduce's result: 1 + 1
        raise RuntimeError(f"exchange summed to {float(total[0])}, expected 2.0")
    return {"pair": pair, "matmuls_per_rep": k, "exchange_s": times, "wall_s": wall, "cpu_s_loop": cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_hexiscale.emulate.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("rate", "exchange"))
    ap.add_argument("--out", required=True, help="folder for rank<R>.json")
    ap.add_argument("--seconds", type=float, default=2.0, help="rate: measuring time [2]")
    ap.add_argument("--windows", type=int, default=5, help="rate: timing windows [5]")
    ap.add_argument("--reps", type=int, default=100, help="exchange: timed repetitions [100]")
    ap.add_argument("--work-mflop", type=float, default=60.0, help="exchange: work between exchanges [60 MFLOP]")
    ap.add_argument("--numel", type=int, default=256, help="exchange: float32 elements all-reduced [256]")
    ap.add_argument("--timeout", type=float, default=60.0, help="exchange: socket deadline in seconds [60]")
    args = ap.parse_args(argv)
    rank = int(os.environ["RANK"])
    if args.mode == "rate":
        rate, windows = _matmul_rate(args.seconds, args.windows)
        doc = {"rank": rank, "flops": rate, "windows_flops": windows}
    else:
        doc = {"rank": rank, **_exchange(args.reps, args.work_mflop, args.numel, args.timeout)}
    doc["cpu_s"] = time.process_time()
    out = Path(args.out)
    tmp = out / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(out / f"rank{rank}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
