"""The torch names this package uses that are newer than its torch floor, with their older forms.

``pyproject.toml`` promises the oldest torch the distributed suites were run on (README, "Torch and
Lightning versions"). Where the package calls a name that torch added later, it calls the function
here instead, which takes the new name when this torch has it and the older form otherwise:

=================================  =======  ===================================================
new name (used when present)       since    older form (same semantics)
=================================  =======  ===================================================
``dist.all_gather_single``         2.13     ``dist.all_gather_into_tensor`` (2.0; deprecated
                                            from 2.13 with a FutureWarning, hence the order)
``dist.reduce_scatter_single``     2.13     ``dist.reduce_scatter_tensor`` (2.0; deprecated
                                            from 2.13)
SDPA's ``enable_gqa=`` argument    2.5      key/value heads repeated ``nq / nkv`` times
                                            (``repeat_interleave`` on dim 1) before plain SDPA
``no_dist=`` of DCP's ``save`` /   2.7      ``dcp.save_state_dict`` / ``dcp.load_state_dict``
``load``                                    (2.0; deprecated), which take ``no_dist``
DCP ``_StorageInfo.``              > 2.4    none: an item without the field has no transforms
``transform_descriptors``
``Store.clone()``                  > 2.4    a new ``TCPStore`` client of the same server (the
                                            store under the ``PrefixStore`` wrappers)
``FileSystemWriter.stage`` copies  > 2.4    2.4 returns CPU tensors themselves (its
CPU tensors                                 ``.to("cpu")`` is a no-op): those are cloned
=================================  =======  ===================================================

(``> 2.4``: absent in 2.4.1, the oldest torch run, present in 2.13.)

Communication is unchanged by the choice: ``all_gather_into_tensor`` and ``all_gather_single``
(likewise the reduce-scatters) are one NCCL/gloo collective with the same group, input and output
sizes and dtype (torch 2.13's deprecated names are thin wrappers around the new ones), so the bytes
on the wire and the collective order the cost model and the NCCL rules rely on are the same on every
torch. The collectives look the name up at every call, not at import, so a test can hide the new
names from ``torch.distributed`` and a wrapper installed after import (the suite's NCCL recorder)
sees the call.

DCP's deprecated functions run the same ``_save_state_dict`` / ``_load_state_dict`` as ``save`` /
``load`` for a dict of plain tensors (the only state this package hands to DCP): same files, same
collectives.

The GQA fallback computes the same attention (query head j reads key/value head ``j // (nq/nkv)``,
which is what ``enable_gqa`` does) at the memory cost of the repeated k/v: (nq/nkv - 1) x the k/v
activations of one layer, only on torch < 2.5.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

SDPA_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
"""Whether ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5)."""


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False):
    """All-gather equal chunks ``input`` (n elements) of every member of ``group`` into ``output``
    (t x n elements, rank order): ``dist.all_gather_single`` (torch >= 2.13) or
    ``dist.all_gather_into_tensor``. Returns the work handle when ``async_op``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Reduce ``input`` (t x n elements) over ``group`` with ``op`` and keep this rank's chunk (n
    elements, rank order) in ``output``: ``dist.reduce_scatter_single`` (torch >= 2.13) or
    ``dist.reduce_scatter_tensor``. Returns the work handle when ``async_op``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``F.scaled_dot_product_attention`` on q (B, nq, S, d) and k, v (B, nkv, S, d), nq a
    multiple of nkv: ``enable_gqa`` where torch has it (>= 2.5), else k/v heads repeated."""
    group = q.shape[1] // k.shape[1]
    if SDPA_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@functools.lru_cache(maxsize=1)
def dcp_takes_no_dist() -> bool:
    """Whether ``dcp.save`` / ``dcp.load`` take ``no_dist`` (torch >= 2.7; decided once)."""
    import torch.distributed.checkpoint as dcp

    return "no_dist" in inspect.signature(dcp.save).parameters


def dcp_save(state: dict, *, storage_writer, planner, process_group: dist.ProcessGroup | None, no_dist: bool):
    """``dcp.save`` of a dict of tensors; ``no_dist``: one process, no collectives."""
    import torch.distributed.checkpoint as dcp

    if dcp_takes_no_dist():
        return dcp.save(state, storage_writer=storage_writer, planner=planner, process_group=process_group,
                        no_dist=no_dist)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*save_state_dict. is deprecated", category=FutureWarning)
        return dcp.save_state_dict(state, storage_writer, process_group=process_group, no_dist=no_dist,
                                   planner=planner)


def dcp_load(state: dict, *, storage_reader, planner=None, process_group: dist.ProcessGroup | None = None,
             no_dist: bool = False) -> None:
    """``dcp.load`` into a dict of tensors (in place); ``no_dist``: one process, no collectives."""
    import torch.distributed.checkpoint as dcp

    if dcp_takes_no_dist():
        dcp.load(state, storage_reader=storage_reader, planner=planner, process_group=process_group,
                 no_dist=no_dist)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load_state_dict. is deprecated", category=FutureWarning)
        dcp.load_state_dict(state, storage_reader, process_group=process_group, no_dist=no_dist, planner=planner)


def dcp_stream_transforms(info) -> list:
    """The stream transforms (compression, ...) DCP applied to a saved item (``_StorageInfo``);
    torch 2.4 has no such field, and no transforms."""
    return list(getattr(info, "transform_descriptors", None) or ())


def store_clone(store):
    """A second connection to the rendezvous store, usable from another thread with its own
    timeout: ``store.clone()`` where torch has it; otherwise a new ``TCPStore`` client of the TCP
    server under ``store``'s ``PrefixStore`` wrappers.

    The fallback's keys are not under ``store``'s prefixes (torch 2.4's ``PrefixStore`` does not
    expose its prefix): use it for keys of your own, written and read through it on every rank."""
    if hasattr(store, "clone"):
        return store.clone()
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        raise RuntimeError(f"torch {torch.__version__} cannot open a second connection to a {type(inner).__name__} "
                           "(Store.clone is newer): rendezvous over TCP (env:// or tcp://, what torchrun and "
                           "Lightning use), or upgrade torch")
    return dist.TCPStore(inner.host, inner.port, is_master=False, timeout=inner.timeout, wait_for_workers=False,
                         use_libuv=inner.libuvBackend)


def dcp_stage(writer, state: dict) -> dict:
    """``writer.stage(state)`` (DCP's ``FileSystemWriter``: a CPU copy of the tensors, immune to
    later in-place updates), with every staged tensor that still shares storage with its source
    cloned: torch 2.4 stages CPU tensors as they are, so training would change what an
    asynchronous save writes."""
    staged = writer.stage(state)
    for key, t in staged.items():
        src = state.get(key)
        shared = torch.is_tensor(t) and torch.is_tensor(src) and t.untyped_storage().data_ptr() == \
            src.untyped_storage().data_ptr()
        if shared:
            staged[key] = t.clone()
    return staged
