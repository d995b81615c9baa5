"""Hydra structured configs: the typed schemas every YAML under conf/ extends, and composition.

Schemas are registered in Hydra's ConfigStore as ``<group>/base_<group>`` so a preset reads
``defaults: [base_cluster, _self_]`` and a misspelt key fails with "Key 'bandwith' not in ...".
Quantities with units stay strings here ("200 GB/s"); :mod:`lightning_hexiscale.config.cluster` parses them.
Nothing below the entry points reads argv: the CLI and recipes compose a config and pass it down.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from importlib import resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_hexiscale.config.compose_errors import SWEEP_FIX, compose_error, group_value_error, sweep_error
from lightning_hexiscale.config.layer_table import LayerTableConfig
from lightning_hexiscale.config.overrides import (HF_PLACEHOLDER, check_compose_arguments, hf_model_overrides,
                                                  reapply_overrides)
from lightning_hexiscale.config.recipe import DataConfig, TrainerConfig
from lightning_hexiscale.config.values import CONFIG_GROUPS
from lightning_hexiscale.config.file_errors import (  # noqa: F401 (is_file: re-exported)
    ENTRY_EXAMPLES, check_name_or_path, check_not_directory, clean_message, doc_page, expand_user, is_file,
    locate_entry)
from lightning_hexiscale.errors import ConfigError


@dataclass
class GpuTypeConfig:
    """A user-defined GPU type, or figures that override a catalog type's (``config/catalog.py``)
    field by field: a key naming a listed type (``H100``, ``A800``, an alias such as ``4090``)
    keeps the catalog's value of every field left out; a new type must give ``flops`` and ``memory``."""

    flops: Optional[str] = None
    """Peak dense 16-bit tensor throughput, e.g. "312 TFLOPS" (required for a new type)."""
    memory: Optional[str] = None
    """Device memory, e.g. "80 GiB" (required for a new type)."""
    efficiency: Optional[float] = None
    """Sustained fraction of ``flops`` the cost model assumes (FLOPs / (flops x efficiency)), as
    ``hexiscale calibrate`` fits it; null: not calibrated (CUDA plans use the roofline where the
    type has a ``memory_bandwidth``, else ``flops`` itself). In (0, 1] of a catalog type's datasheet
    ``flops``; in (0, 10] of a ``flops`` given here (``config.gpu_types.check_efficiency``)."""
    hopper: Optional[bool] = None
    fp32_flops: Optional[str] = None
    """Peak FP32 throughput without tensor cores, e.g. "67 TFLOPS": what 32-true runs at."""
    tf32_flops: Optional[str] = None
    """Peak dense TF32 tensor throughput (32-true with TF32 matmuls allowed)."""
    memory_bandwidth: Optional[str] = None
    """Device-memory bandwidth, e.g. "3.35 TB/s": the roofline's ceiling for memory-bound work."""
    gemm_efficiency: Optional[float] = None
    """Fraction of ``flops`` large GEMMs reach (``recipes/mfu_probe.py``'s GEMM ceiling); null: the
    roofline's default (``planner.cost.compute.DEFAULT_GEMM_EFFICIENCY``)."""
    hbm_efficiency: Optional[float] = None
    """Fraction of ``memory_bandwidth`` memory-bound kernels reach (the probe's HBM ceiling); null:
    ``planner.cost.compute.DEFAULT_HBM_EFFICIENCY``."""


@dataclass
class LinkConfig:
    """A network link class: bandwidth and latency (alpha-beta model)."""

    bandwidth: str = MISSING
    """e.g. "1 GB/s", "5.6 Gbps" (bits), "200 GB/s"."""
    latency: str = "10us"
    """One-message latency alpha, e.g. "10us"."""


@dataclass
class InterMachineConfig(LinkConfig):
    """The link between GPUs of different machines, unless ``machine_links`` or a matrix file say
    otherwise. ``bandwidth`` null (not given): priced at ``config.cluster.DEFAULT_INTER_MACHINE``
    (1 GB/s), a guess, and the planner says so (``Cluster.default_links``); it was the
    schema's silent default."""

    bandwidth: Optional[str] = None


