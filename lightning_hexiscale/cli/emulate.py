"""`hexiscale emulate`: run a command once per rank of a cluster YAML, emulated on this machine.

    sudo hexiscale emulate conf/cluster/emu_4to1.yaml --cores 1.5 -- hexiscale profile --out emu.yaml
    sudo hexiscale emulate emu_4to1 --bw-scale 0.5 -- python my_train.py

Each rank gets a CPU quota proportional to its GPU type's FLOP/s (one compute thread), optionally a
memory limit (``--memory``), and runs in its machine's network namespace; machines are joined by
links shaped to the YAML's inter-machine bandwidth times ``--bw-scale``. The command sees a
torchrun-like environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT ...), so anything
that joins a process group with ``init_method="env://"`` runs unchanged. See
:mod:`lightning_hexiscale.emulate`.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys

from lightning_hexiscale.cli.common import parse_number, subcommand


DEFAULT_TIMEOUT_S = 3600.0
"""``--timeout``'s default: an emulated run is stopped after an hour."""


def _positive_float(text: str) -> float:
    """A finite number > 0 (``--cores``, ``--bw-scale``, ``--timeout``): ``inf`` would make every quota
    ``inf * 0`` = nan cores and every link unshaped."""
    v = parse_number(text, float, "a number", "1.5")
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}; e.g. 1.5")
    return v


def _port(text: str) -> int:
    """``--master-port``: a TCP port, 1-65535 (beyond it the rendezvous fails inside every rank)."""
    v = parse_number(text, int, "a port number", "29500")
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 1 to 65535, got {v}; e.g. 29500, or leave "
                                         "--master-port out for a free one")
    return v


def _emulate_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("hexiscale emulate CLUSTER [--cores N] [--bw-scale F] [--memory] [--describe] [--no-trim] [--check] "
               "-- COMMAND [ARG ...]\n"
               "       hexiscale emulate CLUSTER --check [--cores N]\n"
               "       hexiscale emulate --cleanup")
    p.description = (
        "Run COMMAND once per rank of CLUSTER (a conf/cluster preset or a YAML path) on this machine, each rank a "
        "genuinely unequal device: a cgroup CPU quota proportional to its GPU type's FLOP/s (quotas sum to --cores; "
        "none above one core, the one compute thread a rank runs), one network namespace per machine, links between "
        "machines shaped with tc to the YAML's bandwidth times --bw-scale. Needs root, a cgroup CPU controller, "
        "`ip netns` and `tc`. Before COMMAND runs, the quotas are trimmed until every rank's measured matmul rate "
        "stands in the declared ratio (within 3 %; a quota-throttled rank does less work per CPU-second than one that "
        "holds its core); --check also measures TP-2 all-reduces against the declared latency. Everything is removed "
        "at exit, also on Ctrl-C or when a rank fails (then the others are stopped and the exit status is 1).")
    p.epilog = ("example:\n"
                "  hexiscale emulate conf/cluster/emu_4to1.yaml --cores 1.5 -- hexiscale profile --out emu.yaml\n"
                "environment of each rank: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT\n"
                "  GLOO_SOCKET_IFNAME HEXISCALE_MACHINE HEXISCALE_DEVICE_TYPE HEXISCALE_EMULATED=1 OMP_NUM_THREADS=1\n"
                "  GROUP_RANK (the machine) TORCHELASTIC_RUN_ID (so Lightning takes RANK and WORLD_SIZE as they are)\n"
                "  HEXISCALE_EMULATION (a digest of the quotas and links: part of `hexiscale discover`'s cache key)")
    p.add_argument("cluster", metavar="CLUSTER", nargs="?",
                   help="cluster preset name (conf/cluster/NAME.yaml) or YAML path")
    p.add_argument("--cores", type=_positive_float, default=None, metavar="N",
                   help="CPU cores the ranks' quotas sum to (default, and at most: the cores this process may use)")
    p.add_argument("--bw-scale", type=_positive_float, default=1.0, metavar="F",
                   help="multiply every inter-machine bandwidth by F (and divide latencies by F); default 1")
    p.add_argument("--memory", action="store_true",
                   help="also limit each rank's memory, proportional to its device memory (sum: 80%% of MemAvailable)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove what emulated clusters whose owner was killed (SIGKILL) left behind, and exit")
    p.add_argument("--describe", action="store_true", help="print the rank table and exit without running anything")
    p.add_argument("--no-trim", dest="trim", action="store_false",
                   help="keep the quotas proportional to the declared FLOP/s (no measuring and correcting first)")
    p.add_argument("--check", action="store_true",
                   help="print the host's load, the measured compute ratio and TP-2 all-reduce costs against the "
                        "declared ones; without COMMAND exit 0 when all pass, 1 otherwise")
    p.add_argument("--no-quota-clock", dest="quota_clock", action="store_false",
                   help="no real-time sleepers enforcing the quotas every 0.5 ms: quotas are then enforced at the "
                        "kernel's tick and periods are 10 ms (see lightning_hexiscale/emulate/clock.py)")
    p.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="stop every rank after S seconds (default 3600)")
    p.add_argument("--master-port", type=_port, default=None, metavar="PORT",
                   help="rank 0's rendezvous port (default: a free port)")


