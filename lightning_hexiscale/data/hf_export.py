"""Write a Hugging Face Llama directory: ``config.json``, sharded ``*.safetensors`` (+ index) and the
tokenizer files, loadable with ``transformers.LlamaForCausalLM.from_pretrained(OUT)``.

Layout (the one ``save_pretrained`` writes)::

    OUT/config.json                          LlamaConfig.to_hf(): shape, RoPE (theta + llama3 scaling), tie
    OUT/model-00001-of-00003.safetensors     tensors by HF name, each file at most max_shard_bytes
    OUT/model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    OUT/tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...   copied from --tokenizer
    OUT/generation_config.json               copied from --tokenizer when present

One shard is named ``model.safetensors`` and gets no index. A tied model writes the matrix once, as
``model.embed_tokens.weight``. Files are written into ``OUT.tmp-*`` and renamed into place, so an
interrupted export never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from lightning_hexiscale.config.file_errors import check_hub_id, expand_user
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.data.weights import expected_shapes, global_to_hf

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""5 GB per file, transformers' default ``max_shard_size``."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")
"""Files copied from a tokenizer directory when present (tokenizer.json or tokenizer.model required).
The chat template: transformers >= 4.50 saves it in ``chat_template.jinja``, no longer in
tokenizer_config.json, so an instruct model exported without that file has none."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def shard_names(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Greedy split of tensors (in order, by byte size) into shards of at most ``max_shard_bytes``
    (a tensor larger than the limit gets a shard of its own); returns tensor indices per shard."""
    shards: list[list[int]] = []
    used = max_shard_bytes
    for i, n in enumerate(sizes):
        if used + n > max_shard_bytes or not shards:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def tokenizer_extras(tokenizer_dir: Path | None) -> dict:
    """bos/eos token ids for config.json, from the tokenizer directory's config.json or
    generation_config.json (the original model directory usually has both)."""
    out: dict = {}
    if tokenizer_dir is None:
        return out
    for name in ("config.json", "generation_config.json"):
        f = tokenizer_dir / name
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except ValueError:
                continue
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in data and key not in out:
                    out[key] = data[key]
    return out


class NoTokenIdsWarning(UserWarning):
    """An export without a tokenizer directory: config.json gets no bos/eos token ids."""

    cli_notice = True
    """``hexiscale export`` prints it as one line (``cli/common.py``)."""


def _written_by_export(name: str) -> bool:
    """A file name that :func:`save_hf` writes (or copies from a tokenizer directory)."""
    return (name in ("config.json", "model.safetensors", "model.safetensors.index.json") or name in TOKENIZER_FILES
            or (name.startswith("model-") and name.endswith(".safetensors")))


def check_export_target(out: str | Path, overwrite: bool) -> Path:
    """The output directory of an export, checked before any work: an existing file is refused (the
    export writes a directory, and deleting a file the user named is never what they meant), an
    existing directory needs ``overwrite``, and even then it may hold only what an export writes,
    so that ``--overwrite`` cannot wipe a model's source directory, a checkpoint or a home folder.
    A symbolic link is followed: the export is renamed into place beside the directory it names
    (else it would replace the link, on the link's file system, and leave the link as ``.old-*``)."""
    out = expand_user(out).absolute()
    if out.is_symlink():
        out = out.resolve()  # a dangling link too: its target is where the user wants the export
    parent = out.parent
    while not parent.exists():  # missing folders are created; the first one that exists must be one
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError("--hf", str(out), f"cannot create a directory in {parent} "
                          f"({'a file' if not parent.is_dir() else 'not writable'})",
                          "give a path inside a writable directory")
    if out.exists() and not out.is_dir():
        raise ConfigError("--hf", str(out), "is a file; the export writes a directory (config.json, *.safetensors)",
                          "give the path of a new directory, e.g. --hf " + str(out.with_suffix("")) + "-hf")
    if out.is_dir() and any(out.iterdir()):  # an empty directory (made ahead, e.g. by a job script) is taken
        if not overwrite:
            raise ConfigError("--hf", str(out), "the output directory exists",
                              "choose a new directory or pass --overwrite")
        foreign = sorted(p.name for p in out.iterdir() if not (p.is_file() and _written_by_export(p.name)))
        if foreign:
            raise ConfigError("--hf", str(out), f"holds {foreign[0]!r} (and {len(foreign) - 1} more), which an export "
                              "does not write: --overwrite replaces only a previous export",
                              "choose a new directory, or move those files away first")
    return out


def check_tokenizer_dir(tokenizer_dir: str | Path | None) -> Path | None:
    """``--tokenizer``: a directory holding tokenizer.json or tokenizer.model (checked before the
    checkpoint is read); None stays None."""
    if tokenizer_dir is None:
        return None
    tok = expand_user(tokenizer_dir)
    if tok.is_file():  # prepare-data takes tokenizer.json itself; here the directory's other files count
        raise ConfigError("--tokenizer", str(tok), "is a file; the export copies the tokenizer files of a "
                          "directory and takes the bos/eos ids from its config.json",
                          f"give the directory holding it: --tokenizer {tok.parent}")
    check_hub_id("--tokenizer", str(tokenizer_dir), "--tokenizer DIR")
    if not tok.exists():  # was "no tokenizer.json or tokenizer.model in this directory"
        raise ConfigError("--tokenizer", str(tok), "no such directory",
                          "point to the HF model directory the checkpoint was trained from")
    if not tok.is_dir() or not any((tok / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise ConfigError("--tokenizer", str(tok), "no tokenizer.json or tokenizer.model in this directory",
                          "point to the HF model directory the checkpoint was trained from")
    return tok


def save_hf(state: Mapping[str, torch.Tensor], config: LlamaConfig, out: str | Path, *, dtype: str | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer_dir: str | Path | None = None,
            overwrite: bool = False) -> Path:
    """Write ``state`` (global name -> full tensor, e.g. ``load_llama_state_dict(ckpt)``) as an HF Llama
    directory ``out`` (see the module doc). ``dtype``: float32 / bfloat16 / float16 (None: as stored)."""
    from safetensors.torch import save_file

    out = check_export_target(out, overwrite)
    tok = check_tokenizer_dir(tokenizer_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError("--dtype", dtype, f"must be one of {sorted(DTYPES)}", "use bfloat16 or float32")
    want = expected_shapes(config)
    missing = [n for n in want if n not in state]
    if missing:
        raise ConfigError("CKPT", f"{len(missing)} missing tensors", f"the state has no {missing[0]}",
                          "export a complete checkpoint")
    names = list(want)
    tensors = []
    for n in names:
        t = state[n].detach().to("cpu")
        if tuple(t.shape) != want[n]:
            raise ConfigError("CKPT", f"{n} {list(t.shape)}", f"{config.name} needs {list(want[n])}", "check the checkpoint")
        cast = t.to(DTYPES[dtype]) if dtype is not None else t
        if cast.is_floating_point() and t.is_floating_point() and torch.isinf(cast).any() \
                and not torch.isinf(t).any():
            # float16 tops out at 65,504: a larger weight would be written as inf without a word
            raise ConfigError("--dtype", dtype, f"{n} has values up to {t.abs().max().item():.4g}, beyond {dtype}'s "
                              f"range ({torch.finfo(cast.dtype).max:.5g}): they would be written as inf",
                              "use --dtype bfloat16 (float32's range) or float32")
        tensors.append(cast)
    out_dtype = next((k for k, v in DTYPES.items() if v == tensors[0].dtype), "float32")
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        groups = shard_names([t.numel() * t.element_size() for t in tensors], max_shard_bytes)
        weight_map, total = {}, 0
        for k, idx in enumerate(groups):
            fname = "model.safetensors" if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            part = {global_to_hf(names[i]): tensors[i].contiguous() for i in idx}
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
            for hf_name, t in part.items():
                weight_map[hf_name] = fname
                total += t.numel() * t.element_size()
        if len(groups) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        extras = tokenizer_extras(tok)
        if "eos_token_id" not in extras:
            # transformers then assumes Llama 2's ids (bos 1, eos 2): Llama 3's are 128000 / 128001 and up,
            # and generation would not stop at the end of a turn
            why = "no --tokenizer" if tok is None else f"none in {tok}"
            warnings.warn(f"config.json of {out} gets no bos/eos token ids ({why}), so transformers assumes 1 "
                          f"and 2 (Llama 2's). Fix: pass --tokenizer DIR, the Hugging Face directory the model "
                          f"came from (its config.json has them)", NoTokenIdsWarning, stacklevel=2)
        hf = config.to_hf(out_dtype, extras)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if tok is not None:
            for name in TOKENIZER_FILES:
                if (tok / name).is_file():
                    shutil.copy2(tok / name, tmp / name)
        # The previous export is set aside, not deleted, until the new one is in place: a failure
        # between the two renames leaves the old directory (under .old-*), never neither.
        old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}") if out.exists() else None
        if old is not None:
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
