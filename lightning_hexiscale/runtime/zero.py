"""ZeRO-2 / ZeRO-3 across asymmetric pipelines: sharded gradients, optimizer states, (parameters).

Layout: :mod:`lightning_hexiscale.runtime.zero_layout` (each bucket's holders, one per pipeline;
this rank owns chunk i of c = ceil(n/k) elements). Per optimizer step, for every bucket in the one
global order of :func:`~lightning_hexiscale.runtime.zero_layout.build_buckets`:

1. :meth:`ZeroSharder.reduce_grads`: reduce-scatter(SUM) of the flat bucket of local gradients
   among its holders -> this rank's c summed elements. Pipelines weighted their losses by
   micro_batch / global_batch, so the sum is the global-mean gradient (as in grad_sync). A local
   gradient is freed as soon as every bucket holding a piece of it has been flattened. ZeRO-2
   starts them during the step's last backward, at block boundaries and in bucket order
   (:meth:`ZeroSharder.arm`, :class:`~lightning_hexiscale.runtime.grad_sync.BoundaryStarts`), so the
   transfer overlaps the backward as the planner prices it; ZeRO-3 issues them after the backward.
2. :meth:`ShardedOptimizer.step`: a torch optimizer of the user's class and hyper-parameters steps
   only the c owned elements (one inner optimizer per bucket, its parameters leaf views of the
   chunk, one per run of elements in the same param group). Element-wise optimizers (SGD, Adam,
   AdamW) give exactly the unsharded update. Then all-gather of the updated chunks among the
   holders -> every holder's full local parameter again (ZeRO-2 and the ``whole`` buckets of
   ZeRO-3), and a broadcast of the replicated parameters (norms, embedding, LM head) from the
   stage leader to its TP group, since only leaders hold those in the cross-pipeline groups.
   ZeRO-3's ``sharded`` buckets keep their chunk as the only persistent copy (the "master"); the
   block's full local parameters are gathered on demand (:mod:`lightning_hexiscale.runtime.zero3`).

Memory per rank (bytes per local parameter, fp32 weights and AdamW, k pipelines): DDP 4 + 4 + 8;
ZeRO-2 4 + 4 + 8/k during backward (the local gradient accumulates over the pipeline's
micro-batches before the cross-pipeline reduction can start, because pipelines run different numbers
of micro-batches), 4 + 4/k + 8/k after the reduce-scatter; ZeRO-3 4/k + 4 + 8/k plus one or two
gathered blocks. Appendix B's ZeRO-2 term B + (B + K)/N assumes gradients sharded during backward too.

Collectives are issued in list order with at most ``WINDOW`` in flight (except the reduce-scatters
ZeRO-2 starts during the backward: each one's flat buffer replaces the local gradients it frees, so
they stay in flight until :meth:`ZeroSharder.reduce_grads` at no extra memory). Every rank's list is a
subsequence of one global order, so the globally first unfinished bucket always has all its holders
at it: no deadlock, whatever groups a rank belongs to.

Wire dtypes (what the cost model prices): gradients are reduce-scattered in ``reduce_dtype`` (the
plan's, default the autocast dtype under mixed precision); parameters are all-gathered in the
*wire* dtype, the autocast dtype under mixed precision. Then, as in mixed-precision ZeRO (FSDP's
``param_dtype``, DeepSpeed's bf16 optimizer), the exact float32 values live only in each owner's
*master* chunk (the optimizer steps it); every holder's full local parameters are the bf16-rounded
gathered values (autocast rounds matmul weights to bf16 anyway), equal on all holders.
:meth:`ZeroSharder.full_params` gathers the masters exactly (checkpoints, validation).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_hexiscale.runtime.grad_sync import BoundaryStarts, finite, squared_norm
from lightning_hexiscale.runtime.parallelize import StageModule
from lightning_hexiscale.runtime.topology import Topology
from lightning_hexiscale.runtime.zero_layout import Bucket, Item, build_buckets, chunk_runs
from lightning_hexiscale.torch_compat import all_gather_single, reduce_scatter_single

WINDOW = 2
"""Bucket collectives in flight: overlap of two transfers, two buckets of transient memory."""


def item_view(t: torch.Tensor, it: Item) -> torch.Tensor:
    """The item's piece of a local (full-local-shape) tensor."""
    return t if it.dim is None else t.narrow(it.dim, it.start, it.length)


