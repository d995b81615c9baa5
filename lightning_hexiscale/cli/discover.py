"""`hexiscale discover`: the job's ranks measure their cluster for one model and write (and cache) the cluster file.

    hexiscale discover --local 4 --model llama_tiny --out outputs/disc.yaml        # 4 forked CPU ranks (no CUDA)
    hexiscale discover --local 8 --model llama2_7b     # a CUDA machine: one spawned NCCL rank per GPU (at most the GPUs)
    torchrun --nproc-per-node 4 --nnodes 2 ... -m lightning_hexiscale.cli discover --model llama2_7b
    sudo hexiscale emulate emu_headroom --cores 1.6 -- hexiscale discover --model llama_tiny --out d.yaml

Cheaper than ``hexiscale profile`` (one link per machine pair, FLOP/s and layer times per device type:
:mod:`lightning_hexiscale.profiling.discover`), and cached: a second run on the same hardware, model
shape, precision and torch version reuses the file at once (``$HEXISCALE_CACHE_DIR``, default
``~/.cache/lightning_hexiscale/clusters``); ``--rediscover`` measures again.
"""

from __future__ import annotations

import argparse

from lightning_hexiscale.cli.common import add_precision_arg, positive_int, positive_seconds, resolve_precision, subcommand
from lightning_hexiscale.cli.profile import (LAYER_MICRO_BATCHES, check_local_matmul_size, cluster_name,
                                             emulated_defaults, int_list, layer_time_model, message_sizes)


def _discover_args(p: argparse.ArgumentParser) -> None:
    # add_launch_args's options, with --local saying what it means here: GPUs on a CUDA machine
    p.add_argument("--local", type=positive_int, metavar="N", default=None,
                   help="start N local ranks here instead of joining a torchrun/SLURM/Lightning-launched process "
                        "group: one spawned NCCL rank per GPU on a CUDA machine (N at most the visible GPUs), else "
                        "N forked CPU ranks (gloo, one thread each)")
    p.add_argument("--timeout", type=positive_seconds, default=900.0, metavar="S",
                   help="deadline in seconds for the whole run and every collective (default 900)")
    p.add_argument("--model", required=True, metavar="NAME",
                   help="the job's model (a preset, a model YAML or hf:DIR): its layer times are measured per device "
                        "type, TP degree and micro-batch size, and its shape is part of the cache fingerprint")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="S", help="sequence length (default: the model's)")
    add_precision_arg(p)
    p.add_argument("--out", default=None, metavar="PATH.yaml",
                   help="also write the cluster file here (its matrices beside it, PATH.matrix.yaml; files already there are "
                        "replaced, and the output names them); default: only the cache's file")
    p.add_argument("--name", default=None, type=cluster_name,
                   help="cluster name, also given to a reused file (default: discovered_<first 8 of the fingerprint>)")
    p.add_argument("--rediscover", action="store_true",
                   help="measure again even when a file of the same fingerprint is cached (and replace it)")
    p.add_argument("--budget", type=positive_seconds, default=60.0, metavar="S",
                   help="seconds discovery should take; a warning names the longest phase when exceeded (default 60)")
    p.add_argument("--layer-micro-batches", type=int_list, default=None, metavar="M1,M2,...",
                   help=f"micro-batch sizes of the layer times (default {','.join(map(str, LAYER_MICRO_BATCHES))})")
    p.add_argument("--layer-tp", type=int_list, default=None, metavar="T1,T2,...",
                   help="TP degrees of the layer times (default: powers of two up to the largest machine and each "
                        "machine's device count, at most the model's KV heads)")
    p.add_argument("--layer-reps", type=positive_int, default=2, help="timed reps per layer-time case (default 2)")
    p.add_argument("--reps", type=positive_int, default=3, help="timed ping-pongs per size and pair (default 3)")
    p.add_argument("--sizes", type=message_sizes, default=None, metavar="S1,S2,...",
                   help="ping-pong message sizes (default as `hexiscale profile`)")
    p.add_argument("--matmul-size", type=positive_int, default=None, metavar="N", help="matmul size of the FLOP/s test")
    p.add_argument("--matmul-time", type=positive_seconds, default=None, metavar="S",
                   help="seconds of matmuls per rank (default 0.5; 2 inside `hexiscale emulate`)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or lines")


