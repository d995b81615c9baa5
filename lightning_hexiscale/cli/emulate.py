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
import socket
import sys

from lightning_hexiscale.cli.common import subcommand


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _emulate_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("hexiscale emulate CLUSTER [--cores N] [--bw-scale F] [--memory] [--describe] -- COMMAND [ARG ...]\n"
               "       hexiscale emulate --cleanup")
    p.description = (
        "Run COMMAND once per rank of CLUSTER (a conf/cluster preset or a YAML path) on this machine, each rank a "
        "genuinely unequal device: a cgroup CPU quota proportional to its GPU type's FLOP/s (quotas sum to --cores; "
        "none above one core, the one compute thread a rank runs), one network namespace per machine, links between "
        "machines shaped with tc to the YAML's bandwidth times --bw-scale. Needs root, a cgroup CPU controller, "
        "`ip netns` and `tc`. Everything is removed at exit, also on Ctrl-C or when a rank fails (then the others "
        "are stopped and the exit status is 1).")
    p.epilog = ("example:\n"
                "  hexiscale emulate conf/cluster/emu_4to1.yaml --cores 1.5 -- hexiscale profile --out emu.yaml\n"
                "environment of each rank: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT\n"
                "  GLOO_SOCKET_IFNAME HEXISCALE_MACHINE HEXISCALE_DEVICE_TYPE HEXISCALE_EMULATED=1 OMP_NUM_THREADS=1\n"
                "  GROUP_RANK (the machine) TORCHELASTIC_RUN_ID (so Lightning takes RANK and WORLD_SIZE as they are)")
    p.add_argument("cluster", metavar="CLUSTER", nargs="?",
                   help="cluster preset name (conf/cluster/NAME.yaml) or YAML path")
    p.add_argument("--cores", type=_positive_float, default=None, metavar="N",
                   help="CPU cores the ranks' quotas sum to (default: the cores this process may use)")
    p.add_argument("--bw-scale", type=_positive_float, default=1.0, metavar="F",
                   help="multiply every inter-machine bandwidth by F (and divide latencies by F); default 1")
    p.add_argument("--memory", action="store_true",
                   help="also limit each rank's memory, proportional to its device memory (sum: 80%% of MemAvailable)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove what emulated clusters whose owner was killed (SIGKILL) left behind, and exit")
    p.add_argument("--describe", action="store_true", help="print the rank table and exit without running anything")
    p.add_argument("--timeout", type=_positive_float, default=3600.0, metavar="S",
                   help="stop every rank after S seconds (default 3600)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="rank 0's rendezvous port (default: a free port)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@subcommand("emulate", "run a command once per rank of a cluster YAML emulated on this machine (cgroups, "
                       "network namespaces, tc)", _emulate_args)
def cmd_emulate(args: argparse.Namespace) -> int:
    from lightning_hexiscale.emulate import EmulatedCluster, EmulationError

    if args.cleanup:
        from lightning_hexiscale.emulate import remove_stale

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
    emu = EmulatedCluster(args.cluster, cores=args.cores, bw_scale=args.bw_scale, memory=args.memory)
    if args.describe:
        print(emu.describe())
        return 0
    if not command:
        raise EmulationError("no command given. Fix: add `-- COMMAND ...`, e.g. hexiscale emulate emu_4to1 -- "
                             "hexiscale profile --out emu.yaml")
    try:
        with emu:
            print(emu.describe(), flush=True)
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
