"""The environment of one ``hexiscale train`` job: which process this is, what the command line
overrode, where the run writes, and the command line's checks before Hydra composes it.

Every rank of a run executes the same command: the popen launcher (Lightning's default here)
re-runs it once per extra rank with ``LOCAL_RANK`` set, torchrun and SLURM start it once per GPU.
The helpers below tell the ranks apart by their environment variables, never by argv.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.config.file_errors import expand_user, is_dir
from lightning_hexiscale.config.schema import is_file as schema_is_file
from lightning_hexiscale.runtime.host import slurm_launched


@dataclass(frozen=True)
class AppName:
    """How the app names itself in its messages and in the launch commands it prints.

    ``hexiscale train`` and the ``recipes/train.py`` wrapper run the same job; each prints its own
    name, so that a command copied from a message runs what the user ran."""

    prog: str = "hexiscale train"
    """Prefix of the messages on stderr (``hexiscale train: error: ...``)."""
    torchrun: str = "--no-python hexiscale train"
    """What follows torchrun's own options in the printed launch command."""
    srun: str = "hexiscale train"
    """What follows srun's own options in the printed launch command."""


HEXISCALE = AppName()
RECIPE = AppName(prog="recipes/train.py", torchrun="recipes/train.py", srun="python recipes/train.py")


def is_rank_zero() -> bool:
    """The launching process or global rank 0 (popen children and torchrun/SLURM ranks have env vars)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    if slurm_launched() and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def say(*args) -> None:
    """print() on rank 0 only, flushed (the ranks' lines would interleave otherwise)."""
    if is_rank_zero():
        print(*args, flush=True)


def overrides_given() -> list[str]:
    """The overrides of this job's command line (of this sweep point under ``-m``); [] outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_point() -> int:
    """This job's number in its ``-m`` sweep (Hydra's ``#N``, from 0); 0 outside a sweep."""
    from hydra.core.hydra_config import HydraConfig

    return int(HydraConfig.get().job.num) if HydraConfig.initialized() else 0


def not_run_line(argv: list[str], stopped: int) -> str:
    """Which jobs of the sweep on ``argv`` (the overrides Hydra swept) did not run after job #``stopped``:
    the cartesian product of the swept values, in the order of Hydra's basic sweeper, named by the
    values that vary (``#1 trainer.lr=0.002``)."""
    import itertools

    from lightning_hexiscale.cli.common import sweep_axes

    args = [a for a in argv if not a.startswith("-") and "=" in a]
    axes = [values for values in sweep_axes(args) if len(values) > 1]
    points = list(itertools.product(*axes))
    left = [f"#{i} {' '.join(p)}" for i, p in enumerate(points) if i > stopped]
    if not left:
        return "it was the sweep's last job"
    shown = "; ".join(left[:8]) + (f"; and {len(left) - 8} more" if len(left) > 8 else "")
    return f"{len(left)} of its {len(points)} jobs did not run ({shown})"


def output_dir(cfg: DictConfig) -> Path:
    """trainer.output_dir, else Hydra's run directory, resolved to a plain path now: spawned workers
    have no HydraConfig to resolve ``${hydra:...}`` with."""
    if cfg.trainer.output_dir:
        return Path(cfg.trainer.output_dir).resolve()
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir).resolve() if HydraConfig.initialized() else Path.cwd()


def is_popen_child() -> bool:
    """A rank that Lightning's popen launcher started (it records Ctrl-C instead of raising it; rank 0
    ends the job)."""
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ and not slurm_launched()