def local_args(ranks: int, precision: str | None) -> argparse.Namespace:
    """The options of ``hexiscale discover --local RANKS [--precision P]`` with every other default (the
    model is passed to :func:`run_discover` built): ``hexiscale train`` with cluster=auto (its default)
    discovers with them."""
    p = argparse.ArgumentParser(add_help=False)
    _discover_args(p)
    return p.parse_args(["--local", str(ranks), "--model", "-", *(["--precision", precision] if precision else [])])


def _discover_rank(rank: int, world: int, model, opts: dict):
    from lightning_hexiscale.profiling.discover import discover_process_group

    return discover_process_group(model, **opts)


def run_discover(args: argparse.Namespace, model=None):
    """Discover with the launch mode of ``args``; the :class:`~lightning_hexiscale.profiling.discover.Discovery`
    (on every rank of an external launch). ``model``: a built LlamaConfig instead of ``args.model``'s
    name (``hexiscale train`` with cluster=auto passes its composed model). ``--local N``: N forked CPU
    ranks, or on a CUDA machine N spawned NCCL ranks, one per GPU (:mod:`lightning_hexiscale.cli.discover_local`)."""
    from lightning_hexiscale.cli.discover_local import local_launch, run_local_ranks
    from lightning_hexiscale.profiling.launch import run_from_env

    args = emulated_defaults(args)
    if model is None:
        model = layer_time_model(args.model, args.seq_len, args.layer_tp)
    opts = dict(precision=resolve_precision(args),
                micro_batches=args.layer_micro_batches or list(LAYER_MICRO_BATCHES),
                tp_degrees=args.layer_tp, sizes=args.sizes, reps=args.reps, matmul_n=args.matmul_size,
                matmul_time_s=args.matmul_time, layer_reps=args.layer_reps, rediscover=args.rediscover,
                out=args.out, name=args.name, budget_s=args.budget, progress=args.progress)
    if args.local:
        from lightning_hexiscale.profiling.discover import cache_folder_error
        from lightning_hexiscale.profiling.discovery_plan import cache_dir

        launch = local_launch(args.local)
        if launch.backend == "gloo":  # forked CPU ranks: the host's RAM is known here (GPUs: the ranks check)
            check_local_matmul_size(args.matmul_size, launch.ranks, opts["precision"])
        bad_cache = cache_folder_error(cache_dir())  # before the ranks start: they are on this host
        if bad_cache is not None:
            raise bad_cache
        return run_local_ranks(launch, _discover_rank, model, opts, timeout_s=args.timeout)[0]
    return run_from_env(_discover_rank, model, opts, timeout_s=args.timeout)


@subcommand("discover", "measure this job's cluster for one model (per machine pair and device type, cached by a "
                        "hardware + model fingerprint) and write the cluster file", _discover_args,
            no_overrides="the model is --model NAME (see `hexiscale discover --help`)")
def cmd_discover(args: argparse.Namespace) -> int:
    import os

    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.cli.common import check_output_file
    from lightning_hexiscale.profiling.launch import env_rank

    # before any rank starts; under an external launch rank 0 checks it inside discovery and every rank refuses alike
    if args.out is not None and args.local:
        check_output_file("--out", args.out, "cluster.yaml", kind="cluster")
    found = run_discover(args)
    er = env_rank() if not args.local else None
    if er is not None and er.rank != 0:  # an external launch: rank 0 prints
        return 0
    cluster = Cluster.load(found.path)  # prove the planner reads what was written
    print(cluster.summary())
    print(f"{'reused' if found.reused else 'wrote'} {found.path}"
          + (f" (cache: {found.cache_path})" if os.path.abspath(found.cache_path) != os.path.abspath(found.path) else ""))
    return 0
