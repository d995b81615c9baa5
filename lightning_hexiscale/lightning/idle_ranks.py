"""Idle devices at run time: a plan that leaves devices idle, run by a job launched on all of them.

A job launched with ``plan.world_size`` processes maps rank r to ``plan.device_order[r]``, as every
plan does. A job launched on every device of ``plan.launch_order`` (used and idle, sorted) maps
launch rank r to ``launch_order[r]``; the ranks whose device the plan leaves idle take no part.
Any other world size is a :class:`ConfigError` before training (the strategy's world check).

**What an idle rank does: it ends its Trainer call at setup.** ``fit`` (``validate``, ...) returns
without training, the process exits 0, and it stays out of every later call of the same script.
Before that it prints one line saying why (the planner's reason from the plan's ``meta``, else
"the plan gives device d no work"). Why leave rather than stay: an idle rank holds nothing the job
needs (no layer, no optimizer state, no data), so leaving frees its device and cannot hang anything;
a process that stays would have to be woken at the end and could be forgotten by its launcher.

Some idle processes must stay until the job ends (:func:`stay_reason`: the one hosting the
rendezvous store, a torchrun machine's local rank 0 where no rank trains), and no training group
includes an idle rank (:meth:`IdleRankMethods._switch_if_idle`: the training ranks form a compact
default group). Who stays and why, and how the switch works: ``docs/concepts/processes.md``, "Idle ranks".
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment

from lightning_hexiscale.errors import ConfigError, RankFailure
from lightning_hexiscale.lightning import internals
from lightning_hexiscale.lightning.launch import job_watch
from lightning_hexiscale.lightning.launch.guard import IdleRankExit, portable_error, mark_agreed
from lightning_hexiscale.planner import Plan, RankLayout

REASONS_KEY = "idle_reasons"
"""``plan.meta[REASONS_KEY]``: why each idle device is idle, ``{device id: text}`` (the planner's)."""
REASON_KEY = "idle_reason"
"""``plan.meta[REASON_KEY]``: why the plan leaves its devices idle, one text for all of them."""
ACTIVE_PREFIX = "hexiscale/active"
END_PREFIX = "hexiscale/idle"
POLL_S = 0.2


@dataclass(frozen=True)
class IdleLayout:
    """A job launched on every device of a plan's ``launch_order``, seen from one launch rank: the
    plan's rank layout on that world (its rank map says which launch ranks train) and this rank."""

    ranks: RankLayout
    """The plan's rank layout on the launched world: training rank i is plan rank i, on launch rank
    ``ranks.ranks[i]``; ``ranks.idle`` are the launch ranks of idle devices."""
    launch_rank: int

    @property
    def launch_order(self) -> tuple[int, ...]:
        """Cluster device of every launch rank (index = the rank the launcher gave the process)."""
        return self.ranks.devices

    @property
    def idle_devices(self) -> tuple[int, ...]:
        return tuple(sorted(self.ranks.plan.idle_devices))

    @property
    def active_ranks(self) -> tuple[int, ...]:
        """Launch ranks that train, ascending; the i-th of them is training rank i."""
        return self.ranks.ranks

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        return self.ranks.idle

    @property
    def device(self) -> int:
        return self.launch_order[self.launch_rank]

    @property
    def idle(self) -> bool:
        return self.launch_rank in self.ranks.idle

    @property
    def world_size(self) -> int:
        """Processes that train (= ``plan.world_size``)."""
        return len(self.active_ranks)

    @property
    def rank(self) -> int:
        """Training rank (index among the active ranks); an idle rank gets world_size + its index
        among the idle ones, so that no idle rank is rank zero."""
        if self.idle:
            return self.world_size + self.idle_ranks.index(self.launch_rank)
        return self.ranks.plan_rank(self.launch_rank)


def layout_for(plan: Plan, world_size: int, launch_rank: int) -> IdleLayout | None:
    """The layout of a job of ``world_size`` processes launched on every device of the plan's
    ``launch_order``; None when it runs the used devices only (``world_size == plan.world_size``)
    or when the world size fits neither (the strategy's world check says so)."""
    if not plan.idle_devices or world_size == plan.world_size or world_size != len(plan.launch_order):
        return None
    return IdleLayout(RankLayout.of(plan, world_size), launch_rank)


def accepted_world_sizes(plan: Plan) -> tuple[int, ...]:
    """Process counts a plan runs with: its used devices, or every device of its launch order."""
    return (plan.world_size,) if not plan.idle_devices else (plan.world_size, len(plan.launch_order))


def hosts_store(launch_rank: int) -> bool:
    """Whether this process hosts the rendezvous store: global rank 0, unless torchrun's agent
    hosts it (``TORCHELASTIC_USE_AGENT_STORE``, the rule of torch's env:// rendezvous)."""
    return launch_rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def stay_reason(layout: IdleLayout, local_rank: int, local_world: int) -> str | None:
    """Why this idle process must stay until the job ends (module doc), or None when it may leave.
    ``local_rank`` / ``local_world``: its rank among its machine's processes and their number (the
    machine's launch ranks are contiguous, as torchrun numbers them)."""
    if hosts_store(layout.launch_rank):
        return "it hosts the job's rendezvous store"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") is not None  # torchrun sets it, True or False
    first = layout.launch_rank - local_rank
    if agent and local_rank == 0 and not set(range(first, first + local_world)) & set(layout.active_ranks):
        return "no rank of its machine trains, and torchrun's agent there must not finish before the job"
    return None


def idle_reason(plan: Plan, device: int) -> str:
    """Why ``device`` is idle: the plan's ``meta`` (per device, then one for all), else a plain fact."""
    per_device = plan.meta.get(REASONS_KEY) or {}
    text = per_device.get(device, per_device.get(str(device))) if isinstance(per_device, dict) else None
    text = text or plan.meta.get(REASON_KEY)
    return str(text).strip() if text else f"the plan gives device {device} no work"


def idle_line(plan: Plan, layout: IdleLayout, cluster=None, stays: str | None = None) -> str:
    """The one line an idle rank prints."""
    d = layout.device
    where = f"device {d}"
    if cluster is not None and d < cluster.num_devices:
        dev = cluster.devices[d]
        where += f": {dev.gpu_type} on machine {cluster.machines[dev.machine].name}"
    then = (f"it stays until the job ends, outside every process group, because {stays}" if stays
            else "it leaves now")
    return (f"hexiscale: rank {layout.launch_rank} ({where}) is idle: {idle_reason(plan, d)}; it takes no part in "
            f"training ({layout.world_size} of {len(layout.launch_order)} ranks train) and {then}")


class ActiveRanksEnvironment(ClusterEnvironment):
    """The launcher's cluster environment with the training rank and world size (local and node
    rank, addresses and the rest stay the launcher's)."""

    def __init__(self, inner: ClusterEnvironment, rank: int, world_size: int):
        self.inner, self._rank, self._world = inner, rank, world_size

    @property
    def creates_processes_externally(self) -> bool:
        return self.inner.creates_processes_externally

    @property
    def main_address(self) -> str:
        return self.inner.main_address

    @property
    def main_port(self) -> int:
        return self.inner.main_port

    @staticmethod
    def detect() -> bool:
        return False  # never chosen by Lightning; the strategy installs it

    def world_size(self) -> int:
        return self._world

    def set_world_size(self, size: int) -> None:
        pass  # the training world is fixed by the plan (Lightning sets the launch size again per call)

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.inner.local_rank()

    def node_rank(self) -> int:
        return self.inner.node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        self.inner.validate_settings(num_devices, num_nodes)

    def teardown(self) -> None:
        self.inner.teardown()


class JobEnd:
    """Keys on the launch store through which the training ranks tell the idle rank that hosts the
    store how each Trainer call ended: ``<call>/failed`` (the first failure, a pickled exception)
    and ``<call>/ended`` (a counter of training ranks done). Writes are best effort."""

    def __init__(self, store, token: str, training_ranks: int):
        self._store = dist.PrefixStore(f"{END_PREFIX}/{token}", store)
        self.training_ranks = training_ranks
        self.call = 0
        self._published: set[tuple[int, str]] = set()

    def failed(self, exc: BaseException) -> None:
        if (self.call, "failed") in self._published:
            return
        self._published.add((self.call, "failed"))
        try:
            self._store.set(f"{self.call}/failed", pickle.dumps(portable_error(exc)))
        except Exception:  # noqa: BLE001 -- the store's host is gone: nobody is waiting
            pass

    def ended(self) -> None:
        if (self.call, "ended") in self._published:
            return
        self._published.add((self.call, "ended"))
        try:
            self._store.add(f"{self.call}/ended", 1)
        except Exception:  # noqa: BLE001
            pass

    def wait(self) -> BaseException | None:
        """Block until every training rank ended this call (None) or one failed (its exception)."""
        key = f"{self.call}/failed"
        while True:
            try:
                failed, ended = self._store.check([key]), self._store.add(f"{self.call}/ended", 0)
            except Exception as e:  # noqa: BLE001 -- the store's host ended (torchrun tears the job down)
                return RankFailure(f"the job's rendezvous store became unreachable ({type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
            if failed:
                try:
                    return pickle.loads(self._store.get(key))
                except Exception as e:  # noqa: BLE001 -- an exception class this process cannot rebuild
                    return RuntimeError(f"a training rank failed ({type(e).__name__} reading its error)")
            if ended >= self.training_ranks:
                return None
            time.sleep(POLL_S)


class IdleRankMethods:
    """The strategy's side (a mixin of HexiScaleStrategy): the switch at setup, leaving, and the
    end-of-call signals. Uses the strategy's ``plan``, ``cluster``, ``global_rank``, ``world_size``,
    ``broadcast``, ``barrier``, ``cluster_environment``, ``root_device`` and ``settings.timeout``."""

    _layout: IdleLayout | None = None
    """This process's view of an idle-device launch (set by the switch; kept for later calls)."""
    _job_end: JobEnd | None = None

    @property
    def idle(self) -> bool:
        """Whether this process runs an idle device of the plan (it trains in no call)."""
        return self._layout is not None and self._layout.idle

    def setup_distributed(self) -> None:
        """Lightning's process-group set-up, except on an idle rank after the switch (a later
        Trainer call of the same script), which belongs to no process group any more."""
        if not self.idle:
            super().setup_distributed()

    def _switch_if_idle(self) -> None:
        """Collective over the launcher's default group, once per job: when the job was launched on
        every device of the plan's launch order, the training ranks get a default group of their
        own (module doc) and idle ranks none; then an idle rank leaves (:meth:`_leave`)."""
        layout = layout_for(self.plan, self.world_size, self.global_rank)
        if layout is None:
            return
        token = self.broadcast(uuid.uuid4().hex[:12] if self.global_rank == 0 else None, 0)
        self._share_logger_versions()
        store = dist.distributed_c10d._get_default_store()
        backend = dist.get_backend()
        self.barrier("hexiscale-idle-switch")
        dist.destroy_process_group()
        self._layout = layout
        self._job_end = JobEnd(store, token, layout.world_size)
        self._launch_store = store  # keeps it (and, on its host, the server) alive
        self.cluster_environment = ActiveRanksEnvironment(self.cluster_environment, layout.rank, layout.world_size)
        _set_rank_zero(layout.rank)
        if layout.idle:
            self._leave()
        cuda = self.root_device.type == "cuda"
        dist.init_process_group(backend, store=dist.PrefixStore(f"{ACTIVE_PREFIX}/{token}", store), rank=layout.rank,
                                world_size=layout.world_size, timeout=self.settings.timeout,
                                device_id=self.root_device if cuda else None)

    def _share_logger_versions(self) -> None:
        """Global rank 0 created its loggers' experiments (a version directory) before the switch;
        training rank 0, which logs from now on, writes into the same ones."""
        trainer = self.lightning_module.trainer
        versions = self.broadcast(internals.logger_versions(trainer) if self.global_rank == 0 else None, 0)
        internals.adopt_logger_versions(trainer, versions)

    def _leave(self) -> None:
        """On an idle rank (every call): say why once, wait for the job when this process hosts the
        store, then end the Trainer call (:class:`IdleRankExit`)."""
        layout = self._layout
        stays = stay_reason(layout, self.local_rank, self.num_processes)
        if self._job_end.call == 0:
            print(idle_line(self.plan, layout, self.cluster, stays), flush=True)
        if stays:
            # the others train meanwhile: Ctrl-C lets them finish the step (job_watch's training phase)
            job_watch.set_phase("training")
            err = self._job_end.wait()
            if err is not None:
                raise mark_agreed(err, list(layout.active_ranks))
        raise IdleRankExit(f"rank {layout.launch_rank} is idle")

    def _next_call(self) -> None:
        """A later Trainer call of the same job (the same script on every rank): an idle rank
        leaves at once, the training ranks count the call."""
        if self._job_end is None:
            return
        self._job_end.call += 1
        if self.idle:
            self._leave()

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """An idle rank holds no part of the state: ``trainer.save_checkpoint`` after its (empty)
        call writes nothing there (the training ranks write the checkpoint)."""
        if not self.idle:
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def end_idle_call(self, trainer) -> None:
        """The launcher caught :class:`IdleRankExit`: end the Trainer call as one with nothing to do."""
        if trainer is not None:
            internals.end_without_training(trainer)

    def note_failure(self, exc: BaseException) -> None:
        """A training rank's Trainer call failed: tell the idle rank that waits (LaunchGuard.stop)."""
        if self._job_end is not None and not self.idle:
            self._job_end.failed(exc)

    def _call_ended(self) -> None:
        if self._job_end is not None and not self.idle:
            self._job_end.ended()


def _set_rank_zero(rank: int) -> None:
    """Lightning's rank-zero-only utilities follow the training rank (what DDPStrategy sets up)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    rank_zero_only.rank = utils_rank_zero_only.rank = rank


def world_error(plan: Plan, world: str, cluster_name: str | None) -> ConfigError:
    """The world size fits neither the plan's used devices nor its launch order."""
    where = f"cluster {cluster_name}, " if cluster_name else ""
    n = plan.world_size
    rule = f"the plan runs {n} processes, one per device ({where}devices {list(plan.device_order)})"
    fix = (f"start {n} processes: Trainer(accelerator='cpu', devices={n}) to emulate on CPU, or num_nodes x "
           f"devices = {n} under torchrun/SLURM")
    if plan.idle_devices:
        m = len(plan.launch_order)
        rule += (f", or {m}, one per device of its launch order (devices {list(plan.launch_order)}: "
                 f"{list(plan.idle_devices)} stay idle)")
        fix += f"; or launch {m} processes, one per device of the launch order (the idle ranks leave at setup)"
    return ConfigError("Trainer(num_nodes, devices)", world, rule, fix)
