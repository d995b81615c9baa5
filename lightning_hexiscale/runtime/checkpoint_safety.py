"""Loading a checkpoint runs no code it carries, unless the caller says it trusts it.

A checkpoint directory holds two pickles: ``meta.pt`` (Lightning's state and the hexiscale record,
``torch.save``) and DCP's ``.metadata`` (the index of the saved tensors, ``pickle.dump``). Unpickling
can call any importable function with any arguments, so a checkpoint from someone else could run
code on load. As torch (>= 2.6) and Lightning do, both are read ``weights_only`` by default:

- ``meta.pt`` with ``torch.load(weights_only=True)``: tensors, containers, numbers, strings, and the
  globals the user allowed with ``torch.serialization.add_safe_globals`` (what this project and
  Lightning write needs nothing else);
- ``.metadata`` with an unpickler that resolves only DCP's metadata classes (``Metadata``,
  ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``, ... and the file system
  writer's ``_StorageInfo``), torch's ``Size``, dtypes, layouts and memory formats, and paths.

Anything else (a pickled callable, an unknown class) is refused with a :class:`ConfigError` naming
the file and the global, before anything of it runs. ``weights_only=False`` (``trainer.fit(...,
weights_only=False)``, ``read_meta(path, weights_only=False)``, ``load_llama(path,
weights_only=False)``) loads any pickle: only for checkpoints you trust.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lightning_hexiscale.errors import ConfigError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
"""Modules whose classes (and only classes) DCP's metadata may name."""
_PATH_CLASSES = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath"}


def weights_only_default(weights_only: bool | None) -> bool:
    """None (Lightning's and torch's "not given") means True, as in torch >= 2.6."""
    return True if weights_only is None else bool(weights_only)


def _refused(path: Path | str, what: str) -> ConfigError:
    return ConfigError("ckpt_path", str(path),
                       f"it holds a pickled {what}, which loading would have to execute; refused with weights_only=True "
                       "(the default: a checkpoint from someone else must not run code)",
                       "load it only if you trust where it came from: trainer.fit(..., ckpt_path=..., "
                       "weights_only=False), or read_meta / load_llama(..., weights_only=False); or allow its class "
                       "with torch.serialization.add_safe_globals([...])")


def load_meta(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """``meta.pt`` (see the module doc for ``weights_only``)."""
    if not weights_only_default(weights_only):
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        raise _refused(path, f"global {found.group(1)}" if found else "object beyond plain types") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata needs (module doc); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        ok = ((module in _DCP_MODULES and not name.startswith("__"))
              or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                     (torch.dtype, torch.layout, torch.memory_format))))
              or (module == "torch.serialization" and name == "_get_layout")
              or (module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES)
              or (module == "collections" and name == "OrderedDict"))
        if ok:
            obj = super().find_class(module, name)
            if module not in _DCP_MODULES or isinstance(obj, type):  # DCP's classes, never its functions
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name}")


def load_dcp_metadata(stream: BinaryIO, path: Path | str, weights_only: bool | None = None):
    """DCP's ``.metadata`` from an open stream (see the module doc for ``weights_only``)."""
    if not weights_only_default(weights_only):
        return pickle.load(stream)
    data = stream.read()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise _refused(path, str(e)) from None
