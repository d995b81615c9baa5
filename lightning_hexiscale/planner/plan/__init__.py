"""The Plan: a frozen, typed description of an asymmetric parallel execution.

Plan -> pipelines (data-parallel replicas, each with its own batch and micro-batch size)
     -> stages (a TP group of devices and a contiguous range of layers).

Conventions the runtime relies on:
- ``Stage.devices[0]`` is the stage leader (it sends/receives activations between stages).
- The TP degree of a stage is ``len(Stage.devices)``.
- Layers are [start, end) half-open ranges; the first stage of every pipeline also holds the token
  embedding, the last stage the final norm and the LM head.
- Rank mapping: global rank r runs the r-th device of ``Plan.device_order`` (all used device ids,
  sorted ascending), so a plan over devices {0..N-1} maps rank r to device r.
- Recomputation is per pipeline (``Pipeline.recompute``): a roomy pipeline runs without it while a
  tight one beside it recomputes. ``Plan.recompute`` is the common flag when every pipeline has the
  same, ``None`` when they differ; passing a bool to ``Plan(..., recompute=)`` (or
  ``dataclasses.replace``) sets every pipeline, which is how an explicit user setting wins.
- Idle devices: ``Plan.idle_devices`` are cluster devices the plan deliberately leaves without work
  (the planner found the plan faster without them, or the user left them out). A job launched on
  the used devices alone maps ranks by ``device_order``; a job launched on every device of
  ``Plan.launch_order`` (used + idle, sorted) maps rank r to ``launch_order[r]``, and the ranks of
  idle devices take no part in training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml

from lightning_hexiscale.errors import ConfigError, PlanError, check_argument_types, shown
from lightning_hexiscale.planner.plan.model_check import (  # noqa: F401 (re-exported)
    MODEL_SHAPE_FIELDS, check_meta_record, check_plan_model, model_shape)
from lightning_hexiscale.planner.plan.yaml_io import (  # noqa: F401
    ClusterSource, OtherClusterWarning, UniqueKeyLoader, cluster_source, finite_or_null, made_for_another_cluster,
    check_plan_keys, named_stream, plain, write_atomically)

if TYPE_CHECKING:  # pragma: no cover
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig

SCHEDULES = ("gpipe", "1f1b")
DP_SHARDINGS = ("ddp", "zero2", "zero3")
MAX_GLOBAL_BATCH = 2**24
"""Most sequences one optimizer step may take (16,777,216; Llama 3's 405B trained on 16M tokens, a
few thousand sequences, per step). 2**70 was an OverflowError traceback in the search, and a plan
file's pipeline of that batch was priced as if a runtime could loop over its micro-batches."""


def check_global_batch_bound(value: Any, key: str = "train.global_batch") -> None:
    """A global batch (or a pipeline's share of it) above :data:`MAX_GLOBAL_BATCH` is a ConfigError
    naming ``key``; other values are left to the caller's own rule (positive integer)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_GLOBAL_BATCH:
        raise ConfigError(key, value, f"must be at most {MAX_GLOBAL_BATCH:,} sequences per optimizer step",
                          "give the global batch in sequences (not tokens), e.g. 32")


REDUCE_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a tensor-parallel group running a contiguous range of layers."""

    devices: tuple[int, ...]
    """Cluster device ids of the TP group; ``devices[0]`` is the stage leader."""
    layers: tuple[int, int]
    """Half-open range [start, end) of transformer layers run by this stage."""

    def __post_init__(self) -> None:
        _tuples(self, "devices", "layers")

    @property
    def tp(self) -> int:
        """Derived: tensor-parallel degree = number of devices."""
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        """Derived: end - start."""
        return self.layers[1] - self.layers[0]

    @property
    def leader(self) -> int:
        """Derived: ``devices[0]``."""
        return self.devices[0]


