"""Plan-independent sharded checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint is a directory (its name may end in ``.ckpt``: ModelCheckpoint names it)::

    .metadata           DCP's index: every global tensor (full shape, dtype) and where each saved
                        box of it lies (file, byte offset); written by rank 0 after every rank's data
    __<r>_0.distcp      rank r's boxes (torch.save records, one per box); ranks with nothing to
                        write leave an empty file
    meta.pt             Lightning's checkpoint dict (loops, callbacks, LR schedulers, hparams, ...)
                        without model/optimizer tensors, plus ``"hexiscale"``: format, model config,
                        the plan it was saved under (provenance), optimizer class and param groups
    COMPLETE            written last; a directory without it is refused as partial

The global tensors are named by the plain :class:`~lightning_hexiscale.models.llama.Llama`'s
parameters (``model.<name>``, ``optim.<key>.<name>``; :mod:`.checkpoint_layout`), so the same
checkpoint resumes under any plan, TP layout, ``dp_sharding`` or cluster, and
:func:`load_llama_state_dict` returns the single-device model's state dict.

Saving (collective, :class:`Checkpointer`): every rank writes only its own pieces (whole TP
shards under ddp, split over the replicas; its owned chunks under ZeRO) with their global offsets;
no tensor crosses the network (DCP exchanges only the small write plans). Rank 0 writes
``meta.pt`` into ``<path>.tmp-<token>``, and after DCP's metadata (so after every rank's data)
``COMPLETE``, then renames the directory to ``<path>`` (an existing ``<path>`` is moved aside first
and deleted after). A crash leaves either the previous checkpoint or a ``.tmp-`` directory, never a
half-written ``<path>``. With ``async_save`` the pieces are copied to CPU memory (DCP's stager),
DCP's save and the rename run in one background thread per rank (saves in order, on a process
group of their own) while training goes on; a load, the end of the run, or a save beyond
:data:`MAX_IN_FLIGHT` waits for them, a removal for the save writing that path.

Loading: each rank reads the byte ranges of its own shards only (:class:`RangeReader`), straight
into its parameters and a freshly allocated optimizer state; DCP's planner reshards.

Memory (tests/runtime/test_checkpoint_shards.py measures the bound: own shard bytes + 16 MiB): a
save adds at most the rank's own shard bytes (contiguous copies of boxes that are not whole
tensors, e.g. ZeRO chunk boxes or column slices; with ``async_save``, the staged copy per save in
flight) plus a constant; a load adds the optimizer state it
allocates (at most the rank's own shard bytes) plus a constant: never another rank's tensors.

The file system must be shared by all ranks (as for any multi-node checkpoint).
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_hexiscale.errors import ConfigError, HexiScaleError
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.runtime.checkpoint_io import PieceLoadPlanner, PieceSavePlanner, RangeReader
from lightning_hexiscale.runtime.checkpoint_safety import load_meta
from lightning_hexiscale.runtime.checkpoint_layout import (OptimizerTargets, Piece, model_fqn, read_model_pieces,
                                                           read_optimizer_targets, saved_optimizer_keys, write_pieces)
from lightning_hexiscale.runtime.parallelize import param_specs
from lightning_hexiscale.runtime.zero import user_optimizer
from lightning_hexiscale.torch_compat import dcp_load, dcp_save, dcp_stage

FORMAT = "hexiscale-checkpoint/2"
PREVIOUS_FORMATS = {"hexiscale-checkpoint/1": "one full-tensor file per layer under model/ and optim/"}
COMPLETE = "COMPLETE"
META = "meta.pt"


# ---- saving ---------------------------------------------------------------------------------------
MAX_IN_FLIGHT = 2
"""Asynchronous saves in flight at once (each holds a staged copy of the rank's pieces): the
top-k and the "last" checkpoint that ModelCheckpoint writes at the same step."""


@dataclass
class _Pending:
    future: Future
    path: Path


class Checkpointer:
    """Writes checkpoints atomically, synchronously or in the background.

    Args:
        group: process group of the checkpoint's collectives (all ranks; ``None``: the default
            group). With ``async_save`` it must have a CPU backend and be used by nothing else,
            e.g. ``dist.new_group(backend="gloo")`` created by every rank.
        async_save: return from :meth:`save` once the pieces are staged (copied to CPU memory by
            DCP's ``FileSystemWriter.stage``, the stager of ``dcp.async_save``); DCP's ``save`` and the
            rename run in ONE background thread per rank, saves in the order they were made. Not
            ``dcp.async_save`` itself: it starts a thread per call, so two saves in flight would
            issue their collectives from two threads, in an order that may differ between ranks.
            At most :data:`MAX_IN_FLIGHT` saves are in flight; a further save waits for the oldest.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, async_save: bool = False):
        self.group, self.async_save = group, async_save
        self._pending: list[_Pending] = []
        self._executor: ThreadPoolExecutor | None = None
        self._run_id: str | None = None
        self._count = 0

    @property
    def pending(self) -> bool:
        """Whether an asynchronous save is still in flight (or not yet waited for)."""
        return any(not p.future.done() for p in self._pending)

    def save(self, path: str | Path, engine, optimizer: Optimizer | None = None,
             lightning_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> None:
        """Collective: every rank calls it with its engine (and its optimizer, to save its state).

        ``lightning_state`` (rank 0's is written) and ``extra`` (added to ``meta["hexiscale"]``)
        go to ``meta.pt``. No communication happens in the calling thread except, once, the
        agreement on this Checkpointer's name for temporary directories. ``optimizer``: the user's,
        or the :class:`~.zero.ShardedOptimizer` that steps in its place (the user's is recorded)."""
        optimizer = user_optimizer(optimizer)
        if optimizer is not None:
            check_optimizer(engine, optimizer)
        path = Path(path)
        check_save_target(path)
        while len(self._pending) >= MAX_IN_FLIGHT:
            self._pop()
        on = _distributed()
        coordinator = not on or dist.get_rank(self.group) == 0
        if self._run_id is None:  # before any save is in flight: the group is free
            self._run_id = _agree_token(self.group) if on else uuid.uuid4().hex[:16]
        self._count += 1
        tmp = path.with_name(f"{path.name}.tmp-{self._run_id}-{self._count}")
        if coordinator:
            tmp.mkdir(parents=True, exist_ok=True)
            meta = dict(lightning_state or {})
            meta["hexiscale"] = {"format": FORMAT, "model": engine.config.to_dict(), "plan": engine.plan.to_dict(),
                                 "world_size": engine.plan.world_size, **(extra or {}),
                                 "optimizer": optimizer_meta(optimizer) if optimizer is not None else None}
            torch.save(meta, tmp / META)
        pieces = write_pieces(engine, optimizer)
        state = {p.key: p.tensor for p in pieces}
        writer = dcp.FileSystemWriter(str(tmp))
        job = (writer, PieceSavePlanner(pieces), self.group, on, tmp, path, coordinator)
        if not self.async_save:
            _write(state, *job)
            if on:
                dist.barrier(group=self.group)  # nobody looks for <path> before the rename
            return
        staged = dcp_stage(writer, state)  # the values of this step, whatever training does next
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hexiscale-checkpoint")
        self._pending.append(_Pending(self._executor.submit(_write, staged, *job), path))

    def _pop(self) -> None:
        p = self._pending.pop(0)
        try:
            p.future.result()
        except BaseException as e:
            self._pending.clear()  # later saves of a failed sequence are not trusted either
            raise RuntimeError(f"the asynchronous checkpoint save of {p.path} failed: {e}") from e

    def wait(self, barrier: bool = True) -> None:
        """Block until every save in flight is written and renamed into place; re-raise the first
        error. Collective when something was in flight and ``barrier`` (every rank then sees the
        renamed directories: the coordinator renames)."""
        had = bool(self._pending)
        try:
            while self._pending:
                self._pop()
        finally:
            if had and barrier and _distributed():
                dist.barrier(group=self.group)

    def wait_for(self, path: str | Path) -> None:
        """Local: block until the saves in flight up to the last one writing ``path`` are done
        (before removing ``path``; only the coordinator renames and removes)."""
        path = Path(path)
        last = max((i for i, p in enumerate(self._pending) if p.path == path), default=-1)
        for _ in range(last + 1):
            self._pop()

    def close(self, wait: bool = True) -> None:
        """Wait for the saves in flight (no barrier) and stop the writer thread (a later save starts
        another). ``wait=False`` (after a failure elsewhere): abandon them; their ``.tmp-``
        directories stay partial and are refused."""
        try:
            if wait:
                self.wait(barrier=False)
        finally:
            self._pending.clear()
            if self._executor is not None:
                self._executor.shutdown(wait=wait, cancel_futures=True)
                self._executor = None


def check_save_target(path: Path) -> None:
    """A save moves an existing ``path`` aside and deletes it: allowed for an earlier checkpoint (any
    format, with its COMPLETE marker), an empty directory or a file (Lightning's single-file saves
    overwrite too); any other directory is refused before anything is written, so that a typo
    cannot delete a folder. Every rank checks the same path on the shared file system, so all raise
    or none does. A path whose folder cannot be created (it lies below a file) is refused too: it was
    the coordinator's raw ``OSError`` from ``mkdir`` while the other ranks waited."""
    from lightning_hexiscale.config.recipe import nearest_existing

    if not (below := nearest_existing(path.parent)).is_dir():
        raise ConfigError("checkpoint path", str(path), f"lies below {below}, which is a file, so its directory "
                          "cannot be created", "save to a path inside a directory")
    if not path.is_dir() or (path / COMPLETE).is_file():
        return
    inside = sorted(c.name for c in path.iterdir())
    if inside:
        raise ConfigError("checkpoint path", str(path), f"an existing directory that is not a checkpoint (it holds "
                          f"{', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}); a save would replace it whole",
                          "save to a new path, e.g. " + str(path / "last.ckpt"))


def save(path: str | Path, engine, optimizer: Optimizer | None = None, lightning_state: dict[str, Any] | None = None,
         extra: dict[str, Any] | None = None, group: dist.ProcessGroup | None = None) -> None:
    """A synchronous :meth:`Checkpointer.save` (collective)."""
    Checkpointer(group).save(path, engine, optimizer, lightning_state, extra)


def _write(state, writer, planner, group, on: bool, tmp: Path, path: Path, coordinator: bool) -> None:
    """DCP's collective save of this rank's pieces; then, on the coordinator (every rank's data and
    DCP's metadata are on disk once its ``dcp.save`` returns), ``COMPLETE`` and the rename."""
    with _quiet_no_dist(not on):
        dcp_save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=not on)
    if coordinator:
        _finalize(tmp, path)