@dataclass
class NicConfig:
    """A machine's network interfaces (NICs): what its GPUs reach other machines through.

    Concurrent transfers through one NIC share its bandwidth (the cost model divides it among them:
    ``planner/cost/nic.py``); a single transfer between two machines runs at most at the smaller of the
    link (``inter_machine``/``machine_links``) and the two NICs. Leaving ``nics`` out means one NIC
    at the machine's fastest link to another machine (``inter_machine.bandwidth`` unless
    ``machine_links`` or a matrix file say more)."""

    count: int = 1
    """Number of NICs, 1 to the machine's GPU count (each GPU uses one NIC)."""
    bandwidth: Optional[str] = None
    """Bandwidth of EACH NIC per direction, with its unit: "100 Gbps" (bits/s), "12.5 GB/s" (bytes/s);
    a bare number is an error. null = the machine's fastest link to another machine."""
    gpus: Optional[List[List[int]]] = None
    """Which GPUs use which NIC: one list of machine-local GPU indices (0 .. count-1) per NIC, every GPU
    exactly once, e.g. [[0, 1, 2, 3], [4, 5, 6, 7]]. null = contiguous blocks (GPU g of G uses NIC
    floor(g * count / G))."""
    to: Optional[List[Any]] = None
    """Per destination: [{machines: [names], bandwidth: "1 Gbps"}, ...]: what each NIC carries in traffic
    with those machines (a slower path to machines of another kind); every other machine: ``bandwidth``.
    A name matches a machine entry and all its ``repeat`` copies (``config/nics.py``)."""


@dataclass
class MachineConfig:
    """A machine (host) with ``count`` identical GPUs; ``repeat`` declares several identical machines."""

    gpu: str = MISSING
    """GPU type: a catalog name (A800, RTX4090, ...) or a key of ``gpu_types``."""
    count: int = MISSING
    """GPUs in this machine."""
    intra_bandwidth: Optional[str] = None
    """Bandwidth between two GPUs of this machine, e.g. "200 GB/s" (NVLink) or "32 GB/s" (PCIe);
    required when ``count`` > 1 (a machine of one GPU has no such link)."""
    intra_latency: str = "5us"
    name: Optional[str] = None
    """Label used in tables, machine links and ``nics.to``; left out: the GPU type and the entry's
    index (``A800-0``). An empty name is refused."""
    repeat: int = 1
    """Number of identical machines this entry stands for."""
    hostname: Optional[str] = None
    """Host name (set by the profiler; used to map ranks to machines)."""
    nics: Optional[NicConfig] = None
    """Network interfaces (:class:`NicConfig`); null = one NIC at the machine's fastest link to
    another machine. ``hexiscale profile`` writes the measured figure."""


@dataclass
class MachineLinkConfig:
    """Override of the inter-machine link between two named machines (e.g. an RDMA pair)."""

    machines: List[str] = MISSING
    bandwidth: str = MISSING
    latency: str = "10us"


@dataclass
class CalibrationConfig:
    """Cost-model constants (Appendix B theta overlap slowdowns); 1.0 = no slowdown. Fitted by the profiler."""

    theta_ddp: float = 1.0
    theta_zero2: float = 1.0
    theta_zero3_fwd: float = 1.0
    theta_zero3_bwd: float = 1.0


