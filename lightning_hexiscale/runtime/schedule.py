"""Pipeline schedules as pure op lists, and the executor that walks them on one rank.

A schedule is, per (num_stages S, stage s, micro-batches m), the list of ops ``("F", i)`` (forward
of micro-batch i) and ``("B", i)`` (its backward) that stage s runs, in order:

- GPipe: all m forwards, then all m backwards (peak: m micro-batches of activations).
- 1F1B (PipeDream-flush): w = min(S - s - 1, m) warm-up forwards, then m - w pairs
  (forward i + w, backward i), then w cool-down backwards (peak: w + 1 micro-batches in flight).

Both consume and produce micro-batches in increasing order on every stage, so per direction a
stage's k-th send matches its neighbour's k-th receive: the pairing needs no tags (NCCL has none).

Exchanges (pure data, :func:`exchange_points`). Between two ops of a stage lie at most one send
(what the previous op produced: an activation to the next stage after F, an activation gradient to
the previous stage after B) and one receive (what the next op consumes). When both go to the SAME
neighbour and the neighbour has the two counterparts back to back as well, they are fused into one
``batch_isend_irecv`` (1F1B's steady state: send-forward + receive-backward with the next stage,
send-backward + receive-forward with the previous one, as in Megatron's p2p layer and
``torch.distributed.pipelining``); otherwise the send goes first, then the receive, each its own
batch. Un-fused ``isend``/``irecv`` pairs in opposite directions block each other on NCCL once the
messages exceed its buffers (an ``ncclSend`` completes only when the peer posts the matching
``ncclRecv``; concurrent ones must be fused in a group: NCCL user guide, "Point-to-point
communication"): every p2p call here is a batch, and the two sides of
every link hold matching batches (checked for every shape by tests/runtime/test_schedule.py).

Transport of one exchange (paper §3.2), on the two-rank link group of :func:`..topology.link_pairs`:

- leader path: the stage leaders exchange the whole tensor; the receiving leader ``broadcast``s it
  within its TP group;
- scatter/gather path, when both stages have the same TP degree t > 1: the tensor (equal on all
  ranks of the sending TP group) is flattened and cut into t chunks of c = ceil(n/t) elements; TP
  rank r sends chunk r to TP rank r of the other stage, and the receivers all-gather the chunks in
  their TP group (:func:`~lightning_hexiscale.torch_compat.all_gather_single`; TP rank r is the
  r-th device as the stage lists them, the gathered chunks come in ascending rank order and are put
  back in TP-rank order where the two differ). Each link then carries 1/t of the bytes.

Wire dtype: activations and activation gradients cross links (and TP broadcasts) in the autocast
dtype under mixed precision (bf16 for ``bf16-mixed``: what the cost model prices, 2 bytes per
element), otherwise in the parameter dtype; the receiver casts back to the compute dtype.
"""

from __future__ import annotations

import contextlib

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import ConfigError, PlanError
from lightning_hexiscale.runtime.parallelize import StageModule
from lightning_hexiscale.runtime.topology import Role, Topology
from lightning_hexiscale.torch_compat import all_gather_single

Op = tuple[str, int]


