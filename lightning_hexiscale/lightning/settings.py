"""``StrategySettings``: every ``HexiScaleStrategy`` keyword argument, checked once, as a frozen value.

The strategy's constructor keeps its keyword arguments (``HexiScaleStrategy(cluster=..., plan=...)``
is how Lightning users write it) and builds one :class:`StrategySettings` from them; every check of
an argument lives here, in ``__post_init__``, and raises :class:`~lightning_hexiscale.errors.ConfigError`
naming ``HexiScaleStrategy(<argument>)``, the value, the rule and the fix. Why here and not at
``setup``: an error after the launch is raised by every rank; one from the constructor is raised
once, in the caller's process, from the line that made it (files are read here for the same reason).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.errors import ConfigError, shown
from lightning_hexiscale.lightning.fast_path import strategy_fast_path
from lightning_hexiscale.lightning.plan_check import DEFAULT_WARMUP, plan_check_setting
from lightning_hexiscale.lightning.plan_resolution import AUTO, load_cluster_arg, load_plan_arg
from lightning_hexiscale.planner import DP_SHARDINGS, SCHEDULES, Plan
from lightning_hexiscale.planner.plan import (check_global_batch_bound, check_meta_record, cluster_source,
                                              OtherClusterWarning, made_for_another_cluster)
from lightning_hexiscale.planner.search.settings import MAX_ITERATIONS
from lightning_hexiscale.runtime import NONFINITE_POLICIES

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
PLAN_OVERRIDE_KEYS = ("micro_batch_size", "schedule", "recompute", "dp_sharding")
"""The settings that override the plan's values (or bind the search): :attr:`StrategySettings.overrides`."""


MAX_THREADS = 4096
"""Most CPU threads per rank (``num_threads``): more than any machine's cores."""
MAX_GRACE_S = 86_400
"""Longest ``watchdog_grace_s``: a day."""


def _key(name: str) -> str:
    return f"HexiScaleStrategy({name})"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _global_seed() -> int:
    """``PL_GLOBAL_SEED`` (what Lightning's ``seed_everything`` exported), 0 when unset; a ConfigError
    naming the variable when it is not a non-negative integer (it was int()'s ValueError traceback)."""
    text = os.environ.get("PL_GLOBAL_SEED", "").strip()
    if not text:
        return 0
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise ConfigError("PL_GLOBAL_SEED", text, "must be a non-negative integer (HexiScaleStrategy(seed=None) "
                          "takes the plan search's seed from it)", "unset it, or pass seed=0")
    return seed


def _divisors(n: int) -> str:
    """The first few divisors of n and n itself, for a fix: "1, 2, 4, 8"."""
    small = [d for d in range(1, min(n, 64) + 1) if n % d == 0][:5]
    return ", ".join(map(str, small + ([n] if n not in small else [])))


def check_process_group_backend(backend: Any) -> None:
    """``process_group_backend`` (passed on to DDPStrategy as it is): None, a backend torch.distributed
    knows (``torch.distributed.Backend.backend_list``: gloo, nccl, mpi, ucc, ... and any registered with
    ``Backend.register_backend`` before the strategy is built) or ``"cpu:gloo,cuda:nccl"`` pairs of
    such backends. torch takes any other name with a warning and fails in every rank's
    ``init_process_group``, after the launch."""
    if backend is None:
        return
    from torch.distributed import Backend  # torch is imported by the strategy anyway

    known = [b for b in Backend.backend_list if b != Backend.UNDEFINED]
    rule = (f"must be None, one of {', '.join(known)} (torch.distributed's backends) or device:backend pairs "
            "such as 'cpu:gloo,cuda:nccl'")
    fix = "pass process_group_backend=None (gloo on CPU, nccl on CUDA) or e.g. 'gloo'"
    if not isinstance(backend, str):
        raise ConfigError(_key("process_group_backend"), backend, rule, fix)
    pairs = [p.split(":") for p in backend.lower().split(",")] if ":" in backend else [["", backend.lower()]]
    devices = [p[0] for p in pairs]
    if any(len(p) != 2 or p[1] not in Backend.backend_list for p in pairs) or len(set(devices)) != len(devices):
        raise ConfigError(_key("process_group_backend"), backend, rule, fix)


