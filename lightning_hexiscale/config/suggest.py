"""Unknown config keys, refused with the closest valid key (``trainer.max_step`` -> ``trainer.max_steps``).

Hydra refuses ``trainer.max_step=3`` ("Could not override ... use +trainer.max_step=3") and, on that
advice, accepts ``+trainer.max_step=3``: it adds a key that nothing reads, and the run trains the
default 40 steps. Here a key below a typed node (a dataclass schema of
:mod:`~lightning_hexiscale.config.schema` or :mod:`~lightning_hexiscale.config.recipe`) must be one
of the schema's fields, with or without ``+``; the closest field names
(:func:`difflib.get_close_matches`) are the fix. Nodes that are plain mappings (free keys) take any key.
Beside it, the other checks of what a user wrote: value types, file references, interpolations.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_hexiscale.config.file_errors import check_hub_id
from lightning_hexiscale.config.values import CONFIG_GROUPS, check_value_type, did_you_mean
from lightning_hexiscale.errors import ConfigError


def closest(name: str, candidates: list[str]) -> list[str]:
    """Up to three of ``candidates`` closest to ``name`` (difflib's ratio >= 0.6), best first."""
    return difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)


CALL_KEY = re.compile(r"([\w.]+)\((\w+)\)")
"""The key of a call's argument, as the errors name it: ``LlamaLitModule(config)``."""


def written(key: str, value: str) -> str:
    """``value`` as the user gives it under ``key``: after a flag (``--model llama_tiny``), as the argument
    of a call (key ``LlamaLitModule(config)``: ``LlamaLitModule(config='hf:/m')``), else as an override
    (``model=llama_tiny``). So a fix reads in the words of the call that failed."""
    if key.startswith("--"):
        return f"{key} {value}"
    call = CALL_KEY.fullmatch(key)
    if call:
        return f"{call[1]}({call[2]}={value!r})"
    return f"{key}={value}"


def like_preset(name: str, presets: list[str]) -> str | None:
    """The preset whose name is closest to ``name`` compared on letters and digits alone (difflib's
    ratio >= 0.6): ``Llama-3.2-1B`` -> ``llama3_2_1b``, ``Meta-Llama-3-8B`` -> ``llama3_8b``."""
    def bare(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower())

    scored = [(difflib.SequenceMatcher(None, bare(name), bare(p)).ratio(), p) for p in presets]
    best = max(scored, default=(0.0, None))
    return best[1] if best[0] >= 0.6 else None


def check_model_hub_id(key: str | None, value: str, presets: list[str]) -> None:
    """A model value shaped as a hub id (:func:`~.file_errors.check_hub_id`): the fix reads the
    downloaded folder as ``hf:DIR``, or names a preset of a like name (:func:`like_preset`), for a
    model of that shape with fresh weights. ``key`` None: the API's loaders (values quoted)."""
    near = like_preset(value.split("/", 1)[-1], presets)
    also = (f"; or, for a model of its shape with fresh weights, the preset "
            f"{written(key, near) if key else repr(near)}" if near else "")
    check_hub_id(key or "model", value, written(key, "hf:DIR") if key else "'hf:DIR'", also)


def unknown_key_error(key: str, value: Any, name: str, fields: list[str], schema: str,
                      root: DictConfig | None = None) -> ConfigError:
    """The ConfigError for ``key`` (whose last part ``name`` is not among ``fields`` of ``schema``).
    ``root``: the composed config, whose field the closest key is, for a value it takes in the fix
    (:func:`did_you_mean`)."""
    parent = key[: -len(name)]
    near = closest(name, fields)
    if near:
        fix = did_you_mean(root, f"{parent}{near[0]}", value) if value is not None else \
            f"did you mean {near[0]}?" + (f" (or {', '.join(near[1:])})" if near[1:] else "")
    else:
        fix = f"the keys of {parent.rstrip('.') or 'the config'} are: {', '.join(fields)}"
    return ConfigError(key, value if value is not None else name, f"no such key in {schema}", fix)


