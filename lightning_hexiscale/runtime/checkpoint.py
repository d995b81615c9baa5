"""Plan-independent checkpoints: save under plan A, resume under plan B (or on another cluster).

A checkpoint is a directory (its name may end in ``.ckpt``: ModelCheckpoint names it)::

    meta.pt                 Lightning's checkpoint dict (loops, callbacks, schedulers, hparams, ...)
                            without model/optimizer tensors, plus ``"hexiscale"``: format, model
                            config, the plan it was saved under (provenance only), the unit list,
                            the optimizer's param-group hyper-parameters and each parameter's group
    model/embed.pt          {global name: FULL tensor} of the token embedding
    model/layer_00000.pt    ... one file per transformer layer (all its weights, unsharded)
    model/head.pt           final norm + LM head
    optim/<unit>.pt         {global name: {state key: FULL tensor (exp_avg, ...) or scalar (step)}}
    COMPLETE                written last; a directory without it is refused as partial

Global names are those of the plain :class:`~lightning_hexiscale.models.llama.Llama`, so
:func:`load_llama_state_dict` loads a checkpoint into the single-device model, whatever plan saved it.

Writing (collective; every rank calls :func:`save`): pipeline 0 holds every parameter exactly once;
each of its stage leaders gathers its TP group's shards (``gather_object`` in the TP group),
concatenates them along the shard dim into full tensors and writes its units into
``<path>.tmp-<token>``. After a barrier rank 0 writes ``meta.pt`` and ``COMPLETE`` and renames the
directory to ``<path>`` (an existing ``<path>`` is moved aside first and deleted after), so a crash
leaves either the old checkpoint or a ``.tmp-`` directory, never a half-written ``<path>``.
The file system must be shared by all ranks (as for any multi-node checkpoint).

Reading: every rank reads only the units its stage holds and slices its shards out of the full
tensors (:func:`lightning_hexiscale.runtime.parallelize.load_full_state_dict`); optimizer state
is sliced the same way and mapped to the current optimizer's parameter order by name.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.runtime.parallelize import LocalShard, StageModule, param_specs

FORMAT = "hexiscale-checkpoint/1"
COMPLETE = "COMPLETE"


def unit_of(name: str) -> str:
    """File stem holding a global parameter: ``embed``, ``layer_00012`` or ``head``."""
    if name.startswith("embed."):
        return "embed"
    if name.startswith("layers."):
        return f"layer_{int(name.split('.')[1]):05d}"
    return "head"


def all_units(config: LlamaConfig) -> list[str]:
    return ["embed"] + [f"layer_{i:05d}" for i in range(config.num_layers)] + ["head"]


# ---- helpers on a stage ------------------------------------------------------------------------
def _param_names(optimizer: Optimizer, stage: StageModule) -> list[tuple[int, str]]:
    """(group index, global name) of every optimizer parameter, in torch's state-dict index order."""
    names = {id(p): n for n, p in stage.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError("configure_optimizers", "a parameter outside the Llama",
                                  "hexiscale checkpoints hold the model's parameters and their optimizer state only",
                                  "optimise self.parameters() (the model's)")
            out.append((g, names[id(p)]))
    return out


def _local_pieces(stage: StageModule, optimizer: Optimizer | None) -> dict[str, dict[str, Any]]:
    """name -> {"param": local tensor, "state": {key: tensor or scalar}} on CPU, for this rank."""
    params = dict(stage.named_parameters())
    pieces = {n: {"param": p.detach().cpu(), "state": {}} for n, p in params.items()}
    if optimizer is not None:
        for _, name in _param_names(optimizer, stage):
            p = params[name]
            for k, v in optimizer.state.get(p, {}).items():
                pieces[name]["state"][k] = v.detach().cpu() if torch.is_tensor(v) else v
    return pieces


def _full(spec_shard: LocalShard, parts: list[torch.Tensor], param_shape: tuple[int, ...], value: Any) -> Any:
    """Concatenate TP parts of a sharded tensor (parts in TP-rank order); replicated values as is."""
    dim = spec_shard.spec.shard_dim
    if dim is None or not torch.is_tensor(value) or tuple(value.shape) != param_shape:
        return value
    return torch.cat(parts, dim=dim)


# ---- save ----------------------------------------------------------------------------------------
def save(path: str | Path, lightning_state: dict[str, Any], stage: StageModule, topology, optimizer: Optimizer | None,
         extra_meta: dict[str, Any]) -> None:
    """Write a checkpoint directory (collective over the world; see the module doc)."""
    path = Path(path)
    rank, role = topology.rank, topology.role
    token = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    tmp = path.with_name(f"{path.name}.tmp-{token[0]}")
    if rank == 0:
        (tmp / "model").mkdir(parents=True, exist_ok=True)
        (tmp / "optim").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if role.pipeline == 0:
        pieces = _local_pieces(stage, optimizer)
        if role.tp > 1:
            gathered: list | None = [None] * role.tp if role.is_leader else None
            dist.gather_object(pieces, gathered, dst=role.leader, group=topology.tp_group)
        else:
            gathered = [pieces]
        if role.is_leader:
            _write_units(tmp, stage, gathered, optimizer is not None)
    dist.barrier()
    if rank == 0:
        meta = dict(lightning_state)
        meta["hexiscale"] = extra_meta
        torch.save(meta, tmp / "meta.pt")
        (tmp / COMPLETE).write_text(FORMAT + "\n")
        old = path.with_name(f"{path.name}.old-{token[0]}")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    dist.barrier()


def _write_units(tmp: Path, stage: StageModule, gathered: list[dict], with_optim: bool) -> None:
    shards = stage.shards()
    units: dict[str, tuple[dict, dict]] = {}
    for name, shard in shards.items():
        if shard.tied_copy:  # a tied embedding is written once, by the first stage
            continue
        first = gathered[0][name]
        shape = tuple(first["param"].shape)
        full_param = _full(shard, [g[name]["param"] for g in gathered], shape, first["param"])
        state = {k: _full(shard, [g[name]["state"][k] for g in gathered], shape, v) for k, v in first["state"].items()}
        model_u, optim_u = units.setdefault(unit_of(name), ({}, {}))
        model_u[name] = full_param.clone()
        optim_u[name] = state
    for unit, (model_u, optim_u) in units.items():
        torch.save(model_u, tmp / "model" / f"{unit}.pt")
        if with_optim:
            torch.save(optim_u, tmp / "optim" / f"{unit}.pt")


def optimizer_meta(optimizer: Optimizer, stage: StageModule) -> dict[str, Any]:
    """Hyper-parameters of each param group (no tensors) and each parameter's group, by name."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"param_groups": groups, "group_of": {n: g for g, n in _param_names(optimizer, stage)}}


# ---- load ----------------------------------------------------------------------------------------
def check_complete(path: str | Path) -> Path:
    """The checkpoint directory, or ConfigError saying why it cannot be used."""
    p = Path(path)
    if not p.exists():
        raise ConfigError("ckpt_path", str(p), "no such checkpoint", "give the directory a hexiscale run saved")
    if not p.is_dir():
        raise ConfigError("ckpt_path", str(p), "not a hexiscale checkpoint directory (a single-file checkpoint of "
                          "another strategy?)", "resume from a checkpoint saved with strategy='hexiscale'")
    if not (p / COMPLETE).is_file() or ".tmp-" in p.name:
        raise ConfigError("ckpt_path", str(p), f"partial checkpoint: the {COMPLETE} marker is missing, so the save was "
                          "interrupted before every rank had written its part", "resume from an earlier checkpoint")
    return p


def read_meta(path: str | Path) -> dict[str, Any]:
    p = check_complete(path)
    meta = torch.load(p / "meta.pt", map_location="cpu", weights_only=False)
    info = meta.get("hexiscale", {})
    if info.get("format") != FORMAT:
        raise ConfigError("ckpt_path", str(p), f"format {info.get('format')!r} is not {FORMAT!r}",
                          "save it again with this version")
    return meta


def _check_model(meta: dict[str, Any], config: LlamaConfig, path: Path) -> None:
    saved = dict(meta["hexiscale"]["model"])
    now = config.to_dict()
    diff = [k for k in now if k != "name" and saved.get(k) != now[k]]
    if diff:
        k = diff[0]
        raise ConfigError(f"model.{k}", now[k], f"the checkpoint {path} was saved for {k}={saved.get(k)!r}",
                          f"resume with the model it was trained with ({saved.get('name')})")


def load_units(path: Path, units: list[str], kind: str = "model") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for u in units:
        f = path / kind / f"{u}.pt"
        if not f.is_file():
            raise ConfigError("ckpt_path", str(path), f"{kind}/{u}.pt is missing", "the checkpoint is damaged; use another")
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def load_stage(path: str | Path, stage: StageModule, meta: dict[str, Any]) -> None:
    """Copy this rank's shards out of the checkpoint's full tensors."""
    from lightning_hexiscale.runtime.parallelize import load_full_state_dict

    p = Path(path)
    _check_model(meta, stage.config, p)
    units = sorted({unit_of(n) for n in stage.shards()})
    load_full_state_dict(stage, load_units(p, units, "model"))


def load_optimizer(path: str | Path, stage: StageModule, optimizer: Optimizer, meta: dict[str, Any]) -> None:
    """Slice the saved full optimizer state to this rank's shards and load it into ``optimizer``."""
    p = Path(path)
    saved = meta["hexiscale"].get("optimizer")
    if saved is None or not (p / "optim").is_dir() or not any((p / "optim").iterdir()):
        raise ConfigError("ckpt_path", str(p), "the checkpoint holds no optimizer state (weights only)",
                          "resume training from a full checkpoint, or load weights only")
    shards = stage.shards()
    names = _param_names(optimizer, stage)
    state = load_units(p, sorted({unit_of(n) for _, n in names}), "optim")
    sd_state = {}
    for idx, (_, name) in enumerate(names):
        shape = tuple(shards[name].spec.shape)
        sd_state[idx] = {k: shards[name].slice_of(v).clone() if torch.is_tensor(v) and tuple(v.shape) == shape else v
                         for k, v in state[name].items()}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = saved["param_groups"][g] if g < len(saved["param_groups"]) else {}
        ids = [i for i, (gi, _) in enumerate(names) if gi == g]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper, "params": ids})
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError("configure_optimizers", f"{len(optimizer.param_groups)} param groups",
                          f"the checkpoint's optimizer had {len(saved['param_groups'])}", "build the same groups")
    optimizer.load_state_dict({"state": sd_state, "param_groups": groups})


def load_llama_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The full state dict of the plain :class:`Llama` from a checkpoint saved under any plan."""
    p = check_complete(path)
    meta = read_meta(p)
    config = LlamaConfig(**meta["hexiscale"]["model"])
    state = load_units(p, all_units(config), "model")
    missing = [s.name for s in param_specs(config) if s.name not in state]
    if missing:
        raise ConfigError("ckpt_path", str(p), f"missing parameters {missing[:3]}", "the checkpoint is damaged")
    return state


def load_llama(path: str | Path, device: str | torch.device = "cpu"):
    """A plain single-device :class:`Llama` with the checkpoint's weights."""
    from lightning_hexiscale.models.llama import Llama

    state = load_llama_state_dict(path)
    config = LlamaConfig(**read_meta(path)["hexiscale"]["model"])
    with torch.device("meta"):
        model = Llama(config)
    dtype = next(iter(state.values())).dtype
    model = model.to(dtype).to_empty(device=device)
    model.load_state_dict(state)
    return model


def remove(path: str | Path) -> None:
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        os.remove(p)
