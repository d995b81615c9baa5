"""Where the strategy's plan comes from: a file, a Plan, or the planner's search on a cluster.

The runtime consumes only a Plan; this module is the strategy's (and the recipes') one door to the
planner, so that the rules live in one place:

- explicit ``schedule`` / ``recompute`` / ``dp_sharding`` / ``micro_batch_size`` override the plan's;
- the plan is validated against the cluster, the model and the global batch (when given);
- ``cluster="auto"`` (the strategy's default) with no plan: the job's ranks discover their cluster
  for the job's model and precision (:func:`discover_cluster`, cached by a hardware + model
  fingerprint), and the search plans on it; with a plan given, ``"auto"`` reads the plan's
  ``meta.cluster_file`` (while that file exists) or ``meta.cluster`` or, without one, describes the
  local devices as ``None`` does;
- ``cluster=None``: the local devices are described as a nominal homogeneous cluster, nothing is
  measured (:func:`describe_local_devices`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lightning_hexiscale.config import catalog
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.suggest import CALL_KEY
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.launch.guard import mark_agreed
from lightning_hexiscale.lightning.step_adapter import frozen
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama
from lightning_hexiscale.planner import Plan, Workload


AUTO = "auto"
"""``HexiScaleStrategy(cluster="auto")``: discover the cluster on the job's ranks (:func:`discover_cluster`)."""


def load_cluster_arg(cluster: str | Path | Cluster | None, key: str = "HexiScaleStrategy(cluster)") -> Cluster | str | None:
    """``HexiScaleStrategy(cluster=...)`` (or the plan's ``meta.cluster``): a preset name or a cluster
    YAML path, read now; ``"auto"`` stays ``"auto"`` (discovered at setup)."""
    if cluster is None or isinstance(cluster, Cluster) or cluster == AUTO:
        return cluster
    if CALL_KEY.fullmatch(key):  # a fix written as the call takes it: HexiScaleStrategy(cluster='hetero3')
        return Cluster.load(str(cluster), key=key)
    try:  # a plan file's meta.cluster: a field, not an override, so its fix stays quoted ('hetero3')
        return Cluster.load(str(cluster))
    except ConfigError as e:
        if e.key != "cluster":  # an error inside the file names its own key
            raise
        raise ConfigError(key, str(cluster), e.rule, e.fix) from None


def load_plan_arg(plan: str | Path | Plan | None, key: str = "HexiScaleStrategy(plan)") -> Plan | None:
    """``HexiScaleStrategy(plan=...)`` (or the recipe's ``plan=``): a plan file, read now (a ``Plan`` as is)."""
    if plan is None or isinstance(plan, Plan):
        return plan
    return Plan.load(plan, key)


def describe_local_devices(root_device: torch.device, num_nodes: int, devices_per_node: int) -> Cluster:
    """A homogeneous cluster of ``num_nodes`` machines x ``devices_per_node`` local devices.

    CPU processes become ``CPU-FAST`` devices; a CUDA device is looked up in the GPU catalog by its
    name ("NVIDIA A800-SXM4-80GB" -> A800). Links are nominal (NVLink-class inside a machine,
    10 GB/s between machines): profile the cluster (``hexiscale profile``) for measured ones.
    """
    if root_device.type == "cuda":
        gpu = _catalog_name(torch.cuda.get_device_name(root_device))
        intra, inter = "100 GB/s", "10 GB/s"
    else:
        gpu, intra, inter = "CPU-FAST", "10 GB/s", "1 GB/s"
    return Cluster.from_config({
        "name": f"local_{num_nodes}x{devices_per_node}_{gpu}",
        "description": "the local devices, described by HexiScaleStrategy (cluster=None)",
        "machines": [{"name": "node", "gpu": gpu, "count": devices_per_node, "intra_bandwidth": intra,
                      "repeat": num_nodes}],
        "inter_machine": {"bandwidth": inter, "latency": "20us"},
    })


