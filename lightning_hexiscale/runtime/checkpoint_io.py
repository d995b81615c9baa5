"""torch.distributed.checkpoint (DCP) adapters for :mod:`.checkpoint_layout`'s pieces.

Why a custom planner, not DTensor or ShardedTensor: a piece is an arbitrary box of a global tensor
(uneven KV-head and FFN splits that differ per stage and per pipeline, ZeRO chunks cut at any
element). DTensor placements can only express even ``Shard(dim)`` splits of a device mesh, and one
mesh per parameter per pipeline would be needed; ``ShardedTensor`` is deprecated and needs a process
group per tensor. DCP's planner interface takes boxes directly: :class:`PieceSavePlanner` emits one
``WriteItem`` (``ChunkStorageMetadata(offsets, sizes)``) per piece, and DCP's global planning checks
that the boxes of each tensor neither overlap nor leave a gap (so "written exactly once" is verified
on every save), builds the standard metadata and writes one file per rank with the standard
``FileSystemWriter``: any DCP tool reads the result (e.g. ``dcp_to_torch_save``).
:class:`PieceLoadPlanner` asks DCP's resharding helper (``create_read_items_for_chunk_list``) for the
overlaps of this rank's boxes with the saved ones.

:class:`RangeReader` is the project's own part: DCP's ``FileSystemReader`` ``torch.load``\\ s every
saved chunk it touches whole, so a TP-8 rank resuming from a TP-1 save would read (and hold) whole
layers. The writer stores each chunk as a ``torch.save`` zip whose tensor data is one uncompressed,
contiguous record (the planner hands DCP contiguous tensors); the reader finds that record from the
zip directory (a few hundred bytes) and reads only the byte runs of its own sub-box, straight into
the destination tensor when it is a contiguous CPU tensor of the saved dtype (else through a buffer
of the sub-box's size). It logs every read
(``RangeReader.log``) so that tests can check a rank read its own bytes and nothing else.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import re
import sys
import zipfile
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from lightning_hexiscale.runtime.checkpoint_layout import Piece
from lightning_hexiscale.torch_compat import dcp_stream_transforms

_DATA_RECORD = re.compile(r"(.*/)?data/\d+")


def _index_key(fqn: str, offsets) -> tuple[str, tuple[int, ...]]:
    return fqn, tuple(int(o) for o in offsets)


class PieceSavePlanner(DefaultSavePlanner):
    """Writes a flat ``{piece.key: tensor}`` state dict as boxes of global tensors.

    The state dict handed to DCP holds only tensors (so that async staging can copy it); the box
    of each key lives in this planner, which DCP carries into the writer thread.
    """

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = {p.key: (p.fqn, p.offsets, p.shape) for p in pieces}
        self.by_index = {_index_key(p.fqn, p.offsets): p.key for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, t in self.state_dict.items():
            fqn, offsets, shape = self.boxes[key]
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
                                            properties=TensorProperties.create_from_tensor(t), size=torch.Size(shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[self.by_index[_index_key(index.fqn, index.offset)]]

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        # Contiguous, so that the stored record is the box in row-major order (RangeReader relies on it).
        return self.lookup_object(write_item.index).detach().contiguous()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads the checkpoint's overlaps with this rank's pieces (views of the memory to fill)."""

    def __init__(self, pieces: list[Piece], path: str = ""):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {p.key: p for p in pieces}
        self.by_index = {_index_key(p.fqn, p.offsets): p for p in pieces}
        self.path = path

    def create_local_plan(self) -> LoadPlan:
        from lightning_hexiscale.errors import ConfigError

        assert self.metadata is not None
        per_fqn: dict[str, list[Piece]] = {}
        for p in self.pieces.values():
            per_fqn.setdefault(p.fqn, []).append(p)
        requests: list[ReadItem] = []
        for fqn, pieces in per_fqn.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise ConfigError("ckpt_path", self.path, f"the checkpoint has no tensor {fqn!r}",
                                  "resume with the model and optimizer it was saved with")
            if tuple(md.size) != tuple(pieces[0].shape):
                raise ConfigError("ckpt_path", self.path, f"{fqn} is {tuple(md.size)} in the checkpoint, "
                                  f"{tuple(pieces[0].shape)} here", "resume with the model it was saved with")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.size()) for p in pieces]
            reads = create_read_items_for_chunk_list(fqn, md, chunks)
            covered = [0] * len(pieces)
            for r in reads:
                covered[r.dest_index.index] += math.prod(r.lengths)
            for p, c in zip(pieces, covered):
                if c != p.tensor.numel():
                    raise ConfigError("ckpt_path", self.path, f"the checkpoint covers {c} of the {p.tensor.numel()} "
                                      f"elements of {fqn} at {p.offsets} this rank needs", "the checkpoint is damaged")
            requests += reads
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.by_index[_index_key(index.fqn, index.offset)].tensor

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError(f"unexpected non-tensor entry {read_item.dest_index.fqn} in a hexiscale checkpoint")


