"""``hexiscale train``, one job from its composed config to its final metrics: the checks that need
no plan, the plan (printed, written and drawn), then training (or elastic training, which plans at
every start). Exit codes and messages are the app's (:mod:`lightning_hexiscale.cli.train`); this
module raises.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.cli.common import with_cluster_file
from lightning_hexiscale.cli.train_fit import check_data, check_logger, fit, load_dataset, quiet_logs
from lightning_hexiscale.cli.train_job import (HEXISCALE, AppName, apply_file_overrides, auto_cluster, is_multirun,
                                               cluster_file_given, is_rank_zero, output_dir, overrides_given, say)
from lightning_hexiscale.cli.train_plan import (check_search_overrides, effective_config, launch_settings, make_plan,
                                                write_picture)
from lightning_hexiscale.lightning.launch.job_watch import JobWatch
from lightning_hexiscale.planner.plan import OtherClusterWarning, made_for_another_cluster


def _fits_timedelta(seconds: float) -> bool:
    from datetime import timedelta

    try:
        timedelta(seconds=seconds)
    except OverflowError:
        return False
    return True


def check_early(cfg: DictConfig) -> None:
    """What needs no plan, checked before planning (not after minutes of it, nor on every rank):
    trainer.nonfinite, trainer.timeout_s, trainer.precision, trainer.launcher, trainer.resume,
    trainer.fast_path, and the optimizer, schedule and data values
    (:func:`~lightning_hexiscale.config.recipe.check_values`)."""
    from lightning_hexiscale.config.recipe import CKPT_ALIASES, check_ckpt_path, check_values, precision_dtype
    from lightning_hexiscale.errors import ConfigError

    t = cfg.trainer
    if t.nonfinite not in ("skip", "stop"):
        raise ConfigError("trainer.nonfinite", t.nonfinite, "must be skip or stop",
                          "trainer.nonfinite=stop (raise, exit 4) or trainer.nonfinite=skip (drop the update)")
    if not 0 < float(t.timeout_s) < float("inf") or not _fits_timedelta(float(t.timeout_s)):
        # inf and 1e308 (a timedelta overflows): the strategy refused them after planning, as its own key
        raise ConfigError("trainer.timeout_s", t.timeout_s, "must be a positive number of seconds (finite)",
                          "e.g. trainer.timeout_s=600")
    if t.precision is not None:
        precision_dtype(t.precision)
    if t.launcher not in ("popen", "spawn", "fork"):
        raise ConfigError("trainer.launcher", t.launcher, "must be popen, spawn or fork", "use popen (the default)")
    for key in ("max_steps", "accumulate_grad_batches", "log_every"):
        if int(t[key]) < 1:
            raise ConfigError(f"trainer.{key}", t[key], "must be a positive integer", f"e.g. trainer.{key}=1")
    check_values(cfg)
    check_ckpt_path(t.resume, key="trainer.resume")
    if t.resume and str(t.resume).split(":")[0] not in CKPT_ALIASES:
        # Complete, this format, and a checkpoint at all (not the folder of them): the ranks would
        # refuse it too, but after the search and the launch, and under their own key, ckpt_path.
        from lightning_hexiscale.runtime.checkpoint import check_complete

        check_complete(t.resume, key="trainer.resume")
    check_resume_alias(cfg)
    from lightning_hexiscale.config.fast_path import FastPath

    FastPath.coerce(t.get("fast_path"), key="trainer.fast_path")  # a bad switch value, before planning


def check_resume_alias(cfg: DictConfig) -> None:
    """``trainer.resume=last`` / ``best``, which Lightning resolves against the recipe's ModelCheckpoint
    (``<output dir>/checkpoints``, no monitored metric). "best" is refused: Lightning refused it on
    every rank after planning and launching. "last" that finds nothing in Hydra's new per-run
    directory can never find anything (Lightning started from step 0 with a warning whose hint,
    ``save_last=True``, the recipe already follows): refused. In a directory the user fixed
    (``trainer.output_dir``, ``hydra.run.dir``) it is the first run of a command that resumes on
    every later one: it starts from step 0 and says so."""
    from lightning_hexiscale.errors import ConfigError

    alias = str(cfg.trainer.resume).split(":")[0] if cfg.trainer.resume else None
    fix = ("give the earlier run's checkpoint, trainer.resume=<its output dir>/checkpoints/last.ckpt, or run in "
           "its directory again: trainer.output_dir=<its output dir> trainer.resume=last")
    if alias == "best":
        raise ConfigError("trainer.resume", "best", "the recipe's ModelCheckpoint monitors no metric, so it keeps no "
                          "best checkpoint to resume", fix)
    found = output_dir(cfg) / "checkpoints"
    if (not cfg.trainer.resume and cfg.trainer.elastic is not True and not cfg.get("dry_run")
            and any(found.glob("last*.ckpt"))):
        # Lightning keeps the earlier run's last.ckpt and saves this one beside it (last-v1.ckpt)
        say(f"{found} holds an earlier run's {', '.join(sorted(p.name for p in found.glob('last*.ckpt')))}: this "
            "run starts from step 0 and saves its own beside it (trainer.resume=last continues the newest instead)")
    if alias != "last" or cfg.trainer.elastic is True:  # elastic refuses any trainer.resume itself
        return
    if any(found.glob("last*.ckpt")):
        return
    if _hydra_made_the_run_dir(cfg):
        raise ConfigError("trainer.resume", "last", f"'last' is the last.ckpt of this run's output directory, and "
                          f"{found} holds none: Hydra gives every run a new directory (unless trainer.output_dir or "
                          "hydra.run.dir names one), so training would start from step 0", fix)
    say(f"trainer.resume=last: no last.ckpt in {found} yet, so training starts from step 0")


def _hydra_made_the_run_dir(cfg: DictConfig) -> bool:
    """Whether the output directory is Hydra's default one for this run (a new, timestamped one):
    no ``trainer.output_dir`` and no ``hydra.run.dir`` / ``hydra.sweep.dir`` on the command line."""
    from hydra.core.hydra_config import HydraConfig

    if cfg.trainer.output_dir or not HydraConfig.initialized():
        return False
    given = [str(o).split("=")[0].lstrip("+~") for o in HydraConfig.get().overrides.hydra]
    return not any(k in ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir") for k in given)


def for_another_cluster(e, plan_file: str | None, cluster: str):
    """``e`` (a plan file that does not fit the cluster), saying so when the plan records that it was
    made for another cluster (``meta.cluster``), with both fixes; else ``e`` itself."""
    import yaml

    from lightning_hexiscale.errors import PlanError

    try:
        made_for = (yaml.safe_load(Path(plan_file).read_text()) or {}).get("meta", {}).get("cluster") if plan_file else None
    except (OSError, ValueError, yaml.YAMLError, AttributeError):  # ValueError: not UTF-8 text
        made_for = None
    if not isinstance(made_for, str) or not made_for or made_for == cluster or e.key.startswith("plan.meta"):
        return e  # (an error in the meta's own record is about that record, not about another cluster)
    return PlanError(e.key, e.value, f"{e.rule}; the plan {plan_file} was made for cluster {made_for}",
                     f"run it on that cluster (cluster={made_for}), or leave plan= out to plan for cluster {cluster}")


def plan_file_to_write(given: str | None, plan, target: Path) -> bool:
    """Whether the run writes its ``plan.yaml`` (``target``). Not when ``plan=`` IS that file (a run re-run
    in its own directory, ``hydra.run.dir``) and holds this very plan: rewriting it dropped a hand-edited
    file's comments and layout. A ConfigError when it is that file and the plan differs from it (a
    ``train.*`` override or ``meta.cluster_file`` applied): the file the user wrote would be replaced."""
    import os

    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.planner import Plan

    if not given or not target.is_file() or not Path(given).is_file() or not os.path.samefile(given, target):
        return True
    if Plan.load(target) == plan:
        return False
    raise ConfigError("plan", str(given), "is the plan.yaml of this run's directory, which the run writes with the "
                      "plan it runs, and that plan differs from the file (train.* overrides, or meta.cluster_file, "
                      "applied): the file would be replaced",
                      "copy the plan out of the run directory (plan=my_plan.yaml), or run in another directory "
                      "(hydra.run.dir=DIR)")


def run(cfg: DictConfig, progress: JobWatch | None = None, app: AppName = HEXISCALE) -> int:
    """The job on one composed config: check, plan, print the plan and its estimate, train (or stop
    after planning with ``dry_run``). Returns 0; errors are raised (the app maps them to exit codes).
    ``progress`` (the job's :class:`~lightning_hexiscale.lightning.launch.job_watch.JobWatch`) records the
    phase and the output directory for the Ctrl-C message."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.config.recipe import CKPT_ALIASES, effective_precision
    from lightning_hexiscale.config.schema import resolve_hf_model
    from lightning_hexiscale.config.suggest import check_flag_overrides, check_interpolations
    from lightning_hexiscale.errors import ConfigError, PlanError
    from lightning_hexiscale.models.config import LlamaConfig

    quiet_logs()
    apply_file_overrides(cfg)
    check_interpolations(cfg)  # ${oc.env:UNSET} names its key before anything reads it (here or in a rank)
    check_flag_overrides(cfg, overrides_given())
    check_early(cfg)
    check_search_overrides(cfg, overrides_given())  # planner.* beside plan=FILE: before any discovery or launch
    check_logger(cfg)
    resolve_hf_model(cfg, overrides_given())  # model=hf:/dir: the shape from its config.json
    out = output_dir(cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        key = "trainer.output_dir" if cfg.trainer.output_dir else "hydra.run.dir"
        raise ConfigError(key, str(out), f"cannot create the run's directory ({e.strerror})",
                          f"give a writable directory: {key}=DIR") from None
    progress = progress if progress is not None else JobWatch(app.prog)
    progress.out = out
    model = LlamaConfig.from_config(cfg.model)
    if cfg.trainer.weights:  # every difference between the preset and config.json, before any process starts
        from lightning_hexiscale.data.weights import check_hf_config

        check_hf_config(cfg.trainer.weights, model)
    if cfg.trainer.resume and str(cfg.trainer.resume).split(":")[0] not in CKPT_ALIASES:
        # a checkpoint of another model: once, before planning and launching (the ranks found it
        # after their setup, and every process printed it)
        from lightning_hexiscale.runtime.checkpoint import check_model

        check_model(cfg.trainer.resume, model, key="trainer.resume")
    dataset = None if cfg.dry_run else load_dataset(cfg, model)
    if cfg.dry_run:  # the file may be on the training machines only: checked where it is here
        note = check_data(cfg, model)
        if note:
            say(note)
    if auto_cluster() and "LOCAL_RANK" not in os.environ:  # cluster=auto (the default): discover, then plan
        from lightning_hexiscale.cli.train_discover import discover_for_train
        from lightning_hexiscale.lightning.plan_resolution import load_plan_arg

        if cfg.plan:  # a plan file that is not there or not valid says so before discovery's minute
            load_plan_arg(cfg.plan, key="plan")
        discover_for_train(cfg, say, auto_cluster())
    cluster = Cluster.from_config(cfg.cluster)
    precision = effective_precision(cfg.trainer.precision, [d.gpu_type for d in cluster.devices])
    if cfg.trainer.elastic and not cfg.dry_run:
        return run_elastic(cfg, cluster, model, out, precision, dataset, progress, app)
    say(f"planning for {model.name} on cluster {cluster.name} ({cluster.num_devices} devices) ...")
    try:
        plan, est = make_plan(cfg, cluster, out)
    except PlanError as e:
        raise for_another_cluster(e, cfg.plan, cluster.name) from None
    files = cluster_file_given()  # the fix names the cluster as given: its file, else its preset
    if cfg.plan and is_rank_zero():  # rank 0 says it for the job (no rank else loads the plan's cluster again)
        note = made_for_another_cluster(plan.meta, cluster, "run", files[0].split("=", 1)[1] if files else None)
        if note:  # cluster= wins over the plan's meta, but not without a word
            warnings.warn(note, OtherClusterWarning)
    picture = None
    plan = with_cluster_file(plan, files)  # plan=plan.yaml finds the cluster file again
    rewrite = plan_file_to_write(cfg.plan, plan, out / "plan.yaml")
    if is_rank_zero():
        if rewrite:
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
    launch = launch_settings(cluster, plan, out / "plan.yaml", app)
    if is_multirun():
        # A previous job's port is in TIME_WAIT or still bound; let Lightning choose a free one.
        os.environ.pop("MASTER_PORT", None)
    progress.set_phase("starting")  # the Trainer, then the launcher starts the other ranks
    metrics = fit(cfg, cluster, model, plan, out, launch, precision, dataset, est)
    print_metrics(metrics, out)
    return 0


def print_metrics(metrics: dict | None, out: Path | None = None) -> None:
    """The training rank 0's final logged figures, one line (the other ranks have None), then where
    the run's checkpoint and logs are."""
    if metrics is None:
        return
    print("final metrics: " + ", ".join(f"{k}={float(v):.4f}" for k, v in sorted(metrics.items())), flush=True)
    if out is not None:
        # the newest: a run in a directory that held an earlier run's last.ckpt saved last-v1.ckpt beside it
        saved = sorted((out / "checkpoints").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
        last = saved[-1] if saved else out / "checkpoints" / "last.ckpt"
        logs = sorted((out / "logs").glob("version_*"), key=lambda p: p.stat().st_mtime)
        where = [f"checkpoint: {last} (resume with trainer.resume={last})" if last.exists() else "no checkpoint",
                 f"logs: {logs[-1] if logs else out / 'logs'}"]
        print("; ".join(where), flush=True)


def elastic_launch(cfg: DictConfig, app: AppName = HEXISCALE) -> dict:
    """trainer.elastic=true: the checks (torchrun's elastic agent, a shared output directory, no plan
    file) and Trainer(accelerator, devices, num_nodes) of this start."""
    import torch

    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.lightning.launch.elastic import MACHINE_ENV

    command = (f"{MACHINE_ENV}=<machine> torchrun --nnodes=1:<machines> --nproc-per-node=<GPUs> --rdzv-backend=c10d "
               f"--rdzv-endpoint=<host:port> --max-restarts=10 {app.torchrun} trainer.elastic=true "
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


def run_elastic(cfg: DictConfig, cluster, model, out: Path, precision: str, dataset, progress: JobWatch,
                app: AppName) -> int:
    """trainer.elastic=true: no plan here; the strategy plans for the machines present at every start."""
    from lightning_hexiscale.lightning.launch.elastic import ElasticSettings

    launch = elastic_launch(cfg, app)
    say(cluster.summary(), "\n")
    settings = ElasticSettings(out / "elastic", every_n_steps=int(cfg.trainer.checkpoint_every))
    progress.set_phase("starting")
    metrics = fit(cfg, cluster, model, None, out, launch, precision, dataset, elastic=settings)
    print_metrics(metrics)  # its checkpoints are under <out>/elastic (the strategy says where)
    return 0