def _setting_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that set up, measure or run an emulation (none of which ``--cleanup`` uses)."""
    defaults = {"cores": None, "bw_scale": 1.0, "memory": False, "describe": False, "trim": True, "check": False,
                "quota_clock": True, "timeout": DEFAULT_TIMEOUT_S, "master_port": None}
    names = {"trim": "--no-trim", "quota_clock": "--no-quota-clock"}
    return [names.get(k, "--" + k.replace("_", "-")) for k, v in defaults.items() if getattr(args, k) != v]


def _prepare(emu, args: argparse.Namespace) -> bool:
    """Trim the quotas (unless --no-trim) and, with --check, measure the load and the TP-2 all-reduces;
    whether every check passed."""
    from lightning_hexiscale.emulate.fidelity import RATE_TOLERANCE, check_exchange, trim
    from lightning_hexiscale.emulate.hostload import load_refusal, sample_load

    passed = True
    if args.check:
        load = sample_load(2.0)
        print(f"host load before: {load.text()}", flush=True)
        if load_refusal(load):
            print(f"  ({load_refusal(load)})", flush=True)
            passed = False
    if args.trim:
        result = trim(emu)
        print(result.text(), flush=True)
        passed &= result.final.passes(RATE_TOLERANCE)
    if args.check:
        for pair in check_exchange(emu):
            print(pair.text(), flush=True)
            passed &= pair.passes
    return passed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@subcommand("emulate", "run a command once per rank of a cluster YAML emulated on this machine (cgroups, "
                       "network namespaces, tc)", _emulate_args,
            no_overrides="the command to run goes after `--`, e.g. hexiscale emulate emu_4to1 --cores 1.5 -- "
                         "hexiscale profile --out emu.yaml (a word before `--` reads as an override)")
def cmd_emulate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.emulate import EmulatedCluster, EmulationError

    if args.cleanup:
        from lightning_hexiscale.emulate import remove_stale

        extra = ([args.cluster] if args.cluster else []) + list(getattr(args, "command_argv", None) or [])
        if extra:  # they were ignored: a user who meant to run something would think it ran
            raise EmulationError(f"--cleanup takes no CLUSTER or command (got {' '.join(extra)}): it removes what "
                                 "killed emulations left behind, and exits. Fix: run hexiscale emulate --cleanup "
                                 "alone, then the emulation")
        flags = _setting_flags(args)
        if flags:  # as ignored: nothing is measured or run, and the user would think they were applied
            raise EmulationError(f"--cleanup takes no other flag (got {' '.join(flags)}): it removes what killed "
                                 "emulations left behind, and exits. Fix: run hexiscale emulate --cleanup alone, "
                                 "then the emulation with its flags")

        removed = remove_stale()
        print(f"removed {len(removed)} stale emulated cluster(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    if args.cluster is None:
        raise EmulationError("no CLUSTER given. Fix: hexiscale emulate emu_4to1 -- COMMAND (a conf/cluster preset or "
                             "a YAML path)")
    command = list(getattr(args, "command_argv", None) or [])
    if args.overrides:
        raise EmulationError(f"unexpected arguments {args.overrides} before `--`. Fix: put the command after `--`, "
                             "e.g. hexiscale emulate emu_4to1 -- hexiscale profile")
    emu = EmulatedCluster(args.cluster, cores=args.cores, bw_scale=args.bw_scale, memory=args.memory,
                          quota_clock=args.quota_clock)
    if args.describe:
        if command or args.check:  # --describe exits first: the command never ran, with exit 0
            given = "-- " + " ".join(command) if command else "--check"
            raise EmulationError(f"--describe prints the rank table and runs nothing, so {given} would not run. "
                                 "Fix: drop --describe to run it (the table is printed first anyway), or drop "
                                 f"{'the command' if command else '--check'} to see the table alone")
        print(emu.describe())
        return 0
    if not command and not args.check:
        raise EmulationError("no command given. Fix: add `-- COMMAND ...`, e.g. hexiscale emulate emu_4to1 -- "
                             "hexiscale profile --out emu.yaml (or --check to measure the emulation itself)")
    try:
        with emu:
            print(emu.describe(), flush=True)
            passed = _prepare(emu, args)
            if not command:
                return 0 if passed else 1
            procs = emu.launch(command, master_port=args.master_port or _free_port())
            try:
                emu.wait(procs, args.timeout)
            except EmulationError as e:
                print(f"hexiscale emulate: {e}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:  # the context manager has stopped the ranks and removed everything
        print("hexiscale emulate: interrupted; the ranks were stopped and the emulated cluster removed",
              file=sys.stderr)
        return 130
    return 0