def flatten(tensors: dict[str, torch.Tensor | None], b: Bucket, like: torch.Tensor) -> torch.Tensor:
    """Flat k*c buffer of the bucket's items (missing tensors as zeros), zero-padded."""
    parts = []
    for it in b.items:
        t = tensors.get(it.name)
        parts.append(torch.zeros(it.numel, dtype=like.dtype, device=like.device) if t is None
                     else item_view(t, it).reshape(-1))
    if b.padded > b.numel:
        parts.append(torch.zeros(b.padded - b.numel, dtype=like.dtype, device=like.device))
    return torch.cat(parts)


def unflatten(flat: torch.Tensor, b: Bucket, into: dict[str, torch.Tensor]) -> None:
    """Copy the flat buffer's items into the local tensors ``into[name]`` (in place)."""
    for it, off in zip(b.items, b.offsets):
        v = item_view(into[it.name], it)
        v.copy_(flat[off:off + it.numel].view(v.shape))


class _Window:
    """Runs async collectives with at most WINDOW in flight; ``done(i, value)`` on completion."""

    def __init__(self, done):
        self.pending: list[tuple[int, Any, Any]] = []
        self.done = done

    def add(self, i: int, work, value) -> None:
        self.pending.append((i, work, value))
        if len(self.pending) >= WINDOW:
            self.pop()

    def pop(self) -> None:
        i, work, value = self.pending.pop(0)
        if work is not None:
            work.wait()
        self.done(i, value)

    def drain(self) -> None:
        while self.pending:
            self.pop()