def discover_cluster(config: LlamaConfig, precision: str, global_batch: int, micro_batch_size: int | None, rank: int,
                     broadcast, log=None) -> Cluster:
    """Collective over the default process group: the cluster these ranks are, discovered for the
    job's model and precision (:func:`~lightning_hexiscale.profiling.discover.discover_process_group`:
    reused from ``$HEXISCALE_CACHE_DIR`` when the fingerprint matches), with layer times at the
    user's ``micro_batch_size``, else at 1, 2, 4 up to the global batch (the cost model scales the
    nearest beyond them). Rank 0 reads the file it wrote and ``broadcast(obj, src)`` hands the same
    Cluster to every rank (the file lives on rank 0's machine)."""
    from lightning_hexiscale.profiling.discover import DEFAULT_MICRO_BATCHES, discover_process_group

    micro_batches = [micro_batch_size] if micro_batch_size else [m for m in DEFAULT_MICRO_BATCHES if m <= global_batch]
    found = discover_process_group(config, precision=precision, micro_batches=micro_batches or [1], progress=rank == 0,
                                   log=log)
    return broadcast(Cluster.load(found.path) if rank == 0 else None, 0)


def _catalog_name(device_name: str) -> str:
    """The catalog type a CUDA device name denotes (:func:`catalog.name_of_device`), or a clear error."""
    name = catalog.name_of_device(device_name)
    if name is None:
        raise ConfigError("HexiScaleStrategy(cluster)", device_name, "this GPU is not in the catalog",
                          "pass cluster=<cluster YAML> (hexiscale profile writes one) or add the type under gpu_types")
    return name


def search_plan(cluster: Cluster, workload: Workload, global_batch: int, overrides: dict[str, Any], *,
                seed: int = 0, iterations: int = 20, progress: bool = False, use_all_devices: bool = False):
    """The planner's search (§4) -> (Plan, Estimate or None), pricing ``workload`` (a run's workload
    comes from :meth:`Workload.for_cluster`: the precision's dtypes and the cluster's device kind).
    The runtime runs ddp, zero2 and zero3, so the search picks the sharding with the cost model
    unless ``overrides['dp_sharding']`` binds it. ``use_all_devices``: every device takes work (else
    the plan may leave devices idle)."""
    from lightning_hexiscale.planner import SearchSettings, search  # networkx, pymetis: on use
    settings = SearchSettings(iterations=iterations, seed=seed, progress=progress,
                              schedule=overrides.get("schedule") or "1f1b",
                              recompute="auto" if overrides.get("recompute") is None else overrides["recompute"],
                              micro_batch_size=overrides.get("micro_batch_size"),
                              dp_sharding=overrides.get("dp_sharding") or None, use_all_devices=use_all_devices)
    result = search(cluster, workload, global_batch, settings)
    return result.plan, result.estimate


def apply_overrides(plan: Plan, overrides: dict[str, Any]) -> Plan:
    """Explicit schedule / recompute / dp_sharding / micro_batch_size replace the plan's values."""
    changes = {k: overrides[k] for k in ("schedule", "recompute", "dp_sharding")
               if overrides.get(k) is not None and overrides.get(k) != "auto"}  # auto: the plan's own choice
    mb = overrides.get("micro_batch_size")
    if mb is not None:
        for i, p in enumerate(plan.pipelines):
            if p.batch_size % mb:
                raise ConfigError("micro_batch_size", mb, f"must divide pipeline {i}'s batch_size={p.batch_size}",
                                  "choose a divisor of every pipeline batch, or leave it to the plan")
        changes["pipelines"] = tuple(replace(p, micro_batch_size=mb) for p in plan.pipelines)
    return replace(plan, **changes) if changes else plan


def plan_for(plan: str | Path | Plan | None, cluster: Cluster, workload: Workload, global_batch: int | None,
             overrides: dict[str, Any], *, seed: int = 0, iterations: int = 20, use_all_devices: bool = False,
             settings=None, check_global_batch: bool = True, key: str = "HexiScaleStrategy(plan)") -> Plan:
    """A validated plan: ``plan`` itself, the file it names, or the search's plan on ``cluster``
    pricing ``workload``. The one door of the strategy and of ``hexiscale train``.

    - the search runs with ``settings`` (a :class:`~lightning_hexiscale.planner.SearchSettings`, as
      ``hexiscale train`` builds it from every ``planner.*`` key) or, without one, with the settings
      :func:`search_plan` builds from ``overrides``, ``seed``, ``iterations`` and ``use_all_devices``;
    - explicit ``overrides`` then replace the plan's values (:func:`apply_overrides`);
    - the plan is validated against the cluster and the model, and against ``global_batch`` unless
      ``check_global_batch`` is false (a plan file whose batch the user did not restate).
    """
    if plan is None:
        if global_batch is None:
            raise ConfigError("global_batch", None, "planning needs the global batch", "pass global_batch=G")
        from lightning_hexiscale.planner.plan import check_global_batch_bound

        check_global_batch_bound(global_batch, "train.global_batch" if key == "plan" else "global_batch")
        if settings is None:
            plan, _ = search_plan(cluster, workload, global_batch, overrides, seed=seed, iterations=iterations,
                                  use_all_devices=use_all_devices)
        else:
            from lightning_hexiscale.planner import search  # networkx, pymetis: on use
            plan = search(cluster, workload, global_batch, settings).plan
    else:
        plan = load_plan_arg(plan, key=key)
    plan = apply_overrides(plan, overrides)
    return plan.validate(cluster, workload.model, global_batch=global_batch if check_global_batch else None)


