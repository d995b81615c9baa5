"""Train a LLaMA with the hexiscale strategy: plan on the cluster, print the plan, train.

    python recipes/train.py                                  # 4 CPU processes emulate cpu_hetero4, llama_tiny
    python recipes/train.py trainer.max_steps=200 trainer.precision=bf16-mixed
    python recipes/train.py data.kind=text data.path=book.txt # a local text file, byte tokens
    python recipes/train.py cluster=hetero3 model=llama_30b   # plans; says what hardware it needs
    python recipes/train.py cluster=hetero3 model=llama_30b dry_run=true   # only plans, anywhere
    python recipes/train.py -m cluster=cpu2,cpu_hetero4 train.global_batch=8,16
    python recipes/train.py model=hf:/models/Llama-3.2-1B data.kind=bin data.path=data/train.bin  # fine-tune

Config: conf/config.yaml (cluster, model, train, planner groups) plus ``trainer.*`` and ``data.*``
(lightning_hexiscale/config/recipe.py), ``plan=<file>`` and ``dry_run``. ``model=hf:/dir`` takes the
model from a local Hugging Face directory and starts from its weights (``trainer.weights=/dir``
with a preset does the same, checking the preset against the directory's config.json). Emulated CPU clusters run
here as one process per device; GPU clusters run under torchrun or SLURM (one process per GPU,
node k on machine k of the cluster file), or here when this machine has the GPUs.

Exit status: 0 trained (or planned, with dry_run); 2 bad configuration (one message naming the key,
value, rule and fix); 3 the plan needs hardware this machine does not have; 4 training stopped (a
non-finite step with ``trainer.nonfinite=stop``, or a rank failed: see "Failure behaviour" in the
README); 5 an elastic worker stopped on SIGTERM after saving, for torchrun to restart it (a machine
joins or leaves; not a failure); 130 interrupted (Ctrl-C); 1 any other error.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.config.schema import register_configs
from lightning_hexiscale.errors import ElasticStop, HexiScaleError, TrainingFailure, TrainingInterrupted

EXIT_CONFIG, EXIT_HARDWARE, EXIT_FAILED, EXIT_RESTART, EXIT_INTERRUPTED = 2, 3, 4, 5, 130
register_configs()


class HardwareMissing(HexiScaleError):
    """The plan's devices are not here; the message says what is needed and how to launch it."""


def is_rank_zero() -> bool:
    """The launching process or global rank 0 (popen children and torchrun/SLURM ranks have env vars)."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def say(*args) -> None:
    if is_rank_zero():
        print(*args, flush=True)


def overrides_given() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def output_dir(cfg: DictConfig) -> Path:
    """trainer.output_dir, else Hydra's run directory, resolved to a plain path now: spawned workers
    have no HydraConfig to resolve ``${hydra:...}`` with."""
    if cfg.trainer.output_dir:
        return Path(cfg.trainer.output_dir).resolve()
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir).resolve() if HydraConfig.initialized() else Path.cwd()


# ---- planning ----------------------------------------------------------------------------------
def make_plan(cfg: DictConfig, cluster, model, out: Path):
    """The plan file given, or the search's plan (with every planner.* setting, as ``hexiscale plan``
    makes it); ranks launched by popen reuse rank 0's plan file."""
    from lightning_hexiscale.cli.common import explicit as _explicit
    from lightning_hexiscale.lightning.plan_resolution import apply_overrides, load_plan_arg
    from lightning_hexiscale.planner.estimate import estimate, workload_from_config
    from lightning_hexiscale.planner.plan import Plan
    from lightning_hexiscale.planner.search import SearchSettings, search

    given = overrides_given()
    workload = workload_from_config(cfg)  # its dtype comes from trainer.precision
    gb = int(cfg.train.global_batch)
    overrides = {k: cfg.train[k] for k in ("schedule", "recompute", "dp_sharding", "micro_batch_size")
                 if _explicit(given, f"train.{k}")}
    saved = out / "plan.yaml"
    if cfg.plan:
        plan = apply_overrides(load_plan_arg(cfg.plan, key="plan"), overrides)
    elif not is_rank_zero() and saved.is_file():
        plan = Plan.load(saved)
    else:
        # The search picks ddp / zero2 / zero3 with the cost model unless train.dp_sharding was given.
        settings = SearchSettings.from_config(cfg, dp_sharding_explicit="dp_sharding" in overrides, progress=False)
        plan = search(cluster, workload, gb, settings).plan
    plan.validate(cluster, model, global_batch=gb if (not cfg.plan or _explicit(given, "train.global_batch")) else None)
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
    from lightning_hexiscale.cli.picture import draw_plan
    from lightning_hexiscale.config.units import format_flops

    try:
        draw_plan(plan, cluster, path, title=f"{model.name} on {cluster.name}: {est.iteration_time_s:.3f} s/iteration "
                  f"(estimated), {format_flops(est.pflops * 1e15)}", estimate=est)
    except HexiScaleError as e:  # no matplotlib: the plan table above says the same
        return f"no plan picture ({e.rule})"
    return f"plan picture written to {path}"


