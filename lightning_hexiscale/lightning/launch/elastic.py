"""Elastic training under torchrun: the job re-plans for the machines present at every (re)start.

At every start of the workers, :class:`ElasticRun` gathers which machine of the cluster file each
node is (:data:`MACHINE_ENV` or ``ElasticSettings(machine=...)``), builds the cluster of the devices
present in global-rank order (device k = the device global rank k runs, so the plan needs no rank
permutation), lets the strategy plan for it, resumes from the newest complete checkpoint under
``checkpoint_dir`` and prints what changed against the previous start. While training it saves
``step-<N>`` every ``every_n_steps`` and on SIGTERM, then stops with :class:`ElasticStop` so that
torchrun restarts the workers. Why each node names its machine: under c10d the rendezvous assigns
node ranks, so a node's rank says nothing about which machine it is. The launch command, the steps
and what is printed: docs/guide/elastic.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, ElasticStop, InfeasiblePlan, shown  # noqa: F401 (ElasticStop: here too)
from lightning_hexiscale.planner.plan import Plan

MACHINE_ENV = "HEXISCALE_MACHINE"
"""Which machine of the cluster file this node is: its name or its index (0-based, ``repeat`` expanded)."""
RECORD = "elastic.json"
"""Written by global rank 0 into ``checkpoint_dir``: the machines, plan and estimate of this start,
and the last step reached (updated every step), read by the next start."""
PREFIX = "step-"
RESUME_MODES = ("auto", "must", "never")


@dataclass(frozen=True)
class ElasticSettings:
    """``HexiScaleStrategy(elastic=ElasticSettings(...))`` (or just the checkpoint directory).

    Args:
        checkpoint_dir: shared directory of the elastic checkpoints (``step-<N>``) and ``elastic.json``.
        every_n_steps: save every this many optimizer steps (0: only on SIGTERM).
        keep: newest ``step-<N>`` checkpoints kept.
        machine: this node's machine (name or index); None: ``$HEXISCALE_MACHINE``.
        resume: ``auto`` (the newest complete checkpoint if there is one, else from scratch), ``must``
            (a clear error when there is none), ``never``.
    """

    checkpoint_dir: str | Path
    every_n_steps: int = 0
    keep: int = 2
    machine: str | int | None = None
    resume: str = "auto"

    def __post_init__(self) -> None:
        key = "HexiScaleStrategy(elastic)"
        d = self.checkpoint_dir  # '' was the working directory without a word; 3 a TypeError at setup, in every rank
        given = isinstance(d, (str, os.PathLike)) and bool(str(d).strip())
        if not given or Path(d).is_file():
            raise ConfigError(f"{key}.checkpoint_dir", shown(d), "is a file; it must be a directory" if given else
                              "must be the path of a directory (shared by the nodes) for the elastic checkpoints",
                              "pass e.g. elastic='ckpt/elastic' or ElasticSettings(checkpoint_dir='ckpt/elastic')")
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) or self.every_n_steps < 0:
            raise ConfigError(f"{key}.every_n_steps", self.every_n_steps, "must be an integer >= 0",
                              "e.g. every_n_steps=50 (0: save only on SIGTERM)")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"{key}.keep", self.keep, "must be an integer >= 1", "e.g. keep=2")
        if self.resume not in RESUME_MODES:
            raise ConfigError(f"{key}.resume", self.resume, f"must be one of {RESUME_MODES}", "use auto")


def as_settings(value: ElasticSettings | str | Path | None) -> ElasticSettings | None:
    if value is None or isinstance(value, ElasticSettings):
        return value
    if isinstance(value, (str, Path)):
        return ElasticSettings(checkpoint_dir=value)
    raise ConfigError("HexiScaleStrategy(elastic)", shown(value), f"is of type {type(value).__name__}; it "
                      "must be None, a checkpoint directory or an ElasticSettings",
                      "pass elastic=ElasticSettings(checkpoint_dir='ckpt', every_n_steps=50)")


# ---- membership ------------------------------------------------------------------------------
def _machine_names(cluster: Cluster) -> str:
    return ", ".join(f"{m.name} ({i})" for i, m in enumerate(cluster.machines))


def resolve_machine(cluster: Cluster, value: str | int | None, key: str = MACHINE_ENV) -> int:
    """The index of the machine ``value`` names (its name, or its 0-based index), or ConfigError."""
    fix = (f"export {MACHINE_ENV}=<machine name or index> on each node before torchrun (cluster {cluster.name}: "
           f"{_machine_names(cluster)})")
    if value is None or str(value).strip() == "":
        raise ConfigError(key, None, "elastic training needs each node to say which machine of the cluster file "
                          "it is (under c10d the node rank is the rendezvous' choice, not the machine)", fix)
    text = str(value).strip()
    for i, m in enumerate(cluster.machines):
        if m.name == text:
            return i
    if text.isdigit() and int(text) < len(cluster.machines):
        return int(text)
    raise ConfigError(key, text, f"is not a machine of cluster {cluster.name}", fix)


def present_devices(cluster: Cluster, entries: list[dict[str, Any]]) -> list[int]:
    """Cluster device of every global rank, from each rank's ``{"machine", "local_rank", "host"}``
    (index = global rank). The same ConfigError on every rank for a bad entry."""
    devices: list[int] = []
    owner: dict[int, int] = {}
    for rank, e in enumerate(entries):
        m = resolve_machine(cluster, e["machine"], key=f"{MACHINE_ENV} (rank {rank}, host {e['host']})")
        machine = cluster.machines[m]
        local = int(e["local_rank"])
        if local >= len(machine.devices):
            raise ConfigError(f"{MACHINE_ENV} (rank {rank}, host {e['host']})", machine.name,
                              f"machine {machine.name} has {len(machine.devices)} device(s) in cluster {cluster.name}, "
                              f"but this node runs local rank {local}",
                              f"run --nproc-per-node={len(machine.devices)} or fewer on {machine.name}, or fix "
                              f"{MACHINE_ENV} on that node")
        dev = machine.devices[local]
        if dev in owner:
            raise ConfigError(f"{MACHINE_ENV} (rank {rank}, host {e['host']})", machine.name,
                              f"global ranks {owner[dev]} and {rank} both claim device {local} of machine "
                              f"{machine.name}: two nodes name the same machine",
                              f"give each node its own {MACHINE_ENV}")
        owner[dev] = rank
        devices.append(dev)
    return devices


def machines_of(cluster: Cluster, devices: list[int]) -> list[str]:
    """Names of the machines holding ``devices``, in the cluster file's order."""
    used = {cluster.devices[d].machine for d in devices}
    return [cluster.machines[i].name for i in sorted(used)]


