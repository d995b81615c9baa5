"""``hexiscale train``, before training: the plan (a plan file or the search's), the config as it
will run, the plan's picture, and where the plan can be launched from here.

Rank 0 plans and writes ``plan.yaml``; ranks that the popen launcher started reuse that file, so
every rank trains on the same plan even where the search's timeout could make two searches differ.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.cli.common import explicit
from lightning_hexiscale.cli.train_job import AppName, is_rank_zero, overrides_given
from lightning_hexiscale.runtime.host import slurm_launched
from lightning_hexiscale.errors import HexiScaleError

PLAN_OVERRIDES = ("schedule", "recompute", "dp_sharding", "micro_batch_size")
"""``train.*`` keys that, given on the command line, replace what a plan file (or the search) chose."""


class HardwareMissing(HexiScaleError):
    """The plan's devices are not here; the message says what is needed and how to launch it."""


def explicit_train_settings(cfg: DictConfig) -> dict:
    """The :data:`PLAN_OVERRIDES` that this job's command line gave, with their values."""
    given = overrides_given()
    return {k: cfg.train[k] for k in PLAN_OVERRIDES if explicit(given, f"train.{k}")}


PRICING_KEYS = ("allow_table_mismatch",)
"""``planner.*`` keys that pricing reads too (the estimate of a plan file): the others set the search only."""


def check_search_overrides(cfg: DictConfig, given: list[str]) -> None:
    """A ``planner.*`` override on the command line beside a plan file: the search does not run, so it
    changed nothing and was dropped without a word. Only keys the command line gave (Hydra's task
    overrides): the base config's ``planner.*`` defaults are always there."""
    from lightning_hexiscale.errors import ConfigError

    if not cfg.plan:
        return
    for o in given:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith("planner.") and key.split(".")[1] not in PRICING_KEYS:
            raise ConfigError(key, o.split("=", 1)[1] if "=" in o else None,
                              f"sets the planner's search, which a plan file skips (plan={cfg.plan} runs as it is)",
                              f"drop {key}=..., or drop plan= to plan here with it")


def make_plan(cfg: DictConfig, cluster, out: Path):
    """The plan file given, or the search's plan (with every planner.* setting, as ``hexiscale plan``
    makes it); ranks launched by popen reuse rank 0's plan file. Returns (plan, its estimate)."""
    from lightning_hexiscale.lightning.plan_resolution import plan_for
    from lightning_hexiscale.planner import SearchSettings, estimate, workload_from_config

    workload = workload_from_config(cfg)  # its dtype comes from trainer.precision
    gb = int(cfg.train.global_batch)
    overrides = explicit_train_settings(cfg)
    saved = out / "plan.yaml"
    given = cfg.plan or (saved if not is_rank_zero() and saved.is_file() else None)
    # The search picks ddp / zero2 / zero3 with the cost model unless train.dp_sharding was given;
    # its planner.* settings are read only when it runs, as before plan_for was this door too.
    settings = None if given else SearchSettings.from_config(cfg, dp_sharding_explicit="dp_sharding" in overrides,
                                                             progress=False)
    batch_given = not cfg.plan or explicit(overrides_given(), "train.global_batch")
    plan = plan_for(given, cluster, workload, gb, overrides, settings=settings, check_global_batch=batch_given,
                    key="plan")
    return plan, estimate(plan, cluster, workload)


def effective_config(cfg: DictConfig, plan, precision: str) -> DictConfig:
    """The run's config as it ran (written to config.yaml): the plan's global batch, schedule,
    recomputation, dp_sharding and micro-batch (when every pipeline uses the same), and the precision."""
    eff = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    eff.trainer.precision = precision
    eff.train.global_batch = plan.global_batch
    eff.train.schedule, eff.train.recompute, eff.train.dp_sharding = plan.schedule, plan.recompute, plan.dp_sharding
    mbs = {p.micro_batch_size for p in plan.pipelines}
    eff.train.micro_batch_size = mbs.pop() if len(mbs) == 1 else None  # per pipeline: plan.yaml
    return eff


def write_picture(plan, cluster, model, est, path: Path) -> str:
    """The plan drawn as ``hexiscale plan --picture`` draws it; a sentence saying where (or why not)."""
    from lightning_hexiscale.cli.picture import draw_plan, plan_title

    try:
        draw_plan(plan, cluster, path, title=plan_title(model.name, cluster.name, est), estimate=est)
    except HexiScaleError as e:  # no matplotlib: the plan table above says the same
        return f"no plan picture ({e.rule})"
    return f"plan picture written to {path}"


def launch_settings(cluster, plan, plan_file: Path, app: AppName) -> dict:
    """Trainer(accelerator, devices, num_nodes) for this plan here, or HardwareMissing. Here the job
    is launched on every device of the plan's launch order: devices it leaves idle get a process,
    which leaves at setup (lightning/idle_ranks.py)."""
    import torch

    from lightning_hexiscale.config.recipe import device_kind
    from lightning_hexiscale.lightning.idle_ranks import accepted_world_sizes

    types = sorted({cluster.devices[d].gpu_type for d in plan.device_order})
    launched_here = len(plan.launch_order)
    if device_kind(types) == "cpu":  # emulated devices: one CPU process per device
        return {"accelerator": "cpu", "devices": launched_here, "num_nodes": 1}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    launched = launched_world(gpus) if gpus else None  # no GPU here: the message says what is needed
    if launched:
        world, local, nodes = launched
        if world in accepted_world_sizes(plan):
            return {"accelerator": "gpu", "devices": local, "num_nodes": nodes}
    elif gpus >= launched_here and len({cluster.devices[d].machine for d in plan.launch_order}) == 1:
        return {"accelerator": "gpu", "devices": launched_here, "num_nodes": 1}
    raise HardwareMissing(hardware_message(cluster, plan, gpus, plan_file, app))