_DEVICES = ("the devices come from the cluster, not the trainer: one rank per device of cluster=<preset or "
            "file>, or cluster=auto (this machine's GPUs, else 4 CPU processes); under torchrun or SLURM the "
            "launch decides (see docs/guide/clusters.md)")
_STEPS = "training is counted in optimizer steps: trainer.max_steps=N"
_BATCH = "sequences per optimizer step, which the planner splits among the pipelines"
LIGHTNING_KEYS = {
    "trainer.devices": _DEVICES, "trainer.num_nodes": _DEVICES, "trainer.accelerator": _DEVICES,
    "trainer.strategy": "hexiscale train always runs the hexiscale strategy; to use another, call "
                        "lightning.Trainer(strategy=...) in a script of your own",
    "trainer.max_epochs": _STEPS, "trainer.max_time": _STEPS, "trainer.limit_train_batches": _STEPS,
    "trainer.val_check_interval": "validation runs every trainer.val_every steps (e.g. trainer.val_every=50; 0 = never)",
    "trainer.check_val_every_n_epoch": "validation runs every trainer.val_every steps (e.g. trainer.val_every=50)",
    "trainer.log_every_n_steps": "use trainer.log_every (e.g. trainer.log_every=10)",
    "trainer.enable_progress_bar": "use trainer.progress_bar (true or false)",
    "trainer.default_root_dir": "use trainer.output_dir (or hydra.run.dir)",
    "trainer.enable_checkpointing": "set trainer.checkpoint_every (0: only the last checkpoint, at the end)",
    "trainer.batch_size": f"the batch is train.global_batch ({_BATCH})",
    "data.batch_size": f"the batch is train.global_batch ({_BATCH})",
    "train.batch_size": f"did you mean train.global_batch? ({_BATCH})",
}
"""Lightning's Trainer (and DataLoader) arguments that the recipe's config takes elsewhere, or not at
all: the fix says where, rather than the list of keys (``trainer.devices=4`` listed 27 keys)."""


def _typed_fields(node: Any) -> tuple[list[str], str] | None:
    """(field names, schema name) of a typed DictConfig node; None for a free mapping."""
    if not isinstance(node, DictConfig):
        return None
    kind = OmegaConf.get_type(node)
    if kind is None or not dataclasses.is_dataclass(kind):
        return None
    return [f.name for f in dataclasses.fields(kind)], kind.__name__