def plan_summary(plan: Plan, cluster: Cluster) -> str:
    """One line: per pipeline its batch and stages (machine:local device[s], TP, layers), then the
    devices the plan leaves idle (their ranks leave at setup: lightning/idle_ranks.py)."""
    def where(d: int) -> str:
        dev = cluster.devices[d]
        m = cluster.machines[dev.machine]
        return f"{m.name}:{m.devices.index(d)}"

    pipes = []
    for p in plan.pipelines:
        stages = " | ".join(f"{'+'.join(where(d) for d in s.devices)} L{s.layers[0]}-{s.layers[1]}" for s in p.stages)
        pipes.append(f"b={p.batch_size}/mb={p.micro_batch_size} [{stages}]")
    idle = f"; idle: {', '.join(where(d) for d in plan.idle_devices)}" if plan.idle_devices else ""
    return f"{plan.num_pipelines} pipeline(s) {plan.dp_sharding} {plan.schedule}: " + "; ".join(pipes) + idle


# ---- checkpoints -----------------------------------------------------------------------------
def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(global_step, path) of every complete checkpoint directly under ``directory``, oldest first."""
    from lightning_hexiscale.runtime import CHECKPOINT_COMPLETE, read_checkpoint_meta

    found = []
    root = Path(directory)
    if not root.is_dir():
        return []
    for p in root.iterdir():
        if not p.is_dir() or not (p / CHECKPOINT_COMPLETE).is_file():
            continue
        try:
            meta = read_checkpoint_meta(p)
        except (ConfigError, OSError, RuntimeError, EOFError):
            continue  # a damaged or foreign directory is not a candidate
        found.append((int(meta.get("global_step", 0)), p.stat().st_mtime, p))
    return [(s, p) for s, _, p in sorted(found)]


def _checkpoint_name(choice: tuple[int, str] | None) -> str:
    return Path(choice[1]).name if choice is not None else "none"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_record(directory: str | Path) -> dict | None:
    p = Path(directory) / RECORD
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


# ---- the run ---------------------------------------------------------------------------------
class ElasticRun(Callback):
    """The strategy's elastic half (one per strategy); also the Lightning callback that saves."""

    def __init__(self, settings: ElasticSettings) -> None:
        super().__init__()
        self.settings = settings
        self.full_cluster: Cluster | None = None
        self.devices: list[int] = []
        """Cluster-file device of every global rank (index = rank), at this start."""
        self.report = ""
        self.resumed_from: tuple[int, str] | None = None
        self.chosen: tuple[int, str] | None = None
        """(step, path) of the checkpoint this rank chose before the call's processes started."""
        self._handed: str | None = None
        """The ``trainer.ckpt_path`` this run set for the current call (taken back at the next)."""
        self.sigterm = False
        self._step_before: int | None = None
        self._last_saved = -1
        self._record: dict = {}
        self._old_handler: Any = None

    @property
    def directory(self) -> Path:
        return Path(self.settings.checkpoint_dir)

    def machine(self) -> str | None:
        m = self.settings.machine
        return str(m) if m is not None else os.environ.get(MACHINE_ENV)

    def present_cluster(self, strategy, cluster: Cluster | None) -> Cluster:
        """Collective (the default group): the cluster of the devices present, device k = global rank k."""
        entry = {"machine": self.machine(), "local_rank": strategy.local_rank, "host": socket.gethostname()}
        entries: list[dict] = [None] * strategy.world_size  # type: ignore[list-item]
        if strategy.world_size > 1:
            dist.all_gather_object(entries, entry)
        else:
            entries = [entry]
        if cluster is None:  # checked after the gather, so every rank raises together
            raise ConfigError("HexiScaleStrategy(cluster)", None, "elastic training re-plans on the machines of a "
                              "cluster file and needs one", "pass cluster=<cluster YAML or preset>")
        self.full_cluster = cluster
        self.devices = present_devices(cluster, entries)
        sub = cluster.subset(self.devices)
        sub.name = f"{cluster.name}[{','.join(machines_of(cluster, self.devices))}]"
        return sub

    def infeasible(self, err: InfeasiblePlan) -> ConfigError:
        cluster = self.full_cluster
        present = machines_of(cluster, self.devices)
        missing = [m.name for m in cluster.machines if m.name not in present]
        return ConfigError("HexiScaleStrategy(elastic)", f"machines {', '.join(present)}",
                           f"no plan fits the devices present (missing: {', '.join(missing) or 'none'}): "
                           f"{str(err).split('. Fix:')[0]}",
                           "bring machines back (the next restart re-plans), or lower train.global_batch / use a "
                           "smaller model")

    # ---- before processes start: the checkpoint to resume -------------------------------------
    def before_call(self, trainer, fitting: bool, ckpt_path) -> None:
        """Before a Trainer call's processes start (every launching process; spawn/fork workers
        inherit it). For ``fit``: the newest complete checkpoint under ``checkpoint_dir``, handed to
        Lightning as ``trainer.ckpt_path`` so that Lightning restores it as it would
        ``fit(ckpt_path=...)``; a ``ckpt_path`` the call names itself wins, as it always did. Why
        here, not at setup: Lightning reads ``trainer.ckpt_path`` once, as the call begins.
        :meth:`start` checks that every rank chose alike. Any call first takes back the path handed
        to the previous one, so that no later call of this Trainer loads it again."""
        if self._handed is not None and trainer.ckpt_path == self._handed:
            trainer.ckpt_path = None
        self._handed = None
        if not fitting:
            return
        found = complete_checkpoints(self.directory) if self.settings.resume != "never" else []
        self.chosen = (found[-1][0], str(found[-1][1])) if found else None
        if self.chosen is not None and ckpt_path is None:
            trainer.ckpt_path = self._handed = self.chosen[1]

    # ---- after the strategy's setup: resume and report ----------------------------------------
    def start(self, strategy, trainer, workload) -> None:
        """Collective. Check that every rank chose rank 0's checkpoint (:meth:`before_call`),
        print and record what changed, and join the Trainer's callbacks. ``workload``: the one the
        plan was searched for (the estimate printed is the planner's)."""
        from lightning_hexiscale.planner.cost.estimate import estimate

        cluster, plan = strategy.cluster, strategy.plan
        est = estimate(plan, cluster, workload)
        choice = strategy.broadcast(self.chosen, 0)
        if choice != self.chosen:
            raise ConfigError("HexiScaleStrategy(elastic).checkpoint_dir", str(self.directory),
                              f"rank {strategy.global_rank} found {_checkpoint_name(self.chosen)} as the newest "
                              f"complete checkpoint, rank 0 {_checkpoint_name(choice)}: every rank must see the "
                              "same checkpoints", "put checkpoint_dir on a filesystem that every node shares")
        if choice is None and self.settings.resume == "must":
            partial = sorted(p.name for p in self.directory.glob("*.tmp-*")) if self.directory.is_dir() else []
            raise ConfigError("HexiScaleStrategy(elastic).resume", "must",
                              f"no complete checkpoint under {self.directory}" +
                              (f" (only partial ones: {', '.join(partial)})" if partial else ""),
                              "point checkpoint_dir at the run's checkpoints, or use resume='auto' to start "
                              "from scratch")
        self.resumed_from = choice
        if choice is not None:
            self._last_saved = choice[0]
        names = machines_of(self.full_cluster, self.devices)
        now = {"machines": names, "devices": len(self.devices), "plan": plan_summary(plan, cluster),
               "tokens_per_s": est.tokens_per_s, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
               "resumed_step": choice[0] if choice else 0, "step": choice[0] if choice else 0,
               "start_time": time.time(), "step_time": None}
        if strategy.global_rank == 0:
            self.report = describe_change(read_record(self.directory), now, choice)
            print(self.report, flush=True)
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_json(self.directory / RECORD, now)
        self._record = now
        if self not in trainer.callbacks:
            trainer.callbacks.append(self)

    # ---- Lightning hooks -------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning's own handler (whose notifier broadcasts from inside the handler, which can
        # pair with another rank's pipeline collective): ours only sets a flag, agreed at step ends.
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        step = trainer.global_step
        if strategy.global_rank == 0 and step != self._record.get("step"):
            self._record.update(step=step, step_time=time.time())
            _write_json(self.directory / RECORD, self._record)
        if step == self._step_before:
            # inside a gradient-accumulation window: a checkpoint here would hold the loader past
            # batches whose gradients it lacks (the resumed step would miss them). Stop and save at
            # the window's end; every rank is at the same batch, so every rank skips alike.
            return
        stop = strategy.reduce_boolean_decision(self.sigterm, all=False) if strategy.world_size > 1 else self.sigterm
        every = self.settings.every_n_steps
        if (stop or (every and step % every == 0)) and step != self._last_saved and step > 0:
            self.save(trainer, step)
        if stop:
            why = (f"SIGTERM (torchrun's agent stops its workers: a machine joins or leaves): checkpoint of step {step} "
                   f"saved under {self.directory}; the workers stop and torchrun restarts them on the machines present")
            if strategy.global_rank == 0:
                print(f"hexiscale elastic: {why}", flush=True)
            raise ElasticStop(why)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handler()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._old_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def save(self, trainer, step: int) -> None:
        """Collective: ``step-<N>`` under the directory, then the older ones beyond ``keep`` removed."""
        trainer.save_checkpoint(str(self.directory / f"{PREFIX}{step:08d}"))
        self._last_saved = step
        mine = sorted(p for p in self.directory.glob(f"{PREFIX}*") if p.is_dir() and ".tmp-" not in p.name
                      and p.name[len(PREFIX):].isdigit())
        for old in mine[:-self.settings.keep]:
            trainer.strategy.remove_checkpoint(old)