@dataclass
class ClusterConfig:
    """A cluster: machines, links, optional measured matrices."""

    name: str = MISSING
    description: str = ""
    machines: List[MachineConfig] = MISSING
    inter_machine: InterMachineConfig = field(default_factory=InterMachineConfig)
    """Default link between GPUs of different machines (bandwidth not given: 1 GB/s, with a notice)."""
    machine_links: List[MachineLinkConfig] = field(default_factory=list)
    gpu_types: Dict[str, GpuTypeConfig] = field(default_factory=dict)
    matrix_file: Optional[str] = None
    """YAML/JSON with ``bandwidth_Bps`` and ``latency_s`` N x N matrices that override the links
    (profiled clusters). Relative paths are resolved against the working directory, then conf/."""
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    layer_times: List[LayerTableConfig] = field(default_factory=list)
    """Measured layer times per device type, TP degree and micro-batch size (``hexiscale profile
    --model``); see :mod:`lightning_hexiscale.config.layer_table` for the fields and units."""


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling of Llama 3.1 / 3.2 (see :class:`lightning_hexiscale.models.config.RopeScaling`)."""

    rope_type: str = "llama3"
    """Only ``llama3`` is implemented; any other type is refused with a ConfigError naming it."""
    factor: float = MISSING
    low_freq_factor: float = MISSING
    high_freq_factor: float = MISSING
    original_max_position_embeddings: int = MISSING


@dataclass
class ModelConfig:
    """A LLaMA shape (see :class:`lightning_hexiscale.models.config.LlamaConfig`)."""

    name: str = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    ffn_hidden_size: int = MISSING
    vocab_size: int = MISSING
    seq_len: int = MISSING
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScalingConfig] = None
    """null = plain RoPE; ``{rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}`` for Llama 3.1 / 3.2."""
    tie_word_embeddings: bool = False
    """The LM head reuses the token embedding (Llama 3.2 1B / 3B)."""
    max_position_embeddings: Optional[int] = None
    """Longest context the model supports (config.json's value); null = seq_len."""


@dataclass
class TrainConfig:
    """Training workload settings shared by the planner, the estimate and the recipes."""

    global_batch: int = 32
    """Sequences per optimizer step, summed over pipelines."""
    micro_batch_size: Optional[int] = None
    """Sequences per micro-batch; None lets the planner choose."""
    schedule: str = "1f1b"
    """gpipe or 1f1b."""
    recompute: Any = "auto"
    """Activation recomputation per layer: auto (the planner prices both and keeps the faster plan that fits), true or false."""
    dp_sharding: str = "ddp"
    """ddp, zero2 or zero3 across pipelines (the search picks one unless this is given explicitly)."""
    memory_headroom: float = 0.0
    """Fraction of every device's memory the planner keeps free (0 <= x < 1): a plan fits when each
    device's estimated peak is at most (1 - memory_headroom) x its memory."""


@dataclass
class PlannerConfig:
    """Search settings (§4)."""

    iterations: int = 50
    seed: int = 0
    tau: int = 2
    """Top-tau greedy stage-order search width."""
    balance: float = 1.2
    """Max (heaviest part compute) / (mean part compute) in the phase-1 partition."""
    max_pipelines: Optional[int] = None
    progress: bool = True
    """A tqdm bar on stderr while searching, drawn only when stderr is a terminal (or a Jupyter kernel's)."""
    cut: str = "auto"
    """Phase-1 cut between pipelines (§4.4): auto (moving averages of simulated DP and pipeline
    costs), min (pipelines on well-connected islands) or max (every machine dealt over the pipelines)."""
    group_balance: float = 2.0
    """Max / mean group compute in the phase-2 split of a pipeline into groups (looser than
    ``balance``: layers follow compute, so groups may differ)."""
    use_all_devices: bool = False
    """False: the plan may leave devices idle where it is faster without them (machine subsets are
    searched too; the plan names them in ``idle_devices``). True: every device takes work."""
    allow_table_mismatch: bool = False
    """A layer table measured on another model shape or precision (or without a TP degree the plan
    uses) is a ConfigError (False) or a warning and FLOP/s pricing of that type (True)."""


@dataclass
class HexiScaleConfig:
    """The root config composed by the CLI and recipes."""

    cluster: ClusterConfig = MISSING
    model: ModelConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    # hexiscale train: see lightning_hexiscale/config/recipe.py (ignored by the CLI).
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    plan: Optional[str] = None
    """A plan file for the recipe; null = plan with the search on the cluster."""
    dry_run: bool = False
    """hexiscale train: plan, print the plan and its estimate, and exit without training."""


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=HexiScaleConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="planner", name="base_planner", node=PlannerConfig)