def reuse_stage(stage, strategy) -> tuple[Any, Plan, Cluster | None, Workload | None]:
    """A Trainer call whose module already holds this rank's stage (``stage``, a ``PipelineModel``
    an earlier call built, perhaps under another Trainer and strategy): ``(stage, plan, cluster,
    workload)`` for ``strategy``, the plan being the stage's. The stage holds the trained weights,
    which one device's module would keep too; a strategy that planned nothing yet (``cluster`` only)
    takes the stage's plan; one given another plan, or overrides (``dp_sharding``, ``schedule``,
    ...) the stage's plan does not have, is refused (the same error on every rank)."""
    built = stage.engine.plan
    given = strategy.settings.plan
    wanted = apply_overrides(given if given is not None else built, strategy.settings.overrides)
    if wanted.to_dict() != built.to_dict():
        raise mark_agreed(ConfigError(
            "HexiScaleStrategy(plan)" if given is not None else "HexiScaleStrategy(dp_sharding/schedule/...)",
            _brief(wanted), f"the module's Llama is already each rank's stage of another plan ({_brief(built)}), "
            "built by an earlier Trainer call, and it holds the trained weights", "pass the same plan and "
            "overrides (or none: the stage's plan is taken), or start from a new module with ckpt_path=... to "
            "resume under this plan"), list(range(strategy.world_size)))
    cluster, workload = stage.built_for
    return stage, built, cluster, workload


def _brief(plan: Plan) -> str:
    return (f"{len(plan.pipelines)} pipeline(s), batches {[p.batch_size for p in plan.pipelines]}, micro-batches "
            f"{[p.micro_batch_size for p in plan.pipelines]}, {plan.schedule}, {plan.dp_sharding}")


def _hf_model_fix(model, name: str = "model") -> str | None:
    """The fix for a Hugging Face transformers model where the strategy looks for its Llama (it
    splits ``lightning_hexiscale.models.Llama`` only, whose parameters it names and shards): the same
    weights as a Llama (``hf:DIR``, the model's ``name_or_path`` when that is a local directory), or,
    for another architecture, that it is not one the strategy trains. None for anything else."""
    if not isinstance(model, torch.nn.Module) or not type(model).__module__.startswith("transformers."):
        return None
    kind = getattr(getattr(model, "config", None), "model_type", None)
    where = str(getattr(model, "name_or_path", "") or "")
    where = where if where and Path(where).is_dir() else "DIR"
    held = f"self.{name} is transformers' {type(model).__name__}"
    if kind != "llama":
        return (f"{held} ({kind!r}); the strategy trains Llama-shaped models as lightning_hexiscale's Llama: "
                "use a Llama checkpoint, or another strategy for this one")
    return (f"{held}; the strategy trains lightning_hexiscale's Llama: start from the same weights with "
            f"LlamaLitModule('hf:{where}'), or build self.model = Llama(LlamaConfig.from_hf_dir('{where}')) in "
            f"configure_model and call lightning_hexiscale.attach_weights(module, '{where}')")


