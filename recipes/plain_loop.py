"""Train with the planner and the runtime in a plain PyTorch loop: no Lightning.

    torchrun --standalone --nproc_per_node 4 recipes/plain_loop.py --cluster cpu_demo --steps 30

What ``Trainer(strategy="hexiscale")`` does, written out for a loop of your own (the steps are
numbered below): the cluster (a preset, a file, or ``auto``: the ranks measure it,
:func:`~lightning_hexiscale.profiling.discover.discover_process_group`), a plan (the search on
rank 0, or ``--plan FILE``) that rank 0 hands to every rank, this rank's stage
(:class:`~lightning_hexiscale.runtime.engine.PipelineEngine`), and one ``engine.fit_step`` per
global batch: every rank passes the same (G, S) batch and the engine cuts its pipeline's rows.
``--save DIR`` writes a DCP checkpoint (``hexiscale export DIR --hf OUT`` writes Hugging Face files),
``--resume DIR`` continues from one, under this plan or another. A plan that leaves devices idle
runs too: their ranks take part in creating the process groups, then end.

One rank per device: CUDA GPUs under NCCL (``LOCAL_RANK``'s GPU), else CPU processes under gloo.
Errors in the arguments, the cluster or the plan are printed once, by rank 0, and every rank exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_hexiscale import Cluster, LlamaConfig, Plan, estimate, search
from lightning_hexiscale.config.recipe import check_output_dir
from lightning_hexiscale.data import generated_corpus
from lightning_hexiscale.errors import ConfigError, HexiScaleError, PlanError
from lightning_hexiscale.planner import SearchSettings, Workload
from lightning_hexiscale.runtime import checkpoint
from lightning_hexiscale.runtime.engine import PipelineEngine
from lightning_hexiscale.runtime.topology import create_groups, rank_map


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Said once, by rank 0 (every rank parses the same arguments), then every rank exits 2."""
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description="train a Llama with a HexiScale plan in a plain PyTorch loop; launch with "
                "torchrun --nproc_per_node N (one process per device)")
    p.add_argument("--cluster", default="auto", help="a cluster preset or YAML file, or auto (measured by the "
                   "ranks and cached; default)")
    p.add_argument("--model", default="llama_demo", help="a model preset, YAML file or hf:DIR (default llama_demo)")
    p.add_argument("--plan", help="a plan file (hexiscale plan --out); default: the search's plan on the cluster")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step (default 32)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30; with --resume: this many more)")
    p.add_argument("--samples", type=int, default=1024, help="sequences of the generated corpus, reshuffled "
                   "every epoch (default 1024)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], help="float32, or bf16 autocast over float32 "
                   "weights (default: bf16-mixed on CUDA GPUs, 32-true on CPU); the plan is priced in it")
    p.add_argument("--save", metavar="DIR", help="write a checkpoint here after the last step")
    p.add_argument("--resume", metavar="DIR", help="load the weights and optimizer state of a checkpoint first")
    args = p.parse_args(argv)
    for flag, value in (("--global-batch", args.global_batch), ("--steps", args.steps), ("--samples", args.samples)):
        if value < 1:
            p.error(f"{flag} = {value}: must be a whole number >= 1 (e.g. {flag} 8)")
    if not args.lr > 0 or args.clip < 0:
        p.error(f"--lr = {args.lr}, --clip = {args.clip}: the rate must be > 0 and the clip >= 0 (0: no clipping)")
    return args


def make_plan(args: argparse.Namespace, config: LlamaConfig, world: int) -> tuple[Plan, Cluster | None, float | None]:
    """Steps 1-2, collective: the cluster (discovered by every rank when ``auto``), rank 0's plan and
    its estimated step time in seconds (None without a cluster to price it on), the same on every
    rank. An error of rank 0 reaches every rank as the same message."""
    precision = args.precision
    cluster = None
    if args.cluster == "auto" and args.plan is None:  # a plan file needs no cluster
        from lightning_hexiscale.profiling.discover import discover_process_group

        found = discover_process_group(config, precision=precision, progress=dist.get_rank() == 0)
        cluster = Cluster.load(found.path) if dist.get_rank() == 0 else None
    made: list = [None]
    if dist.get_rank() == 0:
        try:
            check_paths(args, config)
            if cluster is None and args.cluster != "auto":
                cluster = Cluster.load(args.cluster, key="--cluster")
            workload = (Workload.for_devices(config, [d.gpu_type for d in cluster.devices], precision)
                        if cluster is not None else None)
            if args.plan is not None:  # checked against the cluster too where one is named
                plan = Plan.load(args.plan, key="--plan").validate(cluster, config, global_batch=args.global_batch)
                priced = estimate(plan, cluster, workload).cost if cluster is not None else None
            else:
                found = search(cluster, workload, args.global_batch, SearchSettings(progress=False))
                plan, priced = found.plan, found.estimate.cost
            made[0] = ("plan", (plan.to_dict(), priced))
        except HexiScaleError as e:
            made[0] = ("error", str(e))
    dist.broadcast_object_list(made, src=0)
    kind, value = made[0]
    if kind == "error":
        raise SystemExit(_fail(value))
    plan, priced = Plan.from_dict(value[0]), value[1]
    try:
        rank_map(plan, world)  # the runtime's rule for the job's size
    except PlanError as e:  # its fix, in torchrun's words
        raise SystemExit(_fail(f"{e.key} = {e.value}: {e.rule}. Fix: torchrun --nproc_per_node "
                               f"{len(plan.launch_order)}")) from None
    return plan, cluster, priced


