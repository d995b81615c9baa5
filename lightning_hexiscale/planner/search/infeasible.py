"""Why no plan fits in memory: the message of :class:`~lightning_hexiscale.errors.InfeasiblePlan`.

The search gives every device work, so nothing fits when either

1. the training state does not fit the cluster at all: parameters, gradients and optimizer states,
   ``N x (2P + K)`` bytes for N parameters, P bytes per stored parameter and K optimizer bytes
   (fully sharded, ZeRO-3), exceed the memory of all devices less their reserves; or
2. some device cannot hold even the smallest stage any plan could give it: one layer of a middle
   stage at the largest TP degree t (at most the KV heads and the devices), its states sharded
   ZeRO-3 over as many pipelines as there are devices, one sequence in flight, recomputation on.
   Its peak (:func:`~lightning_hexiscale.planner.cost.memory.stage_memory_at`) is the sum of three terms:
   ``reserve_bytes`` + the communicator buffers (one communicator, ``comm_buffer_bytes``, on CUDA
   only: gloo on CPU keeps none) + that layer's states and activations. The message names the
   first of them that no longer fits the device (its capacity less ``memory_headroom``).

Otherwise the activations of the global batch are what is missing. The message says which case it
is, with the numbers, and the fix. Before any of that, :func:`capacity_message` says when the
cluster has more devices than the model and batch can give work to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hexiscale.config.recipe import device_kind
from lightning_hexiscale.config.units import format_bytes
from lightning_hexiscale.planner.cost import model as cm
from lightning_hexiscale.planner.cost.memory import stage_memory_at, usable_memory

if TYPE_CHECKING:
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.planner.cost.workload import Workload


def _mib(n: float) -> str:
    """Bytes in MiB below 64 GiB (a 1045 MiB device is not "1.0 GiB" when 21 MiB decide), else as usual."""
    return f"{n / 2**20:,.1f} MiB" if n < 64 * 2**30 else format_bytes(n)


def format_count(n: float) -> str:
    """A parameter count for people: 3,149,824 -> "3.1M", 6.74e9 -> "6.74B", 812 -> "812"."""
    for scale, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{suffix}"
    return f"{n:.0f}"


def smallest_stage_terms(workload: Workload, num_devices: int) -> dict[str, float]:
    """Bytes of the smallest stage any plan can give a device (module doc, case 2), by term:
    ``reserve``, ``buffers`` (communicator buffers; 0 on CPU), ``layer`` (one layer's states and
    activations), and their sum ``total``."""
    model = workload.model
    tp = max(1, min(model.num_kv_heads, num_devices))
    total = stage_memory_at(workload, "zero3", max(1, num_devices), True, False, False, 1, tp, 1,
                            communicators=1).peak(1)
    buffers = cm.comm_buffer_bytes(1, workload.comm_buffer_bytes) if workload.device == "cuda" else 0.0
    return {"reserve": workload.reserve_bytes, "buffers": buffers,
            "layer": total - workload.reserve_bytes - buffers, "total": total, "tp": tp}


def memory_message(cluster: Cluster, workload: Workload, global_batch: int, recompute: bool | None = None) -> str:
    """What is missing when no plan fits in memory (module doc), with the numbers and a fix;
    ``recompute``: whether the plans tried recomputed (True: under ``auto`` too, whose message is
    that of its run with recomputation), so that the fix offers it only where it was not tried."""
    m = workload.model
    per_param = 2 * workload.param_bytes + workload.optimizer_bytes_per_param  # parameter, gradient, optimizer
    need = m.total_params * per_param
    usable = sum(max(0.0, usable_memory(workload, d.memory_bytes) - workload.reserve_bytes) for d in cluster.devices)
    head = f"no plan fits in memory: {m.name} ({format_count(m.total_params)} parameters)"
    totals = (f"needs {format_bytes(need)} for weights, gradients and optimizer states ({per_param:g} bytes per "
              f"parameter, even fully sharded with ZeRO-3) plus activations for global batch {global_batch}; cluster "
              f"{cluster.name} has {format_bytes(cluster.total_memory)} ({format_bytes(usable)} after the "
              f"{format_bytes(workload.reserve_bytes)} reserve per device"
              + (f" and train.memory_headroom={workload.memory_headroom:g}" if workload.memory_headroom else "") + ")")
    if need > usable:
        if need <= cluster.total_memory:
            # the devices hold the states; what the reserve and the headroom keep back does not leave room
            return (f"{head} {totals}: the reserve and the headroom leave too little of the devices. Fix: a smaller "
                    f"train.memory_headroom (now {workload.memory_headroom:g}) or Workload.reserve_bytes (now "
                    f"{format_bytes(workload.reserve_bytes)}), or more or larger GPUs")
        return f"{head} {totals}. Fix: use more or larger GPUs, or a smaller model"
    short = _devices_without_room(cluster, workload)
    if short:
        return f"{head}: {short}"
    also = "" if recompute else " train.recompute=true (or auto),"
    return (f"{head} {totals}: the states fit, the activations do not{' even with recomputation' if recompute else ''}. "
            f"Fix: a smaller train.micro_batch_size or train.global_batch,{also} or more or larger GPUs")


def _devices_without_room(cluster: Cluster, workload: Workload) -> str | None:
    """Case 2 of the module doc: the first device type whose devices cannot hold the smallest stage,
    said with its terms and the one that does not fit, or None."""
    terms = smallest_stage_terms(workload, cluster.num_devices)
    for gpu_type in sorted({d.gpu_type for d in cluster.devices}):
        devs = [d for d in cluster.devices if d.gpu_type == gpu_type]
        capacity = min(d.memory_bytes for d in devs)
        room = usable_memory(workload, capacity)
        if terms["total"] <= room:
            continue
        where = (f"the {len(devs)} {gpu_type} device(s) ({_mib(capacity)} each"
                 + (f", {format_bytes(room)} usable with train.memory_headroom={workload.memory_headroom:g}"
                    if workload.memory_headroom else "") + ")")
        parts = (f"the {_mib(terms['reserve'])} reserve (Workload.reserve_bytes) + "
                 + (f"{_mib(terms['buffers'])} of communicator buffers (Workload.comm_buffer_bytes, "
                    f"priced because the workload runs on {workload.device}: NCCL) + " if terms["buffers"] else "")
                 + f"{_mib(terms['layer'])} for one layer's states and activations at TP {terms['tp']} "
                 f"= {_mib(terms['total'])}")
        if terms["reserve"] > room:
            culprit = (f"the reserve alone does not fit. Fix: give {gpu_type} its real memory in the cluster file, "
                       "or a smaller reserve")
        elif terms["reserve"] + terms["buffers"] > room:
            culprit = "the communicator buffers do not fit beside the reserve. Fix: " + (
                f"{gpu_type} is an emulated CPU device, which keeps no NCCL buffers: price the run with "
                "Workload.for_cluster (device='cpu')" if device_kind([gpu_type]) == "cpu" else
                "use devices with more memory, or leave these out of the cluster")
        else:
            culprit = ("one layer does not fit beside them. Fix: use devices with more memory, a smaller model, "
                       "or leave these out of the cluster")
        return (f"every device gets work, but {where} cannot hold even the smallest stage: {parts}; {culprit}")
    return None


def most_busy(workload: Workload, global_batch: int) -> int:
    """How many devices any plan can give work to: G x L x K (:func:`capacity_message`)."""
    m = workload.model
    return global_batch * m.num_layers * m.num_kv_heads


def capacity_message(cluster: Cluster, workload: Workload, global_batch: int) -> str | None:
    """What is missing when the cluster has more devices than the model and batch can occupy, or None.

    The search gives work to every device. A pipeline takes at least one sequence of the global
    batch G, a stage at least one of the L layers, and a TP rank at least one of the K key/value
    heads, so at most G * L * K devices can be busy (e.g. 1 x 1 x 1 = 1 for a one-layer model with
    one KV head at batch 1: a second device has nothing to do). Found by the property tests, where
    such draws were reported as "no plan fits in memory". Only the search that gives every device
    work (``planner.use_all_devices=true``) raises it; otherwise the plan runs on at most that many
    devices and names the others idle (``entry._core``).
    """
    m = workload.model
    most = most_busy(workload, global_batch)
    if cluster.num_devices <= most:
        return None
    return (f"no plan gives every device work: cluster {cluster.name} has {cluster.num_devices} devices, but "
            f"{m.name} needs at most {most} (global batch {global_batch} sequences x {m.num_layers} layers x "
            f"{m.num_kv_heads} KV heads: a pipeline needs a sequence, a stage a layer, a TP rank a KV head). "
            f"Fix: a larger train.global_batch, a deeper model, or a cluster (or plan file) with at most {most} devices")