def is_group_choice(override: str) -> bool:
    """``override`` chooses a preset (``cluster=cpu2``, a group of the user's own, ``hydra/launcher=...``),
    as opposed to setting a key (``train.global_batch=8``) or a root value (``dry_run=true``, ``trainer=...``),
    whose bad values must not stop the composition of the groups that the keys are checked against."""
    name = override.partition("=")[0].lstrip("+~")
    roots = {f.name for f in dataclasses.fields(HexiScaleConfig)}
    return "." not in name and (name not in roots or name in CONFIG_GROUPS)


def conf_dir() -> Path:
    """The presets directory: ``$HEXISCALE_CONF_DIR`` when set (an override), else the package data
    ``lightning_hexiscale/conf`` found through :mod:`importlib.resources`, so an installed wheel has its
    presets without any environment variable (a source checkout's top-level ``conf`` links there).

    Hydra composes from a directory on disk, so a package imported from a zip archive is refused."""
    if env := os.environ.get("HEXISCALE_CONF_DIR"):
        return Path(env).resolve()
    res = resources.files("lightning_hexiscale") / "conf"
    if not isinstance(res, Path):
        raise ConfigError("HEXISCALE_CONF_DIR", None,
                          f"unset, and the package's presets are not a directory on disk ({res})",
                          "install lightning-hexiscale unpacked (pip install), or set HEXISCALE_CONF_DIR "
                          "to a copy of its conf/ directory")
    if not res.is_dir():
        raise ConfigError("HEXISCALE_CONF_DIR", None, f"unset, and the package's presets are missing ({res})",
                          "reinstall lightning-hexiscale from a wheel or checkout that has "
                          "lightning_hexiscale/conf, or set HEXISCALE_CONF_DIR to a conf/ directory")
    return res


def packaged_file(path: str | Path) -> Path | None:
    """The preset file a relative ``path`` names inside :func:`conf_dir`, or None.

    ``path`` may be written as in a source checkout (``conf/plans/X.yaml``) or relative to the presets
    directory (``plans/X.yaml``), so the paths the docs and ``hexiscale list`` print also work after
    ``pip install``, from any working directory. Absolute paths are never redirected."""
    p = Path(path)
    if p.is_absolute():
        return None
    parts = p.parts[1:] if p.parts[:1] == ("conf",) else p.parts
    cand = conf_dir().joinpath(*parts) if parts else None
    return cand if cand is not None and is_file(cand) else None


def matrix_file_path(cluster_file: str | Path, matrix_file: str | Path) -> Path:
    """The file a cluster file's ``matrix_file`` names: an absolute path as written; a relative one
    beside the cluster file first (a profiled cluster moves as a pair), then from the working
    directory, then among the presets (:func:`packaged_file`). One rule for every reader and writer:
    ``hexiscale calibrate`` rewrote the matrix file it looked up from the working directory only, so a
    pair that loaded failed after the whole measurement, or rewrote another file of that name."""
    m = Path(expand_user(str(matrix_file)))
    if m.is_absolute():
        return m
    beside = Path(cluster_file).resolve().parent / m
    if beside.is_file():
        return beside
    return m if m.is_file() else (packaged_file(m) or beside)