def check_override_key(cfg: DictConfig, override: str) -> None:
    """``override`` (``[+|++|~]a.b.c=value``) names a key the composed ``cfg`` has, or one its typed
    parent node could have; ConfigError with the closest field otherwise. A root value or section
    (``dry_run=maybe``, ``trainer=5``) is checked against its type; group selections (``cluster=...``) are
    Hydra's to check, and ``hydra.*`` is checked only against a ``cfg`` that has Hydra's node."""
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    if key.startswith("hydra.") and "hydra" not in cfg:
        return  # Hydra's own node, checked where it is composed (cli/train_hydra.py)
    if "." not in key:
        # dry_run=maybe, plan=[1,2], trainer=5: a value or section of the root, not a group's preset
        if not override.startswith("~") and key in cfg and key not in CONFIG_GROUPS:
            check_value_type(cfg, key, key, value)
        return
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig):
            if not part.isdigit():
                raise _list_by_name_error(node, parts, i, value)
            if int(part) >= len(node):  # OmegaConf: "Invalid type assigned: dict is not a subclass of MachineConfig"
                raise ConfigError(".".join(parts), value, f"{'.'.join(parts[:i])} has {len(node)} "
                                  f"entr{'y' if len(node) == 1 else 'ies'} (index 0 to {len(node) - 1})",
                                  "use the index of an existing entry; to add entries, write them in a file "
                                  f"({parts[0]}=my_{parts[0]}.yaml)")
            node = node[int(part)]
            if node is None:
                return
            continue
        if not isinstance(node, DictConfig):
            return  # below a leaf: OmegaConf refuses it with its own message
        if part in node:
            _check_fills_null(node, parts, i, value)
            if i == len(parts) - 1:
                if not override.startswith("~"):  # ~key (delete) carries no value
                    check_value_type(node, part, ".".join(parts), value)
                return
            node = node[part]
            continue
        typed = _typed_fields(node)
        if typed is None:  # a free mapping: any key, added with '+' (Hydra: "Could not override ... Key 'FOO' is not in struct")
            element = getattr(node._metadata, "element_type", None)  # OmegaConf's: no public reader
            where = ".".join(parts[:i])
            if dataclasses.is_dataclass(element) and not override.startswith("~"):
                raise _missing_entry_error(cfg, node, parts, i, value, element)
            if not override.startswith(("+", "~")):
                raise ConfigError(key, value, f"{where} has no key {part}, and a key a mapping lacks is added with '+'",
                                  f"write +{key}={value}")
            return
        fields, schema = typed
        elsewhere = [top for top in cfg if i == 1 and top != parts[0] and isinstance(cfg[top], DictConfig)
                     and part in cfg[top]]  # train.lr for trainer.lr: the key is in another section
        if elsewhere:  # the same name elsewhere beats a near name here (trainer.global_batch: not limit_val_batches)
            moved = [".".join([top, *parts[1:]]) for top in elsewhere]
            others = f" (or {', '.join(moved[1:])})" if moved[1:] else ""
            raise ConfigError(key, value, f"no such key in {schema}", did_you_mean(cfg, moved[0], value, others))
        bad = ".".join(parts[: i + 1])
        indexed = re.fullmatch(r"(\w+)\[(\d+)\]", part)  # machines[1]: Python's index, not the grammar's
        if indexed and isinstance(node.get(indexed[1]), ListConfig):
            dotted = ".".join([*parts[:i], indexed[1], indexed[2], *parts[i + 1:]])
            raise ConfigError(key, value, "a Hydra override indexes a list with a dot, not brackets",
                              f"write {dotted}={value}")
        if bad in LIGHTNING_KEYS:
            raise ConfigError(bad, value if i == len(parts) - 1 else part, f"no such key in {schema}",
                              LIGHTNING_KEYS[bad])
        raise unknown_key_error(bad, value if i == len(parts) - 1 else None, part, fields, schema, root=cfg)


def _list_by_name_error(node: ListConfig, parts: list[str], i: int, value: str) -> ConfigError:
    """``cluster.machines.big.count=1``: a list's entry named by its ``name`` (or any word), not its
    position. OmegaConf said "Index 'big' (str) is not an int" under the whole command line; this names
    the list, its entries by position and, where an entry has that name, the key to write."""
    where, part = ".".join(parts[:i]), parts[i]
    names = [entry.get("name") if isinstance(entry, DictConfig) else None for entry in node]
    rest = ".".join(parts[i + 1:])
    if part in names:
        at = names.index(part)
        fix = f"write {'.'.join([*parts[:i], str(at), *parts[i + 1:]])}={value} ({where}.{at} is {part})"
    else:
        shown = ", ".join(f"{n} {name}" if name is not None else str(n) for n, name in enumerate(names))
        fix = (f"index it by position ({shown or 'it is empty'}): e.g. {where}.0" + (f".{rest}" if rest else "")
               + f"={value}")
    span = f"0 to {len(node) - 1}" if len(node) else "empty here"
    return ConfigError(".".join(parts), value, f"{where} is a list, indexed by position ({span}), not by a name "
                       f"like {part!r}", fix)