@dataclasses.dataclass
class _Record:
    data_start: int
    """Absolute file offset of the tensor's bytes."""
    nbytes: int


class RangeReader(FileSystemReader):
    """A ``FileSystemReader`` that reads only the bytes of the requested sub-boxes (module doc).

    ``log`` collects ``(file, offset, nbytes, kind)`` of every read: ``"data"`` for tensor bytes,
    ``"index"`` for the zip directory of a saved chunk.
    """

    def __init__(self, path, weights_only: bool | None = None):
        super().__init__(path)
        self.metadata: Metadata | None = None
        self.log: list[tuple[str, int, int, str]] = []
        self.weights_only = weights_only
        """DCP's ``.metadata`` pickle: None/True resolves only DCP's metadata classes (checkpoint_safety)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's index, unpickled without running code it may carry (:mod:`.checkpoint_safety`)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        from lightning_hexiscale.runtime.checkpoint_safety import load_dcp_metadata

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_dcp_metadata(stream, path, self.weights_only)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            records: dict[int, _Record] = {}
            self._check_shard(rel, max(self.storage_data[r.storage_index].offset +
                                       self.storage_data[r.storage_index].length for r in reqs))
            with open(self.fs.concat_path(self.path, rel), "rb", buffering=0) as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    if req.type != LoadItemType.TENSOR:
                        raise AssertionError(f"unexpected non-tensor entry {req.storage_index.fqn}")
                    info = self.storage_data[req.storage_index]
                    if dcp_stream_transforms(info):
                        raise AssertionError(f"{rel}: stream transforms {dcp_stream_transforms(info)} are not supported")
                    rec = records.get(info.offset)
                    if rec is None:
                        rec = records[info.offset] = self._record(f, rel, info.offset, info.length)
                    self._read_box(f, rel, rec, req, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _check_shard(self, rel: str, needed: int) -> None:
        """A shard file the index names must be there whole: a deleted or cut one (an interrupted copy)
        was a FileNotFoundError or BadZipFile traceback inside DCP's CheckpointException."""
        from lightning_hexiscale.errors import ConfigError

        file = self.fs.concat_path(self.path, rel)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < needed:
            what = "is missing" if size is None else f"holds {size} bytes, its index needs at least {needed}"
            raise ConfigError("ckpt_path", str(self.path), f"the shard {rel} {what}: the checkpoint is damaged or "
                              "cut short (an interrupted copy?)",
                              "copy the checkpoint again from where it was saved, or use an earlier one")

    # ---- the zip record of one saved chunk -------------------------------------------------------
    def _record(self, f, rel: str, offset: int, length: int) -> _Record:
        view = _Slice(f, offset, length, lambda o, n: self.log.append((rel, o, n, "index")))
        with zipfile.ZipFile(view) as z:
            data = [i for i in z.infolist() if _DATA_RECORD.fullmatch(i.filename)]
            order = [i for i in z.infolist() if i.filename.endswith("/byteorder")]
            if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
                raise AssertionError(f"{rel}@{offset}: not one stored tensor record: {[i.filename for i in data]}")
            if order and z.read(order[0]).decode() != sys.byteorder:
                raise AssertionError(f"{rel}@{offset}: saved with another byte order than this machine's")
            info = data[0]
        view.seek(info.header_offset)
        head = view.read(30)  # zip local file header: 30 fixed bytes, then the name and the extra field
        name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
        return _Record(offset + info.header_offset + 30 + name_len + extra_len, info.file_size)

    def _read_box(self, f, rel: str, rec: _Record, req: ReadItem, planner: LoadPlanner) -> None:
        md = self.metadata.state_dict_metadata[req.storage_index.fqn]
        chunk = md.chunks[req.storage_index.index]  # the index hint DCP's resharding helper sets
        if tuple(chunk.offsets) != tuple(req.storage_index.offset):
            raise AssertionError(f"{req.storage_index}: index hint points at chunk {chunk}")
        saved = tuple(chunk.sizes)
        dtype = md.properties.dtype
        item = torch.empty((), dtype=dtype).element_size()
        if rec.nbytes != math.prod(saved) * item:
            raise AssertionError(f"{rel}: record of {rec.nbytes} bytes for a {saved} {dtype} chunk")
        target = planner.resolve_tensor(req).detach()
        lengths, offs = tuple(req.lengths), tuple(req.storage_offsets)
        direct = target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
        buf = target if direct else torch.empty(lengths, dtype=dtype)
        flat = buf.reshape(-1).view(torch.uint8)
        run_elems, starts = _runs(saved, offs, lengths)
        run_bytes = run_elems * item
        for i, start in enumerate(starts):
            pos = rec.data_start + start * item
            _read_exact(f, pos, flat[i * run_bytes:(i + 1) * run_bytes])
            self.log.append((rel, pos, run_bytes, "data"))
        if not direct:
            target.copy_(buf)
        planner.commit_tensor(req, target)


