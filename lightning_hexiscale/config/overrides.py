"""Command-line overrides that Hydra cannot apply as written: rewritten before composition, or
applied again after it.

- ``model=hf:/dir`` becomes ``model=_hf trainer.weights=/dir`` (:func:`hf_model_overrides`): Hydra
  composes the placeholder preset, which :func:`lightning_hexiscale.config.schema.resolve_hf_model`
  then fills from the directory's config.json.
- ``model.seq_len=2048`` given with ``model=file.yaml`` (or an HF model) was applied to the node the
  file replaced: :func:`reapply_overrides` applies it to the file's node.

Kept apart from :mod:`lightning_hexiscale.config.schema` (which imports it) so that the schemas and
their composition stay one file each of a readable size; nothing here reads a schema.
"""

from __future__ import annotations

import yaml
from omegaconf import DictConfig, OmegaConf

from lightning_hexiscale.config.compose_errors import hydra_quoted
from lightning_hexiscale.config.file_errors import clean_message, doc_page, expand_user
from lightning_hexiscale.config.hf_model import hf_dirs_of, read_hf_config
from lightning_hexiscale.errors import ConfigError, shown

HF_PLACEHOLDER = "_hf"
"""Model preset name that ``model=hf:/dir`` composes as (conf/model/_hf.yaml), filled from config.json."""


def check_compose_arguments(overrides: object, config_name: object) -> None:
    """``compose(overrides, config_name)``'s arguments: a list (or tuple) of ``key=value`` strings and a
    config name. A str was read one character an override ('c l u s t e r = c p u 2'), None and a number
    were a TypeError, a Path in the list an AttributeError, a number for the name Hydra's message keyed
    ``overrides``."""
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, (list, tuple)):
        fix = (f"pass a list of overrides: compose({overrides.split()!r})" if isinstance(overrides, str)
               else "pass a list of overrides, e.g. compose(['cluster=cpu_hetero4', 'train.global_batch=8']), or ()")
        raise ConfigError("compose(overrides)", shown(overrides), "must be a list of key=value strings", fix)
    for i, o in enumerate(overrides):
        if not isinstance(o, str):
            raise ConfigError(f"compose(overrides)[{i}]", shown(o), f"is of type {type(o).__name__}; an override is "
                              "a key=value string", "write it as a string, e.g. 'cluster=cpu_hetero4' (a file: "
                              "f'cluster={path}')")
    if not isinstance(config_name, str) or not config_name.strip():
        raise ConfigError("compose(config_name)", shown(config_name), "must be the name of a config (a str)",
                          "leave it out for the package's config.yaml, or pass e.g. config_name='config'")


def hf_model_overrides(overrides: list[str]) -> list[str]:
    """Rewrite ``model=hf:/dir`` into what Hydra can compose: ``model=_hf trainer.weights=/dir``
    (``conf/model/_hf.yaml`` is the placeholder :func:`~lightning_hexiscale.config.schema.resolve_hf_model` fills from config.json).
    ``trainer.weights`` given too must name the same directory. Each directory's config.json is read
    here, so that a missing directory or a bad config.json is the error of ``model = 'hf:DIR'``."""
    out, hf_dir, written = [], None, ""
    for o in overrides:
        key, _, value = o.partition("=")
        dirs = hf_dirs_of(value) if key == "model" else None
        if dirs is None:
            out.append(o)
            continue
        for d in dirs:  # keyed by model= here: read again below as trainer.weights, which the user never typed
            read_hf_config(d, "model")
        resolved = [str(expand_user(d).resolve()) for d in dirs]
        hf_dir = ",".join(resolved)  # a -m sweep: one job per directory
        written = ",".join(hydra_quoted(d) for d in resolved)  # a '~' or '#' in a directory's name: quoted
        out.append(f"model={HF_PLACEHOLDER}")
    if hf_dir is None:
        return out
    given = [o.partition("=")[2] for o in out if o.partition("=")[0] == "trainer.weights"]
    if given and str(expand_user(given[-1]).resolve()) != hf_dir:
        raise ConfigError("trainer.weights", given[-1], f"model=hf:{hf_dir} already starts from that directory's "
                          "weights", "drop trainer.weights, or give the same directory")
    if not given:
        out.append(f"trainer.weights={written}")
    return out


def reapply_overrides(cfg: DictConfig, key: str, overrides: list[str] | tuple[str, ...]) -> None:
    """Apply ``key.x=v`` overrides to a node that replaced the composed one (a file or HF model)."""
    for o in overrides:
        k, _, v = o.partition("=")
        k = k.lstrip("+")
        if k.startswith(key + "."):
            try:
                OmegaConf.update(cfg, k, yaml.safe_load(v) if v else v, merge=True)
            except Exception as e:
                raise ConfigError(k, v, clean_message(str(e)), f"see {doc_page(key)} for its keys") from None
