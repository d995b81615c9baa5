"""Shared pieces of the `hexiscale` subcommands: the registry, override helpers and launch flags.

Subcommand modules register themselves with :func:`subcommand`; :mod:`lightning_hexiscale.cli.main`
imports every one of them and builds the parser. Nothing here imports a subcommand module, so
there is no import circle between the entry point and the commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_hexiscale.config.file_errors import expand_user
from lightning_hexiscale.config.values import register_section_check
from lightning_hexiscale.config.recipe import check_output_file  # noqa: F401 (the commands' name for it)


def _search_settings_check(cfg) -> None:
    """``train.*`` and ``planner.*`` as the search reads them (recompute, schedule, the iterations' bounds...):
    the rules a value that a "did you mean" proposes must pass (:mod:`lightning_hexiscale.config.values`,
    which may not import the planner)."""
    from lightning_hexiscale.planner import SearchSettings

    SearchSettings.from_config(cfg, dp_sharding_explicit=True)


register_section_check(("train", "planner"), _search_settings_check)


def end_command(code: int) -> None:
    """End a ``hexiscale`` command or a recipe with its exit status ``code``. One that imported torch
    (``train`` and its ranks, ``discover``, ``emulate``, ...) ends through
    :func:`~lightning_hexiscale.runtime.host.exit_without_finalizing`: the interpreter's teardown of
    torch and Lightning took seconds per process after the job's last line, every rank paying it.
    Not when another program runs the script in its own process (:func:`hosted`): that program goes on."""
    if "torch" in sys.modules and not hosted():
        from lightning_hexiscale.runtime.host import exit_without_finalizing

        exit_without_finalizing(code)
    sys.exit(code)


def hosted() -> bool:
    """Whether this process goes on after the script: ``python -i`` (its prompt follows), IPython or
    Jupyter's ``%run recipes/train.py ...`` (the kernel), a test that runs the script with ``runpy``
    (pytest). There ``os._exit`` would end that program too (Jupyter's "kernel died"); the script
    raises ``SystemExit`` instead, which each of them catches."""
    if sys.flags.interactive or hasattr(sys, "ps1") or "_pytest" in sys.modules:
        return True
    ipython = sys.modules.get("IPython")  # imported by tqdm.auto and others in plain runs too: ask it
    get_ipython = getattr(ipython, "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


EPILOG = """overrides (Hydra syntax, composed over conf/config.yaml):
  cluster=NAME|PATH.yaml   a preset of conf/cluster/ or a cluster file (e.g. from `hexiscale profile`)
  model=NAME|PATH.yaml|hf:DIR  a preset of conf/model/, a model file, or a local Hugging Face directory
  train.global_batch=N     trainer.precision=bf16-mixed|32-true  train.schedule=1f1b|gpipe
  train.recompute=auto|true|false  train.dp_sharding=ddp|zero2|zero3
  cluster.inter_machine.bandwidth="10 Gbps"   any key of the cluster, model or train config
run `hexiscale list` for the presets."""

# The examples each `hexiscale COMMAND --help` shows (``train`` and ``emulate`` write their own); one
# table, not one per command module, so that only `hexiscale --help` imports every command.
# tests/test_cli_commands.py parses every line with the command's parser: no example outlives an option.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "plan": (
        "hexiscale plan cluster=case_study model=llama2_7b train.global_batch=24 --baselines",
        "hexiscale plan cluster=cpu_hetero4 model=llama_demo --out plan.yaml --picture plan.png",
        "hexiscale plan -m cluster=hetero1,hetero2 model=llama2_7b,llama2_13b   # a sweep, one table",
    ),
    "estimate": (
        "hexiscale estimate --plan conf/plans/hetero3_llama30b_tab7.yaml",
        "hexiscale estimate --plan plan.yaml train.dp_sharding=zero3 --json   # cluster, model from the plan's meta",
    ),
    "list": ("hexiscale list",),
    "cluster": ("hexiscale cluster cluster=hetero3", "hexiscale cluster cluster=outputs/cpu2.yaml"),
    "profile": (
        "hexiscale profile --local 2 --out outputs/cpu2.yaml   # 2 forked CPU ranks",
        "hexiscale profile --local 2 --model llama_tiny --out outputs/cpu2.yaml   # + layer times",
    ),
    "discover": ("hexiscale discover --local 4 --model llama_tiny --out outputs/disc.yaml",),
    "calibrate": ("hexiscale calibrate --local 2 cluster=outputs/cpu2.yaml model=llama_tiny",),
    "check-estimate": (
        "hexiscale check-estimate --local 2 --plan plan.yaml cluster=outputs/cpu2.yaml model=llama_tiny",
    ),
    "prepare-data": (
        "hexiscale prepare-data corpus/*.jsonl --tokenizer /models/Llama-3.2-1B --out data/train.bin",
        "hexiscale prepare-data book.txt --tokenizer tokenizer.json --out data/book.bin --bos",
    ),
    "export": (
        "hexiscale export run/checkpoints/last.ckpt --hf /models/tuned --tokenizer /models/Llama-3.2-1B "
        "--dtype bfloat16",
    ),
    "checkpoint": (
        "hexiscale checkpoint info run/checkpoints/last.ckpt",
        "hexiscale checkpoint consolidate run/checkpoints/last.ckpt llama.pt   # torch.load-able state dict",
    ),
    "rendezvous-store": ("hexiscale rendezvous-store --port 29400 &   # then torchrun --rdzv-endpoint=HOST:29400 ...",),
}


def examples_text(command: str) -> str | None:
    """The ``examples:`` block of a command's --help, or None when it has none."""
    lines = EXAMPLES.get(command)
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None


SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


NO_OVERRIDES: dict[str, str] = {}
"""Commands that compose no configuration -> the fix their refusal suggests: ``main`` refuses KEY=VALUE
overrides for them (an ignored ``model=...`` would look as if it had been applied), and their --help
does not offer any."""


def subcommand(name: str, help_: str, configure: Callable[[argparse.ArgumentParser], None], *,
               no_overrides: str | None = None):
    """Register ``fn(args) -> exit code`` as ``hexiscale NAME`` (other modules add theirs this way).
    ``no_overrides``: the command reads no Hydra configuration; the fix to print when given some."""
    def deco(fn: Callable[[argparse.Namespace], int]):
        SUBCOMMANDS[name] = (help_, configure, fn)
        NO_OVERRIDES.pop(name, None)
        if no_overrides is not None:
            NO_OVERRIDES[name] = no_overrides
        return fn
    return deco


def notice_printer(prog: str, default_show):
    """A ``warnings.showwarning`` that prints the package's own notices (warning classes with
    ``cli_notice``, e.g. ``planner.cost.compute.DatasheetPricingWarning``) as one line, ``PROG: warning:
    ...``, instead of Python's file:line form; other warnings go to ``default_show``."""
    def show(message, category, filename, lineno, file=None, line=None):
        if getattr(category, "cli_notice", False):
            print(f"{prog}: warning: {message}", file=sys.stderr if file is None else file)
        else:
            default_show(message, category, filename, lineno, file, line)
    return show


def explicit(overrides: Sequence[str], key: str) -> bool:
    return given_value(overrides, key) is not None


def given_value(overrides: Sequence[str], key: str) -> str | None:
    """The value of the last ``key=VALUE`` override (``+key`` / ``~key`` alike; ``~key`` without a value
    gives ""), else None."""
    found = None
    for o in overrides:
        name, _, value = o.partition("=")
        if name.lstrip("+~") == key:
            found = value
    return found


def sweep_axes(overrides: Sequence[str]) -> list[list[str]]:
    """The values of each override of a ``-m`` sweep, one whole override per value, read with Hydra's own
    grammar (its basic sweeper runs the cartesian product of these): ``cluster=a,b`` -> ``cluster=a``,
    ``cluster=b``; ``range(8,17,8)``, ``choice(..)`` and ``glob(..)`` (over a group's presets) likewise;
    a quoted value keeps its commas (``data.path='a,b.txt'``). An override that is no sweep, or that
    Hydra cannot parse (composing it reports that), is its own one value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    axes = []
    for o in overrides:
        try:
            (ov,) = parser.parse_overrides([o])
        except HydraException:
            ov = None
        if ov is None or not ov.is_sweep_override() or ov.value_type == ValueType.INTERVAL_SWEEP:
            axes.append([o])  # interval(): for optimising sweepers, which sample it; Hydra's basic one refuses it
            continue
        key = ov.get_key_element()
        if ov.value_type == ValueType.GLOB_CHOICE_SWEEP:  # a glob picks among the group's presets
            from lightning_hexiscale.config.schema import preset_names

            values = ov.value().filter(preset_names(ov.key_or_group)) if "." not in key else []
        else:
            values = list(ov.sweep_string_iterator())
        axes.append([f"{key}={v}" for v in values] or [o])
    return axes


def axis_points(axes: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each value of each of a sweep's ``axes`` once, the other axes at their first value: the points
    that check every value for a sum of the axes' lengths, where the sweep runs their product."""
    first = [values[0] for values in axes]
    return [first] + [first[:i] + [v] + first[i + 1:] for i, values in enumerate(axes) for v in values[1:]]


def plan_meta_sources(plan_meta: dict, overrides: Sequence[str] = (), where: str = "meta") -> dict[str, tuple[str, Any]]:
    """``{"cluster" / "model": (the meta key, its value)}`` a plan file names for what ``overrides`` do
    not give: the cluster from ``meta.cluster_file`` (a cluster file's path, which must exist), else
    ``meta.cluster`` (:func:`~lightning_hexiscale.planner.plan.cluster_source`, whose errors name
    ``{where}.cluster_file``); the model from ``meta.model``. A ``cluster=`` given on the command line
    is not looked up in the meta at all (a plan made on a file that has moved runs on the one given)."""
    from lightning_hexiscale.planner.plan import cluster_source

    out = {}
    if not explicit(overrides, "cluster"):
        out["cluster"] = tuple(cluster_source(plan_meta, where))
    if not explicit(overrides, "model"):
        out["model"] = ("model", plan_meta.get("model"))
    return {k: v for k, v in out.items() if v[1]}


def compose_for_plan(overrides: list[str], plan_meta: dict, where: str = "meta") -> list[str]:
    """Default ``cluster=`` and ``model=`` to the ones a plan file names in its ``meta``."""
    out = list(overrides)
    for key, (_, value) in plan_meta_sources(plan_meta, out, where).items():
        out.insert(0, f"{key}={value}")
    return out


def with_cluster_file(plan, overrides: Sequence[str]):
    """The plan with ``meta.cluster_file``, the absolute path of the cluster file the command line's
    ``cluster=FILE`` named (the last one), so that ``hexiscale estimate --plan``, ``hexiscale train
    plan=`` and ``HexiScaleStrategy(plan=...)`` find the cluster without ``cluster=`` again; a preset
    (``meta.cluster`` loads it by name) adds nothing."""
    from lightning_hexiscale.config.schema import is_file

    value = next((o.partition("=")[2] for o in reversed(overrides) if o.partition("=")[0] == "cluster"), None)
    if not value or not is_file(value):  # as config.schema.load_preset tells a file from a preset
        return plan
    return replace(plan, meta={**plan.meta, "cluster_file": str(Path(value).resolve())})


class DefaultStandInWarning(UserWarning):
    """A plan file names no cluster or model in its ``meta``, none was given as ``cluster=`` / ``model=``,
    and ``cluster.*`` / ``model.*`` overrides build on the default preset instead."""

    cli_notice = True
    """Printed by the command line as one ``PROG: warning: ...`` line."""


def compose_plan_config(overrides: list[str], plan, source: str, needs: Sequence[str] = ("cluster", "model")):
    """The config a plan file runs on: :func:`compose_for_plan`'s overrides, composed. A cluster or
    model the plan's meta names (none given on the command line) that does not load is blamed on
    ``SOURCE: meta.KEY``, not on a ``cluster=`` the user never typed. One of ``needs`` that neither the
    meta nor the command line names (a plan written by hand, or its ``meta:`` deleted) was the demo's
    default (cpu_demo, llama_demo) without a word: a ConfigError, or, where ``KEY.*`` overrides build on
    the default preset (``model.hidden_size=64 ...``), a warning naming that preset."""
    import warnings

    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.errors import ConfigError

    from lightning_hexiscale.planner.plan import check_meta_record

    # a name that is no string was 'overrides = ...: Config group override must be a string'; '' was the default
    check_meta_record(plan.meta, tuple(k for k in ("cluster", "model") if not explicit(overrides, k)), f"{source}: meta")
    named = plan_meta_sources(plan.meta, overrides, where=f"{source}: meta")
    unnamed = [k for k in needs if k not in named and not explicit(overrides, k)]
    keyed = [k for k in unnamed if any(o.partition("=")[0].lstrip("+~").startswith(f"{k}.") for o in overrides)]
    missing = [k for k in unnamed if k not in keyed]
    keys = {"cluster": "meta.cluster or meta.cluster_file", "model": "meta.model"}
    if missing:
        example = {"cluster": "cluster=NAME|FILE.yaml", "model": "model=NAME|FILE.yaml|hf:DIR"}
        raise ConfigError(missing[0], None, f"{source} names no {' and no '.join(missing)} ({', '.join(keys[k] for k in missing)}"
                          f") and none was given on the command line; the defaults (the demo's) would stand in for "
                          "what the plan was made for", f"pass {' '.join(example[k] for k in missing)}, the "
                          f"{' and '.join(missing)} the plan was made for (or restore the plan's meta: section, which "
                          "`hexiscale plan --out` writes)")
    taken = {k: meta_key for k, (meta_key, _) in named.items()}
    try:
        cfg = compose(compose_for_plan(overrides, plan.meta, where=f"{source}: meta"))
    except ConfigError as e:
        if e.key not in taken:
            raise
        raise ConfigError(f"{source}: meta.{taken[e.key]}", e.value, f"the plan file's meta names it (no {e.key}= "
                          f"was given): {e.rule}", f"{e.fix}; or pass {e.key}=NAME on the command line") from None
    for k in keyed:
        warnings.warn(f"{source} names no {k} ({keys[k]}) and no {k}= was given: the {k} is the default preset "
                      f"{cfg[k].name} with the {k}.* overrides given; pass {k}=NAME to name it", DefaultStandInWarning)
    return cfg


def plan_override(overrides: Sequence[str]) -> str | None:
    """The plan file the override ``plan=`` names (quotes taken off), or None (not given, ``~plan``,
    ``plan=``, ``plan=null``)."""
    given = given_value(overrides, "plan")
    if given in (None, "", "null"):
        return None
    if len(given) > 1 and given[0] == given[-1] and given[0] in "'\"":
        return given[1:-1]  # plan='my plan.yaml'
    return given


def plan_source(args: argparse.Namespace) -> tuple[str, str]:
    """(the plan file, the key that named it) of ``hexiscale estimate`` / ``check-estimate``: ``--plan``
    or the override ``plan=`` (the key ``hexiscale train`` reads, so one override list serves the
    commands; it was refused as "--plan is required"). Neither, or the two naming different files, is
    an error."""
    from lightning_hexiscale.errors import ConfigError

    given = plan_override(args.overrides)
    if args.plan is not None and given is not None and Path(given).resolve() != Path(args.plan).resolve():
        raise ConfigError("plan", given, f"names another file than --plan {args.plan}; one run takes one plan",
                          "give the plan once: --plan PLAN.yaml or plan=PLAN.yaml")
    if args.plan is None and given is None:
        raise ConfigError("--plan", None, f"hexiscale {args.command} needs a plan file, and none was given",
                          "pass --plan PLAN.yaml (or plan=PLAN.yaml), e.g. one `hexiscale plan --out PLAN.yaml` "
                          "wrote or conf/plans/case_study_llama2_13b.yaml")
    return (args.plan, "--plan") if args.plan is not None else (given, "plan")


def apply_train_overrides(plan, cfg, overrides: Sequence[str]):
    """Explicit train.schedule / train.recompute / train.dp_sharding / train.micro_batch_size overrides
    replace the plan's values, as ``hexiscale train plan=FILE`` replaces them (plan_resolution.apply_overrides)."""
    changes = {}
    mb = cfg.train.micro_batch_size if explicit(overrides, "train.micro_batch_size") else None
    if mb is not None:  # was ignored here: estimate priced the plan's micro-batches, train ran these
        from lightning_hexiscale.errors import ConfigError

        for i, p in enumerate(plan.pipelines):
            if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1 or p.batch_size % mb:
                raise ConfigError("train.micro_batch_size", mb, f"must be a positive integer dividing every pipeline's "
                                  f"batch (pipeline {i}'s batch_size={p.batch_size})",
                                  "choose a divisor of every pipeline batch, or leave it out to keep the plan's")
        changes["pipelines"] = tuple(replace(p, micro_batch_size=mb) for p in plan.pipelines)
    for key in ("schedule", "recompute", "dp_sharding"):
        if explicit(overrides, f"train.{key}"):
            changes[key] = cfg.train[key]
    if "recompute" in changes:  # auto on a given plan: the plan's own choice stands
        from lightning_hexiscale.planner.search.settings import recompute_setting

        changes["recompute"] = recompute_setting(changes["recompute"])
        if changes["recompute"] == "auto":
            del changes["recompute"]
    return replace(plan, **changes) if changes else plan



def refuse_empty_path(flag: str, path: str | None, what: str, example: str) -> None:
    """``flag ''`` (an unset shell variable): Path('') is the working directory, which the checks after
    this one then named as the value, or missed (an empty CKPT "contained" every output path)."""
    from lightning_hexiscale.errors import ConfigError

    if path is not None and not path.strip():
        raise ConfigError(flag, path, f"is empty; it names {what}", f"give the path, e.g. {example}")


def check_outside_checkpoint(flag: str, path: str, checkpoint: str, example: str) -> None:
    """``flag PATH`` is not inside the checkpoint directory it is made from: a save replaces that
    directory whole (a newer last.ckpt), and a file or export written into it would go with it."""
    from lightning_hexiscale.errors import ConfigError

    ckpt, out = expand_user(checkpoint).resolve(), expand_user(path).resolve()
    if ckpt.is_dir() and (out == ckpt or ckpt in out.parents):
        raise ConfigError(flag, path, f"is inside the checkpoint {checkpoint}, which the next save of that path "
                          "replaces whole (with everything in it)", f"write it beside the checkpoint, e.g. "
                          f"{flag} {ckpt.parent / example}")


# ---- launch flags shared by profile, calibrate and check-estimate -----------------------------
def parse_number(text: str, kind: type, noun: str, example: str):
    """``kind(text)`` (int or float) for an argparse type; a text it cannot read is "'x' is not NOUN,
    e.g. EXAMPLE" (argparse's own "invalid positive_int value: 'x'" named the function, not the rule).
    The callers check the range, each with its own rule."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}, e.g. {example}") from None


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--local N``)."""
    v = parse_number(text, int, "a whole number", "4")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (``--warmup``: steps run untimed before the timed ones; a negative count would
    silently time fewer steps, or none)."""
    v = parse_number(text, int, "a whole number", "1")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (a deadline or budget), checked before any rank starts."""
    import math

    v = parse_number(text, float, "a number of seconds", "60")
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}; e.g. 60")
    return v


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local", type=positive_int, metavar="N", default=None,
                   help="fork N CPU ranks here (gloo, one thread each) instead of joining a torchrun/SLURM/"
                        "Lightning-launched process group")
    p.add_argument("--timeout", type=positive_seconds, default=900.0, metavar="S",
                   help="deadline in seconds for the whole run and every collective (default 900)")


