"""The ``hydra.*`` overrides of a ``hexiscale train`` command line, checked before Hydra reads them.

Hydra applies them after any check of ours, and its refusals were its own text with no fix
(``hydra.run.dri=x``: "Key 'dri' not in 'RunDir'"; ``hydra.job.chdir=maybe``: "Value 'maybe' is not a
valid bool"). It then creates the run's directory (``hydra.run.dir``; ``hydra.sweep.dir`` under ``-m``)
with ``mkdir`` before the job starts: a file of that name, a path below a file or a folder that cannot be
written was a ``FileExistsError`` / ``NotADirectoryError`` traceback and exit status 1.
"""

from __future__ import annotations

from pathlib import Path

NO_JOB_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc")
"""Hydra's flags that print and end: no job runs, and no directory is created."""


def check_hydra_overrides(argv: list[str]) -> None:
    """Every ``hydra.KEY=VALUE`` of ``argv`` names a key of Hydra's config and a value that key takes
    (:func:`~lightning_hexiscale.config.suggest.check_override_key` on Hydra's composed node), and, when
    a job will run, the directory Hydra creates for it can be created and written
    (:func:`check_run_dir`). ConfigError naming the key otherwise."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from lightning_hexiscale.cli.common import sweep_axes
    from lightning_hexiscale.config.suggest import check_override_key

    given = [values[0] for values in sweep_axes([a for a in argv if _is_hydra_key(a)])]  # a sweep: its first value
    cfg = _hydra_config(argv)
    if cfg is None:
        return
    for a in given:
        check_override_key(cfg, a)
    if any(a.partition("=")[0] in NO_JOB_FLAGS for a in argv):
        return
    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = next((a.partition("=")[2] for a in reversed(given) if a.partition("=")[0].lstrip("+") == key), None)
    if value is not None:
        try:
            (override,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
            OmegaConf.set_readonly(cfg, False)
            cfg.hydra[key.split(".")[1]].dir = override.value()
        except (HydraException, ValueError, TypeError):  # the grammar's or the type's refusal: Hydra reports it
            return
    check_run_dir(cfg, key, value)


def _is_hydra_key(arg: str) -> bool:
    """``hydra.KEY=VALUE`` (also ``+``/``++``), not a flag, a deletion, ``hydra.searchpath`` (search_path
    reads it) nor a choice of Hydra's own groups (``hydra/launcher=basic``)."""
    key, sep, _ = arg.partition("=")
    key = key.lstrip("+")
    return bool(sep) and not arg.startswith(("-", "~")) and key.startswith("hydra.") and key != "hydra.searchpath"


def _hydra_config(argv: list[str]):
    """The app's config with Hydra's own node (``hydra.run``, ``hydra.job``, ...), composed with the
    command line's choices of Hydra's groups (``hydra/launcher=...``) and search path; None when that does
    not compose (the overrides' own check says why)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_hexiscale.cli.train_job import flag_value, search_path
    from lightning_hexiscale.config.schema import conf_dir, register_configs

    register_configs()
    name = flag_value(argv, ("--config-name", "-cn")) or "config"
    if not (conf_dir() / f"{name}.yaml").is_file():
        name = "config"
    groups = [a for a in argv if a.lstrip("+~").startswith("hydra/") and "=" in a]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose(config_name=name, overrides=[*search_path(argv), *groups], return_hydra_config=True)
    except Exception:  # noqa: BLE001 -- a choice Hydra refuses: its run says so
        return None
    finally:
        GlobalHydra.instance().clear()


def check_run_dir(cfg, key: str, given: str | None) -> None:
    """The directory Hydra creates for the job (``cfg.hydra.run.dir``, or ``hydra.sweep.dir`` for ``key``
    ``hydra.sweep.dir``), resolved as Hydra resolves it (``${now:...}``), can be created and written
    (:func:`~lightning_hexiscale.config.recipe.check_output_dir`): not a file, not below a file, in a
    folder that takes a new file. ``given``: the value on the command line, None for Hydra's default."""
    from lightning_hexiscale.config.recipe import check_output_dir
    from lightning_hexiscale.errors import ConfigError

    node = cfg.hydra[key.split(".")[1]]
    raw = node._get_node("dir")._value()
    try:
        path = str(node.dir)
    except Exception:  # noqa: BLE001 -- ${hydra:...} resolves in Hydra's run only: its literal folder is checked
        path = str(raw).split("${")[0].rpartition("/")[0] or "."
    shown = given if given is not None else str(raw)
    fix = (f"give a directory to create or fill, e.g. {key}=outputs/my-run" if given is not None else
           f"run from a folder you can write in, or give {key}=DIR (a directory to create or fill)")
    if not path.strip():
        raise ConfigError(key, shown, "is empty; this key names the directory the run writes into", fix)
    try:
        check_output_dir(key, Path(path), fix)
    except ConfigError as e:
        if e.value != shown:  # the resolved path differs from what was written (outputs/${now:...}): both
            raise ConfigError(key, shown, f"{e.rule} ({path})", fix) from None
        raise