@dataclass(frozen=True)
class Pipeline:
    """One data-parallel replica: its own batch, micro-batch and stages."""

    batch_size: int
    """Sequences this pipeline processes per optimizer step (its share of the global batch)."""
    micro_batch_size: int
    """Sequences per micro-batch; divides ``batch_size``."""
    stages: tuple[Stage, ...]
    """Stages in execution order."""
    recompute: bool | None = None
    """Activation recomputation in every stage of this pipeline (re-run each layer's forward in its
    backward, keep only the layer inputs). ``None`` only while building: the Plan fills in its own
    setting (default True), so in a built Plan it is always a bool."""

    def __post_init__(self) -> None:
        _tuples(self, "stages")

    @property
    def num_micro_batches(self) -> int:
        """Derived: batch_size // micro_batch_size."""
        return self.batch_size // self.micro_batch_size

    @property
    def devices(self) -> tuple[int, ...]:
        """Derived: every device of every stage, in stage order."""
        return tuple(d for s in self.stages for d in s.devices)


@dataclass(frozen=True)
class Plan:
    """A complete asymmetric execution plan. Pure data; see :meth:`validate` for the rules."""

    pipelines: tuple[Pipeline, ...]
    """The data-parallel replicas."""
    num_layers: int
    """Transformer layers of the model the plan was made for."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe`` or ``1f1b``."""
    recompute: bool | None = None
    """Activation recomputation, every pipeline alike: a bool sets every pipeline's
    ``Pipeline.recompute``; ``None`` keeps each pipeline's own (True where it has none). Derived
    after construction: the common flag, or ``None`` when the pipelines differ (:attr:`recomputes`)."""
    dp_sharding: str = "ddp"
    """Data-parallel sharding across pipelines: ``ddp``, ``zero2`` or ``zero3``."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Free-form provenance (model, cluster, planner, source); not used by the runtime."""
    reduce_dtype: str | None = None
    """dtype gradients are summed in across pipelines (all-reduce / reduce-scatter): ``bf16`` or
    ``fp32``; ``None`` = the run's own (bf16 for bf16 runs, the parameter dtype otherwise). The cost
    model prices the data-parallel gradient traffic at this dtype's bytes."""
    idle_devices: tuple[int, ...] = ()
    """Cluster device ids the plan leaves without work, ascending (none by default). They are named,
    not merely absent, so that a job launched on the whole cluster knows which ranks stay out."""

    def __post_init__(self) -> None:
        # One source of truth per pipeline: a plan-wide bool wins (an explicit user setting),
        # else each pipeline's own flag, True where it has none (the plan default before
        # per-pipeline recomputation existed).
        _tuples(self, "pipelines", "idle_devices")
        if not isinstance(self.pipelines, tuple):
            raise PlanError("plan.pipelines", self.pipelines, "must be a list of Pipeline",
                            "pass pipelines=(Pipeline(batch_size, micro_batch_size, stages), ...)")
        for name, empty in (("idle_devices", ()), ("meta", {})):  # None: none (what the defaults are)
            if getattr(self, name) is None:
                object.__setattr__(self, name, empty)
        # a scalar or a string here was a TypeError / AttributeError from validate() or check_model()
        # ('' passed as no idle device at all)
        if not isinstance(self.idle_devices, tuple):
            raise PlanError("plan.idle_devices", self.idle_devices, "must be a list of device ids",
                            "pass idle_devices=(6, 7), or () for none")
        if not isinstance(self.meta, dict):
            raise PlanError("plan.meta", self.meta, "must be a mapping (what the plan was made for)",
                            "pass meta={'cluster': 'cpu_hetero4', 'model': 'llama_tiny'}, or leave it out")
        plan_wide = self.recompute
        if plan_wide is not None and not isinstance(plan_wide, bool):
            raise PlanError("plan.recompute", plan_wide, "a plan runs with recomputation or without: true or false",
                            "pass recompute=True or False (or None to keep each pipeline's own)")
        pipes = []
        for i, p in enumerate(self.pipelines):
            if not isinstance(p, Pipeline):  # not a plan at all: validate() names what is wrong
                pipes.append(p)
                continue
            if p.recompute is not None and not isinstance(p.recompute, bool):
                raise PlanError(f"plan.pipelines[{i}].recompute", p.recompute,
                                "a pipeline runs with recomputation or without: true or false", "write true or false")
            flag = plan_wide if plan_wide is not None else (True if p.recompute is None else p.recompute)
            pipes.append(p if p.recompute is flag else replace(p, recompute=flag))
        flags = {p.recompute for p in pipes if isinstance(p, Pipeline)}
        if not flags:  # no pipelines (validate() says so): the plan-wide setting, else the default
            common = True if plan_wide is None else plan_wide
        else:
            common = flags.pop() if len(flags) == 1 else None
        object.__setattr__(self, "pipelines", tuple(pipes))
        object.__setattr__(self, "recompute", common)

    # ---- derived -------------------------------------------------------------------------
    @property
    def recomputes(self) -> tuple[bool, ...]:
        """Derived: ``Pipeline.recompute`` of every pipeline, in order."""
        return tuple(p.recompute for p in self.pipelines)

    def with_recompute(self, flags: bool | Sequence[bool]) -> Plan:
        """This plan with recomputation set: one bool for every pipeline, or one per pipeline."""
        if isinstance(flags, bool):
            return replace(self, recompute=flags)
        if not isinstance(flags, (list, tuple)):  # None / 1 was a TypeError ('not iterable')
            raise PlanError("recompute", flags, "must be True, False or one flag per pipeline",
                            f"pass e.g. with_recompute(True) or with_recompute({[True] * self.num_pipelines})")
        flags = tuple(flags)
        if len(flags) != self.num_pipelines:
            raise PlanError("recompute", list(flags), f"one flag per pipeline: the plan has {self.num_pipelines}",
                            "give as many flags as pipelines, or one bool for all")
        return replace(self, recompute=None,
                       pipelines=tuple(replace(p, recompute=f) for p, f in zip(self.pipelines, flags)))

    @property
    def global_batch(self) -> int:
        """Derived: sum of pipeline batch sizes."""
        return sum(p.batch_size for p in self.pipelines)

    @property
    def device_order(self) -> tuple[int, ...]:
        """Derived: all device ids used, sorted; global rank r runs ``device_order[r]``."""
        return tuple(sorted(d for p in self.pipelines for d in p.devices))

    @property
    def world_size(self) -> int:
        """Derived: number of devices (= processes) the plan needs."""
        return len(self.device_order)

    @property
    def launch_order(self) -> tuple[int, ...]:
        """Derived: used and idle device ids, sorted; a job launched on all of them maps rank r to
        ``launch_order[r]`` (equal to ``device_order`` when nothing is idle)."""
        return tuple(sorted(self.device_order + tuple(self.idle_devices)))

    @property
    def num_pipelines(self) -> int:
        return len(self.pipelines)

    def rank_of(self, device: int) -> int:
        """Global rank that runs ``device``; a PlanError naming the plan's devices for one that runs no
        stage (an idle device, one the plan does not use, or no device id: tuple.index's ValueError before)."""
        if isinstance(device, bool) or device not in self.device_order:
            raise PlanError("Plan.rank_of(device)", shown(device), f"runs no stage of this plan: its stages run devices "
                            f"{list(self.device_order)}" + (f" (idle: {list(self.idle_devices)})" if self.idle_devices
                                                            else ""), "pass one of the plan's device ids")
        return self.device_order.index(device)

    # ---- validation ----------------------------------------------------------------------
    def validate(self, cluster: Cluster | None = None, model: LlamaConfig | None = None,
                 global_batch: int | None = None) -> Plan:
        """Check every rule; raise :class:`PlanError` naming the key, value, rule and fix.

        Rules: at least one pipeline; each device used at most once; each pipeline covers layers
        0..num_layers-1 once, in order; micro-batch divides batch; batches sum to ``global_batch``
        (when given); devices exist in ``cluster`` (when given); TP degree fits the model's heads
        (when ``model`` is given); ``num_layers`` matches the model. Returns ``self``.
        """
        from lightning_hexiscale.config.cluster import Cluster
        from lightning_hexiscale.models.config import LlamaConfig

        # was AttributeError: no attribute 'num_devices'
        check_argument_types("Plan.validate", (
            ("cluster", cluster, (Cluster, type(None)), "pass a Cluster: Cluster.load(name_or_path)"),
            ("model", model, (LlamaConfig, type(None)), "pass a LlamaConfig: LlamaConfig.load(name_or_path)")), PlanError)
        check_meta_record(self.meta)  # the model and cluster it records: read by check_model and the clients
        if self.schedule not in SCHEDULES:
            raise PlanError("plan.schedule", self.schedule, f"must be one of {SCHEDULES}", "pick one of them")
        if self.dp_sharding not in DP_SHARDINGS:
            raise PlanError("plan.dp_sharding", self.dp_sharding, f"must be one of {DP_SHARDINGS}", "pick one of them")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise PlanError("plan.reduce_dtype", self.reduce_dtype,
                            f"must be one of {REDUCE_DTYPES} or null (the run's own dtype)",
                            "use reduce_dtype: bf16 (half the bytes) or fp32, or leave it out")
        if not _whole(self.num_layers) or self.num_layers < 1:
            raise PlanError("plan.num_layers", self.num_layers, "must be a positive integer: the model's transformer "
                            "layers, which every pipeline's stages cover", "write e.g. num_layers: 32 (the model's num_layers)")
        if not self.pipelines:
            raise PlanError("plan.pipelines", [], "a plan needs at least one pipeline", "add a pipeline")
        if model is not None and self.num_layers != model.num_layers:
            raise PlanError("plan.num_layers", self.num_layers,
                            f"the model {model.name} has {model.num_layers} layers",
                            "plan for the same model, or choose the model the plan was made for")
        seen: dict[int, str] = {}
        for i, pipe in enumerate(self.pipelines):
            key = f"plan.pipelines[{i}]"
            if not isinstance(pipe, Pipeline):
                raise PlanError(key, pipe, "must be a Pipeline (batch_size, micro_batch_size, stages)",
                                "build it with Pipeline(...), or read plan files with Plan.from_dict / Plan.load")
            for name in ("batch_size", "micro_batch_size"):
                v = getattr(pipe, name)
                if not _whole(v) or v < 1:  # a bool is no batch size
                    raise PlanError(f"{key}.{name}", v, "must be a positive integer",
                                    f"write a whole number >= 1 in the plan file, e.g. {name}: {1 if name == 'micro_batch_size' else 8}")
            try:
                check_global_batch_bound(pipe.batch_size, f"{key}.batch_size")
            except ConfigError as e:
                raise PlanError(e.key, e.value, e.rule, e.fix) from None
            if pipe.batch_size % pipe.micro_batch_size:
                raise PlanError(f"{key}.micro_batch_size", pipe.micro_batch_size,
                                f"must divide the pipeline's batch_size={pipe.batch_size}",
                                "choose a micro-batch size that divides the batch")
            if not isinstance(pipe.stages, (tuple, list)) or not pipe.stages:
                raise PlanError(f"{key}.stages", pipe.stages, "a pipeline needs a list of at least one stage",
                                "list its stages in execution order")
            expect = 0
            for j, st in enumerate(pipe.stages):
                skey = f"{key}.stages[{j}]"
                if not isinstance(st, Stage):
                    raise PlanError(skey, st, "must be a Stage (devices, layers)", "build it with Stage(devices, layers)")
                if not isinstance(st.devices, (tuple, list)) or not st.devices:
                    raise PlanError(f"{skey}.devices", st.devices, "a stage needs a list of at least one device id",
                                    "list its devices, e.g. devices: [0, 1]")
                if (not isinstance(st.layers, (tuple, list)) or len(st.layers) != 2
                        or not all(_whole(x) for x in st.layers)):
                    raise PlanError(f"{skey}.layers", st.layers, "must be [start, end) with two integers",
                                    "write e.g. layers: [0, 20]")
                for d in st.devices:
                    if not _whole(d) or d < 0:  # True would run device 1
                        raise PlanError(f"{skey}.devices", list(st.devices), "device ids are integers >= 0",
                                        "use the ids of the cluster's devices")
                    if d in seen:
                        raise PlanError(f"{skey}.devices", list(st.devices),
                                        f"device {d} is already used by {seen[d]}; each device runs at most one stage",
                                        "use every device once")
                    seen[d] = skey
                    if cluster is not None and d >= cluster.num_devices:
                        raise PlanError(f"{skey}.devices", list(st.devices),
                                        f"device {d} does not exist: cluster {cluster.name} has devices "
                                        f"0..{cluster.num_devices - 1}", "use ids from the cluster")
                start, end = st.layers
                if start != expect or end <= start:
                    if start != expect:
                        fix = f"start this stage at {expect}"
                    elif start >= self.num_layers:  # [8, 8] after stages that end at the last layer
                        fix = (f"remove this stage: the stages before it run every layer (up to {self.num_layers}), "
                               "or give it layers of theirs")
                    else:  # [3, 3] starts right and is empty: "start this stage at 3" told nothing to change
                        fix = (f"give it at least one layer (the end is exclusive): layers: [{start}, {start + 1}], "
                               f"up to [{start}, {self.num_layers}]")
                    raise PlanError(f"{skey}.layers", list(st.layers),
                                    f"stage layers must be non-empty and continue at layer {expect} "
                                    f"(each pipeline covers layers 0..{self.num_layers - 1} once, in order)", fix)
                if end > self.num_layers:  # past the model: the fix is to end here, not to extend
                    raise PlanError(f"{skey}.layers", list(st.layers),
                                    f"the plan has {self.num_layers} layers (0..{self.num_layers - 1}); this stage "
                                    f"runs past the last", f"end it at layer {self.num_layers}: layers: [{start}, "
                                    f"{self.num_layers}] (or set num_layers to the model's)")
                expect = end
                if model is not None:
                    try:
                        model.check_tp(st.tp, key=f"{skey}.devices (TP degree)")
                    except ConfigError as e:
                        raise PlanError(e.key, e.value, e.rule, e.fix) from None
            if expect != self.num_layers:
                raise PlanError(f"{key}.stages", f"layers 0-{expect - 1}",
                                f"pipeline {i} covers layers 0-{expect - 1} of {self.num_layers}; "
                                "every pipeline must run every layer",
                                f"extend its last stage to layer {self.num_layers}")
        self._validate_idle(seen, cluster)
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise PlanError("plan.pipelines", [p.batch_size for p in self.pipelines],
                            f"the pipelines' batches sum to {self.global_batch:,}: more than {MAX_GLOBAL_BATCH:,} "
                            "sequences per optimizer step", "give the batches in sequences (not tokens)")
        if global_batch is not None and self.global_batch != global_batch:
            raise PlanError("train.global_batch", global_batch,
                            f"the plan's pipeline batches {[p.batch_size for p in self.pipelines]} sum to "
                            f"{self.global_batch}", f"set train.global_batch={self.global_batch} or re-plan")
        return self

    def check_model(self, model: LlamaConfig) -> None:
        """PlanError when the plan records that it was made for a model whose shape
        (:data:`MODEL_SHAPE_FIELDS`) differs from ``model``'s: ``meta.model_shape`` (written by
        ``hexiscale plan --out``), else the preset, model file or ``hf:`` directory that
        ``meta.model`` names when it is not ``model``'s name. A plan that records neither, or
        names a model that does not load here, is not checked (:meth:`validate` still checks the
        layer count and the TP degrees)."""
        check_plan_model(self, model)

    def _validate_idle(self, used: dict[int, str], cluster: Cluster | None) -> None:
        """``idle_devices``: distinct integer ids >= 0, in no stage, present in ``cluster`` (when given)."""
        idle = list(self.idle_devices)
        for d in idle:
            if not _whole(d) or d < 0:
                raise PlanError("plan.idle_devices", idle, "device ids are integers >= 0",
                                "list the ids of the cluster's devices that take no work")
            if d in used:
                raise PlanError("plan.idle_devices", idle,
                                f"device {d} is idle and also runs {used[d]}; a device is either idle or in one stage",
                                f"remove {d} from idle_devices or from that stage")
            if cluster is not None and d >= cluster.num_devices:
                raise PlanError("plan.idle_devices", idle,
                                f"device {d} does not exist: cluster {cluster.name} has devices "
                                f"0..{cluster.num_devices - 1}", "use ids from the cluster")
        if len(set(idle)) != len(idle):
            raise PlanError("plan.idle_devices", idle, "each idle device is listed once", "remove the repeated ids")

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (the plan file format); inverse of :meth:`from_dict`. ``idle_devices`` is
        written only when the plan has some, so plans without idle devices read as before; likewise
        ``recompute`` is one top-level flag when every pipeline has the same, else one per pipeline."""
        mixed = self.recompute is None
        out = {
            "num_layers": self.num_layers,
            "schedule": self.schedule,
            "recompute": self.recompute,
            "dp_sharding": self.dp_sharding,
            "reduce_dtype": self.reduce_dtype,
            "pipelines": [
                {
                    "batch_size": p.batch_size,
                    "micro_batch_size": p.micro_batch_size,
                    "stages": [{"devices": list(s.devices), "layers": list(s.layers)} for s in p.stages],
                    **({"recompute": p.recompute} if mixed else {}),
                }
                for p in self.pipelines
            ],
        }
        if mixed:
            del out["recompute"]
        if self.idle_devices:
            out["idle_devices"] = list(self.idle_devices)
        out["meta"] = plain(dict(self.meta))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        """Build from the plan-file dict; unknown or missing keys raise :class:`PlanError`. The
        top-level ``recompute`` (default true) is every pipeline's unless the pipeline has its own."""
        check_plan_keys(data, {"num_layers", "pipelines"}, {"schedule", "recompute", "dp_sharding", "reduce_dtype", "idle_devices", "meta"},
              source)
        pipes = []
        for i, p in enumerate(_listed(data["pipelines"], f"{source}.pipelines", "pipelines: [{batch_size: 8, "
                                      "micro_batch_size: 1, stages: [...]}]")):
            pkey = f"{source}.pipelines[{i}]"
            check_plan_keys(p, {"batch_size", "micro_batch_size", "stages"}, {"recompute"}, pkey)
            stages = []
            for j, s in enumerate(_listed(p["stages"], f"{pkey}.stages", "stages: [{devices: [0], layers: [0, 32]}]")):
                skey = f"{pkey}.stages[{j}]"
                check_plan_keys(s, {"devices", "layers"}, set(), skey)
                layers = s["layers"]
                if not isinstance(layers, (list, tuple)) or len(layers) != 2 or not all(_is_int(x) for x in layers):
                    raise PlanError(f"{skey}.layers", layers, "must be [start, end) with two integers",
                                    "write e.g. layers: [0, 20]")
                if not isinstance(s["devices"], (list, tuple)):
                    raise PlanError(f"{skey}.devices", s["devices"], "must be a list of device ids",
                                    "write e.g. devices: [0, 1]")
                stages.append(Stage(devices=tuple(s["devices"]), layers=(int(layers[0]), int(layers[1]))))
            pipes.append(Pipeline(batch_size=p["batch_size"], micro_batch_size=p["micro_batch_size"],
                                  stages=tuple(stages), recompute=_recompute_flag(p, pkey)))
        idle = data.get("idle_devices") or []
        if not isinstance(idle, (list, tuple)):
            raise PlanError(f"{source}.idle_devices", idle, "must be a list of device ids",
                            "write e.g. idle_devices: [6, 7]")
        if not isinstance(data.get("meta") or {}, dict):
            raise PlanError(f"{source}.meta", data["meta"], "must be a mapping (what the plan was made for)",
                            "write e.g. meta: {cluster: cpu_hetero4, model: llama_tiny}, or leave it out")
        recompute = _recompute_flag(data, source)
        pipes = [p if p.recompute is not None else replace(p, recompute=True if recompute is None else recompute)
                 for p in pipes]
        return cls(pipelines=tuple(pipes), num_layers=data["num_layers"], idle_devices=tuple(idle),
                   schedule=data.get("schedule", "1f1b"), recompute=None,
                   dp_sharding=data.get("dp_sharding", "ddp"), reduce_dtype=data.get("reduce_dtype"),
                   meta=dict(data.get("meta") or {}))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def to_json(self) -> str:
        """Strict JSON: a non-finite number (in ``meta``) is written null, not ``Infinity`` / ``NaN``,
        tokens that strict parsers (JavaScript's, jq) refuse; YAML keeps ``.inf``."""
        return json.dumps(finite_or_null(self.to_dict()), indent=2, allow_nan=False)

    def save(self, path: str | Path) -> None:
        """Write YAML (or JSON for a .json path) atomically (:func:`write_atomically`: a directory, a
        FIFO or a failed write is a ConfigError; a link is followed)."""
        text = self.to_json() if str(path).lower().endswith(".json") else self.to_yaml()  # plan.JSON too
        write_atomically(path, text)

    @classmethod
    def load(cls, path: str | Path, key: str = "plan") -> Plan:
        """Read a plan file (YAML or JSON): a path, else a packaged preset written as in a checkout
        (``conf/plans/X.yaml``), so the shipped plans load from any working directory. ``key``: what
        named the file, for the errors about it (``--plan``, a recipe's ``plan``, ``HexiScaleStrategy(plan)``)."""
        from lightning_hexiscale.config.file_errors import is_dir
        from lightning_hexiscale.config.schema import check_name_or_path, is_file, packaged_file
        from lightning_hexiscale.config.suggest import check_file_kind

        check_name_or_path(path, key, "conf/plans/case_study_llama2_13b.yaml", "Plan.from_dict(mapping)")
        path = Path(path)
        if not is_file(path):
            path = packaged_file(path) or path
        if not is_file(path):
            raise PlanError(key, str(path), "is a directory, not a plan file" if is_dir(path) else "no such plan file",
                            "give the path of a plan YAML/JSON file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:  # a checkpoint, a picture, a gzip: was a UnicodeDecodeError traceback
            raise PlanError(key, str(path), f"is not a text file (byte {e.start} is not UTF-8): a plan file is "
                            "YAML or JSON", "give the plan file `hexiscale plan --out` wrote (or one like "
                            "conf/plans/*.yaml)") from None
        except OSError as e:  # unreadable (permissions, an I/O error)
            raise PlanError(key, str(path), f"cannot be read ({e.strerror})",
                            "give a readable plan YAML/JSON file") from None
        try:
            data = yaml.load(named_stream(text, path), Loader=UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise PlanError(key, str(path), f"not valid YAML/JSON ({e})",
                            "correct the syntax at the line and column named (quote values holding ':' or '#')") from None
        if not isinstance(data, dict):  # an empty file was said to "hold a mapping" as if it held another thing
            held = "is empty" if data is None else f"holds a {type(data).__name__}"
            raise PlanError(key, str(path), f"{held}; a plan file holds a mapping (num_layers, pipelines, ...)",
                            "write one with `hexiscale plan --out plan.yaml` (examples: conf/plans/)")
        check_file_kind(data.keys(), "plan", key, str(path), PlanError)
        # the keys of its errors read as validate()'s do (plan.pipelines[0].stages ...), whichever of the
        # two finds the fault: the file name prefixed them here only, and the same file gave both forms
        return cls.from_dict(data)

    # ---- display -------------------------------------------------------------------------
    def table(self, cluster: Cluster | None = None) -> str:
        """A table like the paper's Tab. 7: pipeline, stage, GPUs, layers, TP (+ batch)."""
        from lightning_hexiscale.config.cluster import Cluster

        check_argument_types("Plan.table", (("cluster", cluster, (Cluster, type(None)),  # was an AttributeError
                                             "pass a Cluster: Cluster.load(name_or_path), or None"),), PlanError)
        mixed = self.recompute is None  # then a column says which pipelines recompute
        rows = [("pipeline", "batch/mb", "stage", "GPUs", "layers", "#", "TP") + (("recompute",) if mixed else ())]
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                gpus = _describe_devices(s.devices, cluster)
                rows.append((str(i) if j == 0 else "", f"{p.batch_size}/{p.micro_batch_size}" if j == 0 else "",
                             str(j), gpus, f"{s.layers[0]}-{s.layers[1] - 1}", str(s.num_layers), str(s.tp))
                            + (((("on" if p.recompute else "off") if j == 0 else ""),) if mixed else ()))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        reduce = f" (reduce in {self.reduce_dtype})" if self.reduce_dtype else ""
        p, d = self.num_pipelines, self.world_size
        on = ("per pipeline: " + ", ".join("on" if r else "off" for r in self.recomputes) if self.recompute is None
              else "on" if self.recompute else "off")
        head = (f"{p} pipeline{'s' * (p != 1)}, {d} device{'s' * (d != 1)}, global batch {self.global_batch}, "
                f"schedule {self.schedule}, dp {self.dp_sharding}{reduce}, recompute {on}")
        idle = ""
        if self.idle_devices:
            idle = f"\nidle: {_describe_devices(tuple(self.idle_devices), cluster)} (no work in this plan)"
        return head + "\n" + "\n".join(lines) + idle


def _describe_devices(devices: tuple[int, ...], cluster: Cluster | None) -> str:
    ids = ",".join(str(d) for d in devices)
    if cluster is None:
        return f"[{ids}]"
    types: dict[str, int] = {}
    for d in devices:
        if d < cluster.num_devices:
            t = cluster.devices[d].gpu_type
            types[t] = types.get(t, 0) + 1
    return " + ".join(f"{n}x{t}" for t, n in types.items()) + f" [{ids}]"


def _recompute_flag(data: dict[str, Any], where: str) -> bool | None:
    """``data['recompute']`` as a bool, None when absent; anything else (null too) is a PlanError."""
    value = data.get("recompute")
    if "recompute" in data and not isinstance(value, bool):  # bool("false") is True; a plan says what it runs
        raise PlanError(f"{where}.recompute", value, "a plan runs with recomputation or without: true or false",
                        "write recompute: true or recompute: false (auto is a planner setting, "
                        "train.recompute, that a plan's search resolves)")
    return value


def _tuples(obj: Any, *names: str) -> None:
    """Lists a caller passed (``Stage([0, 1], [0, 4])``) held as tuples, so that the plan equals its
    file round trip and hashes (the cost model's caches key on it); other types are validate()'s."""
    for name in names:
        if isinstance(getattr(obj, name), list):
            object.__setattr__(obj, name, tuple(getattr(obj, name)))


def _listed(value: Any, key: str, example: str) -> list:
    """A plan file's list (``pipelines``, ``stages``); null reads as empty, which validate() refuses."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise PlanError(key, value, "must be a list", f"write e.g. {example}")
    return list(value)


def _whole(x: Any) -> bool:
    """An int as a built plan holds one: not a bool (``True`` is no batch size or device id), not 4.0."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    """A whole number: an int (numpy's too) or a float without a fraction (4.0); not a bool, not 2.5."""
    import numbers

    if isinstance(x, bool):
        return False
    return isinstance(x, numbers.Integral) or (isinstance(x, float) and x.is_integer())