def _precision(text: str) -> str:
    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.profiling.precision import check_precision

    try:
        return check_precision(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_precision_arg(p: argparse.ArgumentParser) -> None:
    """``--precision``: the run's precision, which every measurement runs in."""
    p.add_argument("--precision", type=_precision, default=None, metavar="P",
                   help="measure in this Lightning precision, the run's trainer.precision: 32-true, bf16-mixed, "
                        "bf16-true, 64-true or 16-true (parameter dtype and autocast as in training; default: "
                        "32-true on CPU ranks (--local, or no CUDA), bf16-mixed on CUDA)")


def resolve_precision(args: argparse.Namespace, composed: str | None = None) -> str:
    """``--precision``, else ``composed`` (the ``trainer.precision=`` override of the commands that compose
    the run's configuration: calibrate, check-estimate), else 32-true on CPU ranks (``--local`` or no
    CUDA), else bf16-mixed. Both given and different: a ConfigError (one measurement, one precision)."""
    if composed is not None:
        from lightning_hexiscale.errors import ConfigError
        from lightning_hexiscale.profiling.precision import check_precision

        check_precision(composed, "trainer.precision")
        if args.precision is not None and args.precision != composed:
            raise ConfigError("--precision", args.precision, f"differs from trainer.precision={composed}; the "
                              "measurement and the estimate run in one precision", "give only one of them")
        return composed
    if args.precision is not None:
        return args.precision
    import torch

    from lightning_hexiscale.profiling.precision import default_precision

    return default_precision(args.local is None and torch.cuda.is_available())


def version_line() -> str:
    """``hexiscale 0.1.0 (torch 2.13.0+cpu, lightning 2.6.6, hydra 1.3.8, Python 3.11.7)``: what a bug
    report needs (``hexiscale --version``, ``hexiscale train --version``). The libraries' versions come
    from their installed metadata, so that ``--version`` imports none of them."""
    from importlib import metadata

    import lightning_hexiscale

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return (f"hexiscale {lightning_hexiscale.__version__} (torch {installed('torch')}, lightning "
            f"{installed('lightning')}, hydra {installed('hydra-core')}, Python {python})")


def os_error_line(e: OSError) -> str:
    """One line for an OSError about a path the user gave (``e.filename`` set): the path, the OS's
    reason and a fix by its errno. The commands check their paths first; this is the net under the
    checks, so that a path the OS refuses (a name longer than 255 bytes, no permission, a full disk)
    is an error line, not a traceback."""
    import errno

    fixes = {errno.ENAMETOOLONG: "shorten it: each name in a path may be at most 255 bytes",
             errno.EACCES: "choose a path you may read and write, or change its permissions",
             errno.EPERM: "choose a path you may read and write, or change its permissions",
             errno.ENOSPC: "free space on that disk or choose another", errno.EROFS: "choose a writable location"}
    return f"{e.filename!r}: {e.strerror or e}. Fix: {fixes.get(e.errno, 'check the path')}"


def bare_word_error(word: str) -> ConfigError:
    """The error for a command-line word without ``=`` where an override goes (``hexiscale plan
    hetero1``): the fix names the override the word most likely meant, ``cluster=hetero1`` for a
    cluster preset (or one close to it), ``model=...`` for a model preset, ``model=hf:DIR`` for a
    Hugging Face directory, and for a YAML file ``cluster=``, ``model=`` or ``plan=`` by its keys."""
    from lightning_hexiscale.config.file_errors import is_file
    from lightning_hexiscale.config.schema import preset_names
    from lightning_hexiscale.config.suggest import closest
    from lightning_hexiscale.errors import ConfigError

    groups = ("cluster", "model")
    meant = [f"{g}={word}" for g in groups if word in preset_names(g)]
    path = expand_user(word)
    # is_file, not Path.is_dir: a word longer than the OS's NAME_MAX made is_dir raise OSError
    if not meant and is_file(path) and path.suffix in (".yaml", ".yml", ".json"):
        meant = [f"{key}={word}" for key in _file_kind(path)]
    elif not meant and is_file(path / "config.json"):
        meant = [f"model=hf:{word}"]
    if not meant:
        meant = [f"{g}={name}" for g in groups for name in closest(word, preset_names(g))[:1]]
    fix = (f"did you mean {' or '.join(meant)}?" if meant
           else "write KEY=VALUE, e.g. cluster=hetero3 or model=llama_tiny (`hexiscale list` names the presets)")
    return ConfigError("override", word, "is not KEY=VALUE", fix)


def _file_kind(path) -> list[str]:
    """The override keys a YAML/JSON file can be given to, by its top-level keys: ``pipelines`` a plan
    (which has ``num_layers`` too), ``machines`` a cluster, ``hidden_size`` a model; all three when it
    is none of these or unreadable."""
    import yaml

    from lightning_hexiscale.config.suggest import file_kind

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):  # UnicodeDecodeError is a ValueError
        data = None
    kind = file_kind(data.keys()) if isinstance(data, dict) else None
    return [kind] if kind else ["cluster", "model", "plan"]