# ---- the command line, before Hydra --------------------------------------------------------------
def check_overrides(argv: list[str]) -> None:
    """Compose the command line's overrides with the project's own composer before Hydra does.

    Hydra reports an unknown preset (``cluster=nope``) or key with a traceback hint and exit status
    1, before any code of ours runs; :func:`~lightning_hexiscale.config.schema.compose` raises a
    ConfigError that names the key, the value, the rule and the available presets. A key that no
    schema has is refused with or without ``+`` (Hydra accepts ``+trainer.max_step=3`` and trains the
    default 40 steps), with the closest valid key (:mod:`lightning_hexiscale.config.suggest`). A
    multirun sweep (``cluster=a,b``) is checked one value at a time, the other keys at their first value.
    """
    from lightning_hexiscale.cli.common import axis_points, sweep_axes
    from lightning_hexiscale.config.compose_errors import sweep_error
    from lightning_hexiscale.config.schema import compose, conf_dir, is_group_choice
    from lightning_hexiscale.config.suggest import check_override_key

    args = [a for a in argv if not a.startswith("-") and "=" in a and not a.lstrip("+~").startswith("hydra.")]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    axes = sweep_axes(args)  # Hydra's sweep grammar: range(8,17,8), choice(..), a quoted 'a,b'
    first = [values[0] for values in axes]
    # the user's own config directories, as Hydra's run will compose them; a primary config of theirs
    # (--config-name) is found only through them, which Hydra's compose API does not search for the
    # primary: its overrides are checked against the package's config.yaml, as before
    where, name = search_path(argv), flag_value(argv, ("--config-name", "-cn")) or "config"
    if not (conf_dir() / f"{name}.yaml").is_file():
        name = "config"

    def check(overrides: list[str]) -> DictConfig:
        return compose([*where, *overrides], config_name=name)

    for a in args if not multirun else ():  # cluster=a,b without -m: a sweep (compose's own fix names no app)
        error = sweep_error(a, "add -m (--multirun) to the command to run one job per value")
        if error is not None:
            raise error

    # the groups' presets alone (model=_hf needs its trainer.weights: the default model has the same schema)
    base = check([a for a in first if is_group_choice(a) and not a.startswith("model=_hf")])
    for a in first:
        check_override_key(base, a)
    if not multirun:
        check(args)
        return
    check_sweep_output(axes)
    for point in axis_points(axes):
        check(point)


def check_sweep_output(axes: list[list[str]]) -> None:
    """A sweep of several jobs with one fixed ``trainer.output_dir``: every job would write its plan, config
    and checkpoints into that one directory, each over the one before (Hydra gives each job its own
    ``hydra.sweep.dir/<job number>`` only when the output directory is left to it)."""
    from lightning_hexiscale.errors import ConfigError

    fixed = [v for values in axes if len(values) == 1 for v in values
             if v.lstrip("+").partition("=")[0] == "trainer.output_dir" and "${" not in v]
    jobs = 1
    for values in axes:
        jobs *= len(values)
    if fixed and jobs > 1:
        value = fixed[-1].partition("=")[2]
        raise ConfigError("trainer.output_dir", value, f"the sweep runs {jobs} jobs, and each would write its plan, "
                          "config and checkpoints into this one directory over the one before",
                          "leave trainer.output_dir out (each job writes into hydra.sweep.dir/<job number>), or make it "
                          f"per job: trainer.output_dir='{value.rstrip('/')}/${{hydra:job.num}}'")


def flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of a Hydra flag written ``--flag VALUE`` or ``--flag=VALUE`` (the last one given), or None."""
    found = None
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.partition("=")[0] in names and "=" in a:
            found = a.partition("=")[2]
    return found


def search_path(argv: list[str]) -> list[str]:
    """``--config-dir DIR`` (``-cd``) and ``hydra.searchpath=[...]`` of the command line as the one
    ``hydra.searchpath`` override that composes like Hydra's run: their presets after the package's,
    the directories in Hydra's order (``--config-dir``'s first). [] when the command line has neither."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from lightning_hexiscale.errors import ConfigError

    given = ([argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config-dir", "-cd")]
             + [a.partition("=")[2] for a in argv if a.startswith(("--config-dir=", "-cd="))])
    for d in given:  # Hydra stops on it too, with exit status 1 and a pointer to HYDRA_FULL_ERROR
        if not is_dir(expand_user(d)):
            raise ConfigError("--config-dir", d, "no such directory", "give the directory that holds your cluster/, "
                              "model/ (...) presets, e.g. --config-dir ./my_conf for ./my_conf/cluster/mine.yaml")
    dirs = [f"file://{expand_user(d).resolve()}" for d in given]
    for a in argv:
        if a.lstrip("+").partition("=")[0] == "hydra.searchpath":
            try:
                (ov,) = OverridesParser.create().parse_overrides([a])
                dirs += [str(d) for d in ov.value()]
            except (HydraException, TypeError):  # not a list: Hydra's run reports it
                pass
    return [f"hydra.searchpath=[{','.join(dirs)}]"] if dirs else []


FILES_ENV = "HEXISCALE_RECIPE_FILES"
"""``cluster=`` / ``model=`` YAML files of the command line, as JSON, for the job and the popen children."""


def take_file_overrides(argv: list[str]) -> list[str]:
    """``cluster=my_cluster.yaml`` (e.g. from ``hexiscale profile``) or ``model=my_model.yaml``: Hydra
    would look for a preset of that name and stop with "Could not find"; the overrides are taken out
    of the command line (Hydra composes the default preset) and the files replace it in the job
    (:func:`apply_file_overrides`), as ``hexiscale plan`` does; in a ``-m`` sweep too, for every point
    alike. A sweep over files (``cluster=a.yaml,b.yaml``) is refused: Hydra sweeps presets."""
    from lightning_hexiscale.cli.common import sweep_axes
    from lightning_hexiscale.errors import ConfigError

    def is_file(value: str) -> bool:
        return value.endswith((".yaml", ".yml")) and schema_is_file(value)

    files, rest = {}, []
    for a in argv:
        key, _, value = a.partition("=")
        if key in ("cluster", "model") and is_file(value):
            files[key] = str(Path(value).resolve())
            continue
        points = [p.partition("=")[2] for p in sweep_axes([a])[0]] if key in ("cluster", "model") else []
        named = next((p for p in points if is_file(p)), None)
        if len(points) > 1 and named is not None:
            raise ConfigError(key, value, f"a -m sweep chooses among presets, and {named} is a file",
                              f"put the files in a directory of your own as DIR/{key}/NAME.yaml and sweep their "
                              f"names: --config-dir DIR {key}={','.join(Path(p).stem for p in points)}")
        rest.append(a)
    if files:
        os.environ[FILES_ENV] = json.dumps(files)
    return rest


def cluster_file_given() -> list[str]:
    """``[cluster=PATH]`` for the cluster file this job runs on (given as ``cluster=FILE`` or discovered:
    :func:`take_file_overrides`, ``train_discover``), else ``[]``."""
    path = json.loads(os.environ.get(FILES_ENV, "{}")).get("cluster")
    return [f"cluster={path}"] if path else []


def apply_file_overrides(cfg: DictConfig) -> None:
    """Replace the ``cluster`` / ``model`` nodes by the files :func:`take_file_overrides` took out, then
    apply the command line's ``cluster.*`` / ``model.*`` overrides to them again (Hydra applied them to
    the default preset the file replaces), as ``hexiscale plan`` does."""
    from lightning_hexiscale.config.overrides import reapply_overrides
    from lightning_hexiscale.config.schema import ClusterConfig, ModelConfig, load_yaml_node

    for key, path in json.loads(os.environ.get(FILES_ENV, "{}")).items():
        node = load_yaml_node(path, ClusterConfig if key == "cluster" else ModelConfig, key)
        OmegaConf.set_struct(cfg, False)
        cfg[key] = node
        OmegaConf.set_struct(cfg, True)
        reapply_overrides(cfg, key, overrides_given())


AUTO_ENV = "HEXISCALE_TRAIN_CLUSTER_AUTO"
"""Set by :func:`take_auto_cluster` to ``given`` (the command line said ``cluster=auto``) or ``default`` (it named
no cluster): the launching process discovers this machine's cluster before planning
(:func:`lightning_hexiscale.cli.train_discover.discover_for_train`). :func:`lightning_hexiscale.cli.train.main`
removes it when the job ends, so that nothing later in the same process discovers by accident."""

AUTO_FIX = ("discover first under the same launch (`hexiscale discover --model <model> --out my_cluster.yaml`, "
            "with --local N on one machine), then pass cluster=my_cluster.yaml, or name a preset (cluster=cpu_demo)")


def cluster_given(argv: list[str]) -> str | None:
    """The value of the command line's ``cluster=`` override (also ``+cluster=``/``~cluster``), or None."""
    for a in argv:
        key, _, value = a.partition("=")
        if key.lstrip("+~") == "cluster":
            return value
    return None


def config_cluster(argv: list[str]) -> str | None:
    """The cluster preset that a primary config of the command line (``--config-name``/``-cn`` other
    than the package's ``config``) chooses in its defaults list (``override cluster: NAME``,
    ``cluster: NAME``, ``/cluster: NAME``; also through the configs it includes by name, the
    package's ``config`` excepted: its ``cluster`` is the default that auto replaces), or None. The
    primary is looked for where Hydra's run finds it: ``--config-path``, ``--config-dir``, then the
    package's conf directory."""
    import yaml

    from lightning_hexiscale.config.schema import conf_dir

    name = flag_value(argv, ("--config-name", "-cn"))
    if not name or name == "config":
        return None
    cd = ([argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config-dir", "-cd")]
          + [a.partition("=")[2] for a in argv if a.startswith(("--config-dir=", "-cd="))])
    cp = flag_value(argv, ("--config-path", "-cp"))
    dirs = [expand_user(d) for d in ([cp] if cp else []) + cd] + [conf_dir()]
    root = (conf_dir() / "config.yaml").resolve()
    found: dict[bool, str] = {}  # override? -> the last choice seen

    def visit(config: str, depth: int) -> None:
        path = next((d / f"{config}.yaml" for d in dirs if (d / f"{config}.yaml").is_file()), None)
        if path is None or path.resolve() == root or depth > 8:
            return
        try:
            defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
        except (OSError, yaml.YAMLError, AttributeError):
            return
        for entry in defaults if isinstance(defaults, list) else []:
            if isinstance(entry, str) and entry != "_self_":
                visit(entry, depth + 1)
            elif isinstance(entry, dict) and len(entry) == 1:
                (key, value), = entry.items()
                words = str(key).split()
                group = words[-1].lstrip("/").split("@")[0] if words else ""
                if group == "cluster" and isinstance(value, str):
                    found[words[0] == "override"] = value

    visit(name, 0)
    return found.get(True, found.get(False))


def plan_meta(argv: list[str]) -> tuple[str | None, dict | None]:
    """``(FILE, its meta mapping)`` of the command line's ``plan=FILE``; ``{}`` for no plan or a plan
    without ``meta``; None for a plan file that does not read as a mapping, or whose meta is no mapping
    (the run's own load_plan_arg says what is wrong with it)."""
    import yaml

    value = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == "plan"), None)
    if not value:
        return value, {}
    if not schema_is_file(value):
        return value, None
    try:
        data = yaml.safe_load(Path(value).read_text())
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: not UTF-8 text
        return value, None
    meta = (data.get("meta") or {}) if isinstance(data, dict) else None
    return value, meta if isinstance(meta, dict) else None


