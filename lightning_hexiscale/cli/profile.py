"""`hexiscale profile`: measure this cluster and write the cluster YAML the planner reads.

    hexiscale profile --local 2 --out outputs/cpu2.yaml          # 2 forked CPU ranks (gloo)
    hexiscale profile --local 2 --model llama_tiny --out outputs/cpu2.yaml   # + measured layer times
    torchrun --nproc-per-node 8 --nnodes 2 ... -m lightning_hexiscale.cli profile --out c.yaml
    hexiscale estimate --plan my_plan.yaml cluster=outputs/cpu2.yaml

Measures, per rank, sustained matmul FLOP/s (in the compute dtype of ``--precision``, the run's
trainer.precision: default bf16 on CUDA, fp32 on CPU) and memory (CUDA total,
or CPU RAM / ranks on the host), alpha, beta for every pair of ranks, and per host with several
ranks what its network interface carries when they all send to other hosts at once (the
machine's ``nics`` in the written file; ``--no-nics`` skips it). With ``--model``, the layer
times of that model (:mod:`lightning_hexiscale.profiling.layer_times`), written as the cluster's
``layer_times``. See :mod:`lightning_hexiscale.profiling`. ``calibrate`` and ``check-estimate`` live in
:mod:`lightning_hexiscale.cli.calibrate`.
"""

from __future__ import annotations

import argparse

from lightning_hexiscale.cli.common import add_launch_args, add_precision_arg, positive_int, positive_seconds, resolve_precision, subcommand
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.config.units import parse_bytes


MESSAGE_SIZES_FIX = "write each size with a unit of B, KB, MB, GB, KiB, MiB or GiB, e.g. 1KiB,64KiB,1MiB,4MiB"


def message_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated byte sizes with units (``1KiB,64KiB,1MiB``), at least two distinct."""
    out = []
    for part in text.split(","):
        try:
            out.append(int(parse_bytes(part.strip(), "--sizes")))
        except ConfigError as e:  # parse_bytes' own fix names a memory size ("80 GiB"): name message sizes
            raise argparse.ArgumentTypeError(str(ConfigError(e.key, e.value, e.rule, MESSAGE_SIZES_FIX))) from None
    if len(set(out)) < 2:
        raise argparse.ArgumentTypeError("give at least two distinct sizes, e.g. 1KiB,64KiB,1MiB,4MiB")
    return out


def cluster_name(text: str) -> str:
    """``--name`` (profile, discover): not empty, checked before any rank starts (an empty name fell
    back to the file's stem in silence; discovery checks it again for the API)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty; give e.g. --name my_cluster, or leave --name out")
    return text


def _profile_args(p: argparse.ArgumentParser) -> None:
    add_launch_args(p)
    p.add_argument("--out", default="profiled_cluster.yaml", metavar="PATH.yaml",
                   help="cluster YAML to write (its matrices go to PATH.matrix.yaml beside it)")
    p.add_argument("--name", default=None, type=cluster_name, help="cluster name (default: the file's stem)")
    p.add_argument("--sizes", type=message_sizes, default=None, metavar="S1,S2,...",
                   help="ping-pong message sizes, e.g. 1KiB,64KiB,1MiB,4MiB (default: 1 KiB..4 MiB on CPU, "
                        "4 KiB..64 MiB on CUDA, 256 KiB..4 MiB inside `hexiscale emulate`)")
    p.add_argument("--reps", type=positive_int, default=5, help="timed ping-pongs per size and pair (default 5)")
    p.add_argument("--max-pairs", type=positive_int, default=None, metavar="K",
                   help="pairs measured at once (default: no limit on CUDA, cores/2 on CPU)")
    p.add_argument("--no-isolate-hosts", dest="isolate_hosts", action="store_false",
                   help="let several cross-host pairs of one host share its NIC in a step (faster, less exact)")
    p.add_argument("--no-nics", dest="nics", action="store_false",
                   help="skip the shared-NIC measurement (several ranks of a host sending to other hosts at once, "
                        "written as each machine's nics.bandwidth)")
    p.add_argument("--link-stat", choices=("median", "min"), default="median",
                   help="time per message size: median (typical, default) or min (best case) of the reps")
    p.add_argument("--matmul-size", type=positive_int, default=None, metavar="N",
                   help="matmul size N for the FLOP/s test (default 8192 on CUDA, 1024 on CPU, 256 inside "
                        "`hexiscale emulate`); its three N x N buffers must fit in half of a rank's memory")
    p.add_argument("--matmul-time", type=positive_seconds, default=None, metavar="S",
                   help="seconds of matmuls per rank (default 0.5; 2 inside `hexiscale emulate`)")
    add_precision_arg(p)
    add_layer_time_args(p)
    p.add_argument("--model", default=None, metavar="NAME",
                   help="also measure layer times of this model (a preset, a model YAML or hf:DIR; with "
                        "--seq-len): forward and backward of a transformer layer per device type, TP degree "
                        "and micro-batch size, TP collectives inside, and of the embedding and the LM head + loss; "
                        "written as the cluster's layer_times table, which the cost model then uses")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="S",
                   help="sequence length of --model's layer times (default: the model's)")