def _missing_entry_error(cfg: DictConfig, node: DictConfig, parts: list[str], i: int, value: str,
                         element: type) -> ConfigError:
    """``cluster.gpu_types.X.flops=1`` where the mapping has no entry X: Hydra said "Key 'X' is not in
    struct ... use +cluster.gpu_types.X.flops=1", and with '+' OmegaConf refuses the new entry anyway
    ("dict is not a subclass of GpuTypeConfig"): a typed entry cannot be added by an override. This
    names the entries there and the near one (any case), else says where a new entry is written."""
    from lightning_hexiscale.config.catalog import lookup
    from lightning_hexiscale.config.units import format_bytes, format_flops

    where, part = ".".join(parts[:i]), parts[i]
    entries = [str(k) for k in node.keys()]
    near = [k for k in entries if k.lower() == part.lower()] or closest(part, entries)
    rule = f"{where} has no entry {part} (its entries: {', '.join(entries) or 'none'})"
    if near:
        return ConfigError(".".join(parts), value, rule, did_you_mean(cfg, ".".join([*parts[:i], near[0], *parts[i + 1:]]),
                                                                     value))
    built_in = lookup(part) if where == "cluster.gpu_types" else None
    if built_in is not None:  # cluster.gpu_types.A800.flops=...: the catalog's type, which a cluster file may redefine
        rule += (f"; {part} is the catalog's built-in type ({format_flops(built_in.peak_flops)}, "
                 f"{format_bytes(built_in.memory_bytes)}), which a cluster file redefines under gpu_types")
        return ConfigError(".".join(parts), value, rule + f", and an override cannot add an entry of {element.__name__}",
                           f"write gpu_types: {{{part}: {{flops: ..., memory: ...}}}} in a cluster file and pass "
                           "cluster=FILE.yaml (`hexiscale cluster cluster=NAME` shows the preset to start from)")
    return ConfigError(".".join(parts), value, rule + f"; an override cannot add an entry of {element.__name__}",
                       f"write the new entry in a {parts[0]} file and pass {parts[0]}=FILE.yaml (`hexiscale "
                       f"{parts[0]} {parts[0]}=NAME` shows the preset to start from), or change an entry it has")


def top_key_error(name: str, value: str, schema: type) -> ConfigError:
    """The ConfigError for a top-level override ``name=value`` that the root ``schema`` lacks: Hydra
    says "Could not override 'max_steps' ... use +max_steps=3", and on that advice adds a key that
    nothing reads. The fix names the section that has a field of that name (``max_steps`` ->
    ``trainer.max_steps``), else the closest top-level field or section field (``global_bach`` ->
    ``train.global_batch``). Only for what Hydra itself refused: a config group of the user's own
    (an ``experiment=...`` of ``@package _global_``) composes and never gets here."""
    hints = _hints(schema)
    top = [f.name for f in dataclasses.fields(schema)]
    # section field name -> its dotted keys (a name in two sections: both, in the schema's order)
    inner: dict[str, list[str]] = {}
    for section in top:
        sub, mapping = hints.get(section, (None, False))
        if sub is not None and not mapping and dataclasses.is_dataclass(sub):
            for f in dataclasses.fields(sub):
                inner.setdefault(f.name, []).append(f"{section}.{f.name}")
    exact = inner.get(name, [])
    near = closest(name, top) or [inner[n][0] for n in closest(name, list(inner))]
    defaults = OmegaConf.structured(schema)  # the fields' types and defaults, for a value the key takes
    if exact:  # the same name in a section beats a near name at the top (max_steps: not plan)
        others = f" (or {', '.join(exact[1:])})" if exact[1:] else ""
        fix = did_you_mean(defaults, exact[0], value, others)
    elif f"trainer.{name}" in LIGHTNING_KEYS:  # devices=4: Lightning's Trainer(devices=4), not use_all_devices
        fix = LIGHTNING_KEYS[f"trainer.{name}"]
    elif near:
        fix = did_you_mean(defaults, near[0], value)
    else:
        fix = (f"the top-level keys are {', '.join(top)}; every other key is below one of them "
               "(e.g. train.global_batch=32, trainer.max_steps=100)")
    return ConfigError(name, value, f"no such key at the top of the config ({schema.__name__})", fix)


