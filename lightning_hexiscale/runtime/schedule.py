"""Pipeline schedules as pure op lists, and the executor that walks them on one rank.

A schedule is, per (num_stages S, stage s, micro-batches m), the list of ops ``("F", i)`` (forward
of micro-batch i) and ``("B", i)`` (its backward) that stage s runs, in order:

- GPipe: all m forwards, then all m backwards (peak: m micro-batches of activations).
- 1F1B (PipeDream-flush): w = min(S - s - 1, m) warm-up forwards, then m - w pairs
  (forward i + w, backward i), then w cool-down backwards (peak: w + 1 micro-batches in flight).

Both consume and produce micro-batches in increasing order on every stage, so a stage's i-th
receive always matches its neighbour's i-th send.

Communication of the executor (paper §3.2):

- Default path: the stage leader (TP rank 0) ``irecv``s the activation from the previous stage's
  leader and ``broadcast``s it within its TP group; after computing, the leader ``isend``s its output
  to the next stage's leader. Backward mirrors this for activation gradients.
- Scatter/gather path, when both adjacent stages have the same TP degree t > 1: the tensor (equal on
  all ranks of the sending TP group) is flattened and cut into t chunks of ceil(n/t) elements; TP
  rank r sends chunk r to TP rank r of the other stage, which all-gathers the chunks in its TP
  group. Each link then carries 1/t of the bytes.

Sends are non-blocking (``isend``; blocking ``send`` waits for the matching receive even for a few
bytes on gloo); the send handles and buffers are kept until the end of the step and waited then.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_hexiscale.errors import PlanError
from lightning_hexiscale.runtime.parallelize import StageModule
from lightning_hexiscale.runtime.topology import Role, Topology

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


def _tag(micro_batch: int, backward: bool) -> int:
    """Distinct p2p tags for activations (even) and activation gradients (odd) of a micro-batch."""
    return 2 * micro_batch + int(backward)


class PipelineExecutor:
    """Runs one pipeline step (all micro-batches, forward and backward) on this rank.

    Gradients accumulate into the stage parameters' ``.grad`` over micro-batches. Each micro-batch
    loss is the mean token cross-entropy times ``loss_scale`` (the engine passes
    micro_batch_size / global_batch), so summing over micro-batches and pipelines gives the
    global-mean loss and gradient.
    """

    def __init__(self, stage: StageModule, topology: Topology, schedule: str = "1f1b",
                 autocast_dtype: torch.dtype | None = None):
        self.stage, self.topology, self.role = stage, topology, topology.role
        self.schedule = schedule
        self.autocast_dtype = autocast_dtype
        p = next(stage.parameters())
        self.device, self.act_dtype = p.device, p.dtype
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    # ---- communication ------------------------------------------------------------------
    def _recv(self, shape: tuple[int, ...], backward: bool, micro_batch: int) -> torch.Tensor:
        role, tp_group = self.role, self.topology.tp_group
        peers = role.next_stage_ranks if backward else role.prev_stage_ranks
        scatter = role.scatter_gather_next if backward else role.scatter_gather_prev
        tag = _tag(micro_batch, backward)
        if scatter:
            n = math.prod(shape)
            chunk = -(-n // role.tp)
            piece = torch.empty(chunk, dtype=self.act_dtype, device=self.device)
            dist.irecv(piece, src=peers[role.tp_rank], tag=tag).wait()
            full = torch.empty(chunk * role.tp, dtype=self.act_dtype, device=self.device)
            dist.all_gather_into_tensor(full, piece, group=tp_group)
            return full[:n].view(shape)
        buf = torch.empty(shape, dtype=self.act_dtype, device=self.device)
        if role.is_leader:
            dist.irecv(buf, src=peers[0], tag=tag).wait()
        if role.tp > 1:
            dist.broadcast(buf, src=role.leader, group=tp_group)
        return buf

    def _send(self, tensor: torch.Tensor, backward: bool, micro_batch: int) -> None:
        role = self.role
        peers = role.prev_stage_ranks if backward else role.next_stage_ranks
        scatter = role.scatter_gather_prev if backward else role.scatter_gather_next
        tag = _tag(micro_batch, backward)
        flat = tensor.detach().to(self.act_dtype).reshape(-1)
        if scatter:
            chunk = -(-flat.numel() // role.tp)
            start = role.tp_rank * chunk
            piece = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
            mine = flat[start:start + chunk]
            piece[:mine.numel()] = mine
            self._sends.append((dist.isend(piece, dst=peers[role.tp_rank], tag=tag), piece))
        elif role.is_leader:
            buf = flat.contiguous()
            self._sends.append((dist.isend(buf, dst=peers[0], tag=tag), buf))

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    # ---- the step -----------------------------------------------------------------------
    def run(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float,
            before_last_backward: Callable[[], None] | None = None) -> torch.Tensor:
        """Run the schedule on this pipeline's batch (B_i, S) of tokens and targets.

        ``before_last_backward`` is called right before the last micro-batch's backward (the
        gradient synchroniser arms its hooks there, to overlap communication with it).

        Returns the pipeline's summed scaled loss (a detached scalar) on last-stage ranks and 0
        elsewhere; see :func:`global_loss` for the value on every rank.
        """
        role, stage = self.role, self.stage
        mb = role.micro_batch_size
        if tokens.shape[0] != role.batch_size:
            raise ValueError(f"pipeline {role.pipeline} expects {role.batch_size} samples, got {tokens.shape[0]}")
        tok_mb, tgt_mb = tokens.split(mb), targets.split(mb)
        act_shape = (mb, tokens.shape[1], stage.config.hidden_size)
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float64)
        ops = schedule_ops(self.schedule, role.num_stages, role.stage, role.num_micro_batches)
        for n, (kind, i) in enumerate(ops):
            if kind == "F":
                if role.is_first:
                    x = tok_mb[i].to(self.device)
                else:
                    x = self._recv(act_shape, backward=False, micro_batch=i).requires_grad_(True)
                    inputs[i] = x
                with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                                    enabled=self.autocast_dtype is not None):
                    out = stage(x)
                if role.is_last:
                    out = stage.loss(out, tgt_mb[i].to(self.device)) * loss_scale
                    total += out.detach().double().cpu()
                else:
                    self._send(out, backward=False, micro_batch=i)
                outputs[i] = out
            else:
                out = outputs.pop(i)
                if n == len(ops) - 1 and before_last_backward is not None:
                    before_last_backward()
                if role.is_last:
                    out.backward()
                else:
                    grad = self._recv(act_shape, backward=True, micro_batch=i)
                    torch.autograd.backward(out, grad.to(out.dtype))
                if not role.is_first:
                    self._send(inputs.pop(i).grad, backward=True, micro_batch=i)
        self._wait_sends()
        return total


    @torch.no_grad()
    def forward_only(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward of this pipeline's (n, S) batch in micro-batches of the plan's size, the last one
        possibly smaller (evaluation batches need not divide by it); no backward, no gradients.

        Every rank of the pipeline holds the same n samples, so all stages cut the same chunks and
        the i-th receive matches the i-th send; forward tags only, so a later training step's tags
        are untouched. Returns sum over chunks of (chunk mean loss * chunk size), float64, on
        last-stage ranks and 0 elsewhere.
        """
        role, stage = self.role, self.stage
        mb = role.micro_batch_size
        weighted = torch.zeros((), dtype=torch.float64)
        for i, start in enumerate(range(0, tokens.shape[0], mb)):
            tok = tokens[start:start + mb].to(self.device)
            if role.is_first:
                x = tok
            else:
                x = self._recv((tok.shape[0], tok.shape[1], stage.config.hidden_size), backward=False, micro_batch=i)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                                enabled=self.autocast_dtype is not None):
                out = stage(x)
            if role.is_last:
                weighted += stage.loss(out, targets[start:start + mb].to(self.device)).double().cpu() * tok.shape[0]
            else:
                self._send(out, backward=False, micro_batch=i)
        self._wait_sends()
        return weighted


def global_loss(pipeline_loss: torch.Tensor, role: Role, device: torch.device | str = "cpu") -> float:
    """The global-mean loss on EVERY rank: one world all-reduce(SUM) in which only the last-stage
    leader of each pipeline contributes its (already batch-weighted) pipeline loss.

    Collective over the default group: every rank must call it. ``device`` is where the reduced
    scalar lives (a CUDA device under NCCL).
    """
    mine = role.is_last and role.is_leader
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    if mine:
        buf += pipeline_loss.detach().to(device=device, dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return float(buf.item())
