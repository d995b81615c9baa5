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
the file and the global, before anything of it runs; a file that is no such pickle (empty, cut short,
overwritten) is a ConfigError that says it is damaged. ``weights_only=False`` (``trainer.fit(...,
weights_only=False)``, ``read_meta(path, weights_only=False)``, ``load_llama(path,
weights_only=False)``) loads any pickle: only for checkpoints you trust.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
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


def _damaged(path: Path | str, e: Exception) -> ConfigError:
    """A checkpoint file that is not the pickle a save wrote: empty, cut short or overwritten. Told
    apart from a refused global, whose fix (trusting the file) would not help here."""
    if Path(path).is_file() and Path(path).stat().st_size == 0:
        what = "is empty (0 bytes)"
    else:  # torch's weights-only message runs to a page and advises weights_only=False: its name only
        detail = "" if isinstance(e, pickle.UnpicklingError) else (str(e).splitlines() or [""])[0].split(". ")[0][:100]
        what = f"cannot be read ({type(e).__name__}{': ' + detail if detail else ''})"
    return ConfigError("ckpt_path", str(path), f"{what}: the file is damaged or cut short (an interrupted copy, "
                       "a full disk?)", "copy the checkpoint again from where it was saved, or use an earlier one")


def load_meta(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """``meta.pt`` (see the module doc for ``weights_only``)."""
    trusted = not weights_only_default(weights_only)
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except (OSError, ImportError, AttributeError):
        raise  # a path's error (the CLI names the path), or a class a trusted pickle names that is not here
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if trusted or not (found or zipfile.is_zipfile(path)):  # not what torch.save writes: a damaged file
            raise _damaged(path, e) from None
        raise _refused(path, f"global {found.group(1)}" if found else "object beyond plain types") from None
    except Exception as e:  # EOFError (empty), RuntimeError (a cut zip), KeyError (text): damaged
        raise _damaged(path, e) from None


class _Refused(pickle.UnpicklingError):
    """A global the unpickler will not resolve (not a damaged file)."""


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
        raise _Refused(f"global {module}.{name}")


def load_dcp_metadata(stream: BinaryIO, path: Path | str, weights_only: bool | None = None):
    """DCP's ``.metadata`` from an open stream (see the module doc for ``weights_only``)."""
    data = stream.read()
    try:
        if not weights_only_default(weights_only):
            return pickle.loads(data)
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise _refused(path, str(e)) from None
    except (ImportError, AttributeError):
        raise  # a class this torch lacks (or a trusted pickle's): not a damaged file
    except Exception as e:  # EOFError (empty), "invalid load key" or a memo error (not a pickle): damaged
        raise _damaged(path, e) from None