def _check_fills_null(node: DictConfig, parts: list[str], i: int, value: str) -> None:
    """``parts[i]`` of ``node`` is a typed section left null (a machine's ``nics``, a model's
    ``rope_scaling``), and the override sets a key below it or a mapping into it: OmegaConf cannot merge
    into a null section ("'NoneType' object has no attribute 'get'", "Unexpected type for root:
    NoneType" under the whole command line), so the ConfigError says where such a section is written."""
    if node[parts[i]] is not None or (i == len(parts) - 1 and not value.lstrip().startswith("{")):
        return
    kind = OmegaConf.get_type(node)
    sub = _hints(kind).get(parts[i], (None, False))[0] if dataclasses.is_dataclass(kind) else None
    if not dataclasses.is_dataclass(sub):
        return
    here = ".".join(parts[: i + 1])
    raise ConfigError(".".join(parts), value, f"{here} is null here, and an override cannot fill in a null "
                      f"{sub.__name__} section (OmegaConf cannot merge into it)",
                      f"write the {parts[0]} in a file with {parts[i]}: {{...}} (start from its preset under conf/{parts[0]}/) "
                      f"and pass {parts[0]}=that_file.yaml")


IDENTIFIERS = frozenset({"name", "gpu", "hostname"})
"""Text fields that name things; YAML's flags and floats there are refused (its integers, as in
``name: 3090``, read back as written and are kept)."""


FILE_MARKERS = {"plan": "pipelines", "cluster": "machines", "model": "hidden_size"}
"""The top-level key that tells each kind of file apart (a plan has ``num_layers`` too, as a model)."""


def file_kind(keys: Any) -> str | None:
    """``plan``, ``cluster`` or ``model``: the kind of file whose top-level ``keys`` these are, by
    :data:`FILE_MARKERS`; None when no marker is among them."""
    names = {str(k) for k in keys}
    return next((kind for kind, marker in FILE_MARKERS.items() if marker in names), None)


def check_file_kind(keys: Any, wanted: str, key: str, path: str, error: type[ConfigError] = ConfigError) -> None:
    """A ``wanted`` file (plan, cluster or model) whose top-level ``keys`` are those of another kind is
    refused as that kind, e.g. ``cluster = 'p.yaml': is a plan file (it has pipelines:), not a cluster
    file`` (it was the first of its keys the schema does not know: ``cluster.num_layers: no such key``)."""
    names = {str(k) for k in keys}
    kind = file_kind(names)
    if kind is not None and kind != wanted and FILE_MARKERS[wanted] not in names:
        raise error(key, path, f"is a {kind} file (it has {FILE_MARKERS[kind]}:), not a {wanted} file",
                    f"give it as the {kind} ({given_as(kind, key, path)}), and a {wanted} file here")


CALL_FOR_KIND = {"plan": "HexiScaleStrategy(plan)", "cluster": "HexiScaleStrategy(cluster)",
                 "model": "LlamaLitModule(config)"}
"""The argument of the Python API that takes each kind of file."""


def given_as(kind: str, key: str, path: str) -> str:
    """Where a ``kind`` file (plan, cluster or model) goes, in the words of the ``key`` that was given
    it instead: a call's argument (``HexiScaleStrategy(plan='p.yaml')``) after a call's, an override
    (``plan=p.yaml``) after an override or ``--plan`` (estimate and calibrate take overrides beside it),
    the training command after another flag (``discover``/``profile --model`` take no plan or cluster)."""
    if CALL_KEY.fullmatch(key):
        return written(CALL_FOR_KIND[kind], path)
    if key.startswith("--") and key != "--plan":
        return f"hexiscale train {kind}={path}"
    return f"{kind}={path}"