def _runs(saved: tuple[int, ...], offs: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, list[int]]:
    """The sub-box [offs, offs + lengths) of a row-major box of shape ``saved`` as contiguous runs:
    (elements per run, flat start of each run), runs in the row-major order of the sub-box.

    >>> _runs((4, 6), (1, 2), (2, 3))   # rows 1-2, columns 2-4: two runs of 3
    (3, [8, 14])
    >>> _runs((4, 6), (1, 0), (2, 6))   # whole rows 1-2: one run
    (12, [6])
    """
    n = len(saved)
    if n == 0:
        return 1, [0]
    k = n - 1  # the last dim not taken whole; every dim after it is whole
    while k > 0 and offs[k] == 0 and lengths[k] == saved[k]:
        k -= 1
    strides = [math.prod(saved[d + 1:]) for d in range(n)]
    starts = [sum(i * strides[d] for d, i in enumerate(idx)) + offs[k] * strides[k]
              for idx in itertools.product(*(range(offs[d], offs[d] + lengths[d]) for d in range(k)))]
    return lengths[k] * strides[k], starts


def _read_exact(f, pos: int, out: torch.Tensor) -> None:
    mv = memoryview(out.numpy()).cast("B")
    f.seek(pos)
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            raise AssertionError(f"unexpected end of file at {pos + got}")
        got += n


class _Slice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open file, seekable (for ``zipfile``)."""

    def __init__(self, f, offset: int, length: int, on_read):
        self.f, self.offset, self.length, self.pos, self.on_read = f, offset, length, 0, on_read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.offset + self.pos)
        mv = memoryview(b).cast("B")
        got = self.f.readinto(mv[:n]) or 0
        self.on_read(self.offset + self.pos, got)
        self.pos += got
        return got