def launch_settings(cluster, plan, plan_file: Path) -> dict:
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
    launched = "WORLD_SIZE" in os.environ and ("TORCHELASTIC_RUN_ID" in os.environ or "SLURM_PROCID" in os.environ)
    if launched and gpus:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", gpus)))
        if world in accepted_world_sizes(plan):
            return {"accelerator": "gpu", "devices": local, "num_nodes": max(1, world // local)}
    elif gpus >= launched_here and len({cluster.devices[d].machine for d in plan.launch_order}) == 1:
        return {"accelerator": "gpu", "devices": launched_here, "num_nodes": 1}
    raise HardwareMissing(hardware_message(cluster, plan, gpus, plan_file))


def hardware_message(cluster, plan, local_gpus: int, plan_file: Path) -> str:
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
    return (f"cannot launch here: the plan runs {plan.world_size} processes, one per GPU, on {need} in {nodes} "
            f"machine(s) ({per_machine}); this machine has {here}.\n"
            f"Launch one process per GPU on the cluster, node k on machine k of cluster {cluster.name} "
            f"(device ids follow its machine order), with the plan above (copy it to every machine):\n"
            f"  torchrun --nnodes={nodes} --node-rank=<k> --nproc-per-node=<GPUs of machine k> "
            f"--master-addr=<machine 0> --master-port=29500 recipes/train.py {args} plan={plan_file}\n"
            f"  srun --nodes={nodes} --ntasks={len(plan.launch_order)} --gpus-per-task=1 python recipes/train.py {args} "
            f"plan={plan_file}\n"
            f"or pass dry_run=true to plan only.")


# ---- training ----------------------------------------------------------------------------------
def load_dataset(cfg: DictConfig, model):
    """The token dataset of ``data.*``, built before planning so that a missing or malformed file is
    reported at once (not after the search and the launch)."""
    from lightning_hexiscale.data import make_dataset

    d = cfg.data
    return make_dataset(d.kind, model.seq_len, path=d.path, num_samples=int(d.num_samples), seed=int(d.seed),
                        vocab_size=model.vocab_size, dtype=d.get("dtype"))


def make_data(cfg: DictConfig, model, global_batch: int, dataset=None):
    from torch.utils.data import DataLoader, Subset

    ds = dataset if dataset is not None else load_dataset(cfg, model)
    d = cfg.data
    n_val = min(int(d.val_samples), len(ds) // 10)
    n_train = len(ds) - n_val
    if n_train < global_batch:
        from lightning_hexiscale.errors import ConfigError

        raise ConfigError("data", f"{len(ds)} sequences", f"fewer than one global batch ({global_batch}) to train on",
                          "use more data (data.num_samples) or a smaller train.global_batch")
    train = DataLoader(Subset(ds, range(n_train)), batch_size=global_batch, shuffle=True, drop_last=True)
    val = DataLoader(Subset(ds, range(n_train, len(ds))), batch_size=global_batch) if n_val >= 1 else None
    return train, val


LOGGERS = {"csv": None, "tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}
"""trainer.logger -> the packages that can back it (one is enough); csv needs none."""


def check_logger(cfg: DictConfig) -> None:
    """trainer.logger names a logger whose package is installed (checked before planning)."""
    import importlib.util

    from lightning_hexiscale.errors import ConfigError

    kind = str(cfg.trainer.get("logger", "csv"))
    if kind not in LOGGERS:
        raise ConfigError("trainer.logger", kind, f"must be one of {', '.join(LOGGERS)}", "e.g. trainer.logger=csv")
    packages = LOGGERS[kind]
    if packages and not any(importlib.util.find_spec(p) for p in packages):
        raise ConfigError("trainer.logger", kind, f"needs the {packages[0]} package, which is not installed",
                          f"pip install -c constraints.txt 'lightning-hexiscale[{kind}]', or trainer.logger=csv")


def make_logger(cfg: DictConfig, out: Path):
    """Lightning's CSV, TensorBoard or wandb logger writing under ``out`` (wandb offline by default)."""
    check_logger(cfg)
    t = cfg.trainer
    kind = str(t.get("logger", "csv"))
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(str(out), name="logs")
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(project=t.get("wandb_project") or "hexiscale", save_dir=str(out),
                           offline=bool(t.get("wandb_offline", True)))
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(str(out), name="logs")


def plan_hparams(cfg: DictConfig, cluster, model, plan, est) -> dict:
    """What the logger records as hyper-parameters: the model, the plan (and its table), the
    Appendix B estimate (headline figures, per-stage breakdown and the printed table)."""
    hp = {"model": model.to_dict(), "cluster": cluster.name, "plan": plan.to_dict(), "plan_table": plan.table(cluster),
          "train": OmegaConf.to_container(cfg.train, resolve=True)}
    if est is not None:
        doc = est.to_dict()
        hp["estimate"] = {k: doc[k] for k in ("iteration_time_s", "tokens_per_s", "pflops", "feasible",
                                              "bottleneck_pipeline", "breakdown")}
        hp["estimate"]["stages"] = [{k: st[k] for k in ("devices", "tp", "layers", "time_per_micro_batch_s",
                                                        "peak_memory_bytes")}
                                    for p in doc["pipelines"] for st in p["stages"]]
        hp["estimate_table"] = est.summary()
    return hp


def train(cfg: DictConfig, cluster, model, plan, out: Path, launch: dict, precision: str, dataset=None,
          est=None, elastic=None) -> dict:
    """Lightning's Trainer with the hexiscale strategy on ``plan``; with ``elastic`` (an
    ElasticSettings), no plan: the strategy plans for the machines present at every (re)start."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hexiscale.config.fast_path import FastPath
    from lightning_hexiscale.lightning.example import LlamaLitModule, LogHyperparams, LossPrinter, StepProgressBar
    from lightning_hexiscale.lightning.interrupt import GracefulInterrupt
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    t = cfg.trainer
    pl.seed_everything(int(t.seed), verbose=False)
    gb = plan.global_batch if plan is not None else int(cfg.train.global_batch)
    train_dl, val_dl = make_data(cfg, model, gb, dataset)
    module = LlamaLitModule(model, lr=float(t.lr), weight_decay=float(t.weight_decay), warmup_steps=int(t.warmup_steps),
                            init_seed=int(t.seed), eps=float(t.adam_eps))
    if t.weights:
        from lightning_hexiscale.data.weights import attach_weights

        attach_weights(module, t.weights)
    # Multirun: fresh spawned workers per job, so no process or process group outlives its job.
    launcher = "spawn" if is_multirun() else str(t.launcher)
    planning = {}
    if elastic is not None:  # the strategy plans at every start, with the planner.* and train.* settings
        from lightning_hexiscale.cli.common import explicit as _explicit

        planning = {k: cfg.train[k] for k in ("schedule", "recompute", "dp_sharding", "micro_batch_size")
                    if _explicit(overrides_given(), f"train.{k}")}
        planning.update(global_batch=gb, planner_iterations=int(cfg.planner.iterations), elastic=elastic,
                        use_all_devices=bool(cfg.planner.get("use_all_devices", False)))
    strategy = HexiScaleStrategy(cluster=cluster, plan=plan, start_method=launcher, seed=int(t.seed),
                                 nonfinite=str(t.nonfinite), timeout=float(t.timeout_s),
                                 async_checkpoint=bool(t.async_checkpoint),
                                 fast_path=FastPath.coerce(t.get("fast_path"), key="trainer.fast_path"), **planning)
    logger = make_logger(cfg, out)
    # the train.* values that ran (effective_config), not the defaults; logged at fit start by the
    # training rank 0 (global rank 0 may be a device the plan leaves idle)
    hparams = [] if plan is None else [
        LogHyperparams(plan_hparams(effective_config(cfg, plan, precision), cluster, model, plan, est))]
    # elastic: the strategy saves every checkpoint_every steps under <out>/elastic itself
    every = int(t.checkpoint_every) if elastic is None else 0
    last = out / "checkpoints" / "last.ckpt"
    # Ctrl-C: every rank stops at the end of the step (and saves it to last.ckpt if asked)
    interrupt = GracefulInterrupt(save_to=last if t.save_on_interrupt else None, last_checkpoint=last)
    ckpt = ModelCheckpoint(dirpath=str(out / "checkpoints"), save_last=True, save_top_k=0 if not every else -1,
                           every_n_train_steps=every or None)
    trainer = pl.Trainer(
        strategy=strategy, **launch, precision=precision, max_steps=int(t.max_steps),
        accumulate_grad_batches=int(t.accumulate_grad_batches), gradient_clip_val=t.gradient_clip_val,
        val_check_interval=int(t.val_every) if t.val_every and val_dl is not None else None,
        check_val_every_n_epoch=None if t.val_every else 1, limit_val_batches=int(t.limit_val_batches) if t.val_every else 0,
        num_sanity_val_steps=0, log_every_n_steps=int(t.log_every), default_root_dir=str(out),
        logger=logger, callbacks=[ckpt, LossPrinter(), interrupt, *hparams] + ([StepProgressBar()] if t.progress_bar else []),
        enable_progress_bar=bool(t.progress_bar), enable_model_summary=False)
    trainer.fit(module, train_dl, val_dl if t.val_every else None, ckpt_path=t.resume)
    # the training rank 0's figures (None on the other ranks, and on ranks of idle devices)
    return dict(trainer.callback_metrics) if trainer.is_global_zero else None


def quiet_logs() -> None:
    """Hydra also routes Lightning's INFO lines through the root logger: print them once."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric"):
        lg = logging.getLogger(name)
        lg.propagate = False
        # Lightning adds a stderr handler of its own when it is imported before Hydra configures the
        # root logger (the Ctrl-C recorder imports it first): the recipe prints its own summary instead
        lg.handlers.clear()


def check_early(cfg: DictConfig) -> None:
    """What needs no plan, checked before planning (not after minutes of it, nor on every rank):
    trainer.nonfinite, trainer.timeout_s, trainer.precision, trainer.launcher, trainer.resume,
    trainer.fast_path."""
    from lightning_hexiscale.config.recipe import check_ckpt_path, precision_dtype
    from lightning_hexiscale.errors import ConfigError

    t = cfg.trainer
    if t.nonfinite not in ("skip", "stop"):
        raise ConfigError("trainer.nonfinite", t.nonfinite, "must be skip or stop",
                          "trainer.nonfinite=stop (raise, exit 4) or trainer.nonfinite=skip (drop the update)")
    if not float(t.timeout_s) > 0:
        raise ConfigError("trainer.timeout_s", t.timeout_s, "must be a positive number of seconds",
                          "e.g. trainer.timeout_s=600")
    if t.precision is not None:
        precision_dtype(t.precision)
    if t.launcher not in ("popen", "spawn", "fork"):
        raise ConfigError("trainer.launcher", t.launcher, "must be popen, spawn or fork", "use popen (the default)")
    for key in ("max_steps", "accumulate_grad_batches", "log_every"):
        if int(t[key]) < 1:
            raise ConfigError(f"trainer.{key}", t[key], "must be a positive integer", f"e.g. trainer.{key}=1")
    check_ckpt_path(t.resume, key="trainer.resume")
    from lightning_hexiscale.config.fast_path import FastPath

    FastPath.coerce(t.get("fast_path"), key="trainer.fast_path")  # a bad switch value, before planning


def run(cfg: DictConfig) -> int:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.recipe import effective_precision
    from lightning_hexiscale.config.schema import resolve_hf_model
    from lightning_hexiscale.models.config import LlamaConfig

    quiet_logs()
    apply_file_overrides(cfg)
    check_early(cfg)
    check_logger(cfg)
    resolve_hf_model(cfg, overrides_given())  # model=hf:/dir: the shape from its config.json
    out = output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    _OUT[:] = [out]
    cluster = Cluster.from_config(cfg.cluster)
    model = LlamaConfig.from_config(cfg.model)
    if cfg.trainer.weights:  # every difference between the preset and config.json, before any process starts
        from lightning_hexiscale.data.weights import check_hf_config

        check_hf_config(cfg.trainer.weights, model)
    dataset = None if cfg.dry_run else load_dataset(cfg, model)
    precision = effective_precision(cfg.trainer.precision, [d.gpu_type for d in cluster.devices])
    if cfg.trainer.elastic and not cfg.dry_run:
        return run_elastic(cfg, cluster, model, out, precision, dataset)
    say(f"planning for {model.name} on cluster {cluster.name} ({cluster.num_devices} devices) ...")
    plan, est = make_plan(cfg, cluster, model, out)
    picture = None
    if is_rank_zero():
        plan.save(out / "plan.yaml")
        (out / "config.yaml").write_text(OmegaConf.to_yaml(effective_config(cfg, plan, precision)))
        picture = write_picture(plan, cluster, model, est, out / "plan.png")
    say(cluster.summary(), "\n")
    say(plan.table(cluster), "\n")
    say(est.summary(), "\n")
    say(f"plan written to {out / 'plan.yaml'}; {picture}")
    if cfg.dry_run:
        say("dry_run=true: planned only.")
        return 0
    launch = launch_settings(cluster, plan, out / "plan.yaml")
    if is_multirun():
        # A previous job's port is in TIME_WAIT or still bound; let Lightning choose a free one.
        os.environ.pop("MASTER_PORT", None)
    _PHASE[0] = "training"
    metrics = train(cfg, cluster, model, plan, out, launch, precision, dataset, est)
    print_metrics(metrics)
    return 0


def print_metrics(metrics: dict | None) -> None:
    if metrics is not None:
        print("final metrics: " + ", ".join(f"{k}={float(v):.4f}" for k, v in sorted(metrics.items())), flush=True)


def elastic_launch(cfg: DictConfig) -> dict:
    """trainer.elastic=true: the checks (torchrun's elastic agent, a shared output directory, no plan
    file) and Trainer(accelerator, devices, num_nodes) of this start."""
    import torch

    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.lightning.elastic import MACHINE_ENV

    command = (f"{MACHINE_ENV}=<machine> torchrun --nnodes=1:<machines> --nproc-per-node=<GPUs> --rdzv-backend=c10d "
               "--rdzv-endpoint=<host:port> --max-restarts=10 recipes/train.py trainer.elastic=true "
               "trainer.output_dir=<shared dir> ...")
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise ConfigError("trainer.elastic", True, "elastic training runs under torchrun's elastic agent (one agent "
                          "per machine), which restarts the workers when machines leave or join",
                          f"launch on every machine: {command}")
    if not cfg.trainer.output_dir:
        raise ConfigError("trainer.output_dir", None, "elastic training keeps its checkpoints and elastic.json in one "
                          "directory that every node and every restart finds (Hydra's default is per run and host)",
                          "pass trainer.output_dir=<a directory on a file system all nodes share>")
    if cfg.plan:
        raise ConfigError("plan", cfg.plan, "elastic training plans for the machines present at every start",
                          "leave plan= out with trainer.elastic=true")
    if cfg.trainer.resume:
        raise ConfigError("trainer.resume", cfg.trainer.resume, "elastic training resumes by itself from the newest "
                          "complete checkpoint under <trainer.output_dir>/elastic",
                          "leave trainer.resume out (copy the checkpoint there to start from it)")
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("WORLD_SIZE", 1))
    return {"accelerator": "gpu" if torch.cuda.is_available() else "cpu", "devices": local,
            "num_nodes": max(1, world // local)}


def run_elastic(cfg: DictConfig, cluster, model, out: Path, precision: str, dataset) -> int:
    from lightning_hexiscale.lightning.elastic import ElasticSettings

    launch = elastic_launch(cfg)
    say(cluster.summary(), "\n")
    settings = ElasticSettings(out / "elastic", every_n_steps=int(cfg.trainer.checkpoint_every))
    _PHASE[0] = "training"
    metrics = train(cfg, cluster, model, None, out, launch, precision, dataset, elastic=settings)
    print_metrics(metrics)
    return 0


_STATUS: list[int] = []
_PHASE = ["planning"]
"""What the recipe is doing, for the Ctrl-C message: planning (and checks), then training."""
_INTERRUPTED = threading.Event()
"""Set by this process's SIGINT handler (``record_ctrl_c`` in :func:`main`)."""


def interrupted_message(out: Path | None) -> str:
    last = out / "checkpoints" / "last.ckpt" if out is not None else None
    kept = (f"; the last checkpoint, {last}, was kept (resume with trainer.resume={last})"
            if last is not None and last.exists() else "")
    return f"recipes/train.py: interrupted (Ctrl-C) while {_PHASE[0]}{kept}"


_OUT: list[Path] = []


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> int:
    try:
        code = run(cfg)
    except TrainingInterrupted as e:  # every rank stopped at the end of the same step
        if is_rank_zero():
            resume = _OUT[0] / "checkpoints" / "last.ckpt" if _OUT else None
            hint = f" (resume with trainer.resume={resume})" if resume is not None and resume.exists() else ""
            print(f"recipes/train.py: {e}{hint}", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except KeyboardInterrupt:  # while planning (or a second Ctrl-C during training): one line, no traceback
        if is_rank_zero():
            print(interrupted_message(_OUT[0] if _OUT else None), file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except SystemExit:  # Lightning ends the job with exit(1) after a KeyboardInterrupt it caught
        if not _INTERRUPTED.is_set():
            raise
        if is_rank_zero():
            print(interrupted_message(_OUT[0] if _OUT else None), file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except HardwareMissing as e:
        print(f"recipes/train.py: {e}", file=sys.stderr)
        code = EXIT_HARDWARE
    except ElasticStop:  # planned (SIGTERM: a machine joins or leaves): rank 0 said so; torchrun restarts us
        code = EXIT_RESTART
    except TrainingFailure as e:  # the same on every rank (e.g. a non-finite step with nonfinite=stop)
        print(f"recipes/train.py: training stopped: {e}", file=sys.stderr)
        code = EXIT_FAILED
    except HexiScaleError as e:
        print(f"recipes/train.py: error: {e}", file=sys.stderr)
        code = EXIT_CONFIG
    except Exception:  # a bug or a rank's own failure: its traceback is the information, Hydra's wrapper is not
        import traceback

        traceback.print_exc()
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        print(f"recipes/train.py: rank {rank} failed (traceback above)", file=sys.stderr)
        code = 1
    _STATUS.append(code)
    return code


def check_overrides(argv: list[str]) -> None:
    """Compose the command line's overrides with the project's own composer before Hydra does.

    Hydra reports an unknown preset (``cluster=nope``) or key with a traceback hint and exit status
    1, before any code of ours runs; :func:`compose` raises a ConfigError that names the key, the
    value, the rule and the available presets. A multirun sweep (``cluster=a,b``) is checked one
    value at a time, the other keys at their first value.
    """
    from lightning_hexiscale.config.schema import compose

    args = [a for a in argv if not a.startswith("-") and "=" in a and not a.lstrip("+~").startswith("hydra.")]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if not multirun:
        compose(args)
        return
    first = [a.split("=", 1)[0] + "=" + a.split("=", 1)[1].split(",")[0] for a in args]
    for i, a in enumerate(args):
        key, value = a.split("=", 1)
        for v in value.split(",") if "," in value else []:
            compose(first[:i] + [f"{key}={v}"] + first[i + 1:])
    compose(first)


FILES_ENV = "HEXISCALE_RECIPE_FILES"
"""``cluster=`` / ``model=`` YAML files of the command line, as JSON, for run() and the popen children."""


def take_file_overrides(argv: list[str]) -> list[str]:
    """``cluster=my_cluster.yaml`` (e.g. from ``hexiscale profile``) or ``model=my_model.yaml``: Hydra
    would look for a preset of that name and stop with "Could not find"; the overrides are taken out
    of the command line (Hydra composes the default preset) and the files replace it in :func:`run`
    (:func:`apply_file_overrides`), as ``hexiscale`` does. Single runs only; a sweep keeps presets."""
    import json

    if any(a in ("-m", "--multirun") for a in argv):
        return argv
    files, rest = {}, []
    for a in argv:
        key, _, value = a.partition("=")
        if key in ("cluster", "model") and value.endswith((".yaml", ".yml")) and Path(value).is_file():
            files[key] = str(Path(value).resolve())
        else:
            rest.append(a)
    if files:
        os.environ[FILES_ENV] = json.dumps(files)
    return rest


def apply_file_overrides(cfg: DictConfig) -> None:
    import json

    from lightning_hexiscale.config.schema import ClusterConfig, ModelConfig, load_yaml_node

    for key, path in json.loads(os.environ.get(FILES_ENV, "{}")).items():
        node = load_yaml_node(path, ClusterConfig if key == "cluster" else ModelConfig, key)
        OmegaConf.set_struct(cfg, False)
        cfg[key] = node
        OmegaConf.set_struct(cfg, True)


def main() -> int:
    from lightning_hexiscale.config.schema import hf_model_overrides

    from lightning_hexiscale.lightning.interrupt import record_ctrl_c

    # rank 0 (the launching process) raises KeyboardInterrupt on Ctrl-C; ranks its popen launcher started
    # only record it (every rank stops at the end of the step together; before training rank 0 ends them)
    child = "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ and "SLURM_PROCID" not in os.environ
    record_ctrl_c(_INTERRUPTED, raise_interrupt=not child)
    try:
        try:  # model=hf:/dir -> model=_hf trainer.weights=/dir, which Hydra composes (children inherit argv)
            sys.argv[1:] = hf_model_overrides(sys.argv[1:])
            if "LOCAL_RANK" not in os.environ:  # popen children re-run this script; the launcher checked already
                check_overrides(sys.argv[1:])
                sys.argv[1:] = take_file_overrides(sys.argv[1:])
            elif FILES_ENV not in os.environ:  # torchrun/SLURM workers: no launcher of ours took the files out
                sys.argv[1:] = take_file_overrides(sys.argv[1:])
        except HexiScaleError as e:
            print(f"recipes/train.py: error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        _main()
    except KeyboardInterrupt:  # before Hydra started the run (reading the command line)
        if is_rank_zero():
            print(interrupted_message(None), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return max(_STATUS, default=EXIT_CONFIG)


if __name__ == "__main__":
    sys.exit(main())