def check_yaml_keys(raw: DictConfig, schema: type, key: str, path: str) -> None:
    """Every key of a YAML node ``raw`` (a cluster or model file) is a field of ``schema`` (nested
    dataclasses and lists of them included); ConfigError with the closest field otherwise. A name
    (:data:`IDENTIFIERS`) that YAML read as a flag or a float is refused too."""
    def walk(node: Any, kind: Any, where: str) -> None:
        if isinstance(node, ListConfig):
            for i, item in enumerate(node):
                walk(item, kind, f"{where}[{i}]")
            return
        if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(kind):
            return
        names = [f.name for f in dataclasses.fields(kind)]
        hints = _hints(kind)
        flags = _flag_fields(kind)
        containers = _containers(kind)
        for k in node:
            value = node._get_node(k)._value()
            if k not in names:
                near = closest(str(k), names)
                fix = (f"did you mean {near[0]}? (write {near[0]}: ... in the file)" if near
                       else f"the keys of {where} are: {', '.join(names)}")
                raise ConfigError(f"{where}.{k}", value, f"no such key in {kind.__name__} (in {path})", fix)
            _check_container(node._get_node(k), containers.get(k), hints.get(k, (None, False)), f"{where}.{k}", path)
            if k in flags and value is not None and not isinstance(value, bool):
                # OmegaConf turns any number into a flag (tie_word_embeddings: -1 ran as true)
                raise ConfigError(f"{where}.{k}", value, f"must be true or false (in {path})",
                                  f"write {k}: true or {k}: false")
            if k in IDENTIFIERS and isinstance(value, (bool, float)):
                # a str field takes them as text: name: yes became 'True', 1.10 '1.1', 1e3 '1000.0'
                # (then unknown to machine_links and nics.to, or shown so in the plan tables)
                raise ConfigError(f"{where}.{k}", value, f"YAML read this {k} as {type(value).__name__} {value!r}, "
                                  f"not as text (in {path})", f'write it as a string, in YAML in quotes (e.g. {k}: "on", {k}: "1.10"): '
                                  "unquoted, yes/no/on/off/true/false are flags and 1.10 or 1e3 numbers")
            child = node[k] if OmegaConf.is_config(node._get_node(k)) else None
            sub, mapping = hints.get(k, (None, False))
            if mapping and isinstance(child, DictConfig):  # free keys (names), each value of type ``sub``
                for name in child:
                    walk(child[name], sub, f"{where}.{k}.{name}")
            else:
                walk(child, sub, f"{where}.{k}")

    walk(raw, schema, key)


def _containers(kind: type) -> dict[str, str]:
    """Field name -> ``list`` or ``mapping`` (a dict or a dataclass, possibly Optional) for the fields
    of dataclass ``kind`` that hold one."""
    import typing

    try:
        hints = typing.get_type_hints(kind)
    except Exception:  # noqa: BLE001 -- an unresolvable annotation: not checked
        return {}
    out = {}
    for name, hint in hints.items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is typing.Union else [hint]
        if len(args) != 1:
            continue
        origin = typing.get_origin(args[0]) or args[0]
        if origin in (list, tuple):
            out[name] = "list"
        elif origin is dict or dataclasses.is_dataclass(origin):
            out[name] = "mapping"
    return out