def _check(num_stages: int, stage: int, num_micro_batches: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages or num_micro_batches < 1:
        raise ValueError(f"bad schedule shape: num_stages={num_stages}, stage={stage}, "
                         f"num_micro_batches={num_micro_batches}")


def gpipe_schedule(num_stages: int, stage: int, num_micro_batches: int) -> list[Op]:
    """F0..F(m-1), then B0..B(m-1)."""
    _check(num_stages, stage, num_micro_batches)
    m = num_micro_batches
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_schedule(num_stages: int, stage: int, num_micro_batches: int) -> list[Op]:
    """Warm-up w = min(S - s - 1, m) forwards, steady (F, B) pairs, then w backwards."""
    _check(num_stages, stage, num_micro_batches)
    m = num_micro_batches
    warm = min(num_stages - stage - 1, m)
    ops: list[Op] = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", i + warm), ("B", i)]
    ops += [("B", i) for i in range(m - warm, m)]
    return ops


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def schedule_ops(name: str, num_stages: int, stage: int, num_micro_batches: int) -> list[Op]:
    """The op list of schedule ``name`` (``gpipe`` or ``1f1b``)."""
    if name not in SCHEDULES:
        raise PlanError("plan.schedule", name, f"must be one of {sorted(SCHEDULES)}", "pick one of them")
    return SCHEDULES[name](num_stages, stage, num_micro_batches)


Msg = tuple[str, int]
"""A message of an exchange: ``("act", i)`` (activation of micro-batch i, forward) or ``("grad", i)``."""


@dataclass(frozen=True)
class Exchange:
    """One p2p call of a stage with one neighbour: an optional send and an optional receive."""

    side: str
    """``prev`` or ``next``: the neighbouring stage."""
    send: Msg | None = None
    recv: Msg | None = None


def _needs(op: Op, stage: int, num_stages: int) -> tuple[str, Msg] | None:
    kind, i = op
    if kind == "F":
        return ("prev", ("act", i)) if stage > 0 else None
    return ("next", ("grad", i)) if stage < num_stages - 1 else None


def _makes(op: Op, stage: int, num_stages: int) -> tuple[str, Msg] | None:
    kind, i = op
    if kind == "F":
        return ("next", ("act", i)) if stage < num_stages - 1 else None
    return ("prev", ("grad", i)) if stage > 0 else None


def _consumer(msg: Msg) -> Op:
    return ("F", msg[1]) if msg[0] == "act" else ("B", msg[1])


def exchange_points(ops_of: Callable[[int], list[Op]], num_stages: int, stage: int) -> list[list[Exchange]]:
    """The exchanges of ``stage`` at each of the len(ops)+1 points around its ops (point k comes
    before op k; the last point after the last op). ``ops_of(s)`` gives stage s's op list.

    Fusion rule (symmetric, so both sides of a link issue matching batches): the send of op k-1 and
    the receive of op k are fused when they go to the same neighbour AND that neighbour runs the
    producer of our receive immediately before the consumer of our send (then its receive and send
    sit at one point too). Otherwise: send first, then receive.
    """
    ops = ops_of(stage)
    neighbour_next: dict[str, dict[Op, int]] = {}
    for side, d in (("prev", -1), ("next", 1)):
        if 0 <= stage + d < num_stages:
            neighbour_next[side] = {op: k for k, op in enumerate(ops_of(stage + d))}
    peer_ops = {side: list(index) for side, index in neighbour_next.items()}
    points: list[list[Exchange]] = []
    for k in range(len(ops) + 1):
        snd = _makes(ops[k - 1], stage, num_stages) if k > 0 else None
        rcv = _needs(ops[k], stage, num_stages) if k < len(ops) else None
        point: list[Exchange] = []
        if snd and rcv and snd[0] == rcv[0]:
            side = snd[0]
            at = neighbour_next[side]
            producer, consumer = _consumer(rcv[1]), _consumer(snd[1])
            j = at[producer]
            if j + 1 < len(peer_ops[side]) and peer_ops[side][j + 1] == consumer:
                points.append([Exchange(side, send=snd[1], recv=rcv[1])])
                continue
        if snd:
            point.append(Exchange(snd[0], send=snd[1]))
        if rcv:
            point.append(Exchange(rcv[0], recv=rcv[1]))
        points.append(point)
    return points


def forward_ops(num_micro_batches: int) -> list[Op]:
    """Forward only (evaluation): F0 .. F(n-1) on every stage."""
    return [("F", i) for i in range(num_micro_batches)]


def check_token_ids(tokens: torch.Tensor, targets: torch.Tensor, vocab_size: int, pipeline: int) -> None:
    """Every id of a pipeline's inputs and targets in [0, ``vocab_size``), or a ConfigError naming the id,
    where it is and the likely cause (a tokenizer larger than ``model.vocab_size``). Without it, the
    first stage's embedding raised ``IndexError: index out of range in self`` deep in the step (the
    loss on the last stage, for a target). Cost: one ``aminmax`` of each and one host read per
    schedule run (the pipeline's rows; the step reads its loss on the host at the end anyway)."""
    if tokens.dtype.is_floating_point or not tokens.numel():
        return
    lo, hi = torch.aminmax(tokens)
    tlo, thi = torch.aminmax(targets) if targets.numel() and not targets.dtype.is_floating_point else (lo, hi)
    lo, hi, tlo, thi = torch.stack([lo, hi, tlo, thi]).tolist()
    if 0 <= min(lo, tlo) and max(hi, thi) < vocab_size:
        return
    which, t = ("targets", targets) if 0 <= lo and hi < vocab_size else ("inputs", tokens)
    bad = (t < 0) | (t >= vocab_size)
    row, col = (int(i) for i in bad.nonzero()[0])
    value = int(t[row, col])
    raise ConfigError("model.vocab_size", vocab_size,
                      f"the batch's {which} hold token id {value} (row {row} of pipeline {pipeline}'s samples, "
                      f"position {col}; ids run {min(lo, tlo)}..{max(hi, thi)}), and ids must be in [0, {vocab_size})",
                      f"tokenize with the model's tokenizer, or give the model the tokenizer's vocabulary "
                      f"(model.vocab_size >= {max(hi, thi) + 1}); an ignore index such as -100 is not supported")


class PipelineExecutor:
    """Runs one pipeline step (all micro-batches, forward and backward) on this rank.

    Gradients accumulate into the stage parameters' ``.grad`` over micro-batches. Each micro-batch
    loss is the mean token cross-entropy times ``loss_scale`` (the engine passes
    micro_batch_size / global_batch), so summing over micro-batches and pipelines gives the
    global-mean loss and gradient.

    ``before_exchange``: called before every exchange of a training run (ZeRO-3 serves its peers'
    gathers there, see :mod:`.zero3`). ``before_run`` / ``after_run``: called at the start and the
    end of every run and forward-only walk (the main grads' compute copies are cast, then freed,
    there: :mod:`.main_grads`).
    """

    def __init__(self, stage: StageModule, topology: Topology, schedule: str = "1f1b",
                 autocast_dtype: torch.dtype | None = None):
        self.stage, self.topology, self.role = stage, topology, topology.role
        self.schedule = schedule
        self.autocast_dtype = autocast_dtype
        p = next(stage.parameters())
        self.device, self.act_dtype = p.device, p.dtype
        self.wire_dtype = wire_dtype(self.act_dtype, autocast_dtype)
        self.links = {side: topology.link_group(side) for side in ("prev", "next")}
        # The TP group's all-gather lays the chunks out in group-rank order, which torch makes the
        # ascending order of the global ranks; chunk r belongs to TP rank r, the r-th device of the
        # stage as the plan lists it (devices[0], the leader, may be any of them). Where the two
        # orders differ, row r of the gathered (t, c) chunks is taken from this index.
        here = self.role.stage_ranks
        self.gather_order = (None if list(here) == sorted(here)
                             else torch.tensor([sorted(here).index(r) for r in here], device=self.device))
        self.before_exchange: Callable[[], None] | None = None
        self.before_run: Callable[[], None] | None = None
        self.after_run: Callable[[], None] | None = None

    # ---- communication ------------------------------------------------------------------
    def _scatter(self, side: str) -> bool:
        return self.role.scatter_gather_prev if side == "prev" else self.role.scatter_gather_next

    def exchange(self, ex: Exchange, payload: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Run one exchange: send ``payload`` (equal on every TP rank of this stage) and/or receive a
        tensor of ``shape``; returns the received tensor (wire dtype, on every TP rank) or None."""
        role, tp_group, wire = self.role, self.topology.tp_group, self.wire_dtype
        link = self.links[ex.side]
        n = math.prod(shape)
        ops, got = [], None
        if self._scatter(ex.side):
            peer, group = link
            c = -(-n // role.tp)  # ceil(n / t) elements per TP rank
            if ex.send is not None:
                flat = payload.detach().reshape(-1)
                mine = flat[role.tp_rank * c:(role.tp_rank + 1) * c]
                piece = torch.zeros(c, dtype=wire, device=self.device)
                piece[:mine.numel()] = mine
                ops.append(dist.P2POp(dist.isend, piece, peer, group=group))
            if ex.recv is not None:
                got = torch.empty(c, dtype=wire, device=self.device)
                ops.append(dist.P2POp(dist.irecv, got, peer, group=group))
            _batch(ops)
            if got is None:
                return None
            full = torch.empty(c * role.tp, dtype=wire, device=self.device)
            all_gather_single(full, got, group=tp_group)
            if self.gather_order is not None:  # group-rank order -> TP-rank order (see __init__)
                full = full.view(role.tp, c).index_select(0, self.gather_order).reshape(-1)
            return full[:n].view(shape)
        if link is not None:  # a leader
            peer, group = link
            if ex.send is not None:
                ops.append(dist.P2POp(dist.isend, payload.detach().to(wire).reshape(-1).contiguous(), peer, group=group))
            if ex.recv is not None:
                got = torch.empty(shape, dtype=wire, device=self.device)
                ops.append(dist.P2POp(dist.irecv, got, peer, group=group))
            _batch(ops)
        if ex.recv is None:
            return None
        if got is None:
            got = torch.empty(shape, dtype=wire, device=self.device)
        if role.tp > 1:
            dist.broadcast(got, src=self.topology.to_global(role.leader), group=tp_group)
        return got

    def _communicate(self, point: list[Exchange], pending: dict[Msg, torch.Tensor], received: dict[Msg, torch.Tensor],
                     shape_of: Callable[[int], tuple[int, ...]], training: bool) -> None:
        for ex in point:
            if training and self.before_exchange is not None:
                self.before_exchange()
            payload = pending.pop(ex.send) if ex.send is not None else None
            got = self.exchange(ex, payload, shape_of(ex.recv[1] if ex.recv is not None else ex.send[1]))
            if ex.recv is not None:
                received[ex.recv] = got

    def _forward(self, x: torch.Tensor, shared_casts: bool = False) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None, cache_enabled=shared_casts):
            return self.stage(x)

    def _shares_casts(self) -> bool:
        """Mixed precision without recomputation: the micro-batches of a step, all but the last, share
        one autocast cast of each weight (see :meth:`run`); with recomputation a micro-batch stores
        no casts (the recomputed layer casts again in its backward), so nothing is shared."""
        return self.autocast_dtype is not None and not getattr(self.stage, "recompute", False)

    def _step_region(self):
        """An autocast region around the whole step, in the current autocast state (so that the loss
        and the backward run exactly as without it), whose only effect is to keep autocast's weight
        cache alive across the micro-batches' own regions (torch clears it when the outermost
        region exits)."""
        if not self._shares_casts():
            return contextlib.nullcontext()
        dev = self.device.type
        return torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), enabled=torch.is_autocast_enabled(dev),
                              cache_enabled=True)

    # ---- the step -----------------------------------------------------------------------
    def run(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float,
            before_last_backward: Callable[[], None] | None = None) -> torch.Tensor:
        """Run the schedule on this pipeline's batch (B_i, S) of tokens and targets.

        ``before_last_backward`` is called right before the last micro-batch's backward (the
        gradient synchroniser arms its hooks there, to overlap communication with it).

        Returns the pipeline's summed scaled loss (a detached float64 scalar on this rank's device,
        no host synchronisation) on last-stage ranks and 0 elsewhere; see :func:`global_loss` for
        the value on every rank.

        Mixed precision (autocast) without recomputation: every linear saves the bf16 cast of its
        weight for its backward, so with a fresh cast per micro-batch each micro-batch in flight
        would keep its own copy of the stage's weights (8 micro-batches: 8 bf16 copies). Instead the
        forwards of micro-batches 0..n-2 share one cached cast per weight (autocast's weight cache,
        kept alive by :meth:`_step_region`) and the last micro-batch casts afresh, its forward
        after the cache was cleared: at most two copies exist (``planner/cost/model.py``
        :func:`autocast_weight_bytes`). The last micro-batch must not use the shared cast: that
        node, created by the first forward, has the lowest sequence number in its graph, so autograd
        would run it, and accumulate the weight's gradient, only at the end of the last backward,
        and no gradient would be final after its block's backward (the gradient sync starts there).
        """
        check_token_ids(tokens, targets, self.stage.config.vocab_size, self.role.pipeline)
        if self.before_run is not None:
            self.before_run()
        with self._step_region():
            try:
                return self._run(tokens, targets, loss_scale, before_last_backward)
            finally:
                if self._shares_casts():
                    torch.clear_autocast_cache()
                if self.after_run is not None:
                    self.after_run()

    def _run(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float,
             before_last_backward: Callable[[], None] | None) -> torch.Tensor:
        role, stage = self.role, self.stage
        mb = role.micro_batch_size
        if tokens.shape[0] != role.batch_size:
            raise ValueError(f"pipeline {role.pipeline} expects {role.batch_size} samples, got {tokens.shape[0]}")
        tok_mb, tgt_mb = tokens.split(mb), targets.split(mb)
        act_shape = (mb, tokens.shape[1], stage.config.hidden_size)
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        pending: dict[Msg, torch.Tensor] = {}
        received: dict[Msg, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        ops_of = lambda s: schedule_ops(self.schedule, role.num_stages, s, role.num_micro_batches)  # noqa: E731
        ops = ops_of(role.stage)
        points = exchange_points(ops_of, role.num_stages, role.stage)
        for n, (kind, i) in enumerate(ops):
            self._communicate(points[n], pending, received, lambda _i: act_shape, True)
            if kind == "F":
                if role.is_first:
                    x = tok_mb[i].to(self.device)
                else:
                    x = received.pop(("act", i)).to(self.act_dtype).requires_grad_(True)
                    inputs[i] = x
                last_mb = i == role.num_micro_batches - 1
                if last_mb and self._shares_casts():
                    torch.clear_autocast_cache()  # earlier graphs keep the shared casts they saved
                out = self._forward(x, shared_casts=self._shares_casts() and not last_mb)
                if role.is_last:
                    out = stage.loss(out, tgt_mb[i].to(self.device)) * loss_scale
                    total += out.detach().to(torch.float64)
                else:
                    pending[("act", i)] = out.detach()
                outputs[i] = out
            else:
                out = outputs.pop(i)
                if n == len(ops) - 1 and before_last_backward is not None:
                    before_last_backward()
                if role.is_last:
                    out.backward()
                else:
                    torch.autograd.backward(out, received.pop(("grad", i)).to(out.dtype))
                if not role.is_first:
                    pending[("grad", i)] = inputs.pop(i).grad
        self._communicate(points[len(ops)], pending, received, lambda _i: act_shape, True)
        return total

    @torch.no_grad()
    def forward_only(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward of this pipeline's (n, S) batch in micro-batches of the plan's size, the last one
        possibly smaller (evaluation batches need not divide by it); no backward, no gradients.

        Every rank of the pipeline holds the same n samples, so all stages cut the same chunks and
        exchange them in the same order (:func:`exchange_points` over :func:`forward_ops`). Returns
        sum over chunks of (chunk mean loss * chunk size), float64 on this rank's device, on
        last-stage ranks and 0 elsewhere.
        """
        role = self.role
        check_token_ids(tokens, targets, self.stage.config.vocab_size, role.pipeline)
        if self.before_run is not None:
            self.before_run()
        mb = role.micro_batch_size
        starts = list(range(0, tokens.shape[0], mb))
        sizes = [min(mb, tokens.shape[0] - s) for s in starts]
        shape_of = lambda i: (sizes[i], tokens.shape[1], self.stage.config.hidden_size)  # noqa: E731
        ops = forward_ops(len(starts))
        points = exchange_points(lambda _s: ops, role.num_stages, role.stage)
        pending: dict[Msg, torch.Tensor] = {}
        received: dict[Msg, torch.Tensor] = {}
        weighted = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, start in enumerate(starts):
            self._communicate(points[i], pending, received, shape_of, False)
            x = tokens[start:start + mb].to(self.device) if role.is_first else received.pop(("act", i)).to(self.act_dtype)
            out = self._forward(x)
            if role.is_last:
                weighted += self.stage.loss(out, targets[start:start + mb].to(self.device)).to(torch.float64) * sizes[i]
            else:
                pending[("act", i)] = out
        self._communicate(points[len(starts)], pending, received, shape_of, False)
        if self.after_run is not None:
            self.after_run()
        return weighted


def wire_dtype(param_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype tensors cross the wire in: the autocast dtype when it is narrower than the
    parameters (mixed precision: bf16 for ``bf16-mixed``), else the parameter dtype."""
    if autocast_dtype is not None and torch.finfo(autocast_dtype).bits < torch.finfo(param_dtype).bits:
        return autocast_dtype
    return param_dtype


def _batch(ops: list) -> None:
    """One fused p2p call (never un-fused isend/irecv: see the module doc), waited for at once."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def global_loss(pipeline_loss: torch.Tensor, role: Role, device: torch.device | str = "cpu",
                group: dist.ProcessGroup | None = None) -> float:
    """The global-mean loss on EVERY rank of the plan: one all-reduce(SUM) in which only the
    last-stage leader of each pipeline contributes its (already batch-weighted) pipeline loss.

    Collective over ``group``, the plan's ranks (``Topology.plan_group``; None = the default group,
    right when the plan runs on all of it): every rank of it must call it. ``device`` is where the
    reduced scalar lives (a CUDA device under NCCL). One host synchronisation per step (the float).
    """
    mine = role.is_last and role.is_leader
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    if mine:
        buf += pipeline_loss.detach().to(device=device, dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return float(buf.item())