def check_ddp_plugins(accelerator: Any, parallel_devices: Any, cluster_environment: Any, checkpoint_io: Any,
                      precision_plugin: Any) -> None:
    """DDPStrategy's other arguments, passed on as they are: Lightning's own objects (or None). A name
    in their place was taken without a word and failed later: cluster_environment='slurm' as an
    AttributeError ('str' object has no attribute 'set_global_rank') when the Trainer was built,
    parallel_devices=3 as a TypeError there, checkpoint_io='x' / precision_plugin='bf16' only when
    used, in every rank."""
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.plugins.precision import Precision
    from torch import device

    from lightning_hexiscale.errors import check_argument_types

    devices_ok = parallel_devices is None or (isinstance(parallel_devices, (list, tuple)) and len(parallel_devices) > 0
                                              and all(isinstance(d, device) for d in parallel_devices))
    if not devices_ok:
        raise ConfigError(_key("parallel_devices"), shown(parallel_devices), "must be None or a list of torch.device",
                          "leave it out (the Trainer's devices=... set it), or pass e.g. [torch.device('cpu')] * 4")
    check_argument_types("HexiScaleStrategy", (
        ("accelerator", accelerator, (Accelerator, type(None)), "leave it out and pass accelerator= to the Trainer "
         "(Trainer(accelerator='cpu', strategy=HexiScaleStrategy(...)))"),
        ("cluster_environment", cluster_environment, (ClusterEnvironment, type(None)), "leave it out (Lightning "
         "detects torchrun and SLURM), or pass an instance, e.g. SLURMEnvironment()"),
        ("checkpoint_io", checkpoint_io, (CheckpointIO, type(None)), "leave it out (the strategy's checkpoints are "
         "its own), or pass a CheckpointIO instance"),
        ("precision_plugin", precision_plugin, (Precision, type(None)), "leave it out and pass precision= to the "
         "Trainer (Trainer(precision='bf16-mixed'))")))