def _check_container(child: Any, want: str | None, held: tuple[Any, bool], key: str, path: str) -> None:
    """A field that holds a list or a mapping got one (or null): OmegaConf's own errors named neither
    the key nor the fix ("Cannot merge DictConfig with ListConfig", "AnyNode is not a ListConfig").
    ``held``: (the dataclass the list's entries, the mapping's values or the field itself is, whether
    it is the values of a mapping of names), for the rule and the example in the fix."""
    value = child._value()
    if want is None or value is None or OmegaConf.is_missing(child._get_parent(), child._key()):
        return
    got = isinstance(child, ListConfig), isinstance(child, DictConfig)
    if (want == "list" and got[0]) or (want == "mapping" and got[1]):
        return
    what = "a list" if got[0] else "a mapping" if got[1] else f"{type(value).__name__} {value!r}"
    if got[0] or got[1]:  # the error's value as plain data, as the file wrote it (not OmegaConf's node)
        value = OmegaConf.to_container(child, resolve=False)
    entry, by_name = held
    keys = f"{entry.__name__} ({', '.join(f.name for f in dataclasses.fields(entry))})" if dataclasses.is_dataclass(entry) else ""
    name = key.rsplit(".", 1)[-1]
    from lightning_hexiscale.config.file_errors import ENTRY_EXAMPLES, doc_page

    page = doc_page(key.split(".", 1)[0])
    if want == "list":
        example = ENTRY_EXAMPLES.get(getattr(entry, "__name__", ""), "").format(name="a")
        raise ConfigError(key, value, f"must be a list{f' of entries with the keys of {keys}' if keys else ''}, not {what} "
                          f"(in {path})", "write one entry per line, each starting with '- ', or the list on one line in "
                          "brackets" + (f", e.g. {name}: [{example}]" if example else f" (see {page})"))
    rule = (f"must be a mapping of names to entries with the keys of {keys}" if keys and by_name
            else f"must be a mapping with the keys of {keys}" if keys else "must be a mapping")
    raise ConfigError(key, value, f"{rule}, not {what} (in {path})",
                      f"write {name}: with its keys below it, indented (key: value), or {name}: {{key: value, ...}} on "
                      f"one line (see {page})")


def _flag_fields(kind: type) -> set[str]:
    """The fields of dataclass ``kind`` typed bool (or Optional[bool])."""
    import typing

    try:
        hints = typing.get_type_hints(kind)
    except Exception:  # noqa: BLE001 -- an unresolvable annotation: not checked
        return set()
    return {n for n, h in hints.items() if h is bool or h == typing.Optional[bool]}