def preset_names(group: str) -> list[str]:
    """Names of the YAML presets in conf/<group>/ (``_``-prefixed files are placeholders, not presets)."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml") if not p.stem.startswith("_"))


def load_preset(group: str, name_or_path: str, schema: type, key: str | None = None) -> DictConfig:
    """A preset name (conf/<group>/NAME.yaml) or a path to a YAML file, checked against ``schema``.

    ``key``: what named it (a flag such as ``--model``), for the errors about the name and the whole
    file; a close preset is then written as that key takes it (``did you mean --model llama_tiny?``,
    :func:`~lightning_hexiscale.config.suggest.written`). Default: the group, as the API's loaders
    (``Cluster.load``, ``LlamaConfig.load``) are called, with the preset's name quoted."""
    from lightning_hexiscale.config.suggest import check_model_hub_id, written

    check_name_or_path(name_or_path, key or group, {"cluster": "cpu_hetero4", "model": "llama_tiny"}.get(group, "NAME"))
    p = Path(name_or_path)
    if not is_file(p):
        p = conf_dir() / group / f"{name_or_path}.yaml"
        if not is_file(p):
            check_not_directory(name_or_path, key or group, group)  # was 'no such preset or file'
            names = preset_names(group)
            if group == "model":
                check_model_hub_id(key, str(name_or_path), names)
            fix = f"use a path or one of: {', '.join(names)}"
            near = difflib.get_close_matches(str(name_or_path), names, n=1, cutoff=0.6)
            if near:  # quoted for the API's loaders, else as the key takes it (--model llama_tiny)
                fix = f"did you mean {repr(near[0]) if key is None else written(key, near[0])}? (or {fix})"
            raise ConfigError(key or group, str(name_or_path), "no such preset or file", fix)
    return load_yaml_node(p, schema, group, named=key)


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose conf/<config_name>.yaml with Hydra-style overrides (``cluster=hetero3 train.global_batch=64``).

    ``cluster=path/to/file.yaml`` (an existing file) loads that file as the cluster instead of a
    preset, checked against the same schema. ``model=hf:/path/to/dir`` takes the model shape from a
    local Hugging Face directory's config.json (:mod:`lightning_hexiscale.config.hf_model`) and sets
    ``trainer.weights`` to the directory, so the recipe starts from its weights; ``model.*``
    overrides (e.g. ``model.seq_len=2048``) apply on top of a file or HF model too. Errors come back
    as :class:`ConfigError`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_compose_arguments(overrides, config_name)
    register_configs()
    files: dict[str, str] = {}
    rest: list[str] = []
    overrides = hf_model_overrides(list(overrides))
    from lightning_hexiscale.config.suggest import check_file_refs, check_interpolations

    check_file_refs(overrides, {g: preset_names(g) for g in ("cluster", "model")})
    for o in overrides:  # cluster=a,b: a sweep's values, which one composition cannot take (-m splits them first)
        error = sweep_error(o, SWEEP_FIX)
        if error is not None:
            raise error
    for o in overrides:  # model=[a,b]: Hydra merges both presets without a word, planner=5 is its raw message
        error = group_value_error(o, preset_names)
        if error is not None:
            raise error
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("cluster", "model") and value.endswith((".yaml", ".yml")) and is_file(value):
            files[key] = value
        else:
            rest.append(o)
    GlobalHydra.instance().clear()
    error = None
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=rest)
    except Exception as e:  # Hydra wraps every composition error; keep its message, drop the traceback
        error = compose_error(e, rest, preset_names,
                              {n: v for n, v in globals().items() if dataclasses.is_dataclass(v)}, config_name, conf_dir())
    finally:
        GlobalHydra.instance().clear()
    if error is not None or any(o.startswith("+") for o in rest):
        # Hydra's message for a misspelt key or a wrong type names every override and no fix, and it
        # accepts +train.global_bach=8 (a key nothing reads): name the one key, with the closest field
        _check_override_keys(rest, config_name)
    if error is not None:
        raise error
    _check_added_top_keys(cfg, rest)
    for key, path in files.items():
        node = load_yaml_node(path, ClusterConfig if key == "cluster" else ModelConfig, key)
        OmegaConf.set_struct(cfg, False)
        cfg[key] = node
        OmegaConf.set_struct(cfg, True)
        reapply_overrides(cfg, key, rest)
    resolve_hf_model(cfg, rest)
    check_interpolations(cfg)  # ${oc.env:UNSET} names its key here, not in a traceback where it is read
    from lightning_hexiscale.config.suggest import check_flag_overrides

    check_flag_overrides(cfg, rest)
    return cfg


def _check_added_top_keys(cfg: DictConfig, overrides: list[str]) -> None:
    """``+max_steps=3`` (Hydra's own advice for ``max_steps=3``) composes: it adds a top-level value
    that nothing reads, and the run trains the default steps. Refused with the key it meant. A
    ``+group=option`` of a config group adds a mapping, or nothing under ``@package _global_``,
    never a plain value: those pass."""
    roots = {f.name for f in dataclasses.fields(HexiScaleConfig)}
    for o in overrides:
        key, _, value = o.partition("=")
        name = key.lstrip("+")
        if (key.startswith("+") and "." not in name and name not in roots and name in cfg
                and not isinstance(cfg._get_node(name), DictConfig)):
            from lightning_hexiscale.config.suggest import top_key_error

            raise top_key_error(name, value, HexiScaleConfig)