def check_paths(args: argparse.Namespace, config: LlamaConfig) -> None:
    """Before any training: ``--resume`` is a complete checkpoint of this model, and ``--save`` can be
    written (else ConfigError; a save that failed would lose the run it ends)."""
    if args.resume:
        checkpoint.check_model(args.resume, config, key="--resume")
    if args.save:
        check_output_dir("--save", args.save, "save to a directory you can write, e.g. --save checkpoints/last")
        try:
            checkpoint.check_save_target(Path(args.save))
        except ConfigError as e:  # named as this script takes it
            raise ConfigError("--save", e.value, e.rule, e.fix) from None


def _fail(message: str) -> int:
    if dist.get_rank() == 0:
        print(f"plain_loop: error: {message}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 2


def train(args: argparse.Namespace, plan: Plan, config: LlamaConfig, device: torch.device,
          priced: float | None) -> None:
    """Steps 3-5 on a rank the plan uses: its stage, the optimizer, the loop; at the end the measured
    step time against ``priced``, the plan's estimate (the first step, warm-up, not counted)."""
    engine = PipelineEngine(plan, config, seed=0, device=device,  # step 3: this rank's stage (collective)
                            autocast_dtype=torch.bfloat16 if args.precision == "bf16-mixed" else None)
    # step 4: an ordinary optimizer over the stage's parameters; under ZeRO the engine steps a
    # sharded copy of it (wrap_optimizer), so keep what it returns
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=args.lr))
    first = 0
    if args.resume:
        checkpoint.load_model(args.resume, engine, group=engine.topology.plan_group)
        checkpoint.load_optimizer(args.resume, engine, optimizer, group=engine.topology.plan_group)
        first = int(checkpoint.read_meta(args.resume).get("hexiscale", {}).get("step", 0))
    lead = engine.topology.rank == 0
    data = generated_corpus(max(args.samples, args.global_batch), config.seq_len)
    seconds = []
    for step, batch in global_batches(data, args.global_batch, first, first + args.steps):
        tokens, targets = batch[:, :-1].to(device), batch[:, 1:].to(device)  # step 5: one fit_step per batch
        start = time.perf_counter()
        done = engine.fit_step(tokens, targets, optimizer, clip_norm=args.clip or None)  # returns after the update
        seconds.append(time.perf_counter() - start)
        if lead:
            print(f"step {step + 1}: loss {done.loss:.4f}", flush=True)
    if lead and priced and len(seconds) > 1:
        n = len(seconds) - 1
        measured = sum(seconds[1:]) / n
        print(f"step time: measured {measured:.3g} s (mean of {n} step{'s' * (n > 1)} after the first), "
              f"the plan's estimate {priced:.3g} s ({measured / priced - 1:+.0%})", flush=True)
    held_out = held_out_batch(config, args.global_batch).to(device)  # forward only, every pipeline its rows
    loss = engine.eval_loss(held_out[:, :-1], held_out[:, 1:])
    if lead:
        print(f"held-out loss {loss:.4f}", flush=True)
    if args.save:
        checkpoint.save(args.save, engine, optimizer, extra={"step": first + args.steps},
                        group=engine.topology.plan_group)
        if lead:
            print(f"saved {args.save} (Hugging Face files: hexiscale export {args.save} --hf OUT_DIR)", flush=True)


def held_out_batch(config: LlamaConfig, global_batch: int) -> torch.Tensor:
    """One global batch (G, S + 1) of generated text the training batches never hold (another seed)."""
    rows = generated_corpus(global_batch, config.seq_len, seed=1)
    return torch.stack([rows[i] for i in range(global_batch)])


def global_batches(data, global_batch: int, first: int, end: int):
    """(step, batch) for steps ``first`` .. ``end - 1``: epochs of ``data`` shuffled with the epoch's
    seed, the same on every rank (the engine keeps its pipeline's rows of each), and the same for a
    run resumed at ``first`` as for one that trained through it."""
    per_epoch = len(data) // global_batch
    for epoch in range(first // per_epoch, (end - 1) // per_epoch + 1):
        loader = DataLoader(data, batch_size=global_batch, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(epoch))
        for k, batch in enumerate(loader):
            if first <= epoch * per_epoch + k < end:
                yield epoch * per_epoch + k, batch


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torchrun's agent hosts the rendezvous store, so that a rank the plan leaves idle may end early
    # (were the store rank 0's, an idle rank 0 would have to outlive the training); under SLURM: srun torchrun
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "RANK" not in os.environ:
        print("plain_loop: error: run it under torchrun, one process per device: torchrun --standalone "
              "--nproc_per_node 4 recipes/plain_loop.py (on several machines: torchrun --nnodes N "
              "--rdzv-endpoint HOST:PORT ..., e.g. under srun)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    args.precision = args.precision or ("bf16-mixed" if cuda else "32-true")  # as the strategy's default
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # CPU processes share the host's cores
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        config = LlamaConfig.load(args.model, key="--model")
    except HexiScaleError as e:
        return _fail(str(e))
    plan, cluster, priced = make_plan(args, config, dist.get_world_size())
    if dist.get_rank() == 0:
        print(plan.table(cluster), flush=True)
    ranks = rank_map(plan, dist.get_world_size())
    if dist.get_rank() in ranks:
        train(args, plan, config, device, priced)
    else:
        # a device the plan leaves idle: its part of the group set-up, then it ends (torchrun's agent
        # hosts the store and waits for the others); no barrier at the end, where it would wait for a
        # whole training run and exceed the process group's timeout (10 minutes under NCCL)
        create_groups(plan, config, ranks)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