def check_flag_overrides(cfg: DictConfig, overrides: list[str] | tuple[str, ...]) -> None:
    """An override of a true/false key (``planner.use_all_devices=-1``) gives true or false:
    OmegaConf turned any number into a flag (-1 and 2**70 ran as true, 0 as false)."""
    import yaml

    for o in overrides:
        key, sep, value = o.partition("=")
        key = key.lstrip("+")
        if not sep or key.startswith(("~", "hydra.")) or "," in value:
            continue  # group selections, deletions and -m sweeps (each point is composed on its own)
        try:  # an interpolation (${hydra:...} outside a Hydra run) is no flag: not resolved here
            current = OmegaConf.select(cfg, key, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001 -- a key OmegaConf cannot select: composition reported it already
            continue
        if not isinstance(current, bool):
            continue
        try:
            parsed = yaml.safe_load(value) if value else value
        except yaml.YAMLError:
            continue
        if not isinstance(parsed, bool):
            raise ConfigError(key, value, "must be true or false", f"write {key}=true or {key}=false")


def _hints(kind: type) -> dict[str, tuple[Any, bool]]:
    """Field name -> (the dataclass the field holds directly, in a list or Optional, or as the values
    of a mapping; whether it is such a mapping). Fields of other types are absent."""
    import typing

    out: dict[str, tuple[Any, bool]] = {}
    try:
        hints = typing.get_type_hints(kind)
    except Exception:  # noqa: BLE001 -- an unresolvable annotation: that field is not walked
        return out
    for name, hint in hints.items():
        mapping = False
        todo, seen = [hint], []
        while todo:
            h = todo.pop()
            seen.append(h)
            mapping = mapping or typing.get_origin(h) in (dict, typing.Dict)
            todo.extend(typing.get_args(h))
        found = next((c for c in seen if dataclasses.is_dataclass(c)), None)
        if found is not None:
            out[name] = (found, mapping)
    return out


def check_file_refs(overrides: list[str], presets: dict[str, list[str]]) -> None:
    """``cluster=`` / ``model=`` values that look like paths (a ``/``, or a ``.yaml``/``.yml`` ending)
    name files that exist: Hydra would look for a preset of that name and answer "Could not find
    'cluster//path'" with the preset list. ``presets``: group -> preset names, for the fix."""
    from lightning_hexiscale.config.file_errors import expand_user, is_file

    for o in overrides:
        key, _, value = o.partition("=")
        if key not in ("cluster", "model") or value.startswith("hf:") or "," in value:
            continue
        if ("/" in value or value.endswith((".yaml", ".yml"))) and not is_file(expand_user(value)):
            if key == "model":
                check_model_hub_id(key, value, presets.get(key, []))
            where = expand_user(value)
            rule = "no such file" + (f" ({where.resolve()})" if not where.is_absolute() else "")
            try:
                is_dir = where.is_dir()
            except (OSError, ValueError):  # a name longer than the OS allows: not a directory either
                is_dir = False
            if is_dir:
                rule = "a directory, not a YAML file"
                _refuse_hf_dir(key, value, where, rule)
            near = like_preset(where.name.removesuffix(".yaml").removesuffix(".yml"), presets.get(key, []))
            fix = (f"check the path, or use the preset {near} ({key}={near})" if near
                   else f"check the path, or use a preset: {', '.join(presets.get(key, []))}")
            raise ConfigError(key, value, rule, fix)
        names = ", ".join(presets.get(key, []))
        if not value.strip():  # an unset shell variable: Hydra looked for "cluster/" among the presets
            raise ConfigError(key, value, "is empty: it takes a preset name or a .yaml file",
                              f"name one, e.g. {key}=path/to/{key}.yaml, or a preset: {names}")
        if (value not in presets.get(key, []) and value.lower() not in ("auto", "null", "none") and "/" not in value
                and not value.endswith((".yaml", ".yml"))):
            # a name without a path that is no preset but is there in the working directory
            where = expand_user(value)
            if where.is_dir():
                rule = "names no preset; it is a directory here, not a YAML file"
                _refuse_hf_dir(key, value, where, rule)
                raise ConfigError(key, value, rule, f"name the .yaml file inside it, e.g. {key}={value}/{key}.yaml, "
                                  f"or a preset: {names}")
            if where.is_file():
                raise ConfigError(key, value, f"names no preset; it is a file here, but a {key} file is read only "
                                  "when its name ends in .yaml or .yml", f"rename it to {value}.yaml and pass "
                                  f"{key}={value}.yaml, or use a preset: {names}")


def _refuse_hf_dir(key: str, value: str, where, rule: str) -> None:
    """``model=DIR`` of a Hugging Face model directory (it holds config.json): the fix is ``model=hf:DIR``."""
    if key == "model" and (where / "config.json").is_file():
        raise ConfigError(key, value, f"{rule} (it holds a Hugging Face config.json)", f"read it as one: model=hf:{value}")


def check_interpolations(cfg: DictConfig, prefix: str = "") -> None:
    """Every ``${...}`` of ``cfg`` resolves, or a ConfigError names its key: ``${oc.env:VAR}`` of a
    variable that is not set was OmegaConf's InterpolationResolutionError traceback wherever the value
    was first read (the cluster's summary, the search, each rank). ``${hydra:...}`` is left to Hydra
    outside a Hydra run (``hexiscale plan`` composes without one). ``prefix``: the key of ``cfg``."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import OmegaConfBaseException

    def walk(raw: Any, path: list[str | int]) -> None:
        items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
        for k, v in items:
            walk(v, [*path, k])
        if not (isinstance(raw, str) and "${" in raw) or ("${hydra:" in raw and not HydraConfig.initialized()):
            return
        try:
            OmegaConf.select(cfg, ".".join(str(p) for p in path), throw_on_resolution_failure=True)
        except OmegaConfBaseException as e:
            key = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
            env = re.search(r"Environment variable '([^']+)' not found", str(e))
            fix = (f"set {env.group(1)} in the environment, or give a default: ${{oc.env:{env.group(1)},VALUE}}"
                   if env else "interpolate a key the configuration has (`--cfg job` prints it)")
            raise ConfigError(key.lstrip("."), raw, f"cannot be resolved: {str(e).splitlines()[0]}", fix) from None

    walk(OmegaConf.to_container(cfg, resolve=False), [])

