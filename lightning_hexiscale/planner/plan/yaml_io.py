"""YAML and JSON helpers of plan files: a loader that refuses a key given twice, ``meta`` in the
plain types YAML and strict JSON write, the cluster a plan's ``meta`` says it was made for, the
keys a plan file's mappings may hold, and the write that replaces a plan file and nothing else."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from lightning_hexiscale.errors import PlanError


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping: YAML (and json) keep the last,
    so a second ``pipelines:`` block replaced the first and ``batch_size: 4 ... batch_size: 8`` ran 8."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges; explicit keys may override
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: the constructor below says so
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice in one mapping (first on line {first + 1}); "
                "the second would silently replace the first", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def named_stream(text: str, path: str | Path) -> io.StringIO:
    """``text`` as a stream named ``path``: PyYAML's error marks name the stream (``in "plan.yaml",
    line 3``), and a string is named ``"<unicode string>"``."""
    stream = io.StringIO(text)
    stream.name = str(path)
    return stream


def plain(value: Any) -> Any:
    """``meta`` as YAML and JSON write it: numpy scalars as Python numbers (a client's
    ``meta={'time_s': np.float64(...)}`` made save() raise), tuples as lists."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return value.item()
    return value


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (for strict JSON)."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ClusterSource(NamedTuple):
    """The cluster a plan's ``meta`` names: ``key`` is the meta key it came from (``"cluster_file"`` or
    ``"cluster"``), ``value`` that key's value (None when the plan names neither)."""

    key: str
    value: Any


def cluster_source(meta: dict, where: str = "plan.meta") -> ClusterSource:
    """What to load as the cluster a plan was made for: ``meta.cluster_file`` (the cluster file's
    absolute path, written by ``hexiscale plan --out`` and the recipe's ``plan.yaml`` when the cluster
    came from a file), else ``meta.cluster`` (the cluster's name: a preset's name loads as that preset;
    None when the plan names neither). The key comes with the value, so that an error about it names
    the key the user wrote.

    A ``meta.cluster_file`` that is not there (moved, deleted, a hand-edited path) is a ConfigError
    naming ``{where}.cluster_file``: the plan was made and priced on that file, and any other cluster
    (the preset of the same name, or the local machine that ``hexiscale train`` discovers without a
    cluster) would run it on other devices and links without a word. Callers ask only when no
    cluster was given, which is the fix the error names."""
    from lightning_hexiscale.errors import ConfigError

    path = meta.get("cluster_file")
    if path is None:
        return ClusterSource("cluster", meta.get("cluster"))
    key = f"{where}.cluster_file"
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(key, path, "must be the path of the cluster file the plan was made on",
                          "correct the path, or pass cluster=<preset or file> to run the plan on that cluster")
    if not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "is not there (moved or deleted)"
        raise ConfigError(key, path, f"the cluster file this plan was made on {what}",
                          "pass cluster=<the file's new path> (or the preset or file to run the plan on), "
                          "or correct meta.cluster_file in the plan")
    return ClusterSource("cluster_file", path)


class OtherClusterWarning(UserWarning):
    """A plan runs, or is priced, on a cluster other than the one its ``meta`` names (:func:`made_for_another_cluster`)."""

    cli_notice = True
    """Printed by the command line as one ``PROG: warning: ...`` line."""


