"""ZeRO-3 parameter gathering around each TransformerBlock, across asymmetric pipelines.

Between uses, a block's TP-sharded matrices exist only as the chunks their holders own
(:class:`~lightning_hexiscale.runtime.zero.ZeroSharder` masters); ``p.data`` is an empty tensor.
A use gathers the block's full LOCAL parameters (this rank's TP shard) from the holders' chunks,
and frees them afterwards:

- forward pre-hook: gather; forward hook: free, and hook the block's output so that its gradient's
  arrival (the start of the block's backward) gathers again;
- with recomputation, the re-run forward happens inside that backward: nothing to gather, no free;
- after the backward: once every matrix of the block has accumulated its gradient
  (post-accumulate-grad hooks), free again. Gradients stay whole in the local shape (they sum over
  the pipeline's micro-batches and are reduce-scattered once per step).

Why point-to-point and not all-gather: a collective needs every holder at the same call, but the
holders sit in different pipelines with different schedules and micro-batch counts (pipeline A
uses layer 0 four times per step where pipeline B uses it twice, in another order), so a per-use
all-gather would pair different uses and hang. The chunks do not change during a step, so each
holder posts, at the start of a pipeline run, one non-blocking send of its chunk per use the peer
will make (2 x the peer's micro-batches: forward + backward), all tagged per bucket; the peer's
i-th use receives the i-th copy. No send waits on anything, so there is no cycle; a rank waits for
its sends to be consumed at the end of its run, before its chunks can change. (Tested with gloo;
NCCL matches p2p by order, not tag, and is not exercised here.)

``full_params()`` gathers every block once (one send per peer) for forward-only work outside the
training schedule (validation) and for checkpoints, and keeps them until the context exits.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from lightning_hexiscale.runtime.topology import role_of
from lightning_hexiscale.runtime.zero import ZeroSharder, unflatten


class Zero3Gatherer:
    """Installs the gather/free hooks on the stage's blocks; one per ZeRO-3 stage."""

    def __init__(self, sharder: ZeroSharder):
        self.sh = sharder
        stage = sharder.stage
        self.units: dict[str, list[int]] = {}  # "layers.<l>" -> indices of its master buckets
        for i, b in enumerate(sharder.buckets):
            if sharder.is_master(i):
                self.units.setdefault(b.unit, []).append(i)
        self.names = {u: sorted({it.name for i in ix for it in sharder.buckets[i].items}) for u, ix in self.units.items()}
        self.gathered = {u: False for u in self.units}
        self.in_backward = {u: False for u in self.units}
        self.pending = {u: 0 for u in self.units}
        self.pinned = False
        self._sends: list = []
        plan = sharder.topology.plan
        self._n_mb = {r: plan.pipelines[role_of(plan, r).pipeline].num_micro_batches for r in range(plan.world_size)}
        for key, block in stage.layers.items():
            unit = f"layers.{key}"
            if unit not in self.units:
                continue
            block.register_forward_pre_hook(lambda _m, _a, u=unit: self._pre_forward(u))
            block.register_forward_hook(lambda _m, _a, out, u=unit: self._post_forward(u, out))
            for name in self.names[unit]:
                sharder.params[name].register_post_accumulate_grad_hook(lambda _p, u=unit: self._accumulated(u))

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, unit: str) -> None:
        if not self.gathered[unit]:
            self.gather(unit)

    def _post_forward(self, unit: str, out: torch.Tensor) -> None:
        if self.pinned or self.in_backward[unit]:
            return  # validation/checkpoint context, or the re-run forward of recomputation
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda _g, u=unit: self._pre_backward(u))
        self.free(unit)

    def _pre_backward(self, unit: str) -> None:
        self.in_backward[unit] = True
        self.pending[unit] = len(self.names[unit])
        if not self.gathered[unit]:
            self.gather(unit)

    def _accumulated(self, unit: str) -> None:
        if not self.in_backward[unit]:
            return
        self.pending[unit] -= 1
        if self.pending[unit] == 0:
            self.in_backward[unit] = False
            self.free(unit)

    # ---- gather / free ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, unit: str) -> None:
        """Receive the other holders' chunks of the unit's buckets; rebuild the full local tensors."""
        sh = self.sh
        fulls, works = [], []
        for i in self.units[unit]:
            b = sh.buckets[i]
            full = torch.empty(b.padded, dtype=sh.dtype, device=sh.device)
            full[b.index * b.chunk:(b.index + 1) * b.chunk] = sh.masters[i]
            for j, r in enumerate(b.ranks):
                if j != b.index:
                    works.append(dist.irecv(full[j * b.chunk:(j + 1) * b.chunk], src=r, tag=b.tag))
            fulls.append((b, full))
        for w in works:
            w.wait()
        shards = sh.stage.shards()
        tensors = {}
        for name in self.names[unit]:
            s = shards[name]
            shape = list(s.spec.shape)
            shape[s.spec.shard_dim] = s.end - s.start
            tensors[name] = torch.empty(shape, dtype=sh.dtype, device=sh.device)
        for b, full in fulls:
            unflatten(full, b, tensors)
        for name, t in tensors.items():
            sh.params[name].data = t
        self.gathered[unit] = True

    def free(self, unit: str) -> None:
        for name in self.names[unit]:
            self.sh.params[name].data = torch.empty(0, dtype=self.sh.dtype, device=self.sh.device)
        self.gathered[unit] = False

    # ---- the sender side -------------------------------------------------------------------------
    def post_sends(self, uses_per_micro_batch: int | None) -> None:
        """Post one isend of each owned chunk per use each peer will make: ``uses_per_micro_batch``
        x the peer pipeline's micro-batches, or once when ``None`` (a :meth:`full_params` gather)."""
        sh = self.sh
        for ix in self.units.values():
            for i in ix:
                b = sh.buckets[i]
                for r in b.ranks:
                    if r == sh.topology.rank:
                        continue
                    n = 1 if uses_per_micro_batch is None else uses_per_micro_batch * self._n_mb[r]
                    for _ in range(n):
                        self._sends.append(dist.isend(sh.masters[i], dst=r, tag=b.tag))

    def wait_sends(self) -> None:
        for w in self._sends:
            w.wait()
        self._sends.clear()

    @contextmanager
    def training_run(self):
        """Around one pipeline run (all micro-batches, forward and backward) of the schedule."""
        self.post_sends(2)
        try:
            yield
        finally:
            self.wait_sends()

    @contextmanager
    def full_params(self, gather: bool = True, writeback: bool = False):
        """Every block's full local parameters for the duration (collective over the world when
        ``gather``). ``gather=False`` only allocates them (to load a checkpoint into); with
        ``writeback`` the masters are rebuilt from the parameters on exit (after such a load)."""
        if gather:
            self.post_sends(None)
            for unit in self.units:
                self.gather(unit)
            self.wait_sends()
        else:
            shards = self.sh.stage.shards()
            for unit, names in self.names.items():
                for name in names:
                    s = shards[name]
                    shape = list(s.spec.shape)
                    shape[s.spec.shard_dim] = s.end - s.start
                    self.sh.params[name].data = torch.empty(shape, dtype=self.sh.dtype, device=self.sh.device)
                self.gathered[unit] = True
        self.pinned = True
        try:
            yield
        finally:
            self.pinned = False
            if writeback:
                self.sh.reshard_from_params()  # frees the block parameters too
                for unit in self.units:
                    self.gathered[unit] = False
            else:
                for unit in self.units:
                    self.free(unit)
