"""Runtime: a Plan and a global rank -> this rank's part of the training step. Consumes only a Plan.

- :mod:`.topology`         role of a rank, gradient segments, every process group (created once, in order)
- :mod:`.parallelize`      the plain Llama -> this rank's stage (layers + TP shards); :mod:`.tensor_parallel`
- :mod:`.schedule`         GPipe / 1F1B op lists and the executor that walks them; :mod:`.forward_only`
                           (evaluation, prediction)
- :mod:`.grad_sync`        asymmetric gradient sum across pipelines; :mod:`.zero`, :mod:`.zero3` for ZeRO;
                           :mod:`.reducers` (one interface, the flavour chosen once)
- :mod:`.step`             the step's phases: open window, micro-step, close window, clip, update
- :mod:`.checkpoint`       plan-independent sharded checkpoints (torch.distributed.checkpoint);
                           :mod:`.checkpoint_layout`, :mod:`.checkpoint_io`
- :mod:`.failure`          heartbeats that name a failed rank; :mod:`.host` (this machine's load, its processes, forking)
- :mod:`.engine`           all of the above behind one object

The names below are the runtime's public API: what a trainer (the Lightning layer,
:mod:`lightning_hexiscale.lightning`) may use. It drives a step only through
the phases of :attr:`PipelineEngine.step` (``open_window``, ``micro_step``, ``close_window``, ``clip``,
``update``) and the engine's methods (``wrap_optimizer``, ``eval_loss``, ``predict_logits``, ...), never
through the engine's parts (its executor, gradient reducer, topology); ``tests/test_layers.py``
enforces both. The names are
resolved on first use, so importing the package does not import torch.
"""

from lightning_hexiscale._lazy import lazy_exports

_CHECKPOINT = "lightning_hexiscale.runtime.checkpoint"
_FAILURE = "lightning_hexiscale.runtime.failure"

__all__ = ["PipelineEngine", "Topology",
           "Checkpointer", "read_checkpoint_meta", "load_checkpoint_model", "load_checkpoint_state_dict",
           "load_checkpoint_optimizer",
           "remove_checkpoint", "check_checkpoint_complete", "check_checkpoint_model", "CHECKPOINT_COMPLETE",
           "FailureWatch", "is_peer_failure", "EXIT_RANK_FAILED", "host_slowdown",
           "collect_before_fork", "destroy_groups_at_exit", "NONFINITE_POLICIES"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "PipelineEngine": "lightning_hexiscale.runtime.engine",
    "Topology": "lightning_hexiscale.runtime.topology",
    # sharded checkpoints (lightning_hexiscale.runtime.checkpoint), named for what they act on
    "Checkpointer": _CHECKPOINT,
    "read_checkpoint_meta": f"{_CHECKPOINT}:read_meta",
    "load_checkpoint_model": f"{_CHECKPOINT}:load_model",
    "load_checkpoint_state_dict": f"{_CHECKPOINT}:load_llama_state_dict",
    "load_checkpoint_optimizer": f"{_CHECKPOINT}:load_optimizer",
    "remove_checkpoint": f"{_CHECKPOINT}:remove",
    "check_checkpoint_complete": f"{_CHECKPOINT}:check_complete",
    "check_checkpoint_model": f"{_CHECKPOINT}:check_model",
    "CHECKPOINT_COMPLETE": f"{_CHECKPOINT}:COMPLETE",
    # failures and the host's load
    "FailureWatch": _FAILURE,
    "is_peer_failure": _FAILURE,
    "EXIT_RANK_FAILED": _FAILURE,
    "host_slowdown": "lightning_hexiscale.runtime.host",
    "collect_before_fork": "lightning_hexiscale.runtime.host",
    "destroy_groups_at_exit": "lightning_hexiscale.runtime.host",
    "NONFINITE_POLICIES": "lightning_hexiscale.runtime.step",  # fit_step(nonfinite=...), HexiScaleStrategy(nonfinite=...)
})
