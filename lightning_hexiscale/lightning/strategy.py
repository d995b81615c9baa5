"""HexiScaleStrategy: asymmetric parallel training (paper §3) behind ``Trainer(strategy="hexiscale")``.

The only place where Lightning meets the runtime. Per process (global rank r):

1. ``setup_environment``: DDPStrategy's process group (gloo on CPU, NCCL on CUDA), one intra-op
   thread share per process on CPU.
2. ``configure_model`` runs under ``torch.device("meta")``: the module's :class:`Llama` has shapes,
   no memory.
3. ``setup``: the plan (a file, a Plan, or the planner's search on the cluster), checked against the
   world size and the devices; the runtime's :class:`PipelineEngine` builds every process group and
   this rank's stage (layers and TP shards of ``plan.device_order[r]``), initialised from the
   module's ``init_seed`` (bit-identical to ``Llama.init_weights(init_seed)``) or from the weights the
   module already holds; ``module.model`` becomes a :class:`PipelineModel` (see its contract).
4. Each training batch: pipeline i's slice of the global batch (:mod:`lightning_hexiscale.data.samplers`).
   The training hooks call the phases of the engine's step (open the window, micro-step through
   ``self.model.loss``, close the window, clip, update) through one adapter,
   :mod:`lightning_hexiscale.lightning.step_adapter`, which maps each hook onto its phase. Lightning's
   backward and zero_grad are skipped (``fit_loop._skip_backward``): they would wipe the gradients
   the schedule produced inside ``training_step``.

Checkpoints are plan-independent torch.distributed.checkpoint shards: every rank writes and reads
only its own pieces (:mod:`lightning_hexiscale.runtime.checkpoint`), optionally asynchronously.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.recipe import check_ckpt_path, device_kind, precision_dtype
from lightning_hexiscale.data.samplers import check_train_loader
from lightning_hexiscale.errors import (ConfigError, ElasticStop, InfeasiblePlan, NonFiniteError, RankFailure,
                                        TrainingInterrupted)
from lightning_hexiscale.lightning import internals, notices, plan_resolution
from lightning_hexiscale.lightning.device_check import check_local_gpus
from lightning_hexiscale.lightning.fast_path import log_fast_path, prepare_optimizers
from lightning_hexiscale.lightning.idle_ranks import IdleRankMethods, accepted_world_sizes, layout_for, world_error
from lightning_hexiscale.lightning.launch.guard import CHILD_ENV, LaunchGuard, agree, is_agreed, mark_agreed
from lightning_hexiscale.lightning.pipeline_model import PipelineLogits, PipelineModel
from lightning_hexiscale.lightning.plan_check import DEFAULT_WARMUP as DEFAULT_PLAN_CHECK_WARMUP
from lightning_hexiscale.lightning.plan_check import PlanCheck
from lightning_hexiscale.lightning.plan_resolution import (AUTO, describe_local_devices, discover_cluster, find_llama,
                                                           plan_for, training_loader)
from lightning_hexiscale.lightning.settings import (StartMethod, StrategySettings, check_ddp_plugins,
                                                   check_process_group_backend)
from lightning_hexiscale.lightning.step_adapter import GradientMethods, state_to_device
from lightning_hexiscale.lightning.strategy_checkpoints import CheckpointMethods, check_checkpoint_before_launch
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner.cost.workload import Workload
from lightning_hexiscale.planner.plan import Plan
from lightning_hexiscale.runtime import destroy_groups_at_exit


class HexiScaleStrategy(IdleRankMethods, CheckpointMethods, GradientMethods, internals.LauncherHooks, DDPStrategy):
    """Asymmetric pipeline x tensor x data parallelism over heterogeneous devices.

    The keyword arguments are the fields of :class:`~lightning_hexiscale.lightning.settings.StrategySettings`,
    documented there (``cluster``, ``plan``, ``global_batch``, the plan overrides ``micro_batch_size`` /
    ``schedule`` / ``recompute`` / ``dp_sharding``, ``seed``, ``planner_iterations``,
    ``use_all_devices``, ``plan_check``, ``start_method``, ``num_threads``, ``check_devices``,
    ``nonfinite``, ``async_checkpoint``, ``elastic``, ``watchdog``, ``watchdog_grace_s``, ``compile``,
    ``fast_path``, ``timeout``); the constructor checks them once, into :attr:`settings`.
    ``process_group_backend`` / ``accelerator`` / ``parallel_devices`` / ``cluster_environment`` /
    ``checkpoint_io`` / ``precision_plugin``: as for ``DDPStrategy``.
    """

    strategy_name = "hexiscale"

    def __init__(self, cluster: str | Path | Mapping | Cluster | None = AUTO,
                 plan: str | Path | Mapping | Plan | None = None, *,
                 global_batch: int | None = None, micro_batch_size: int | None = None,
                 schedule: str | None = None, recompute: bool | None = None, dp_sharding: str | None = None,
                 seed: int | None = None, planner_iterations: int = 20, use_all_devices: bool = False,
                 plan_check: int | bool | None = DEFAULT_PLAN_CHECK_WARMUP, start_method: StartMethod = "popen",
                 num_threads: int | Literal["auto"] = "auto", check_devices: bool = True,
                 nonfinite: Literal["skip", "stop"] = "stop", async_checkpoint: bool = False, elastic=None,
                 watchdog: bool = True, watchdog_grace_s: float = 5.0, compile: bool | None = None, fast_path=None,
                 process_group_backend: str | None = None, timeout: timedelta | float | None = default_pg_timeout,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None) -> None:
        notices.install()  # Lightning's litlogger tip and a torch deprecation raised inside Lightning
        s = StrategySettings(
            cluster=cluster, plan=plan, global_batch=global_batch, micro_batch_size=micro_batch_size,
            schedule=schedule, recompute=recompute, dp_sharding=dp_sharding, seed=seed,
            planner_iterations=planner_iterations, use_all_devices=use_all_devices, plan_check=plan_check,
            start_method=start_method, num_threads=num_threads, check_devices=check_devices, nonfinite=nonfinite,
            async_checkpoint=async_checkpoint, elastic=elastic, watchdog=watchdog, watchdog_grace_s=watchdog_grace_s,
            compile=compile, fast_path=fast_path, timeout=timeout)
        check_process_group_backend(process_group_backend)  # DDPStrategy's argument: torch takes any name
        check_ddp_plugins(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.settings = s
        """The checked arguments (frozen); the attributes below are run state."""
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=s.timeout, start_method=s.start_method)
        self.elastic = _elastic_run(s.elastic)
        self._discovered: Cluster | None = None
        """``cluster="auto"``: what the ranks discovered at setup."""
        self._present: Cluster | None = None
        self._plan_check: PlanCheck | None = None
        self.cluster: Cluster | None = s.cluster if isinstance(s.cluster, Cluster) else None
        self.plan: Plan | None = s.plan
        self.workload: Workload | None = None
        """What the plan is priced for (set in ``setup``: :meth:`Workload.for_cluster`)."""
        self._pipeline_model: PipelineModel | None = None
        self.nonfinite_events: list[dict[str, Any]] = []
        """One entry per optimizer step with a non-finite loss or gradient (the same on every rank)."""
        self._watch = None
        self._failure: tuple[BaseException, str] | None = None
        self._guard = LaunchGuard(self)
        self._train_sampler = None
        self._call_data: dict[str, Any] = {}
        """The data arguments of the current Trainer call (:meth:`keep_call_arguments`)."""
        self._checkpointer = None
        self._failed = False

    # the settings that other modules of this package read from the strategy
    nonfinite = property(lambda self: self.settings.nonfinite, doc="``StrategySettings.nonfinite`` (step_adapter).")
    plan_check = property(lambda self: self.settings.plan_check, doc="``StrategySettings.plan_check`` (plan_check).")
    watchdog_grace_s = property(lambda self: self.settings.watchdog_grace_s, doc="(launching: the parent's wait).")
    fast_path = property(lambda self: self.settings.fast_path, doc="``StrategySettings.fast_path``.")

    # ---- environment -----------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            # Several processes share few cores: each with torch's default of one thread per core
            # oversubscribes them (8 such processes ran 9x slower than with one thread each).
            n = self.settings.num_threads if self.settings.num_threads != "auto" else max(1, (os.cpu_count() or 1) // max(1, self.num_processes))
            torch.set_num_threads(n)
        notices.install()  # again: built inside a caller's warnings.catch_warnings(), its filter was dropped
        super().setup_environment()
        destroy_groups_at_exit()  # a user's script would otherwise end with gloo's SIGABRT now and then

    def before_launcher_configured(self) -> None:
        """When the Trainer is built (:class:`~lightning_hexiscale.lightning.internals.LauncherHooks`),
        with num_nodes and devices known: the first moment a given plan's world size can be checked,
        before any process starts."""
        if self.settings.plan is not None:
            self._check_world(self.settings.plan)
        if internals.trainer_precision_argument() == "16-mixed":
            # on CPU Lightning has already replaced it by bf16-mixed (with a warning): refuse it as on GPUs
            precision_dtype("16-mixed", key="Trainer(precision)")

    @property
    def launch_guard(self) -> LaunchGuard:
        """The guard around this strategy's launcher (:mod:`~lightning_hexiscale.lightning.launch.guard`)."""
        return self._guard

    def check_before_launch(self, fitting: bool, arguments: dict[str, Any]) -> None:
        """What the Trainer call's arguments allow checking before processes start (the launcher calls
        it in the launching process): ``ckpt_path``, the precision and, for ``fit`` (``fitting``),
        automatic optimisation and the training DataLoader against the plan."""
        module = arguments.get("model")
        check_ckpt_path(arguments.get("ckpt_path"))
        check_checkpoint_before_launch(arguments.get("ckpt_path"), module, arguments.get("weights_only"))
        self._workload_precision()  # refuses a precision the runtime does not train in (16-mixed, ...)
        plan_resolution.check_module_before_launch(self.settings.plan, module)
        if fitting and module is not None and not module.automatic_optimization:
            raise _manual_optimization_error()
        loader = arguments.get("train_dataloaders")
        if fitting and isinstance(loader, DataLoader):
            want = self.settings.plan.global_batch if self.settings.plan is not None else self.settings.global_batch
            check_train_loader(loader, want)

    def keep_call_arguments(self, trainer, fitting: bool, arguments: dict[str, Any]) -> None:
        """What the strategy keeps of the Trainer call's arguments (the launcher calls it before
        processes start, in every process that launches; spawn/fork workers inherit it): the data
        the global batch is read from when none is given, and, elastic, the checkpoint to resume."""
        self._call_data = {key: arguments.get(key) for key in ("train_dataloaders", "datamodule")}
        if self.elastic is not None:
            self.elastic.before_call(trainer, fitting, arguments.get("ckpt_path"))

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # The full model is never materialised: the stage materialises only this rank's shards.
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):
            yield

    # ---- setup ---------------------------------------------------------------------------
    @property
    def pipeline_model(self) -> PipelineModel:
        """This rank's :class:`PipelineModel` (after ``setup``)."""
        if self._pipeline_model is None:
            raise RuntimeError("HexiScaleStrategy.setup has not run yet")
        return self._pipeline_model

    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._next_call()  # a later Trainer call of a job whose plan leaves devices idle
        existing = getattr(module, "model", None)
        if isinstance(existing, PipelineModel):  # a later call with the same module (a new Trainer's too)
            self._pipeline_model, self.plan, self.cluster, self.workload = plan_resolution.reuse_stage(existing, self)
        else:
            if self.elastic is not None:  # collective: the machines present, device k = global rank k
                self._present = agree(lambda: self.elastic.present_cluster(self, self.settings.cluster),
                                      self.global_rank, self.world_size)
            if self.settings.cluster == AUTO and self._discovered is None:  # collective: every rank measures
                self._discovered = self._discover_cluster(module, trainer)
            # Every rank checks the same things (Lightning, the module, the plan, world size and
            # devices); one error, from rank 0, reaches the caller (launch.guard.agree).
            llama = agree(lambda: self._resolve_plan(module, trainer, fitting), self.global_rank, self.world_size)
            self._agree_plan_and_devices()
            self._switch_if_idle()  # launched on idle devices too: they leave, the others train alone
            # As Lightning's own strategies do, before anything is built from the parameters: 64-true
            # and bf16-true cast the (meta) module, so the stage, its TP shards, the ZeRO buffers and
            # the optimizer are created in the Trainer's dtype (32-true and bf16-mixed keep it as is).
            self.precision_plugin.convert_module(module)
            self._pipeline_model = self._build_pipeline_model(module, trainer, llama)
            module.model = self._pipeline_model
        self.model = module
        # Let the DataLoader's own shuffle flag decide, as on one device (Lightning's injected
        # DistributedSampler would always shuffle); process_dataloader cuts it per pipeline.
        internals.keep_dataloader_sampler(trainer)
        internals.stop_on_sigterm(trainer)  # Lightning's SIGTERM handler broadcasts from inside the handler
        if fitting:
            internals.skip_lightning_backward(trainer)
            self._setup_one_optimizer(trainer)
            fused = prepare_optimizers(self.pipeline_model.engine, self.optimizers)  # fused AdamW
            # zero2/zero3: Lightning holds and steps the engine's sharded optimizer (its LR schedulers
            # re-pointed at it), as with Lightning's DeepSpeed strategy; ddp: the user's
            self.optimizers = self.pipeline_model.step_adapter.engine_optimizers(self.optimizers,
                                                                                  self.lr_scheduler_configs)
        log_fast_path(self.pipeline_model.engine, fused if fitting else [], self.global_rank, self.world_size)
        self.setup_precision_plugin()
        self._install_global_clipping()
        if fitting:
            state_to_device(self.optimizers, self.root_device)
        self._setup_checkpointer()
        self._start_watch()
        self._plan_check = PlanCheck.for_strategy(self, trainer) if fitting and self.settings.plan_check is not None else None
        if self.elastic is not None and fitting:
            agree(lambda: self.elastic.start(self, trainer, self.workload), self.global_rank, self.world_size)

    def _setup_checkpointer(self) -> None:
        """One Checkpointer per run. Asynchronous saves run their collectives in a background
        thread, so they get a gloo group of their own (created by every rank here, at the same point)."""
        if self._checkpointer is not None:
            return
        from lightning_hexiscale.runtime import Checkpointer

        group = dist.new_group(backend="gloo") if self.settings.async_checkpoint and dist.is_initialized() else None
        self._checkpointer = Checkpointer(group, async_save=self.settings.async_checkpoint)

    def _start_watch(self) -> None:
        """One FailureWatch per run (a token from rank 0 keeps earlier runs' keys out)."""
        if not self.settings.watchdog or self._watch is not None or self.world_size < 1 or not dist.is_initialized():
            return
        from lightning_hexiscale.runtime import FailureWatch

        token = self.broadcast(uuid.uuid4().hex[:12] if self.global_rank == 0 else None, 0)
        timeout = self.settings.timeout.total_seconds() if self.settings.timeout is not None else None
        self._watch = FailureWatch(self.global_rank, self.world_size, token, grace_s=self.settings.watchdog_grace_s,
                                   collective_timeout_s=timeout).start()

    def _resolve_plan(self, module, trainer, fitting: bool) -> Llama:
        """This rank's checks before anything is built or communicated: Lightning's private
        attributes, automatic optimisation, the module's Llama, the cluster and the plan (searched
        when none was given), the world size and the device types. Sets ``cluster`` and ``plan``."""
        internals.check()
        if fitting and not module.automatic_optimization:
            raise _manual_optimization_error()
        llama = find_llama(module, fitting)
        given = self.settings.plan
        given_cluster = self.settings.cluster if isinstance(self.settings.cluster, Cluster) else None
        self.cluster = (self._present or self._discovered or given_cluster  # elastic: the devices present
                        or describe_local_devices(self.root_device, self.num_nodes, self.num_processes))
        if given is not None:  # the world-size message is clearer than "device 5 does not exist"
            self._check_world(given)
        self._autocast_dtype()
        # Every rank plans (the search is deterministic for a seed); rank 0's plan is checked against
        # everyone's, because ranks with different plans would build different groups and hang.
        # the one workload of this run (the precision's dtypes, the cluster's device kind): the
        # search prices it, and elastic restarts report its estimate
        self.workload = Workload.for_cluster(llama.config, self.cluster, self._workload_precision(),
                                              fast_path=self.settings.fast_path)
        try:
            self.plan = plan_for(given, self.cluster, self.workload, self._global_batch_for(), self.settings.overrides,
                                 seed=self.settings.seed, iterations=self.settings.planner_iterations,
                                 use_all_devices=self.settings.use_all_devices)
        except InfeasiblePlan as e:
            if self.elastic is None:
                raise
            raise self.elastic.infeasible(e) from None
        self._check_world(self.plan)
        self._check_devices(self.plan)
        return llama

    def _agree_plan_and_devices(self) -> None:
        """Collective over the launch: every rank has rank 0's plan, and (CUDA) every rank's GPU is
        the device the plan gives its rank (``device_order``, or ``launch_order`` when the job was
        launched on the plan's idle devices too)."""
        if self.broadcast(self.plan.to_dict(), 0) != self.plan.to_dict():
            raise RuntimeError(f"rank {self.global_rank} planned differently from rank 0; pass an explicit plan file")
        if self.settings.check_devices and self.root_device.type == "cuda" and self.world_size > 1:
            # collective; the same error on every rank, so rank 0 reports it for all
            layout = layout_for(self.plan, self.world_size, self.global_rank)
            order = layout.launch_order if layout is not None else self.plan.device_order
            try:
                check_local_gpus(self.plan, self.cluster, self.root_device, self.node_rank, self.local_rank, order)
            except ConfigError as e:
                raise mark_agreed(e, list(range(self.world_size))) from None

    def _build_pipeline_model(self, module, trainer, llama: Llama) -> PipelineModel:
        from lightning_hexiscale.runtime import PipelineEngine

        config: LlamaConfig = llama.config
        param = next(llama.parameters())
        # Start from given weights: module.init_state_dict (e.g. weights.attach_weights), or the
        # Llama's own when the module materialised it; else initialise from module.init_seed.
        state = getattr(module, "init_state_dict", None)
        if state is None and not param.is_meta:
            state = {k: v.detach() for k, v in llama.state_dict().items()}
        engine = PipelineEngine(self.plan, config, rank=self.global_rank, seed=int(getattr(module, "init_seed", 0)),
                                device=self.root_device, dtype=param.dtype, autocast_dtype=self._autocast_dtype(),
                                state_dict=state, fast_path=self.settings.fast_path)
        loss_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        return PipelineModel(engine, loss_dtype, internals.logged_batch_size(module), (self.cluster, self.workload))

    def _global_batch_for(self) -> int | None:
        """The explicit global batch, else the training DataLoader's batch size (read, not consumed)."""
        if self.settings.global_batch is not None or self.settings.plan is not None:
            return self.settings.global_batch
        loader = training_loader(self._call_data, self.lightning_module)
        if isinstance(loader, DataLoader) and loader.batch_size:
            return int(loader.batch_size)
        raise ConfigError("HexiScaleStrategy(global_batch)", None,
                          "planning needs the global batch and no training DataLoader with a batch_size was found",
                          "pass HexiScaleStrategy(global_batch=G) or a plan file")

    def _workload_precision(self) -> str:
        """The Trainer's precision (one knob), which the planner prices (its dtypes: fp32 parameters
        and gradients under bf16-mixed; ``Workload.from_precision``); a ConfigError for one the
        runtime does not train in (16-mixed, transformer-engine, ...)."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        precision_dtype(precision, key="Trainer(precision)")
        return precision

    def _autocast_dtype(self) -> torch.dtype | None:
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision):
            precision_dtype(plugin.precision, key="Trainer(precision)")  # refuses 16-mixed
            return torch.bfloat16
        return None

    def _check_world(self, plan: Plan) -> None:
        """The job runs the plan's used devices, or every device of its launch order (idle ones too)."""
        if self.world_size not in accepted_world_sizes(plan):
            raise world_error(plan, f"{self.world_size} processes ({self.num_nodes} node(s) x {self.num_processes} "
                              "device(s))", self.cluster.name if self.cluster is not None else None)

    def _discover_cluster(self, module, trainer) -> Cluster:
        """``cluster="auto"``: collective (:func:`~lightning_hexiscale.lightning.plan_resolution.discover_cluster`)."""
        rank, world = self.global_rank, self.world_size
        llama = agree(lambda: find_llama(module), rank, world)
        batch = agree(lambda: self._global_batch_for(), rank, world)
        return discover_cluster(llama.config, self._workload_precision(), batch, self.settings.micro_batch_size,
                                rank, self.broadcast)

    def _check_devices(self, plan: Plan) -> None:
        if not self.settings.check_devices or self.cluster is None or self._discovered is not None:
            return  # a discovered cluster was measured on these very devices
        types_ = sorted({self.cluster.devices[d].gpu_type for d in plan.device_order})
        gpu_types = [t for t in types_ if device_kind([t]) == "cuda"]
        local = self.root_device.type
        if local == "cpu" and gpu_types:
            raise ConfigError("HexiScaleStrategy(cluster)", self.cluster.name,
                              f"the plan runs on {', '.join(gpu_types)} GPUs but this process has only a CPU",
                              "launch on the GPUs the cluster describes (torchrun/SLURM), or pass check_devices=False")
        if local == "cuda" and len(gpu_types) < len(types_):
            raise ConfigError("HexiScaleStrategy(cluster)", self.cluster.name,
                              "the plan describes emulated CPU devices but this process runs on CUDA",
                              "describe the GPUs in a cluster file (or pass cluster=None)")

    # ---- training ------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        # open the window on its first batch; the batch before an optimizer step arms the overlapped sync
        self.pipeline_model.step_adapter.begin_batch(self.lightning_module.trainer)
        if self._train_sampler is not None:
            trainer = self.lightning_module.trainer
            if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
                self._train_sampler.window_starts()  # where a save inside this window rewinds to
            self._train_sampler.consumed += 1  # the loader's resume position (data.PlanDataLoader)
        if self._plan_check is not None:
            self._plan_check.batch_starts()
        return self.pipeline_model.step_adapter.end_batch(super().training_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step``; where it returns ``self.model(tokens)`` (a placeholder here),
        the logits of the whole batch, gathered to global rank 0 (:meth:`PipelineModel.predict_logits`;
        a collective: every rank resolves the same placeholders in the same order)."""
        from lightning.fabric.utilities.apply_func import apply_to_collection

        out = super().predict_step(*args, **kwargs)
        return apply_to_collection(out, PipelineLogits, self.pipeline_model.predict_logits)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        out = self._optimizer_step(optimizer, closure, model, **kwargs)
        if self._plan_check is not None:  # after the warm-up, a collective at the same step on every rank
            self._plan_check.step_ends(self.lightning_module.trainer)
        return out

    def _optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        # the window's last micro-step, then its close (non-finite check, then sync or discard), the
        # same phases as PipelineEngine.fit_step; the plugin then clips and updates (step_adapter)
        out, bad = self.pipeline_model.step_adapter.close_window(closure)
        if bad:
            self._nonfinite_step(bad)
            return out
        return super().optimizer_step(optimizer, lambda: out, model, **kwargs)

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The 2-norm of the whole model's gradient, as one device would compute it from the same
        batch: every element once over all stages, TP shards and pipelines (replicated norms and a
        tied embedding counted once), after the gradient sync and before clipping when called from
        ``on_before_optimizer_step``; the norm ``gradient_clip_val`` clips by. Collective: every rank
        calls it at the same point (one all-reduce of a scalar). Lightning's
        ``lightning.pytorch.utilities.grad_norm(module)`` sees only this rank's parameters (its stage,
        its TP shard; under ZeRO no ``.grad`` at all): log this instead::

            def on_before_optimizer_step(self, optimizer):
                self.log("grad_norm", self.trainer.strategy.grad_norm())
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"HexiScaleStrategy.grad_norm(norm_type={norm_type!r}): only the 2-norm is computed "
                             "across ranks; call grad_norm() (norm_type=2.0)")
        return self.pipeline_model.step_adapter.grad_norm()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        # self.model.loss already ran the schedule's backward; nothing is left to differentiate.
        return closure_loss

    # ---- failures --------------------------------------------------------------------------
    def failure_reason(self, exc: BaseException) -> str | None:
        """Report this rank's failure to the others (once per exception) and say which rank failed
        first, from the failure watch; None without a watch, or for failures every rank shares."""
        if (self._watch is None or is_agreed(exc) or isinstance(exc, (KeyboardInterrupt, SystemExit, NonFiniteError,
                                                                      ElasticStop, TrainingInterrupted))):
            return None  # non-finite steps, elastic stops and agreed errors stop every rank together: nothing to tell
        if self._failure is None or self._failure[0] is not exc:
            self._watch.report(exc)
            self._failure = (exc, self._watch.explain())
        return self._failure[1]

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Under torchrun/SLURM every rank says on stderr which rank failed first (Lightning's own
        launchers hand one error to the caller instead: lightning/launch/guard.py)."""
        super().on_exception(exception)
        self._failed = True
        cause = exception.__cause__ if isinstance(exception, RankFailure) and exception.__cause__ else exception
        why = self.failure_reason(cause)
        env = self.cluster_environment
        external = (env is not None and env.creates_processes_externally and os.environ.get(CHILD_ENV) != "1"
                    and self._guard.child_watch is None)  # not a rank Lightning's popen launcher started
        if why and external:
            sys.stderr.write(f"hexiscale: rank {self.global_rank} stopped by {_short_exc(cause)}; {why}\n")
            sys.stderr.flush()

    # ---- data ----------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        from lightning_hexiscale.data.samplers import plan_dataloader

        if not isinstance(dataloader, DataLoader):
            agree(lambda: _not_a_dataloader(dataloader), self.global_rank, self.world_size)
        trainer = self.lightning_module.trainer
        training = bool(trainer.training)
        assert self.plan is not None
        # The order is the one-device loader's (its generator, else torch's global one); every rank
        # draws, then all take rank 0's draw (a broadcast at the start of each shuffled epoch).
        # Every rank checks the same loader: one error reaches the caller (launch.guard.agree).
        key = "train_dataloader" if training else ("predict_dataloader" if trainer.predicting else "eval_dataloader")
        loader = agree(lambda: plan_dataloader(dataloader, [p.batch_size for p in self.plan.pipelines],
                                               self.pipeline_model.engine.role.pipeline, drop_last=training,
                                               agree=self._agree if self.world_size > 1 else None, key=key),
                       self.global_rank, self.world_size)
        if training:
            self._train_sampler = loader.batch_sampler
        if loader.batch_sampler.left_out:  # a metric over fewer samples, or fewer steps, than one device's: say so
            rank_zero_warn(loader.batch_sampler.left_out_note(key))
        return internals.record_batch_indices(loader) if trainer.predicting else loader  # prediction writers

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the data permutation's draw)."""
        return self.broadcast(value, 0)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning's epoch mean of a value logged with sync_dist is mean(sum value x batch size) /
        # mean(sum batch size) over the ranks, the sizes an integer tensor whose mean Lightning
        # truncates. Here the ranks see unequal slices of each batch (4 and 2 of 6, the last 3 and 2
        # of 5: 11 + 6 samples), so the mean of the sizes is rarely whole (8.5, truncated to 8:
        # val_loss 17/16 too high). Averaged in float64 it is exact.
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() and _is_mean(reduce_op):
            tensor = tensor.to(torch.float64)
        return super().reduce(tensor, group, reduce_op)

    # ---- teardown ------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if self._checkpointer is not None:
            # The last asynchronous saves: written and renamed before the processes end; after a
            # failure they are abandoned (their peers are gone; the directories stay partial).
            self._checkpointer.close(wait=not self._failed)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._guard.job_ended()
        self._call_ended()  # an idle rank that hosts the store waits for this
        self._release_global_clipping()
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Setup stopped before the meta Llama became this rank's stage: Lightning's teardown
            # would move it to the CPU ("Cannot copy out of meta tensor") and hide the error that
            # stopped it. Nothing of it holds memory; it stays on the meta device.
            module.cpu = lambda: module
            try:
                super().teardown()
            finally:
                del module.cpu
            return
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        # DDPStrategy's version would register "ddp", "ddp_spawn", ... as this class; the hexiscale
        # names are registered by lightning_hexiscale.lightning.registration on import instead.
        return None


def _elastic_run(settings):
    """The run of ``StrategySettings.elastic`` (checked there), or None."""
    if settings is None:
        return None
    from lightning_hexiscale.lightning.launch.elastic import ElasticRun  # torch.distributed's elastic helpers: on use

    return ElasticRun(settings)


def _manual_optimization_error() -> ConfigError:
    return ConfigError("LightningModule.automatic_optimization", False,
                       "the hexiscale strategy runs forward and backward inside self.model.loss and supports "
                       "automatic optimisation only", "remove automatic_optimization = False")


def _not_a_dataloader(dataloader: object) -> None:
    raise ConfigError("dataloader", type(dataloader).__name__,
                      "the hexiscale strategy cuts each global batch into per-pipeline slices and needs a torch "
                      "DataLoader over a map-style dataset", "return a DataLoader(dataset, batch_size=G)")


def _is_mean(reduce_op: Any) -> bool:
    """Lightning's names of the mean reduction ("mean", "avg") or torch's ``ReduceOp.AVG``."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG


def _short_exc(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
