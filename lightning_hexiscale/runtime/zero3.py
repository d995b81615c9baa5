"""ZeRO-3 parameter gathering around each TransformerBlock, across asymmetric pipelines.

Between uses, a block's TP-sharded matrices exist only as the chunks their holders own
(:class:`~lightning_hexiscale.runtime.zero.ZeroSharder` masters); ``p.data`` is an empty tensor.
A use gathers the block's full LOCAL parameters (this rank's TP shard) from the holders' chunks,
and frees them afterwards:

- forward pre-hook: gather; forward hook: free, and hook the block's output so that its gradient's
  arrival (the start of the block's backward) gathers again;
- with recomputation, the re-run forward happens inside that backward: nothing to gather, no free;
- after the backward: once every matrix of the block has accumulated its gradient
  (post-accumulate-grad hooks), free again;
- prefetch: once a use's parameters are installed, the receives of the rank's next use are posted
  (asynchronously), so the next block's gather overlaps this block's compute, as the planner prices
  it (eq. 5's max(T_f, T_comm)); the sequence puts an op's first use before the pipeline exchanges
  that precede the op, so this holds across ops too (the very first use of a run is posted at the
  run's first exchange, or at its forward). At most one block is prefetched: the one more gathered
  block the memory estimate holds. Gradients stay whole in the local shape (they sum over
  the pipeline's micro-batches and are reduce-scattered once per step).

How a use is served, with no tags and in an order NCCL accepts (see :mod:`.comm_order`): the holders
sit in pipelines with different schedules and micro-batch counts, so one collective per use could
not pair their calls. Instead every rank follows one global sequence of events fixed by the plan
(:func:`~lightning_hexiscale.runtime.comm_order.global_order`): its own block uses and pipeline
exchanges, and, between them, the uses of the other pipelines it must *serve*. A use is one
``batch_isend_irecv`` per holder group on the user's side (receive every other holder's chunk) and
one per group on each server's side (send its chunk), in the wire dtype (bf16 under mixed
precision). Every rank's calls are a subsequence of the same sequence, so the first unfinished one
always has all its participants at it: no deadlock, and each FIFO pairs by order alone. The
executor calls :meth:`Zero3Gatherer.before_exchange` before each pipeline exchange, the hooks call
:meth:`Zero3Gatherer.gather`; both first serve what the sequence puts before them, and check that
the own event is the one the plan predicts (a mismatch raises instead of hanging).

``full_params()`` gathers every block once with one all-gather per bucket at a point every rank
shares (validation, checkpoints; exact parameter dtype) and keeps them until the context exits.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from lightning_hexiscale.runtime.comm_order import global_order
from lightning_hexiscale.runtime.weak_hooks import weak_hook
from lightning_hexiscale.runtime.zero import ZeroSharder, unflatten


class Zero3Gatherer:
    """Installs the gather/free hooks on the stage's blocks; one per ZeRO-3 stage."""

    def __init__(self, sharder: ZeroSharder):
        self.sh = sharder
        stage = sharder.stage
        self.me = sharder.topology.rank
        self.units: dict[str, list[int]] = {}  # "layers.<l>" -> indices of its on-demand buckets
        for i, b in enumerate(sharder.buckets):
            if sharder.on_demand(i):
                self.units.setdefault(b.unit, []).append(i)
        self.names = {u: sorted({it.name for i in ix for it in sharder.buckets[i].items}) for u, ix in self.units.items()}
        self.gathered = {u: False for u in self.units}
        self.in_backward = {u: False for u in self.units}
        self.pending = {u: 0 for u in self.units}
        self.pinned = False
        self.program = self._program()
        """This rank's part of the global sequence: ``("own", event)`` / ``("serve", rank, layer)``."""
        self._cursor: int | None = None
        self.prefetched: tuple[str, tuple[list, dict[int, torch.Tensor]]] | None = None
        """(unit, its posted receives) of the next use, issued during the current block's compute."""
        for key, block in stage.layers.items():
            unit = f"layers.{key}"
            if unit not in self.units:
                continue
            block.register_forward_pre_hook(lambda _m, _a, u=unit: self._pre_forward(u))
            block.register_forward_hook(lambda _m, _a, out, u=unit: self._post_forward(u, out))
            for name in self.names[unit]:
                # weakly held (weak_hooks.py): the parameter's hook would otherwise keep self alive
                sharder.params[name].register_post_accumulate_grad_hook(
                    weak_hook(self, lambda z, _p, u=unit: z._accumulated(u)))

    # ---- the global sequence -------------------------------------------------------------------
    def _program(self) -> list[tuple]:
        plan = self.sh.topology.plan
        role = self.sh.topology.role
        mine = (role.pipeline, role.stage)
        partners: dict[int, set[int]] = {}  # layer -> ranks whose uses this rank serves
        for ix in self.units.values():
            for i in ix:
                b = self.sh.buckets[i]
                partners.setdefault(int(b.unit.split(".")[1]), set()).update(r for r in b.ranks if r != self.me)
        stages = self.sh.topology.stage_ranks
        program: list[tuple] = []
        for i, j, ev in global_order(plan):
            if (i, j) == mine:
                program.append(("own", ev))
            elif ev[0] == "x" and (i, j + 1) == mine:
                program.append(("own", ("x", "prev", ev[2])))
            elif ev[0] == "u":
                for r in sorted(set(stages[i][j]) & partners.get(ev[1], set())):
                    program.append(("serve", r, ev[1]))
        return program

    def _advance(self, kind: str, layer: int | None = None) -> None:
        """Serve everything the sequence puts before this rank's next own event, then consume that
        event, which must be ``kind`` (and ``layer`` for a use)."""
        if self._cursor is None:
            raise RuntimeError("ZeRO-3 block gather outside a training run and outside full_params(): its holders "
                               "in the other pipelines would not serve it (use engine.full_params() around "
                               "forward-only work)")
        while self._cursor < len(self.program) and self.program[self._cursor][0] == "serve":
            _, rank, served = self.program[self._cursor]
            self._serve(rank, served)
            self._cursor += 1
        if self._cursor == len(self.program):
            raise RuntimeError(f"ZeRO-3: rank {self.me} has an unexpected {kind} event after its last planned one")
        ev = self.program[self._cursor][1]
        if ev[0] != kind or (kind == "u" and ev[1] != layer):
            raise RuntimeError(f"ZeRO-3: rank {self.me} at event {self._cursor} of its plan expected {ev}, got "
                               f"{kind} {'' if layer is None else layer}: the stage's communication order differs "
                               f"from comm_order.stage_events")
        self._cursor += 1

    def before_exchange(self) -> None:
        """Called by the executor before each pipeline exchange of a training run. The sequence puts
        an op's first block use before the exchanges that precede the op: post its gather first
        (when the previous block did not already prefetch it)."""
        if self.prefetched is None:
            self._prefetch()
        self._advance("x")

    @contextmanager
    def training_run(self):
        """Around one pipeline run (all micro-batches, forward and backward) of the schedule."""
        self._cursor = 0
        try:
            yield
            while self._cursor < len(self.program):  # serve the uses that come after this rank's last event
                item = self.program[self._cursor]
                if item[0] != "serve":
                    raise RuntimeError(f"ZeRO-3: rank {self.me} ended its run before its planned event {item[1]}")
                self._serve(item[1], item[2])
                self._cursor += 1
        finally:
            self._cursor = None
            self.prefetched = None

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

    # ---- communication of one use ------------------------------------------------------------
    def _by_group(self, unit: str, with_rank: int | None = None) -> dict[tuple[int, ...], list[int]]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i in self.units.get(unit, []):
            b = self.sh.buckets[i]
            if b.k > 1 and (with_rank is None or with_rank in b.ranks):
                groups.setdefault(b.ranks, []).append(i)
        return dict(sorted(groups.items()))

    @torch.no_grad()
    def _serve(self, rank: int, layer: int) -> None:
        """Send this rank's chunk of every bucket of ``layer`` it shares with ``rank`` (one batch per group)."""
        sh = self.sh
        for ix in self._by_group(f"layers.{layer}", rank).values():
            chunks = [sh.masters[i].to(sh.wire) for i in ix]
            peer = sh.topology.to_global(rank)
            ops = [dist.P2POp(dist.isend, c, peer, group=sh.groups[i]) for i, c in zip(ix, chunks)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    @torch.no_grad()
    def gather(self, unit: str) -> None:
        """The unit's full local parameters: wait for its prefetched receives (or receive them now),
        install them, then prefetch the rank's next use (:meth:`_prefetch`)."""
        if self.prefetched is not None:
            ahead, pending = self.prefetched
            self.prefetched = None
            if ahead != unit:
                raise RuntimeError(f"ZeRO-3: rank {self.me} prefetched {ahead} as its next use but uses {unit}: the "
                                   f"stage's order of block uses differs from comm_order.stage_events")
        else:
            pending = self._receive(unit)
        works, fulls = pending
        for work in works:
            work.wait()
        self.install(unit, fulls)
        self._prefetch()

    def _prefetch(self) -> None:
        """Issue the receives of the rank's next own event now, when it is a block use (the next
        block of the same forward or backward, or the next op's first one): its transfer then
        overlaps the current block's compute. The
        serves that the global sequence puts before it are done first, so every rank still issues
        its calls in the sequence's order (the current block's TP collectives come after, on all
        ranks of the stage alike). Costs one more gathered block of memory, which the planner's
        memory estimate prices (the gathered current and next layer)."""
        c = self._cursor
        if c is None:
            return
        while c < len(self.program) and self.program[c][0] == "serve":
            c += 1
        if c < len(self.program) and self.program[c][1][0] == "u":
            unit = f"layers.{self.program[c][1][1]}"
            self.prefetched = (unit, self._receive(unit))

    def _receive(self, unit: str) -> tuple[list, dict[int, torch.Tensor]]:
        """Consume the unit's use in the global sequence (serving what comes before it) and post the
        receives of the other holders' chunks (one batch per holder group, not waited for):
        (works, flat buffers with this rank's own chunk in place)."""
        sh = self.sh
        self._advance("u", int(unit.split(".")[1]))
        fulls = {}
        for i in self.units[unit]:
            b = sh.buckets[i]
            full = torch.empty(b.padded, dtype=sh.wire, device=sh.device)
            full[b.index * b.chunk:(b.index + 1) * b.chunk] = sh.masters[i]
            fulls[i] = full
        works = []
        for ix in self._by_group(unit).values():
            ops = []
            for i in ix:
                b = sh.buckets[i]
                for j, r in enumerate(b.ranks):
                    if r != self.me:
                        ops.append(dist.P2POp(dist.irecv, fulls[i][j * b.chunk:(j + 1) * b.chunk],
                                              sh.topology.to_global(r), group=sh.groups[i]))
            works += dist.batch_isend_irecv(ops)
        return works, fulls

    def install(self, unit: str, fulls: dict[int, torch.Tensor]) -> None:
        """The unit's full local parameters from its buckets' gathered flat buffers."""
        tensors = self._empty_params(unit)
        for i, full in fulls.items():
            unflatten(full, self.sh.buckets[i], tensors)
        for name, t in tensors.items():
            self.sh.params[name].data = t
        self.gathered[unit] = True

    def _empty_params(self, unit: str) -> dict[str, torch.Tensor]:
        shards = self.sh.stage.shards()
        tensors = {}
        for name in self.names[unit]:
            s = shards[name]
            shape = list(s.spec.shape)
            shape[s.spec.shard_dim] = s.end - s.start
            tensors[name] = torch.empty(shape, dtype=self.sh.dtype, device=self.sh.device)
        return tensors

    def free(self, unit: str) -> None:
        for name in self.names[unit]:
            self.sh.params[name].data = torch.empty(0, dtype=self.sh.dtype, device=self.sh.device)
        self.gathered[unit] = False

    @contextmanager
    def full_params(self, gather: bool = True, writeback: bool = False):
        """Every block's full local parameters for the duration (collective over the world when
        ``gather``: one all-gather per bucket, in the global bucket order, exact parameter dtype).
        ``gather=False`` only allocates them (to load a checkpoint into); with ``writeback`` the
        masters are rebuilt from the parameters on exit (after such a load)."""
        tensors = {}
        for unit in self.units:
            tensors.update(self._empty_params(unit))
        if gather:
            self.sh.gather_masters(on_demand_into=tensors)
        for name, t in tensors.items():
            self.sh.params[name].data = t
        for unit in self.units:
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
                if gather:
                    self.sh.round_params()
                for unit in self.units:
                    self.free(unit)