def take_plan_model(argv: list[str]) -> list[str]:
    """``model=NAME`` added when a ``plan=FILE`` names a model preset (``meta.model``) and the command line
    gives no ``model=``: the configuration reference promises that such a plan needs no ``model=``, as for
    ``hexiscale estimate --plan``; the default model (llama_tiny) was composed instead and the plan refused
    for its shape. A name that is no preset (a model file's ``model.name``) adds nothing: the run then says
    which model the plan was made for. Popen ranks re-run the command line and add the same.

    A plan file that names no model at all (no ``meta.model``, no ``meta.model_shape``: written by hand,
    or its ``meta:`` deleted) with no ``model=`` nor ``model.*`` override and no primary config of the
    user's (``-cn``) is a ConfigError naming ``model``: the default model (llama_demo) trained on a
    layout made for something else without a word, as ``hexiscale estimate plan=`` refuses it too."""
    from lightning_hexiscale.config.schema import preset_names
    from lightning_hexiscale.errors import ConfigError

    if any(a.partition("=")[0].lstrip("+~") == "model" for a in argv):
        return argv
    value, meta = plan_meta(argv)
    if meta is None:
        return argv
    if (value and not {"model", "model_shape"} & set(meta)
            and not any(a.lstrip("+~").startswith("model.") for a in argv)
            and not any(a in ("-cn", "--config-name") or a.startswith("--config-name=") for a in argv)):
        raise ConfigError("model", None, f"plan={value} names no model (no meta.model or meta.model_shape) and none "
                          "was given on the command line; the default model would train on a layout made for "
                          "another", "pass model=NAME|FILE.yaml|hf:DIR, the model the plan was made for (or "
                          "restore the plan's meta: section, which `hexiscale plan --out` writes)")
    name = meta.get("model")
    if not isinstance(name, str) or name not in preset_names("model"):
        return argv
    if "LOCAL_RANK" not in os.environ:
        say(f"model={name}: the model the plan was made for (its meta.model; no model= given)")
    return [*argv, f"model={name}"]