def int_list(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 1,2,4") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 1, e.g. 1,2,4")
    return out


def add_layer_time_args(p: argparse.ArgumentParser) -> None:
    """Options of the layer-time measurement (``profile --model``, ``calibrate --layer-times``)."""
    p.add_argument("--layer-micro-batches", type=int_list, default=None, metavar="M1,M2,...",
                   help=f"micro-batch sizes of the layer times (default {','.join(map(str, LAYER_MICRO_BATCHES))}; "
                        "the cost model interpolates "
                        "between them and scales the nearest per sequence outside them)")
    p.add_argument("--layer-tp", type=int_list, default=None, metavar="T1,T2,...",
                   help="TP degrees of the layer times (default: powers of two up to the largest machine and "
                        "each machine's device count, at most the model's KV heads)")
    p.add_argument("--layer-reps", type=positive_int, default=None,
                   help=f"timed reps per layer-time case (default {LAYER_REPS})")


LAYER_REPS = 3
"""Timed reps per layer-time case when ``--layer-reps`` is not given."""

LAYER_MICRO_BATCHES = (1, 2, 4)
"""Micro-batch sizes of the layer times when ``--layer-micro-batches`` is not given (profile, discover,
calibrate): the cost model interpolates between them and scales the nearest per sequence outside them."""


def check_layer_time_flags(args: argparse.Namespace, needs: str, on: bool) -> None:
    """The options of the layer-time measurement (``--layer-*``, and ``--seq-len`` where the command has
    it) given while ``on`` is false (no ``needs`` flag): refused, as nothing would read them (``profile
    --layer-tp 2`` without ``--model`` wrote a cluster file without layer times, silently)."""
    for flag in ("--layer-micro-batches", "--layer-tp", "--layer-reps", "--seq-len"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and not on:
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            raise ConfigError(flag, shown, f"sets the layer-time measurement, which runs only with {needs}",
                              f"add {needs}, or drop {flag}")


def layer_time_model(name: str, seq_len: int | None, tp: list[int] | None):
    """The model whose layer times are measured, with TP degrees checked against its heads before
    any rank starts (a ConfigError naming ``--layer-tp``)."""
    from dataclasses import replace

    from lightning_hexiscale.models.config import LlamaConfig

    model = LlamaConfig.load(name, key="--model")  # keyed by the flag typed, not the recipe's 'model'
    if seq_len is not None:
        try:
            model = replace(model, seq_len=seq_len)
        except ConfigError as e:  # the model's check keys it model.seq_len, a key this command has not
            raise ConfigError("--seq-len", seq_len, e.rule, f"give a smaller --seq-len (the model's own is "
                              f"{model.seq_len}), or drop it to measure at that length") from None
    model.check_measured_tp(tp or [])
    return model


def _profile_rank(rank: int, world: int, opts: dict, layer_opts: dict | None = None, out: str | None = None):
    from lightning_hexiscale.profiling.measure import profile_process_group

    if out is not None:
        _check_out_on_rank0(rank, out)
    say = lambda m: print(m, flush=True)  # noqa: E731
    result = profile_process_group(log=say, **opts)
    if layer_opts is not None:
        from lightning_hexiscale.profiling.layer_times import measure_layer_tables

        tables = measure_layer_tables(log=say, precision=opts["precision"], **layer_opts)
        if result is not None:
            result.layer_tables = tables
    return result


def _check_out_on_rank0(rank: int, out: str) -> None:
    """An external launch (torchrun, SLURM): rank 0, which writes ``--out``, checks it before anything is
    measured and every rank raises its error alike; collective. Why not in ``cmd_profile``: there every
    rank would check its own file system, and a rank that raised alone would leave the others waiting
    in the first collective until the timeout."""
    import torch.distributed as dist

    from lightning_hexiscale.cli.common import check_output_file

    error = None
    if rank == 0:
        try:
            check_output_file("--out", out, "cluster.yaml", kind="cluster")
        except ConfigError as e:
            error = e
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]