def launched_world(gpus: int, environ=None) -> tuple[int, int, int] | None:
    """(processes in the job, processes per node, nodes) of the launcher Lightning's Trainer will see,
    else None (a local launch). The same order and rules as Lightning's cluster environments, so that
    the Trainer built from them is the one Lightning accepts:

    - SLURM first, when ``SLURM_NTASKS`` is set and the job is not named ``bash`` or ``interactive``
      (Lightning's interactive mode, where it launches the processes itself). srun sets no
      WORLD_SIZE: the world is SLURM_NTASKS, ``devices`` ``--ntasks-per-node`` (SLURM_NTASKS_PER_NODE)
      and ``num_nodes`` ``--nodes`` (SLURM_NNODES); Lightning refuses any other pair and ``--ntasks``
      alone, which is refused here with the fix, before the plan is launched.
    - torchrun: WORLD_SIZE and LOCAL_WORLD_SIZE."""
    e = os.environ if environ is None else environ
    if slurm_launched(e):
        world = int(e["SLURM_NTASKS"])
        nodes = int(e.get("SLURM_NNODES", e.get("SLURM_JOB_NUM_NODES", "1")))
        per_node = e.get("SLURM_NTASKS_PER_NODE")
        if per_node is not None and per_node.isdigit():
            return world, int(per_node), nodes
        if world == 1:
            return 1, 1, 1
        raise HardwareMissing(
            f"srun started {world} tasks on {nodes} node(s) without --ntasks-per-node "
            f"(SLURM_NTASKS_PER_NODE = {per_node!r}): Lightning takes its devices per node from it and "
            f"refuses --ntasks alone. Fix: srun --nodes={nodes} --ntasks-per-node=<GPUs per node> "
            f"--gpus-per-node=<GPUs per node> (the same on every node; else launch with torchrun, in a job "
            f"named interactive: srun --job-name=interactive)")
    if "TORCHELASTIC_RUN_ID" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        local = int(e.get("LOCAL_WORLD_SIZE", gpus or world))
        return world, local, max(1, world // max(1, local))
    return None


def hardware_message(cluster, plan, local_gpus: int, plan_file: Path, app: AppName) -> str:
    """What the plan needs (GPUs by type and by machine), what is here, and the torchrun and srun
    commands that launch it on the cluster."""
    import torch

    by_type: dict[str, int] = {}
    machines: dict[int, int] = {}
    for d in plan.device_order:
        dev = cluster.devices[d]
        by_type[dev.gpu_type] = by_type.get(dev.gpu_type, 0) + 1
    for d in plan.launch_order:  # the job is launched on the idle devices too (their ranks leave at setup)
        machines[cluster.devices[d].machine] = machines.get(cluster.devices[d].machine, 0) + 1
    need = " + ".join(f"{n}x{t}" for t, n in by_type.items())
    if plan.idle_devices:
        need += f", {len(plan.idle_devices)} more GPU(s) idle (launched too: their processes leave at setup)"
    per_machine = ", ".join(f"{cluster.machines[m].name}: {n}" for m, n in sorted(machines.items()))
    here = (f"{local_gpus} CUDA GPU(s) ({torch.cuda.get_device_name(0)})" if local_gpus else "no CUDA GPU")
    args = " ".join(o for o in overrides_given() if not o.startswith(("plan=", "hydra."))) or f"cluster={cluster.name}"
    nodes = len(machines)
    counts = sorted(set(machines.values()))
    if len(counts) == 1:  # Lightning under srun: --ntasks-per-node, the same on every node
        srun_line = (f"  srun --nodes={nodes} --ntasks-per-node={counts[0]} --gpus-per-node={counts[0]} {app.srun} "
                     f"{args} plan={plan_file}\n")
    else:
        srun_line = (f"  (not srun: Lightning under srun runs the same --ntasks-per-node on every node, and these "
                     f"machines have {', '.join(map(str, counts))} GPUs)\n")
    return (f"cannot launch here: the plan runs {plan.world_size} processes, one per GPU, on {need} in {nodes} "
            f"machine(s) ({per_machine}); this machine has {here}.\n"
            f"Launch one process per GPU on the cluster, node k on machine k of cluster {cluster.name} "
            f"(device ids follow its machine order), with the plan above (copy it to every machine):\n"
            f"  torchrun --nnodes={nodes} --node-rank=<k> --nproc-per-node=<GPUs of machine k> "
            f"--master-addr=<machine 0> --master-port=29500 {app.torchrun} {args} plan={plan_file}\n"
            f"{srun_line}"
            f"or pass dry_run=true to plan only.")
