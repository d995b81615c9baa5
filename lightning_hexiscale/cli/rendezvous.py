"""`hexiscale rendezvous-store`: the c10d rendezvous store of an elastic job, in a process of its own.

torchrun's c10d rendezvous keeps its state in a TCP store. Without one given, the agent on the host
named by ``--rdzv-endpoint`` that binds the port first hosts it (on one host: whichever agent
started first), and when that agent dies every other agent loses the rendezvous and the whole job
ends (``RendezvousConnectionError``), whichever machine it was. Run the store here instead, on a
host that outlives the job (a login node, or the most reliable machine), and start every agent as
a client of it::

    hexiscale rendezvous-store --port 29400 &            # until the job is done; Ctrl-C or SIGTERM stops it
    torchrun --nnodes=1:4 ... --rdzv-backend=c10d --rdzv-endpoint=$STORE_HOST:29400 \\
        --rdzv-conf=is_host=false,join_timeout=600,... recipes/train.py trainer.elastic=true ...

``is_host=false`` makes every agent a client, so any agent, the first one included, may die and the
others re-rendezvous without it (``tests/lightning/test_elastic.py`` kills the agent that started
first). The store holds only the rendezvous' small keys; one store can serve several jobs
(distinct ``--rdzv-id``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from datetime import timedelta

from lightning_hexiscale.cli.common import parse_number, subcommand


def _args(p: argparse.ArgumentParser) -> None:
    # parse_number: "abc" was argparse's bare "invalid int value" with no example
    p.add_argument("--port", type=lambda text: parse_number(text, int, "a port number", "29400"), default=29400,
                   help="TCP port of the store (torchrun's --rdzv-endpoint HOST:PORT; default 29400)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")


@subcommand("rendezvous-store", "run the c10d rendezvous store of an elastic torchrun job in a process of its "
            "own, so that any agent may die (agents: --rdzv-conf=is_host=false)", _args,
            no_overrides="see `hexiscale rendezvous-store --help`")
def cmd_rendezvous_store(args: argparse.Namespace) -> int:
    from torch.distributed import TCPStore

    from lightning_hexiscale.errors import ConfigError

    # Checked here: torch answers a port outside 0-65535 with a pybind TypeError traceback, and an
    # unknown host with C++ frames and a connect timeout that the message below blamed on the port.
    # Port 0 would listen on a port nobody is told.
    if not 0 < args.port < 65536:
        raise ConfigError("--port", args.port, "a TCP port is 1-65535", "e.g. --port 29400 (torchrun's default)")
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError("--host", args.host, f"no such host ({e.strerror or e})",
                          "leave --host out (all interfaces), or give an address or host name of this machine") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=timedelta(seconds=60))
    except (RuntimeError, ValueError) as e:
        raise ConfigError("--port", args.port, f"cannot listen on {args.host}:{args.port} ({str(e).splitlines()[0]})",
                          "pick a free port (another store or job may hold this one)") from None
    print(f"hexiscale rendezvous-store: c10d store listening on {args.host}:{args.port}; start every torchrun agent "
          f"with --rdzv-backend=c10d --rdzv-endpoint=<this host>:{args.port} --rdzv-conf=is_host=false,...; "
          "stop this with Ctrl-C or SIGTERM once the job is done", flush=True)
    while not stop.wait(1.0):
        pass
    del store
    print("hexiscale rendezvous-store: stopped", file=sys.stderr, flush=True)
    return 0