def find_llama(module, fitting: bool = False) -> Llama:
    """The contract: the LightningModule holds its :class:`Llama` as ``self.model`` (built in
    ``configure_model``) or returns it from ``module.llama()``; in fit, every parameter trains (:func:`frozen`)."""
    llama = module.llama() if callable(getattr(module, "llama", None)) else getattr(module, "model", None)
    if not isinstance(llama, Llama):
        # a Llama held under another name (self.net = Llama(...)): say where it is
        children = list(module.named_modules()) if isinstance(module, torch.nn.Module) else []
        elsewhere = [name for name, child in children if isinstance(child, Llama)]
        hf = _hf_model_fix(llama) or next((_hf_model_fix(c, name) for name, c in children if _hf_model_fix(c)), None)
        fix = (f"the module holds its Llama as self.{elsewhere[0]}: name it self.model, or return it from a "
               f"llama() method" if elsewhere else hf or "build it in configure_model: self.model = Llama(config)")
        raise ConfigError(f"{type(module).__name__}.model", type(llama).__name__,
                          "the hexiscale strategy turns the module's Llama into this rank's pipeline stage and "
                          "finds it as self.model (or self.llama())", fix)
    return frozen(llama, f"{type(module).__name__}.model") if fitting else llama


def check_module_before_launch(plan: Plan | None, module) -> None:
    """Before any process starts: a module that can hold no Llama when the strategy looks for it is
    :func:`find_llama`'s error here, once (each rank raised it after the launch, and discovery); then
    :func:`check_module_model` where a plan is given. A module may build its Llama in
    ``configure_model`` (or the older ``configure_sharded_model``, or ``setup``) or hand it out from
    ``llama()``: one that overrides any of them, or holds a Llama or an earlier call's stage as
    ``self.model``, is left to the ranks."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_hexiscale.lightning.pipeline_model import PipelineModel

    if module is None:
        return
    later = any(is_overridden(hook, module) for hook in ("configure_model", "configure_sharded_model", "setup"))
    if not (later or callable(getattr(module, "llama", None))
            or isinstance(getattr(module, "model", None), (Llama, PipelineModel))):
        find_llama(module)  # raises: no Llama now, and no hook that could build one
    if plan is not None:
        check_module_model(plan, module)


def check_module_model(plan: Plan, module) -> None:
    """Before any process starts: a given plan made for another model than the module's (its
    ``meta.model_shape`` / ``meta.model``, :meth:`Plan.check_model`) is one error in the words of the
    call. Each rank refused it after the launch, with a traceback per rank and a fix for the command
    line. The model is known here when the module has built its :class:`Llama` already, or is a
    :class:`LlamaLitModule` (which builds ``Llama(module.config)`` in ``configure_model``); any other
    module is checked by every rank as before (:func:`find_llama`). Then the plan's rules that need the
    model (:meth:`Plan.validate` with it: TP degrees within the heads) are checked here too."""
    from lightning_hexiscale.errors import PlanError
    from lightning_hexiscale.lightning.example import LlamaLitModule

    built = getattr(module, "model", None)
    if isinstance(built, Llama):
        config = built.config
    elif isinstance(module, LlamaLitModule) and isinstance(module.config, LlamaConfig):
        config = module.config
    else:
        return
    try:
        plan.check_model(config)
    except PlanError as e:
        name = plan.meta.get("model")
        theirs = f" ({type(module).__name__}({name!r}))" if isinstance(name, str) else ""
        raise PlanError("HexiScaleStrategy(plan)", e.value, e.rule,
                        f"train the model it was made for{theirs}, or plan for this one: HexiScaleStrategy() "
                        f"searches a plan (hexiscale plan model={config.name} --out plan.yaml writes one)") from None
    # the model's own rules for a plan (TP degree within the KV heads, ...): each rank refused them
    # after the launch, although the model and the plan are both known here
    plan.validate(model=config)


def training_loader(arguments: dict[str, Any], module) -> Any:
    """The training DataLoader of a Trainer call, found where Lightning's fit loop will find it, and
    not consumed: ``train_dataloaders`` (a DataModule passed there is the datamodule), else the
    datamodule's or else the module's ``train_dataloader()`` where it defines one. None when none is
    reachable yet (the caller then asks for an explicit global batch)."""
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    loader, datamodule = arguments.get("train_dataloaders"), arguments.get("datamodule")
    if isinstance(loader, LightningDataModule):
        loader, datamodule = None, loader
    if loader is not None:
        return loader
    source = datamodule if datamodule is not None else module
    if source is None or not is_overridden("train_dataloader", source):
        return None
    try:
        return source.train_dataloader()
    except Exception:  # the user's *_dataloader hook may need setup that has not run: treat as unknown
        return None