def plan_cluster(argv: list[str]) -> str | None:
    """The cluster a ``plan=FILE`` of the command line was made for: its ``meta.cluster_file`` (a
    ConfigError when that file is gone: discovering the local machine instead ran the plan on other
    devices without a word), else its ``meta.cluster`` when that names a preset; None otherwise (no
    plan, a plan file that does not read, which the run then refuses, no such key, or a name that is no
    preset, e.g. a discovered cluster's from before cluster_file)."""
    from lightning_hexiscale.config.schema import preset_names
    from lightning_hexiscale.planner.plan import check_meta_record, cluster_source

    value, meta = plan_meta(argv)
    if not meta:
        return None
    check_meta_record(meta, ("cluster",), f"{value}: meta")  # cluster: [a, b] discovered the local machine
    key, name = cluster_source(meta, where=f"{value}: meta")
    if key == "cluster_file":
        return name  # the cluster file the plan was made on, which exists
    return name if isinstance(name, str) and name in preset_names("cluster") else None


def take_auto_cluster(argv: list[str]) -> list[str]:
    """``cluster=auto``, and no ``cluster=`` at all (auto is ``hexiscale train``'s default): recorded in
    :data:`AUTO_ENV` (``given`` / ``default``) and taken out of the command line (Hydra has no preset of that
    name: it composes conf/config.yaml's cpu_demo, which the discovered file replaces before planning; the popen
    children then read the file as a ``cluster=FILE``). Not discovered:

    - a primary config (``-cn NAME``) whose defaults choose a cluster (``override cluster: NAME``:
      :func:`config_cluster`): Hydra composes that one;
    - ``plan=FILE`` without ``cluster=``: the preset the plan was made for (``meta.cluster``) is added, as
      ``HexiScaleStrategy(cluster="auto", plan=...)`` does;
    - ``cluster.KEY=...`` without ``cluster=``: refused (a measured cluster has nothing to override);
    - a sweep (``-m``) and a torchrun/SLURM launch: refused with the fix (discover first, then ``cluster=<file>``).
    """
    from lightning_hexiscale.errors import ConfigError

    given = cluster_given(argv)
    chosen = config_cluster(argv) if given is None else None
    if chosen is not None and chosen != "auto":  # the primary config's defaults name it: Hydra composes it
        os.environ.pop(AUTO_ENV, None)
        return argv
    if given is None and "LOCAL_RANK" in os.environ and "cluster" in json.loads(os.environ.get(FILES_ENV, "{}")):
        # a popen rank: the launching process took the cluster file (given or discovered) out of the command line
        # it re-runs; read as auto, its cluster.KEY=V overrides of that file were refused and the rank failed
        return argv
    made_for = plan_cluster(argv) if given is None else None
    if (given is not None and given != "auto") or made_for:
        os.environ.pop(AUTO_ENV, None)  # an earlier in-process run's, which ended before discovering
        if not made_for:
            return argv
        if "LOCAL_RANK" not in os.environ:  # the launching process says it once (its children re-run this argv)
            say(f"cluster={made_for}: the cluster the plan was made for (its meta.cluster or meta.cluster_file; "
                "no cluster= given)")
        return [*argv, f"cluster={made_for}"]
    value = "auto" if given else "auto (the default: no cluster= given)"
    nested = [a for a in argv if a.lstrip("+~").startswith("cluster.")]
    if nested:
        raise ConfigError("cluster", value, f"{nested[0]} changes a preset or file, and discovery measures the cluster",
                          f"name the cluster it changes (cluster=cpu_demo {nested[0]}), or leave it out")
    if any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError("cluster", value, "a sweep (-m) does not discover its cluster", AUTO_FIX)
    if "TORCHELASTIC_RUN_ID" in os.environ or slurm_launched():
        raise ConfigError("cluster", value, "hexiscale train discovers only the machine it runs on, not under "
                          "torchrun or SLURM", AUTO_FIX + " on every rank")
    os.environ[AUTO_ENV] = "given" if given else "default"
    return [a for a in argv if a != "cluster=auto"]