def check_local_matmul_size(n: int | None, ranks: int, precision: str) -> None:
    """``--matmul-size`` of ``--local`` CPU ranks, before they start: the three n x n buffers of each of
    ``ranks`` forked ranks in the host's RAM (the ranks check it again, against every rank's memory)."""
    import torch

    from lightning_hexiscale.profiling.measure import device_memory_bytes, matmul_size_error
    from lightning_hexiscale.profiling.precision import resolve

    cpu = torch.device("cpu")
    error = matmul_size_error(n, resolve(precision, cpu).compute_dtype, device_memory_bytes(cpu, ranks),
                              f"a rank's share of this host's RAM ({ranks} local ranks)")
    if error is not None:
        raise error


EMULATED_SIZES = [256 * 1024, 1 << 20, 2 << 20, 4 << 20]
"""Message sizes inside ``hexiscale emulate``: the shaped links' token bucket (1 ms of traffic) lets
the first bytes of a message through unshaped, and a rank throttled to a fraction of a core wakes
up late by up to a CFS period, so small messages would measure the CPU quota, not the link."""


def emulated_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Inside ``hexiscale emulate`` (HEXISCALE_EMULATED=1; not HEXISCALE_MACHINE, which a real node also sets
    to name its machine for elastic training), defaults fit for ranks with CPU quotas:
    messages of 256 KiB-4 MiB, 256^3 matmuls (many per 10 ms CFS period) over 2 s (windows of 0.4 s,
    40 periods). Explicit options win."""
    import os

    emulated = os.environ.get("HEXISCALE_EMULATED") == "1"
    out = argparse.Namespace(**vars(args))
    if emulated:
        out.sizes = args.sizes or EMULATED_SIZES
        out.matmul_size = args.matmul_size or 256
    if args.matmul_time is None:
        out.matmul_time = 2.0 if emulated else 0.5
    return out


def run_profile(args: argparse.Namespace):
    """Profile with the launch mode of ``args``; returns the ProfileResult on rank 0, else None."""
    from lightning_hexiscale.profiling.launch import run_from_env, run_local

    args = emulated_defaults(args)
    opts = dict(sizes=args.sizes, reps=args.reps, max_pairs=args.max_pairs, isolate_hosts=args.isolate_hosts,
                matmul_n=args.matmul_size, matmul_time_s=args.matmul_time, link_stat=args.link_stat,
                precision=resolve_precision(args), nics=getattr(args, "nics", True))
    layer_opts = None
    if getattr(args, "model", None):
        layer_opts = dict(model=layer_time_model(args.model, args.seq_len, args.layer_tp),
                          micro_batches=args.layer_micro_batches or list(LAYER_MICRO_BATCHES), tp_degrees=args.layer_tp,
                          reps=args.layer_reps or LAYER_REPS)
    if args.local:
        check_local_matmul_size(args.matmul_size, args.local, opts["precision"])
        return run_local(args.local, _profile_rank, opts, layer_opts, timeout_s=args.timeout)[0]
    return run_from_env(_profile_rank, opts, layer_opts, args.out, timeout_s=args.timeout)


@subcommand("profile", "measure every rank's FLOP/s and memory and alpha/beta of every rank pair (with --model, "
                       "layer times too); write a cluster YAML", _profile_args,
            no_overrides="layer times of a model: --model NAME (see `hexiscale profile --help`)")
def cmd_profile(args: argparse.Namespace) -> int:
    from lightning_hexiscale.cli.common import check_output_file
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.profiling.writer import link_summary, write_cluster

    check_layer_time_flags(args, "--model NAME", bool(args.model))
    if args.local:  # before the measurement; an external launch's rank 0 checks it in _profile_rank
        check_output_file("--out", args.out, "cluster.yaml", kind="cluster")
    result = run_profile(args)
    if result is None:  # not rank 0 of an external launch: rank 0 writes
        return 0
    path, mpath = write_cluster(result, args.out, args.name)
    print(link_summary(result))
    cluster = Cluster.load(str(path))  # prove the planner reads what was written
    print(cluster.summary())
    print(f"wrote {path} and {mpath}")
    return 0