def _finalize(tmp: Path, path: Path) -> None:
    with open(tmp / COMPLETE, "w") as f:
        f.write(FORMAT + "\n")
        f.flush()
        os.fsync(f.fileno())
    old = path.with_name(f"{path.name}.old-{tmp.name.split('.tmp-', 1)[-1]}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        remove(old)


@contextmanager
def _quiet_no_dist(active: bool):
    """DCP warns when it runs without a process group; with ``no_dist`` that is what we ask for.
    (Only then: the filter is process-global and saves may run in a background thread.)"""
    if not active:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_token(group) -> str:
    """A random name, equal on every rank (one int64 broadcast from the group's first rank)."""
    t = torch.tensor([uuid.uuid4().int % (1 << 62)], dtype=torch.int64, device=_group_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return f"{int(t.item()):016x}"


def check_optimizer(engine, optimizer: Optimizer) -> None:
    """The optimizer must optimise exactly the stage's parameters (their state is what is saved)."""
    mine = {id(p) for p in engine.stage.parameters()}
    theirs = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in mine for p in theirs) or len(theirs) != len(mine):
        raise ConfigError("configure_optimizers", f"an optimizer over {len(theirs)} tensors",
                          f"hexiscale checkpoints hold the model's {len(mine)} local parameters and their optimizer "
                          "state; the optimizer has tensors outside the Llama or misses some of its parameters",
                          "optimise self.parameters() (the model's)")


def optimizer_meta(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's class and the hyper-parameters of each param group (no tensors of state)."""
    cls = type(optimizer)
    return {"class": f"{cls.__module__}.{cls.__qualname__}",
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


# ---- checking a directory -------------------------------------------------------------------------
def _refuse_what_is_not_a_checkpoint(p: Path, key: str) -> None:
    """A directory without the COMPLETE marker that is plainly something else, rather than an
    interrupted save: saying "partial checkpoint" there sends the user looking for a crash."""
    for folder in (p, p / "checkpoints"):  # p itself, or a run's output directory (trainer.resume=outputs/run)
        saved = sorted(c.name for c in folder.iterdir() if c.is_dir() and (c / COMPLETE).is_file()) \
            if folder.is_dir() else []
        if saved:
            pick = "last.ckpt" if "last.ckpt" in saved else saved[-1]
            named = f"{', '.join(saved[:4])}{', ...' if len(saved) > 4 else ''}"
            rule = (f"a folder of checkpoints ({named}), not a checkpoint" if folder == p else
                    f"a run's directory, not a checkpoint: its checkpoints are in {folder} ({named})")
            raise ConfigError(key, str(p), rule, f"give one of them, e.g. {folder / pick}")
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        raise ConfigError(key, str(p), "a Hugging Face model directory (config.json, *.safetensors), not a "
                          "checkpoint of the hexiscale strategy",
                          f"start training from its weights: model=hf:{p} (or trainer.weights={p}) in the recipe, "
                          f"LlamaLitModule('hf:{p}') in Python")
    parts = [c.name for c in p.iterdir() if c.name in (".metadata", META, "model") or c.name.endswith(".distcp")]
    if not parts and ".tmp-" not in p.name:  # nothing a save writes: no interrupted save either
        rule = ("an empty directory, not a checkpoint" if not any(p.iterdir()) else f"holds none of a checkpoint's "
                f"files ({COMPLETE}, .metadata, {META}, *.distcp): not a checkpoint, nor an interrupted save")
        raise ConfigError(key, str(p), rule, "give the directory a hexiscale run saved, e.g. "
                          "<output_dir>/checkpoints/last.ckpt (in the recipe, trainer.resume=last takes the newest)")


def _is_consolidated(p: Path) -> bool:
    """A torch.save file of global Llama names (``embed.weight``, ...), read without running code."""
    try:
        state = torch.load(p, map_location="meta", weights_only=True, mmap=True)
    except Exception:  # any unreadable or foreign file: simply not one
        return False
    return isinstance(state, dict) and "embed.weight" in state


def check_complete(path: str | Path, key: str = "ckpt_path") -> Path:
    """The checkpoint directory, or ConfigError saying why it cannot be used (``key``: the setting
    that named it, e.g. the recipe's ``trainer.resume``)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(key, str(p), "no such checkpoint", "give the directory a hexiscale run saved")
    if not p.is_dir():
        if p.suffix == ".pt" and _is_consolidated(p):  # what `hexiscale checkpoint consolidate` writes
            raise ConfigError(key, str(p), "a consolidated state dict (hexiscale checkpoint consolidate), not a "
                              "checkpoint directory: it holds the weights without the model's shape",
                              f"give the checkpoint directory it came from, or load it yourself: "
                              f"Llama(config).load_state_dict(torch.load({str(p)!r}))")
        raise ConfigError(key, str(p), "not a hexiscale checkpoint directory (a single-file checkpoint of "
                          "another strategy?)", "give a checkpoint directory saved with strategy='hexiscale'")
    marker = p / COMPLETE
    written = marker.read_text().strip() if marker.is_file() else None
    if written in PREVIOUS_FORMATS:
        raise ConfigError(key, str(p), f"a checkpoint in the previous format {written!r} "
                          f"({PREVIOUS_FORMATS[written]}); this version reads {FORMAT!r} (torch.distributed."
                          "checkpoint shards) only", "its weights are plain torch files: load them with "
                          "{n: t for f in sorted((ckpt / 'model').glob('*.pt')) for n, t in torch.load(f).items()} "
                          "and start a new run from them (LlamaLitModule.init_state_dict); its optimizer state "
                          "cannot be resumed by this version")
    if written is None:
        _refuse_what_is_not_a_checkpoint(p, key)
    if written is None or ".tmp-" in p.name:
        raise ConfigError(key, str(p), f"partial checkpoint: the {COMPLETE} marker is missing, so the save was "
                          "interrupted before every rank had written its part", "resume from an earlier checkpoint")
    if written != FORMAT:
        raise ConfigError(key, str(p), f"format {written!r} is not {FORMAT!r}",
                          "load it with the lightning-hexiscale version that wrote it")
    if not (p / ".metadata").is_file() or not (p / META).is_file():
        raise ConfigError(key, str(p), f"marked {COMPLETE} but .metadata or {META} is missing",
                          "the checkpoint is damaged; use another")
    return p


def read_meta(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """``meta.pt``: Lightning's state plus ``["hexiscale"]`` (format, model, plan, optimizer).
    ``weights_only`` None/True: plain types only, a pickled callable is refused; False: any pickle,
    for checkpoints you trust (:mod:`.checkpoint_safety`)."""
    p = check_complete(path)
    return load_meta(p / META, weights_only)


def check_model(path: str | Path, config: LlamaConfig, key: str = "ckpt_path",
                weights_only: bool | None = None) -> None:
    """ConfigError when the complete checkpoint at ``path`` was saved for another model than
    ``config``: what loading it would say on every rank, said once before any rank starts (the
    recipe's ``trainer.resume``, the strategy's ``ckpt_path``). ``weights_only``: see :func:`read_meta`."""
    p = check_complete(path, key)
    _check_model(read_meta(p, weights_only), config, p)


def _check_model(meta: dict[str, Any], config: LlamaConfig, path: Path) -> None:
    saved = dict(meta["hexiscale"]["model"])
    now = config.to_dict()
    # The context is metadata (RoPE tables follow the sequence at hand), recorded only when known:
    # a preset leaves it open, the same preset started from HF weights records theirs. The training
    # seq_len is no part of the weights either (continued pre-training at a longer context resumes
    # with a larger one), as in LlamaConfig.check_matches; only the weights' context bounds it.
    open_context = saved.get("max_position_embeddings") is None or now["max_position_embeddings"] is None
    diff = [k for k in now if k not in ("name", "seq_len") and saved.get(k) != now[k]
            and not (k == "max_position_embeddings" and open_context)]
    context = saved.get("max_position_embeddings")
    if not diff and context is not None and now["seq_len"] > context:
        raise ConfigError("model.seq_len", now["seq_len"], f"the checkpoint {path} holds weights for at most "
                          f"{context} positions (max_position_embeddings)", f"use model.seq_len <= {context}")
    if diff:
        k = diff[0]
        raise ConfigError(f"model.{k}", now[k], f"the checkpoint {path} was saved for {k}={saved.get(k)!r}",
                          f"resume with the model it was trained with ({saved.get('name')})")


# ---- loading --------------------------------------------------------------------------------------
def _load(path: Path, pieces: list[Piece], group, reader: RangeReader | None = None,
          no_dist: bool | None = None, weights_only: bool | None = None) -> RangeReader:
    reader = reader or RangeReader(str(path), weights_only)
    no_dist = not _distributed() if no_dist is None else no_dist
    with _quiet_no_dist(no_dist):
        try:
            dcp_load({p.key: p.tensor for p in pieces}, storage_reader=reader,
                     planner=PieceLoadPlanner(pieces, str(path)), process_group=group, no_dist=no_dist)
        except dcp.CheckpointException as e:  # DCP wraps each rank's error: ours (a ConfigError) is the message
            ours = [exc for exc, _trace in e.failures.values() if isinstance(exc, HexiScaleError)]
            if ours:
                raise ours[0] from None
            raise
    return reader


@torch.no_grad()
def load_model(path: str | Path, engine, meta: dict[str, Any] | None = None, group=None,
               weights_only: bool | None = None) -> RangeReader:
    """Collective: fill this rank's parameters (ZeRO-3: its master chunks) from the checkpoint.
    Returns the reader (its ``log`` lists the byte ranges read). ``weights_only``: see :func:`read_meta`."""
    p = check_complete(path)
    _check_model(meta if meta is not None else read_meta(p, weights_only), engine.config, p)
    reader = _load(p, read_model_pieces(engine), group, weights_only=weights_only)
    if engine.zero is not None:
        engine.zero.refresh_masters()  # mixed precision: the float32 masters from the loaded parameters
    return reader


@torch.no_grad()
def load_optimizer(path: str | Path, engine, optimizer: Optimizer, meta: dict[str, Any] | None = None,
                   group=None, weights_only: bool | None = None) -> RangeReader:
    """Collective: this rank's optimizer state (ddp: ``optimizer.state``; ZeRO: the chunks of the
    engine's sharded optimizer) and the saved param-group hyper-parameters. ``optimizer``: the
    user's, or the :class:`~.zero.ShardedOptimizer` that steps in its place."""
    optimizer = user_optimizer(optimizer)
    p = check_complete(path)
    meta = meta if meta is not None else read_meta(p, weights_only)
    check_optimizer(engine, optimizer)
    saved_meta = meta["hexiscale"].get("optimizer")
    if saved_meta is None:
        raise ConfigError("ckpt_path", str(p), "the checkpoint holds no optimizer state (weights only)",
                          "resume training from a full checkpoint, or load weights only")
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved_meta["class"] != cls:
        raise ConfigError("configure_optimizers", cls, f"the checkpoint {p} holds the state of a {saved_meta['class']}",
                          "resume with the optimizer it was trained with")
    if len(saved_meta["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError("configure_optimizers", f"{len(optimizer.param_groups)} param groups",
                          f"the checkpoint's optimizer had {len(saved_meta['param_groups'])}", "build the same groups")
    reader = RangeReader(str(p), weights_only)
    tensors = {fqn: (tuple(md.size), md.properties.dtype)
               for fqn, md in reader.read_metadata().state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    names = [n for n, _ in engine.stage.named_parameters()]
    targets = read_optimizer_targets(engine, optimizer, saved_optimizer_keys(tensors, names))
    _load(p, targets.pieces, group, reader)
    _apply_optimizer_state(engine, optimizer, targets, saved_meta["param_groups"])
    return reader


def _apply_optimizer_state(engine, optimizer: Optimizer, targets: OptimizerTargets,
                           saved_groups: list[dict[str, Any]]) -> None:
    def value(owner, key, v):
        if (owner, key) in targets.python_keys:
            return v.item()
        return v.clone() if v.dim() == 0 else v  # scalars may be shared between owners (step += 1 in place)

    if engine.zero is None:
        names = {id(p): n for n, p in engine.stage.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        state = {i: {k: value(n, k, v) for k, v in targets.state[n].items()}
                 for i, n in enumerate(order) if targets.state.get(n)}
        groups, start = [], 0
        for group, hyper in zip(optimizer.param_groups, saved_groups):
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper,
                           "params": list(range(start, start + n))})
            start += n
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        return
    sopt = engine.sharded_optimizer
    for inner in sopt.inner:
        inner.state.clear()
    for (i, r), st in targets.state.items():
        if st:
            sopt.inner[i].state[sopt.leaves[i][r]] = {k: value((i, r), k, v) for k, v in st.items()}
    for group, hyper in zip(optimizer.param_groups, saved_groups):
        group.update(hyper)


# ---- the plain model ------------------------------------------------------------------------------
def load_llama_state_dict(path: str | Path, weights_only: bool | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of the plain :class:`Llama` (global names) from a checkpoint saved under
    any plan. One process, no collectives; holds the whole model (not the optimizer) in memory.
    ``weights_only``: see :func:`read_meta`."""
    p = check_complete(path)
    config = LlamaConfig(**read_meta(p, weights_only)["hexiscale"]["model"])
    reader = RangeReader(str(p), weights_only)
    md = reader.read_metadata().state_dict_metadata
    out, pieces = {}, []
    for spec in param_specs(config):
        saved = md.get(model_fqn(spec.name))
        if not isinstance(saved, TensorStorageMetadata):
            raise ConfigError("ckpt_path", str(p), f"the checkpoint has no parameter {spec.name!r}",
                              "the checkpoint is damaged")
        out[spec.name] = torch.empty(spec.shape, dtype=saved.properties.dtype)
        pieces.append(Piece(model_fqn(spec.name), (0,) * len(spec.shape), spec.shape, out[spec.name]))
    _load(p, pieces, None, reader, no_dist=True)
    return out


def load_llama(path: str | Path, device: str | torch.device = "cpu", weights_only: bool | None = None):
    """A plain single-device :class:`Llama` with the checkpoint's weights (``weights_only``: see
    :func:`read_meta`)."""
    from lightning_hexiscale.models.llama import Llama

    state = load_llama_state_dict(path, weights_only)
    config = LlamaConfig(**read_meta(path, weights_only)["hexiscale"]["model"])
    with torch.device("meta"):
        model = Llama(config)
    dtype = next(iter(state.values())).dtype
    model = model.to(dtype).to_empty(device=device)
    model.load_state_dict(state)
    return model


def consolidate(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the checkpoint's full model state dict (global names) to one ``torch.save`` file
    (written to ``<out>.tmp-<id>`` and renamed; removed if the write fails, so a full disk or Ctrl-C
    leaves no partial file). Returns a summary: step, tensors, bytes."""
    state = load_llama_state_dict(path)
    meta = read_meta(path)
    out = Path(out)
    if out.is_symlink():  # write where the link points (e.g. a larger disk), and keep the link
        out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")  # unique: never a file of the user's
    try:
        torch.save(state, tmp)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"global_step": meta.get("global_step"), "epoch": meta.get("epoch"), "tensors": len(state),
            "bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "model": meta["hexiscale"]["model"].get("name")}


def stored_tensors(path: str | Path) -> tuple[int, int]:
    """(number of global tensors, their bytes) in a checkpoint, from DCP's metadata."""
    md = RangeReader(str(check_complete(path))).read_metadata().state_dict_metadata
    sizes = [math.prod(m.size) * m.properties.dtype.itemsize for m in md.values()
             if isinstance(m, TensorStorageMetadata)]
    return len(sizes), sum(sizes)


def remove(path: str | Path) -> None:
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        os.remove(p)