def auto_cluster() -> str | None:
    """``given`` or ``default`` when this job discovers its cluster (:func:`take_auto_cluster`), else None."""
    value = os.environ.get(AUTO_ENV)
    return value if value in ("given", "default") else None


def prepare_argv(argv: list[str]) -> list[str]:
    """The overrides Hydra composes, from the command line's: ``model=hf:/dir`` becomes
    ``model=_hf trainer.weights=/dir``; the launching process checks every override first (popen
    children re-run the checked command line) and takes ``cluster=auto`` (:func:`take_auto_cluster`) and
    ``cluster=``/``model=`` files out (torchrun
    and SLURM workers too: no launcher of ours took them out for them)."""
    from lightning_hexiscale.config.overrides import hf_model_overrides

    check_command_line(argv)
    argv = flags_first(argv)
    argv = take_plan_model(take_auto_cluster(hf_model_overrides(argv)))
    if "LOCAL_RANK" not in os.environ:
        check_overrides(argv)
        return take_file_overrides(argv)
    if FILES_ENV not in os.environ:
        return take_file_overrides(argv)
    return argv


HYDRA_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun")
"""Hydra's flags that take the next word as their value (hydra/_internal/utils.py, Hydra 1.3)."""
HYDRA_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
"""The values ``--info``/``-i`` may take as its next word (it may also take none)."""
HYDRA_MODES = {"--run": "run", "-r": "run", "--multirun": "multirun", "-m": "multirun", "--cfg": "cfg", "-c": "cfg",
               "--info": "info", "-i": "info", "--shell-completion": "shell", "-sc": "shell"}
"""Hydra's flags that say what the app does: one of them at most (two was a ValueError traceback)."""
HYDRA_FLAGS = tuple(dict.fromkeys((*HYDRA_VALUE_FLAGS, *HYDRA_MODES, "--resolve", "--hydra-help", "--version", "--help",
                                    "-h")))
"""Every flag the app takes (Hydra's; ``--help`` and ``--version`` the app answers itself)."""