def _check_override_keys(overrides: list[str], config_name: str) -> None:
    """Check every ``a.b=v`` override against the config its group selections compose to
    (:func:`~lightning_hexiscale.config.suggest.check_override_key`); returns when those do not
    compose (the caller reports that error)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_hexiscale.config.suggest import check_override_key

    # the groups' presets alone (model=_hf needs its trainer.weights: the default model has the same schema)
    groups = [o for o in overrides if is_group_choice(o) and not o.startswith(("+", "~", f"model={HF_PLACEHOLDER}"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            base = hydra_compose(config_name=config_name, overrides=groups)
    except Exception:  # noqa: BLE001 -- a bad group selection: the caller's own error says which
        return
    finally:
        GlobalHydra.instance().clear()
    for o in overrides:
        check_override_key(base, o)


def resolve_hf_model(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Fill the ``model=_hf`` placeholder from ``trainer.weights``/config.json (in place), then apply the
    explicit ``model.*`` overrides again (they were applied to the placeholder). Idempotent."""
    if cfg.model.get("name") != HF_PLACEHOLDER:
        return cfg
    from lightning_hexiscale.config.hf_model import model_fields_from_hf, read_hf_config

    weights = cfg.trainer.get("weights") if "trainer" in cfg else None
    if not weights:
        raise ConfigError("model", HF_PLACEHOLDER, "the model shape comes from a Hugging Face directory",
                          "write model=hf:/path/to/dir (or model=_hf trainer.weights=/path/to/dir)")
    d = expand_user(str(weights))
    seq = next((o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+") == "model.seq_len"), None)
    fields = model_fields_from_hf(read_hf_config(d, "trainer.weights"), f"hf:{d.resolve()}",
                                  int(seq) if seq is not None else None, where=str(d / "config.json"))
    try:
        node = OmegaConf.merge(OmegaConf.structured(ModelConfig), fields)
    except Exception as e:
        raise ConfigError("model", f"hf:{d}", clean_message(str(e)), "check config.json") from None
    OmegaConf.set_struct(cfg, False)
    cfg.model = node
    OmegaConf.set_struct(cfg, True)
    reapply_overrides(cfg, "model", overrides)
    return cfg


def _scalar_document(path: str | Path) -> object | None:
    """The value of a YAML file that reads as one scalar (``5``, ``llama_tiny``), else None."""
    try:
        value = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return value if isinstance(value, (str, int, float, bool)) else None


def load_yaml_node(path: str | Path, schema: type, key: str, named: str | None = None) -> DictConfig:
    """Load one YAML file and check it against ``schema`` (unknown keys and wrong types fail).
    ``key``: the file's group (``model``), the prefix of the keys inside it (``model.hidden_size``);
    ``named``: what named the file, for the errors about the whole file (default ``key``)."""
    named = named or key
    value = _scalar_document(path)
    if value is not None:  # OmegaConf: "Invalid loaded object type: int", or a key 'llama_tiny' without a value
        raise ConfigError(named, str(path), f"the file holds one value ({type(value).__name__} {value!r}), not a "
                          f"mapping of keys", f"write the {key}'s keys in it (key: value per line); see {doc_page(key)}")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:
        raise ConfigError(named, str(path), f"cannot read YAML ({e})",
                          "correct the syntax at the line and column named (quote values holding ':' or '#')") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(named, str(path), "the file holds a list, not a mapping of keys",
                          f"see {doc_page(key)} for the format and `hexiscale list` for the presets")
    if isinstance(raw, DictConfig) and "defaults" in raw:
        raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "defaults"])
    if len(raw) == 0:
        raise ConfigError(named, str(path), "the file is empty", f"describe the {key} in it; see {doc_page(key)}")
    from lightning_hexiscale.config.suggest import check_file_kind, check_interpolations, check_yaml_keys

    check_file_kind(raw.keys(), "cluster" if schema is ClusterConfig else "model", named, str(path))
    check_yaml_keys(raw, schema, key, str(path))  # a typo (bandwith) names the closest key
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), raw)
    except Exception as e:
        raise merge_error(e, OmegaConf.to_container(raw), key, str(path)) from None
    check_interpolations(node, key)  # missing_keys resolves them: ${oc.env:UNSET} would be its traceback
    check_missing(node, key, str(path))
    # A relative matrix_file is first looked up next to the cluster file itself, so a profiled
    # cluster (YAML + matrix) can be moved as a pair.
    if schema is ClusterConfig and node.matrix_file and not Path(node.matrix_file).is_absolute():
        beside = Path(path).resolve().parent / node.matrix_file
        if beside.is_file():  # else as written: the working directory, then conf/ (matrix_file_path's order)
            node.matrix_file = str(beside)
    return node