class ZeroSharder:
    """This rank's ZeRO state for its stage (``sharding`` is ``"zero2"`` or ``"zero3"``).

    Build once per stage (after the weights are loaded), collectively (no communication here, but
    ZeRO-3 frees the block parameters right away).
    """

    def __init__(self, stage: StageModule, topology: Topology, sharding: str, bucket_cap_bytes: int,
                 reduce_dtype: torch.dtype | None = None, wire_dtype: torch.dtype | None = None):
        if sharding not in ("zero2", "zero3"):
            raise ValueError(f"ZeroSharder needs zero2 or zero3, got {sharding!r}")
        self.stage, self.topology, self.sharding = stage, topology, sharding
        self.params = dict(stage.named_parameters())
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.reduce_dtype = reduce_dtype or self.dtype
        """dtype of the gradient reduce-scatter."""
        self.wire = wire_dtype or self.dtype
        """dtype parameters are gathered in during training (narrower than ``dtype``: mixed precision)."""
        self.buckets: list[Bucket] = build_buckets(topology.segments, topology.rank, stage.shards(),
                                                   first.element_size(), bucket_cap_bytes)
        self.groups = [topology.group(b.ranks) if b.k > 1 else None for b in self.buckets]
        self.grads: list[torch.Tensor | None] = [None] * len(self.buckets)
        role = topology.role
        shards = stage.shards()
        # Replicated tensors reach the non-leader TP ranks by broadcast (only leaders are holders).
        self.replicated = [n for n, s in shards.items() if s.spec.shard_dim is None] if role.tp > 1 else []
        self.zero3 = sharding == "zero3"
        self.masters: list[torch.Tensor | None] = [None] * len(self.buckets)
        """The owned chunk in the parameter dtype, where it is the exact copy: ZeRO-3's ``sharded``
        buckets (the only persistent copy) and, under mixed precision, every shared bucket."""
        self.sharded_names: list[str] = []
        if any(self.has_master(i) for i in range(len(self.buckets))):
            self.reshard_from_params()
        # ZeRO-2: reduce-scatters start during the step's last backward, at block boundaries, in
        # bucket-list order (grad_sync.BoundaryStarts). Not ZeRO-3: its block gathers follow one
        # global p2p sequence (comm_order) that collectives issued inside the backward would break.
        self._inflight: list[tuple[int, Any, torch.Tensor]] = []
        self._left: dict[str, int] = {}
        self.freed_finite: list[torch.Tensor] = []
        """Per bucket started during the backward: is its flat local gradient finite (0-d bool)? Its
        local gradients are freed at the start, so a finiteness check must ask here too."""
        self.overlapped_buckets = 0
        """Diagnostics: buckets of the last :meth:`reduce_grads` that started during backward."""
        self.starts = BoundaryStarts(stage, self.params, [{it.name for it in b.items} for b in self.buckets],
                                     [b.unit for b in self.buckets], self._start_during_backward,
                                     enabled=not self.zero3)

    @property
    def mixed(self) -> bool:
        return self.wire != self.dtype

    def on_demand(self, i: int) -> bool:
        """ZeRO-3 ``sharded`` bucket: its parameters are gathered around each use (:mod:`.zero3`)."""
        return self.zero3 and self.buckets[i].kind == "sharded"

    def has_master(self, i: int) -> bool:
        return self.on_demand(i) or (self.mixed and self.buckets[i].k > 1)

    def _chunk(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        return flat[b.index * b.chunk:(b.index + 1) * b.chunk]

    # ---- ZeRO-3 storage ------------------------------------------------------------------------
    @torch.no_grad()
    def reshard_from_params(self) -> None:
        """masters := owned chunks of the current full local parameters; then ZeRO-3 frees the block
        parameters (p.data becomes an empty tensor; gathered again on demand) and mixed precision
        rounds the others to the wire dtype (what the next all-gather would give every holder)."""
        sharded = set()
        for i, b in enumerate(self.buckets):
            if self.has_master(i):
                flat = flatten(self.params, b, self.params[b.items[0].name])
                self.masters[i] = self._chunk(flat, b).clone()
                if self.on_demand(i):
                    sharded.update(it.name for it in b.items)
                else:
                    unflatten(flat.to(self.wire), b, {it.name: self.params[it.name].data for it in b.items})
        for name in sharded:
            self.params[name].data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.sharded_names = sorted(sharded)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Mixed precision: after the full local parameters were loaded (a checkpoint), rebuild the
        masters of the buckets that are not gathered on demand from them, and round the parameters
        to the wire dtype (ZeRO-3's on-demand masters are loaded directly)."""
        for i, b in enumerate(self.buckets):
            if self.has_master(i) and not self.on_demand(i):
                views = {it.name: self.params[it.name].data for it in b.items}
                flat = flatten(views, b, self.params[b.items[0].name])
                self.masters[i] = self._chunk(flat, b).clone()
                unflatten(flat.to(self.wire), b, views)

    @torch.no_grad()
    def gather_masters(self, on_demand_into: dict[str, torch.Tensor] | None = None) -> None:
        """All-gather every master chunk exactly (parameter dtype) into the full local parameters;
        collective over the world (each rank walks its buckets in the global order).
        ``on_demand_into``: where ZeRO-3's freed block parameters go (name -> full local tensor)."""
        def done(i, full):
            b = self.buckets[i]
            into = on_demand_into if self.on_demand(i) else {it.name: self.params[it.name].data for it in b.items}
            unflatten(full, b, into)

        window = _Window(done)
        for i, b in enumerate(self.buckets):
            if not self.has_master(i) or (b.k == 1 and not self.on_demand(i)):
                continue
            if b.k == 1:
                window.add(i, None, self.masters[i])
                continue
            full = torch.empty(b.padded, dtype=self.dtype, device=self.device)
            window.add(i, all_gather_single(full, self.masters[i], group=self.groups[i], async_op=True), full)
        window.drain()

    @contextmanager
    def full_params(self, gather: bool = True, writeback: bool = False):
        """Mixed precision (ZeRO-2): the exact masters in the full local parameters for the duration
        (see :meth:`Zero3Gatherer.full_params` for the arguments)."""
        if gather:
            self.gather_masters()
        try:
            yield
        finally:
            if writeback:
                self.reshard_from_params()
            elif gather:
                self.round_params()

    @torch.no_grad()
    def round_params(self) -> None:
        """Mixed precision: the non-ZeRO-3 parameters back to their wire-rounded training values
        (after :meth:`gather_masters` put the exact ones there)."""
        for i, b in enumerate(self.buckets):
            if self.has_master(i) and not self.on_demand(i):
                views = {it.name: self.params[it.name].data for it in b.items}
                unflatten(flatten(views, b, self.masters[i]).to(self.wire), b, views)

    # ---- gradients -------------------------------------------------------------------------------
    def arm(self) -> None:
        """ZeRO-2: start the reduce-scatters at block boundaries of the next backward (the step's last)."""
        if not self.zero3:
            self._begin()
            self.starts.arm()

    def _begin(self) -> None:
        self._left = {}
        for b in self.buckets:
            for it in b.items:
                self._left[it.name] = self._left.get(it.name, 0) + 1
        self.freed_finite = []

    @torch.no_grad()
    def _start_during_backward(self, i: int) -> None:
        self._inflight.append((i, *self._issue(i, record_finite=True)))

    def _issue(self, i: int, record_finite: bool = False) -> tuple[Any, torch.Tensor]:
        """Flatten bucket i's local gradients (freeing each local gradient once every bucket holding a
        piece of it has been flattened) and start its reduce-scatter; (work or None, output)."""
        b = self.buckets[i]
        grads = {it.name: self.params[it.name].grad for it in b.items}
        flat = flatten(grads, b, torch.empty(0, dtype=self.dtype, device=self.device))
        if record_finite:
            self.freed_finite.append(finite(flat))
        for it in b.items:  # the flat copy holds what is needed: drop the local gradient
            self._left[it.name] -= 1
            if self._left[it.name] == 0:
                self.params[it.name].grad = None
        if b.k == 1:
            return None, flat
        flat = flat.to(self.reduce_dtype)
        out = torch.empty(b.chunk, dtype=self.reduce_dtype, device=self.device)
        return reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.groups[i], async_op=True), out

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Reduce-scatter(SUM) every bucket's gradients; frees the local full gradients. Buckets
        started during the backward (:meth:`arm`) are waited for, the rest issued in list order.

        Collective over the world: every rank calls it at the same point of the step.
        """
        if not self.starts.armed:
            self._begin()

        def done(i, out):
            self.grads[i] = out.to(self.dtype)  # the optimizer steps in the parameter dtype

        window = _Window(done)
        window.pending, self._inflight = self._inflight, []  # oldest first: waited as the window fills
        self.overlapped_buckets = len(window.pending)
        for i in self.starts.start_rest():
            window.add(i, *self._issue(i))
        window.drain()
        self.starts.reset()
        self.freed_finite = []

    def drop_grads(self) -> None:
        """Forget the reduced chunks (a skipped step: the update must not see them)."""
        self.grads = [None] * len(self.buckets)

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of the owned gradient chunks (float64 scalar, no float64 copies). Every
        element of the model's gradient is owned by exactly one rank, so a world all-reduce of this
        is ||g||^2."""
        return squared_norm(self.grads, self.device)

    @torch.no_grad()
    def scale_grads(self, coef: float) -> None:
        for g in self.grads:
            if g is not None:
                g.mul_(coef)

    def all_finite(self) -> bool:
        flags = [torch.isfinite(g).all() for g in self.grads if g is not None]
        return not flags or bool(torch.stack(flags).all())  # one host synchronisation

    # ---- parameters after the step ---------------------------------------------------------------
    @torch.no_grad()
    def broadcast_replicated(self) -> None:
        """Stage leader -> its TP group: the replicated parameters (collective in the TP group)."""
        if not self.replicated:
            return
        role = self.topology.role
        # In the wire dtype: under mixed precision the values are wire-rounded already (lossless).
        flat = torch.cat([self.params[n].detach().reshape(-1) for n in self.replicated]).to(self.wire)
        dist.broadcast(flat, src=self.topology.to_global(role.leader), group=self.topology.tp_group)
        off = 0
        for n in self.replicated:
            p = self.params[n]
            p.data.copy_(flat[off:off + p.numel()].view(p.shape))
            off += p.numel()

    def attach(self, optimizer: Optimizer, after_step: Callable[[], None] | None = None) -> ShardedOptimizer:
        """A :class:`ShardedOptimizer` with ``optimizer``'s class and hyper-parameters;
        ``after_step()`` runs at the end of each of its steps (collective if it communicates)."""
        return ShardedOptimizer(self, optimizer, after_step)


def user_optimizer(optimizer):
    """The optimizer a :class:`ShardedOptimizer` copies (its class, ``param_groups`` and defaults);
    any other optimizer itself. Checkpoints record and check that class."""
    return optimizer.user if isinstance(optimizer, ShardedOptimizer) else optimizer


class ShardedOptimizer:
    """Steps only this rank's chunks with inner optimizers of the user's optimizer class.

    It is the optimizer that steps under ZeRO, in place of the user's (built on the stage parameters,
    e.g. by ``configure_optimizers``), as DeepSpeed's engine optimizer is: the strategy hands it to
    Lightning, which steps it. It shares the user's ``param_groups`` (the same dicts: an LR
    scheduler of either writes the ``lr`` every :meth:`step` copies into the inner optimizers) and
    ``defaults``; ``state`` is the inner optimizers' (per chunk run); the user's own stays empty.
    """

    def __init__(self, sharder: ZeroSharder, optimizer: Optimizer, after_step: Callable[[], None] | None = None):
        self.sharder, self.user = sharder, optimizer
        self.after_step = after_step
        """Run after each step's all-gathers (tied embeddings: the first stage's updated rows to the last)."""
        names = {id(p): n for n, p in sharder.params.items()}
        group_of = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                group_of[names[id(p)]] = g
        missing = [n for n in sharder.params if n not in group_of]
        if missing:
            raise ValueError(f"the optimizer does not cover the stage parameters {missing[:3]}: build it on "
                             f"engine.parameters() / self.parameters()")
        self.runs: list[list[tuple[int, int, int]]] = []
        self.leaves: list[list[torch.Tensor]] = []
        self.inner: list[Optimizer] = []
        self.inner_groups: list[list[int]] = []  # inner group j -> user group g
        for b in sharder.buckets:
            runs = chunk_runs(b, group_of)
            leaves = [torch.empty(0, dtype=sharder.dtype, device=sharder.device) for _ in runs]
            gs = sorted({g for _, _, g in runs})
            groups = [{"params": [leaf for leaf, (_, _, g2) in zip(leaves, runs) if g2 == g], **self._hyper(g)}
                      for g in gs]
            self.runs.append(runs)
            self.leaves.append(leaves)
            self.inner.append(type(optimizer)(groups, **self._defaults()))
            self.inner_groups.append(gs)

    def _defaults(self) -> dict[str, Any]:
        # Only what the constructor accepts (AdamW's defaults carry e.g. decoupled_weight_decay);
        # every group gets the full hyper-parameters of its user group anyway.
        accepted = inspect.signature(type(self.user).__init__).parameters
        return {k: v for k, v in self.user.defaults.items() if k in accepted}

    def _hyper(self, g: int) -> dict[str, Any]:
        return {k: v for k, v in self.user.param_groups[g].items() if k != "params"}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.user.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.user.defaults

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Chunk-run leaf -> its state, over every inner optimizer (a new dict of the same entries)."""
        return {leaf: st for inner in self.inner for leaf, st in inner.state.items()}

    def __repr__(self) -> str:
        return f"ShardedOptimizer({type(self.user).__name__}, {len(self.inner)} buckets)"

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``inner``, each bucket's inner optimizer's ``state_dict()`` (its chunk
        runs' state), and ``param_groups``, the user's hyper-parameters. Valid for this plan only;
        the plan-independent checkpoints write the state by global parameter name (:mod:`.checkpoint`)."""
        return {"inner": [o.state_dict() for o in self.inner],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.user.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict` (on the same plan and rank)."""
        inner, groups = state_dict["inner"], state_dict["param_groups"]
        if len(inner) != len(self.inner) or len(groups) != len(self.user.param_groups):
            raise ValueError(f"a state of {len(inner)} buckets and {len(groups)} param groups cannot load into "
                             f"{self!r} with {len(self.user.param_groups)} param groups: another plan or rank "
                             "saved it; load a plan-independent checkpoint (runtime.checkpoint) instead")
        for opt, sd in zip(self.inner, inner):
            opt.load_state_dict(sd)
        for group, hyper in zip(self.user.param_groups, groups):
            group.update(hyper)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.sharder.params.values():
            p.grad = None

    def _bind(self, i: int, base: torch.Tensor) -> None:
        """Point bucket i's leaves at ``base`` (the owned chunk) and its gradient chunk."""
        g = self.sharder.grads[i]
        for leaf, (a, b, _) in zip(self.leaves[i], self.runs[i]):
            leaf.grad = None
            leaf.data = base[a:b]
            if g is not None:
                leaf.grad = g[a:b]

    @torch.no_grad()
    def step(self, closure=None):
        """Inner steps on the owned chunks, all-gather of updated chunks, TP broadcast (collective)."""
        loss = closure() if closure is not None else None
        sh = self.sharder
        for i, gs in enumerate(self.inner_groups):
            for j, g in enumerate(gs):
                self.inner[i].param_groups[j].update(self._hyper(g))
        params = {n: p.data for n, p in sh.params.items()}

        def done(i, full):
            if full is not None:
                unflatten(full[:sh.buckets[i].padded], sh.buckets[i], params)

        window = _Window(done)
        for i, b in enumerate(sh.buckets):
            if sh.has_master(i):
                self._bind(i, sh.masters[i])
                self.inner[i].step()
                if not sh.on_demand(i):  # mixed precision: every holder gets the wire-rounded chunks
                    full = torch.empty(b.padded, dtype=sh.wire, device=sh.device)
                    work = all_gather_single(full, sh.masters[i].to(sh.wire), group=sh.groups[i], async_op=True)
                    window.add(i, work, full)
                continue
            flat = flatten(params, b, sh.params[b.items[0].name])
            own = sh._chunk(flat, b)
            self._bind(i, own)
            self.inner[i].step()
            if b.k == 1:
                window.add(i, None, flat)
                continue
            full = torch.empty(b.padded, dtype=sh.dtype, device=sh.device)
            work = all_gather_single(full, own.clone(), group=sh.groups[i], async_op=True)
            window.add(i, work, full)
        window.drain()
        empty = torch.empty(0, dtype=sh.dtype, device=sh.device)
        for i in range(len(sh.buckets)):
            sh.grads[i] = None
            if not sh.has_master(i):
                self._bind(i, empty)  # drop the views of the transient flat buffers
        sh.broadcast_replicated()
        if self.after_step is not None:
            self.after_step()
        return loss