def check_command_line(argv: list[str]) -> None:
    """A word that is neither a flag, a flag's value, ``KEY=VALUE`` nor ``~KEY`` (a deletion) is refused
    with :func:`~lightning_hexiscale.cli.common.bare_word_error`: Hydra said "Error parsing override
    'hetero1' / missing EQUAL at '<EOF>'" and named no override to write instead. So are two of Hydra's
    modes (``--cfg job --info``): Hydra raised a ValueError whose traceback ended the command. A flag
    the app does not take gets the closest one (Hydra's argparse printed its usage and the flag alone)."""
    import difflib

    from lightning_hexiscale.cli.common import bare_word_error
    from lightning_hexiscale.errors import ConfigError, HexiScaleError

    modes = {}
    for a, is_value in flag_values(argv):
        if not (is_value or a.startswith(("-", "~")) or "=" in a):
            raise bare_word_error(a)
        flag = a.partition("=")[0]  # --cfg=job: --cfg
        if not is_value and a.startswith("-") and flag not in HYDRA_FLAGS:
            long_flags = [f for f in HYDRA_FLAGS if f.startswith("--")]
            near = difflib.get_close_matches(flag, long_flags, n=1)
            fix = f"did you mean {near[0]}?" if near else f"the flags are {', '.join(long_flags)}"
            raise HexiScaleError(f"unrecognized argument: {a}. Fix: {fix} (--help lists them)")
        mode = None if is_value else HYDRA_MODES.get(flag)
        if mode:
            modes.setdefault(mode, flag)
    if len(modes) > 1:  # Hydra raised a ValueError with a traceback
        raise ConfigError("Hydra's flags", " ".join(modes.values()), "only one of --run, --multirun, --cfg, --info "
                          "and --shell-completion may be given", "drop all but one of them")


def flags_first(argv: list[str]) -> list[str]:
    """Hydra's flags (each with its value) moved before the overrides, in their order: Hydra's argparse
    takes the overrides as one positional list, so ``train a=1 -m b=2`` ended in "unrecognized arguments:
    b=2" (its usage, naming neither fix nor key), while ``plan a=1 -m b=2`` takes it. Run after
    :func:`check_command_line`, which tells a flag's value from an override."""
    flags, overrides = [], []
    for a, is_value in flag_values(argv):
        (flags if is_value or a.startswith("-") else overrides).append(a)
    return [*flags, *overrides]


def flag_values(argv: list[str]):
    """``(word, whether it is the value of the flag before it)`` for each word of ``argv``: Hydra's flags
    that take a value (``--cfg job``), and ``--info``'s optional one."""
    before = None
    for a in argv:
        is_value = before in HYDRA_VALUE_FLAGS or (before in ("--info", "-i") and a in HYDRA_INFO)
        yield a, is_value
        before = None if is_value else a


def print_file_config(given: list[str]) -> bool:
    """``--cfg job`` of a single run with a ``cluster=``/``model=`` file (taken out of Hydra's command line
    by :func:`take_file_overrides`): Hydra would print the default preset that the file replaces in the
    job; the config the job runs on is printed instead, composed as ``hexiscale plan`` composes it.
    ``given``: the command line as typed. True when it printed (the app then ends)."""
    from lightning_hexiscale.config.schema import compose

    if (flag_value(given, ("--cfg", "-c")) != "job" or flag_value(given, ("--package", "-p"))
            or FILES_ENV not in os.environ or any(a in ("-m", "--multirun") for a in given)):
        return False
    overrides = [a for a in given if not a.startswith("-") and "=" in a and a != "cluster=auto"
                 and not a.lstrip("+~").startswith("hydra.")]
    cfg = compose([*search_path(given), *overrides], config_name=flag_value(given, ("--config-name", "-cn")) or "config")
    print(OmegaConf.to_yaml(cfg, resolve="--resolve" in given))
    return True