def check_missing(node: DictConfig, key: str, where: str) -> None:
    """A required key (``MISSING`` in the schema) left out of ``node`` is a ConfigError naming it,
    rather than OmegaConf's ``'???'`` read as a value further on."""
    missing = sorted(OmegaConf.missing_keys(node))
    if missing:
        raise ConfigError(f"{key}.{missing[0]}", None, f"a required key is missing (in {where})",
                          f"add {missing[0].split('.')[-1]}: ... (see {doc_page(key)})")


def merge_error(e: Exception, data: Any, key: str, where: str) -> ConfigError:
    """The ConfigError for OmegaConf's error merging ``data`` (a plain container) into ``key``'s
    schema; ``where``: the file (or what stands for it). OmegaConf names the field but not where it
    sits in a list (``count`` for ``machines[1].count``): it is looked up."""
    full_key = getattr(e, "full_key", None) or ""
    number_key = re.match(r"Key (\S+) \((int|float|bool)\) is incompatible with \(str\)", str(e))
    if number_key and full_key:  # gpu_types: {4090: ...}: OmegaConf's message named neither key nor fix
        return ConfigError(f"{key}.{full_key}", number_key.group(1), f"YAML read this key as {number_key.group(2)}; "
                           f"the keys here are names, so text (in {where})",
                           f'quote it in the file: "{number_key.group(1)}": ...')
    found = locate_entry(data, full_key, str(e))
    bad = f"{key}.{found[0]}" if found else key
    conv = re.match(r"Value '.*' of type '(\w+)' could not be converted to (Integer|Float|Boolean)", str(e), re.S)
    if conv and found:  # count: 2.5 / true / "two": OmegaConf's own sentence named the Python types only
        what, example = {"Integer": ("a whole number", "8"), "Float": ("a number", "0.5"),
                         "Boolean": ("true or false", "true")}[conv.group(2)]
        read = {"str": "text", "bool": "a flag", "float": "a number with a fraction",
                "int": "a whole number"}.get(conv.group(1), conv.group(1))
        field_ = found[0].split(".")[-1]
        return ConfigError(bad, found[1], f"must be {what}; YAML read {read} (in {where})",
                           f"write e.g. {field_}: {example} (see {doc_page(key)})")
    entry = re.match(r"Invalid type assigned: (\w+) is not a subclass of (\w+)", str(e))
    schema = globals().get(entry.group(2)) if entry else None
    if found and dataclasses.is_dataclass(schema):  # machines: [a, b]: an entry is a str, not a mapping
        names = ", ".join(f.name for f in dataclasses.fields(schema))
        example = ENTRY_EXAMPLES.get(schema.__name__, "").format(name=found[1] if isinstance(found[1], str) else "a")
        field_ = re.sub(r"\[\d+\]$", "", found[0]).split(".")[-1]
        return ConfigError(bad, found[1], f"an entry of {field_} must be a mapping with the keys {names} "
                           f"({schema.__name__}), not {'an' if entry.group(1)[0] in 'aeiou' else 'a'} {entry.group(1)} (in {where})",
                           f"write it as e.g. {example} (see {doc_page(key)})" if example
                           else f"write it as a mapping of those keys (see {doc_page(key)})")
    return ConfigError(bad, found[1] if found else where, f"{clean_message(str(e))} (in {where})",
                       f"see {doc_page(key)} for the format of this file")


def to_container(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