def made_for_another_cluster(meta: dict, cluster, doing: str, given: str | None = None) -> str | None:
    """The line that says a plan runs on a cluster other than the one its ``meta`` names (``cluster=``
    given beside the plan: the explicit choice wins), or None when it names none or the same cluster:
    the same file, or the same content (devices, machines, links, NICs, calibration, layer tables; the
    name aside: a copy of a preset's file is that preset); one that does not load (its file gone, a
    discovered cluster's name) is compared by name. ``doing``: ``priced`` or ``run``; ``given``:
    the cluster as the user named it (a preset or a path; default its name), for the fix."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.errors import ConfigError

    file, name = meta.get("cluster_file"), meta.get("cluster")
    file = file if isinstance(file, str) and file.strip() else None
    name = name if isinstance(name, str) and name.strip() else None
    if file is None and name is None:
        return None
    try:
        made = Cluster.load(file if file is not None else name)
    except (ConfigError, OSError, ValueError):  # gone, or a discovered cluster's name: compare the names
        made = None
    if made is not None and _same_devices_and_links(made, cluster):
        return None
    if made is None and name == cluster.name:  # e.g. the moved file of a plan whose meta.cluster_file is gone
        return None
    what = f"meta.cluster_file: {file}" if file is not None else "meta.cluster"
    target = given or cluster.name
    return (f"the plan was made for cluster {name or Path(file).stem} ({what}) and is {doing} on cluster "
            f"{cluster.name}, the cluster= given; `hexiscale plan cluster={target}` makes a plan for {cluster.name}")


def _same_devices_and_links(a, b) -> bool:
    """Two clusters alike in everything the cost model and the runtime read (the name aside)."""
    import numpy as np

    return (all(getattr(a, k) == getattr(b, k) for k in ("devices", "machines", "nics", "calibration", "layer_tables"))
            and np.array_equal(a.bandwidth, b.bandwidth) and np.array_equal(a.latency, b.latency))


def write_atomically(path: str | Path, text: str, key: str = "Plan.save(path)") -> None:
    """Replace the file at ``path`` by ``text``: a temporary file beside it, then a rename, so that a
    reader never sees half a plan. A link is followed (the file it names is replaced and the link
    kept: the rename put a plain file in the link's place, and a link to a directory, such as a
    checkout's ``conf``, was replaced by the plan). A directory, something that is no regular file (a
    FIFO, a device) and a failed write are a ConfigError naming ``key``; the temporary file goes."""
    from lightning_hexiscale.errors import ConfigError, shown

    if not isinstance(path, (str, os.PathLike)) or not str(path):  # None, 3: os.path's TypeError before
        raise ConfigError(key, shown(path), "must be the path of a file (a str or a Path)",
                          "pass e.g. 'plan.yaml' (or a .json path for JSON)")
    given, path = str(path), Path(os.path.realpath(path))
    if path.is_dir():
        raise ConfigError(key, given, "is a directory; a plan is written to a file",
                          f"give a file path, e.g. {path / 'plan.yaml'}")
    if path.exists() and not path.is_file():
        raise ConfigError(key, given, "is not a regular file (a FIFO, socket or device)",
                          "give the path of a new or plan file")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        if tmp.is_file():
            tmp.unlink()
        raise ConfigError(key, given, f"cannot be written ({e.strerror})",
                          "give a path in a writable directory") from None


def check_plan_keys(data: Any, required: set[str], optional: set[str], where: str) -> None:
    """A plan file's mapping at ``where`` has the ``required`` keys and no key but those and the
    ``optional`` ones (a misspelt key names the one it meant); else a PlanError."""
    if not isinstance(data, dict):
        raise PlanError(where, data, "expected a mapping", "see conf/plans/ for the plan file format")
    unknown = set(data) - required - optional
    if unknown:
        import difflib

        key = sorted(unknown, key=str)[0]
        allowed = sorted(required | optional)
        # a misspelling (micro_batch, layer, schedul) names the key it meant, as Hydra's config keys do
        near = difflib.get_close_matches(str(key), [k for k in allowed if k not in data], n=1, cutoff=0.6)
        raise PlanError(f"{where}.{key}", data[key], f"unknown key; allowed keys are {allowed}",
                        f"did you mean {near[0]}? rename it" if near else "remove or rename it")
    missing = required - set(data)
    if missing:
        raise PlanError(f"{where}.{sorted(missing)[0]}", None, "required key is missing",
                        f"add {sorted(missing)[0]}: ... (see conf/plans/ for the plan file format)")