@dataclass(frozen=True)
class StrategySettings:
    """The strategy's settings. Built from the constructor's arguments; some fields are normalised
    when built (said under each): ``plan`` and ``cluster`` are read from their files, ``timeout`` is a
    ``timedelta``, ``seed`` an int, ``plan_check`` an int or None, ``fast_path`` a FastPath (with
    ``compile`` folded in), ``elastic`` an ElasticSettings or None."""

    cluster: str | Path | Mapping | Cluster | None = AUTO
    """``"auto"`` (default): with no ``plan``, the job's ranks discover their cluster at ``setup`` (all
    ranks together: devices, hosts, the model's layer times, links per machine pair; cached by a
    hardware + model fingerprint under ``$HEXISCALE_CACHE_DIR``, see ``hexiscale discover``) and the
    search plans on it. A preset name (``conf/cluster/NAME.yaml``), a cluster YAML path (from
    ``hexiscale discover`` / ``profile``), a mapping of a cluster file's keys (a dict, or a Hydra
    app's ``cfg.cluster``) or a :class:`Cluster`: that cluster. ``None``: a nominal
    description of the local devices, nothing measured (``num_nodes x devices`` of the local GPU
    type, or CPU devices). Built: a Cluster, ``"auto"`` or None; with a ``plan``, ``"auto"`` becomes
    the plan's ``meta.cluster`` (read) or None."""
    plan: str | Path | Mapping | Plan | None = None
    """A plan file, a mapping of a plan file's keys, a :class:`Plan`, or None to plan with the planner's
    search on the cluster for ``global_batch``. Built: a Plan (checked against the cluster's devices)
    or None."""
    global_batch: int | None = None
    """Sequences per optimizer step, summed over pipelines (= the DataLoader's ``batch_size``).
    None: the plan's, or the training DataLoader's batch size."""
    micro_batch_size: int | None = None
    """Overrides the plan's micro-batch (it must divide every pipeline's batch), or binds the search."""
    schedule: str | None = None
    """Overrides the plan's pipeline schedule (one of :data:`SCHEDULES`), or binds the search."""
    recompute: bool | str | None = None
    """Overrides the plan's activation recomputation (True, False; None or ``"auto"``: the plan's)."""
    dp_sharding: str | None = None
    """``ddp`` (every pipeline holds its full copy of the state), ``zero2`` (gradients and optimizer
    states sharded over the pipelines) or ``zero3`` (parameters too); None: the plan's, or the
    search's choice (:mod:`lightning_hexiscale.lightning.step_adapter`)."""
    seed: int | None = None
    """Seed of the planner's search when planning here. Built: None becomes ``$PL_GLOBAL_SEED`` (or 0),
    read when the settings are built. The data order is the DataLoader's own, as on one device;
    weights are initialised from the module's ``init_seed`` attribute (default 0)."""
    planner_iterations: int = 20
    """Search iterations when planning here (>= 1)."""
    use_all_devices: bool = False
    """When planning here, give every device work (``planner.use_all_devices``); by default the plan
    may leave devices idle where it is faster without them."""
    plan_check: int | bool | None = DEFAULT_WARMUP
    """After this many warm-up optimizer steps (default 5) the run times a few steps and rank 0 prints
    the estimated vs measured step time and the stage furthest from its price, warns when the step is
    more than 25 % off, and writes ``plan_check.json`` to the log directory
    (:mod:`lightning_hexiscale.lightning.plan_check`). True: 5; None or False: no check. Built: int or None."""
    start_method: StartMethod = "popen"
    """Launcher: ``popen`` (default; re-runs the script, works under Hydra), ``spawn``, ``fork``,
    ``forkserver``. Under torchrun or SLURM the cluster environment launches instead."""
    num_threads: int | Literal["auto"] = "auto"
    """Intra-op threads per process on CPU; ``"auto"`` = cores // local processes."""
    check_devices: bool = True
    """Refuse to run a plan made for GPU types on CPU (or vice versa)."""
    nonfinite: Literal["skip", "stop"] = "stop"
    """When the loss or a gradient is not finite on any rank (checked every optimizer step, all ranks
    agree): ``"stop"`` raises :class:`NonFiniteError` naming the step and the ranks; ``"skip"`` drops
    the update (the step still counts: data and LR schedule move on, as with a loss scaler's skipped
    step) and records it in the strategy's ``nonfinite_events``."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: a save copies this rank's pieces to CPU memory and returns;
    DCP's save and the rename into place run in one writer thread per rank, over a gloo group of their
    own (at most 2 saves in flight). A load, the end of the run, or a third save waits for them; a
    crash meanwhile leaves the previous checkpoint."""
    elastic: Any = None
    """Elastic training under torchrun (``--nnodes=MIN:MAX``, c10d): a checkpoint directory or an
    :class:`~lightning_hexiscale.lightning.launch.elastic.ElasticSettings`. At every (re)start the strategy
    learns which machines of the cluster file are present (``$HEXISCALE_MACHINE`` on each node),
    plans for them, resumes from the newest complete checkpoint and prints what changed. Needs a
    ``cluster``, no ``plan``. Built: an ElasticSettings or None."""
    watchdog: bool = True
    """Run :class:`~lightning_hexiscale.runtime.FailureWatch` (heartbeats over the rendezvous store):
    when a rank fails, every rank stops within ``watchdog_grace_s`` more (exit status 4) and says
    which rank failed."""
    watchdog_grace_s: float = 5.0
    """Seconds (> 0; times the load average per core on a loaded host) the watch waits before the
    other ranks stop. Built: a float."""
    compile: bool | None = None
    """``torch.compile`` of the stage; None: on for CUDA, off on CPU. Shortcut for
    ``fast_path={"compile": ...}``."""
    fast_path: Any = None
    """The stage's speed switches (:class:`~lightning_hexiscale.config.fast_path.FastPath` or a dict of
    its fields); None: all auto (a GPU run takes the whole fast path); False: all off. Built: a
    FastPath with ``compile`` applied."""
    timeout: timedelta | float | None = default_pg_timeout
    """Process-group timeout of every collective and p2p wait (a ``timedelta`` or seconds > 0): a rank
    waiting on a dead or hung peer raises after this long. Built: a timedelta (or None)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalising a frozen dataclass's fields, once, here
        t = self.timeout
        if t is not None:
            secs = t.total_seconds() if isinstance(t, timedelta) else float(t) if _is_int(t) or isinstance(t, float) else None
            try:  # '600', inf, nan and timedelta(-1) reached torch.distributed (or a traceback) before
                if secs is None or not 0 < secs < math.inf:
                    raise ValueError
                set_(self, "timeout", timedelta(seconds=secs))
            except (ValueError, OverflowError):
                raise ConfigError(_key("timeout"), t, "must be a positive number of seconds (or a positive timedelta)",
                                  "use e.g. timeout=600") from None
        for name, fix in (("async_checkpoint", "pass async_checkpoint=True to write checkpoints in the background"),
                          ("use_all_devices", "pass use_all_devices=True to give every device work"),
                          ("check_devices", "pass check_devices=False to run a plan on other device types"),
                          ("watchdog", "pass watchdog=False to run without the failure watch")):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(_key(name), getattr(self, name), "must be True or False", fix)
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(_key("nonfinite"), self.nonfinite, f"must be one of {NONFINITE_POLICIES}",
                              "use 'stop' (raise) or 'skip' (drop the update)")
        if self.start_method not in START_METHODS:
            raise ConfigError(_key("start_method"), self.start_method, f"must be one of {START_METHODS}",
                              "use 'popen' (the default)")
        self._check_plan_overrides()
        # upper bounds: 2**70 threads was torch's ValueError in every rank (set_num_threads takes a C
        # int), 2**70 search iterations never ended, a grace of 1e308 s overflowed the watchdog's timedelta
        if not (self.num_threads == "auto" or (_is_int(self.num_threads) and 1 <= self.num_threads <= MAX_THREADS)):
            raise ConfigError(_key("num_threads"), self.num_threads, f"must be 'auto' or an integer from 1 to {MAX_THREADS:,}",
                              "use 'auto'")
        if not _is_int(self.planner_iterations) or not 1 <= self.planner_iterations <= MAX_ITERATIONS:
            raise ConfigError(_key("planner_iterations"), self.planner_iterations,
                              f"must be an integer from 1 to {MAX_ITERATIONS:,}",
                              "use e.g. planner_iterations=20 (the default)")
        # The plan search's seed (numpy's and random's generators take no negative one: it was the
        # search's 'planner.seed' error at setup, after the ranks had started, naming a key not passed)
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise ConfigError(_key("seed"), shown(self.seed), "must be a non-negative integer or None",
                              "use e.g. seed=0, or None for Lightning's seed_everything seed (PL_GLOBAL_SEED)")
        set_(self, "seed", _global_seed() if self.seed is None else self.seed)
        g = self.watchdog_grace_s
        if not (_is_int(g) or isinstance(g, float)) or not 0 < g <= MAX_GRACE_S:
            raise ConfigError(_key("watchdog_grace_s"), g, f"must be a positive number of seconds, at most {MAX_GRACE_S:,}"
                              " (a day)", "use e.g. watchdog_grace_s=5")
        set_(self, "watchdog_grace_s", float(g))
        set_(self, "plan_check", plan_check_setting(self.plan_check))
        set_(self, "fast_path", strategy_fast_path(self.compile, self.fast_path))
        self._read_cluster_and_plan()
        self._check_search_settings()
        set_(self, "elastic", self._elastic_settings())

    def _check_plan_overrides(self) -> None:
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError(_key("schedule"), self.schedule, f"must be one of {SCHEDULES}", "use 1f1b")
        if self.dp_sharding is not None and self.dp_sharding not in DP_SHARDINGS:
            raise ConfigError(_key("dp_sharding"), self.dp_sharding, f"must be one of {DP_SHARDINGS}", "use ddp")
        if not (self.recompute is None or isinstance(self.recompute, bool) or self.recompute == "auto"):  # 0 == False
            raise ConfigError(_key("recompute"), self.recompute, "must be True, False, 'auto' or None",
                              "leave it to the plan (None)")
        for name, fix in (("global_batch", "pass e.g. global_batch=32 (sequences per optimizer step), or None to take "
                                           "the plan's or the training DataLoader's batch size"),
                          ("micro_batch_size", "pass e.g. micro_batch_size=1, or None to leave it to the plan or the search")):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ConfigError(_key(name), v, "must be a positive integer (or None)", fix)
            check_global_batch_bound(v, _key(name))  # a micro-batch is part of one: the same bound
        gb, mb = self.global_batch, self.micro_batch_size
        if gb is not None and mb is not None and gb % mb:  # the search refuses it too, but after the launch
            raise ConfigError(_key("micro_batch_size"), mb, f"must divide global_batch={gb}",
                              f"choose a divisor of the global batch (e.g. {_divisors(gb)}) "
                              "or None to let the planner choose")

    def _check_search_settings(self) -> None:
        """``planner_iterations`` / ``use_all_devices`` changed from their defaults beside a ``plan``: they
        set the search, which a given plan skips, so they were dropped without a word. A UserWarning
        naming the setting, not an error: the run does what the plan says either way, and a script
        that passes one strategy's arguments for both cases (plan or none) keeps working. (The value
        equal to the default cannot be told from no value and says nothing.)"""
        if self.plan is None:
            return
        for name in ("planner_iterations", "use_all_devices"):
            value = getattr(self, name)
            if value != type(self).__dataclass_fields__[name].default:
                warnings.warn(f"{_key(name)} = {value!r} is ignored: it sets the planner's search, which a given "
                              f"plan skips (the plan runs as it is); drop {name}=..., or pass plan=None to plan "
                              "here with it", UserWarning, stacklevel=4)

    def _read_cluster_and_plan(self) -> None:
        """Files are read now, in the caller's process, so that a wrong name or path is a ConfigError
        from the constructor's line rather than from every rank after the launch."""
        cluster, plan = self.cluster, self.plan
        # a mapping is what a cluster or plan file holds, e.g. a Hydra app's composed cfg.cluster
        # (a DictConfig): read as the file would be, its errors keyed cluster.<key> / plan.<key>
        if isinstance(cluster, Mapping):
            cluster = Cluster.from_config(cluster)
        if isinstance(plan, Mapping):
            plan = Plan.from_dict(OmegaConf.to_container(plan, resolve=True) if isinstance(plan, DictConfig)
                                  else dict(plan))
        if not isinstance(cluster, (str, Path, Cluster, type(None))):
            raise ConfigError(_key("cluster"), shown(cluster), f"is of type {type(cluster).__name__}; it must be a "
                              "preset name, a cluster YAML path, a mapping of a cluster file's keys, a Cluster or None",
                              "pass cluster='cpu_hetero4'")
        if not isinstance(plan, (str, Path, Plan, type(None))):
            raise ConfigError(_key("plan"), shown(plan), f"is of type {type(plan).__name__}; it must be a plan file "
                              "path, a mapping of a plan file's keys, a Plan or None", "pass plan='conf/plans/....yaml'")
        plan = load_plan_arg(plan)
        if cluster == AUTO and plan is not None:  # nothing to plan: the plan's own cluster, or the local devices
            cluster = None
        if cluster is None and plan is not None:  # its cluster file (which must be there), else a preset
            check_meta_record(plan.meta, ("cluster",))  # [a, b] was 'no such preset or file' for its str()
            meta_key, made_for = cluster_source(plan.meta)
            cluster = load_cluster_arg(made_for, key=f"plan.meta.{meta_key}") if made_for else None
        else:
            given = cluster
            cluster = load_cluster_arg(cluster)
            note = (made_for_another_cluster(plan.meta, cluster, "run", given if isinstance(given, (str, Path)) else None)
                    if plan is not None and isinstance(cluster, Cluster) else None)
            if note:  # the explicit cluster wins, but not without a word (the plan's links and devices differ)
                warnings.warn(f"HexiScaleStrategy(plan, cluster): {note}", OtherClusterWarning, stacklevel=5)
        if plan is not None:
            # its devices exist in the cluster; with none (the local devices, described at setup) the
            # plan's own rules; and its batches sum to global_batch: every rank found these after the
            # launch ('pipelines: []' was accepted here)
            try:
                plan.validate(cluster if isinstance(cluster, Cluster) else None, global_batch=self.global_batch)
            except ConfigError as e:
                if e.key != "train.global_batch":
                    raise
                raise ConfigError(_key("global_batch"), e.value, e.rule, f"pass global_batch={plan.global_batch} "
                                  "or None (the plan's), or a plan for this batch") from None
        mb = self.micro_batch_size
        if plan is not None and mb is not None and any(p.batch_size % mb for p in plan.pipelines):
            # every rank refused it at setup (plan_resolution.apply_overrides), after the launch
            i, b = next((i, p.batch_size) for i, p in enumerate(plan.pipelines) if p.batch_size % mb)
            common = math.gcd(*(p.batch_size for p in plan.pipelines))
            raise ConfigError(_key("micro_batch_size"), mb, f"must divide every pipeline's batch of the plan: "
                              f"pipeline {i}'s batch_size is {b}",
                              f"choose a divisor of every pipeline batch ({_divisors(common)}), or None to "
                              "keep the plan's")
        object.__setattr__(self, "cluster", cluster)
        object.__setattr__(self, "plan", plan)

    def _elastic_settings(self):
        """``elastic`` as an ElasticSettings (or None), with what it needs: a cluster file, no plan."""
        from lightning_hexiscale.lightning.launch.elastic import as_settings  # its torch.distributed helpers: on use

        settings = as_settings(self.elastic)
        if settings is None:
            return None
        if self.plan is not None:
            raise ConfigError(_key("plan"), "a plan", "elastic training plans for the machines present at every "
                              "start, so a fixed plan cannot be used", "pass plan=None with elastic=...")
        if not isinstance(self.cluster, Cluster):
            raise ConfigError(_key("cluster"), None, "elastic training re-plans on the machines of a cluster file "
                              "and needs one", "pass cluster=<cluster YAML or preset>")
        return settings

    @property
    def overrides(self) -> dict[str, Any]:
        """The plan overrides (:data:`PLAN_OVERRIDE_KEYS`), as ``plan_resolution.plan_for`` takes them."""
        return {k: getattr(self, k) for k in PLAN_OVERRIDE_KEYS}