def describe_change(before: dict | None, now: dict, choice: tuple[int, str] | None) -> str:
    """What the report prints at a start: machines left/joined, plans, estimates, steps redone."""
    lines = [f"hexiscale elastic: workers started on {now['devices']} device(s) of machine(s) "
             f"{', '.join(now['machines'])} (torchrun restart count {now['restart']})"]
    if before is not None:
        left = [m for m in before["machines"] if m not in now["machines"]]
        joined = [m for m in now["machines"] if m not in before["machines"]]
        lines.append(f"  machines left: {', '.join(left) or 'none'}; joined: {', '.join(joined) or 'none'}")
        lines.append(f"  old plan: {before['plan']}")
        ratio = now["tokens_per_s"] / before["tokens_per_s"] if before.get("tokens_per_s") else float("nan")
        lines.append(f"  new plan: {now['plan']}")
        lines.append(f"  estimated throughput: {before['tokens_per_s']:,.0f} -> {now['tokens_per_s']:,.0f} tokens/s "
                     f"({ratio:.0%} kept)")
    else:
        lines.append(f"  plan: {now['plan']}")
        lines.append(f"  estimated throughput: {now['tokens_per_s']:,.0f} tokens/s")
    if choice is not None:
        reached = int(before.get("step", choice[0])) if before else choice[0]
        lines.append(f"  resuming from {choice[1]} (step {choice[0]}); the previous workers reached step {reached}: "
                     f"{max(0, reached - choice[0])} step(s) redone")
    elif before is not None:
        lines.append(f"  no complete checkpoint: starting from step 0 ({int(before.get('step', 0))} step(s) redone)")
    now["redone"] = max(0, int(before.get("step", 0)) - (choice[0] if choice else 0)) if before else 0
    return "\n".join(lines)
