"""``hexiscale train``, the training: the data, the logger, and Lightning's Trainer with the hexiscale
strategy on the plan (or elastic, planning at every start).

Everything here runs on every rank: the popen launcher re-runs the command, so each rank builds the
same data loaders (same seed, same shuffle) and the strategy gives each its part of the batch.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.cli.train_job import is_multirun
from lightning_hexiscale.cli.train_plan import effective_config, explicit_train_settings


def load_dataset(cfg: DictConfig, model):
    """The token dataset of ``data.*``, built before planning so that a missing or malformed file is
    reported at once (not after the search and the launch)."""
    from lightning_hexiscale.data import make_dataset

    d = cfg.data
    return make_dataset(d.kind, model.seq_len, path=d.path, num_samples=int(d.num_samples), seed=int(d.seed),
                        vocab_size=model.vocab_size, dtype=d.get("dtype"))


def check_data(cfg: DictConfig, model) -> str | None:
    """What ``dry_run=true`` checks of ``data.*``: the settings
    (:func:`~lightning_hexiscale.data.datasets.check_data_settings`), then, where ``data.path`` is on
    this machine, the file itself as training reads it (a folder, a file too short for one sample, a
    token file of the wrong size). A dry run plans anywhere, also where the file is not: then the
    returned note says that the file was not checked (a dry run said "planned only" and the launch
    then failed on the file)."""
    from lightning_hexiscale.config.file_errors import expand_user
    from lightning_hexiscale.data.datasets import check_data_settings

    d = cfg.data
    check_data_settings(d.kind, d.path, model.vocab_size, d.get("dtype"))
    if d.kind == "generated":
        return None
    if expand_user(str(d.path)).exists():
        load_dataset(cfg, model)
        return None
    return (f"data.path {d.path} is not on this machine: its settings are checked, not the file (the training "
            "machines must hold it)")


def make_data(cfg: DictConfig, model, global_batch: int, dataset=None, pipeline_batches=None):
    """(train, validation) DataLoaders of whole global batches: the last ``data.val_samples``
    sequences (at most a tenth) validate, the rest train, shuffled by the seed Lightning set.
    ``pipeline_batches`` (the plan's): a last validation batch too small to give every pipeline a
    sample, which the strategy would leave out, is dropped by the loader itself (the same samples
    validate; the recipe's own split is no cause for a warning); fewer held-out sequences than
    pipelines validate nothing (they train, and the run says so)."""
    from torch.utils.data import DataLoader, Subset

    from lightning_hexiscale.cli.train_job import say
    from lightning_hexiscale.data.samplers import short_last_batch

    ds = dataset if dataset is not None else load_dataset(cfg, model)
    d = cfg.data
    n_val = min(int(d.val_samples), len(ds) // 10)
    pipes = len(pipeline_batches or [])
    if 0 < n_val < pipes:
        # One batch of n_val < P samples cannot give every pipeline one: the strategy would leave it
        # out, and validation would run on nothing after a warning about a batch size the recipe sets.
        say(f"data.val_samples={int(d.val_samples)}: {n_val} held-out sequence{'' if n_val == 1 else 's'} cannot "
            f"give each of the plan's {pipes} pipelines one, so nothing validates (they train); hold out at least "
            f"{pipes} (data.val_samples, and a corpus of at least {10 * pipes} sequences)")
        n_val = 0
    elif n_val < int(d.val_samples):  # said, not silent: the metric covers fewer sequences than asked for
        say(f"data.val_samples={int(d.val_samples)}: {n_val} sequence{'' if n_val == 1 else 's'} validate, a tenth "
            f"of the {len(ds)}-sequence corpus at most (the rest train); use more data for more")
    n_train = len(ds) - n_val
    if n_train < global_batch:
        from lightning_hexiscale.errors import ConfigError

        held = f" less the {n_val} held out to validate" if n_val else ""
        more = (f"data.num_samples={global_batch + n_val}" if d.kind == "generated"
                else f"a longer data.path file (or a shorter model.seq_len than {model.seq_len})")
        fewer = " or data.val_samples=0" if n_val and len(ds) >= global_batch else ""
        raise ConfigError("data", f"{len(ds)} sequences", f"{n_train} train ({len(ds)}{held}), fewer than one "
                          f"global batch ({global_batch})", f"use more data ({more}){fewer}, or a smaller "
                          "train.global_batch")
    train = DataLoader(Subset(ds, range(n_train)), batch_size=global_batch, shuffle=True, drop_last=True)
    drop = bool(pipeline_batches and n_val > global_batch
                and short_last_batch(n_val, global_batch, list(pipeline_batches)))
    val = (DataLoader(Subset(ds, range(n_train, len(ds))), batch_size=global_batch, drop_last=drop)
           if n_val >= 1 else None)
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
                          f"pip install {packages[0]} (the extra 'lightning-hexiscale[{kind}]'), or trainer.logger=csv")


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


def fit(cfg: DictConfig, cluster, model, plan, out: Path, launch: dict, precision: str, dataset=None,
          est=None, elastic=None) -> dict:
    """Lightning's Trainer with the hexiscale strategy on ``plan``; with ``elastic`` (an
    ElasticSettings), no plan: the strategy plans for the machines present at every (re)start."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hexiscale.config.fast_path import FastPath
    from lightning_hexiscale.lightning.example import LlamaLitModule, LogHyperparams, LossPrinter, StepProgressBar
    from lightning_hexiscale.lightning.launch.interrupt import GracefulInterrupt
    from lightning_hexiscale.lightning.launch.quiet_worker import QuietWorker
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    t = cfg.trainer
    pl.seed_everything(int(t.seed), verbose=False)
    gb = plan.global_batch if plan is not None else int(cfg.train.global_batch)
    train_dl, val_dl = make_data(cfg, model, gb, dataset,
                                 pipeline_batches=[p.batch_size for p in plan.pipelines] if plan is not None else None)
    module = LlamaLitModule(model, lr=float(t.lr), weight_decay=float(t.weight_decay), warmup_steps=int(t.warmup_steps),
                            init_seed=int(t.seed), eps=float(t.adam_eps))
    if t.weights:
        from lightning_hexiscale.cli.train_job import is_rank_zero
        from lightning_hexiscale.data.weights import UnusedWeightsWarning, attach_weights

        with warnings.catch_warnings():
            if not is_rank_zero():  # a popen child reads the same files: rank 0 says it for the job
                warnings.simplefilter("ignore", UnusedWeightsWarning)
            attach_weights(module, t.weights)
    # Multirun: fresh spawned workers per job, so no process or process group outlives its job.
    launcher = "spawn" if is_multirun() else str(t.launcher)
    planning = {}
    if elastic is not None:  # the strategy plans at every start, with the planner.* and train.* settings
        planning = explicit_train_settings(cfg)
        planning.update(global_batch=gb, planner_iterations=int(cfg.planner.iterations), elastic=elastic,
                        use_all_devices=bool(cfg.planner.get("use_all_devices", False)))
    with warnings.catch_warnings():  # the run said it already, once, before the plan's table (train_run)
        warnings.filterwarnings("ignore", message=r"HexiScaleStrategy\(plan, cluster\): the plan was made for cluster")
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
    if not t.val_every or val_dl is None:  # validation is off on purpose: Lightning's notice says nothing new
        warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`")
    if t.resume:  # the recipe keeps no top-k checkpoints: what ModelCheckpoint says it will not reload is nothing
        warnings.filterwarnings("ignore", message="The dirpath has changed from")
    bar = bool(t.progress_bar) if t.progress_bar is not None else progress_bar_by_default()
    trainer = pl.Trainer(
        strategy=strategy, **launch, precision=precision, max_steps=int(t.max_steps),
        accumulate_grad_batches=int(t.accumulate_grad_batches), gradient_clip_val=t.gradient_clip_val,
        val_check_interval=int(t.val_every) if t.val_every and val_dl is not None else None,
        check_val_every_n_epoch=None if t.val_every else 1, limit_val_batches=int(t.limit_val_batches) if t.val_every else 0,
        num_sanity_val_steps=0, log_every_n_steps=int(t.log_every), default_root_dir=str(out),
        logger=logger, callbacks=[ckpt, LossPrinter(), interrupt, *hparams, *([QuietWorker()] if launcher == "spawn" else [])]
        + ([StepProgressBar()] if bar else []),
        enable_progress_bar=bar, enable_model_summary=False)
    trainer.fit(module, train_dl, val_dl if t.val_every else None, ckpt_path=t.resume)
    # the training rank 0's figures (None on the other ranks, and on ranks of idle devices)
    return dict(trainer.callback_metrics) if trainer.is_global_zero else None


def progress_bar_by_default() -> bool:
    """``trainer.progress_bar=null``: a bar when stdout is a terminal; none into a file or a pipe."""
    import sys

    from lightning_hexiscale.progress import is_terminal

    return is_terminal(sys.stdout)


def quiet_logs() -> None:
    """Hydra also routes Lightning's INFO lines through the root logger: print them once."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric"):
        lg = logging.getLogger(name)
        lg.propagate = False
        # Lightning adds a stderr handler of its own when it is imported before Hydra configures the
        # root logger (the Ctrl-C recorder imports it first): the recipe prints its own summary instead
        lg.handlers.clear()
