"""Runtime: a Plan and a global rank -> this rank's part of the training step. Consumes only a Plan.

- :mod:`.topology`         role of a rank, gradient segments, every process group (created once, in order)
- :mod:`.parallelize`      the plain Llama -> this rank's stage (layers + TP shards); :mod:`.tensor_parallel`
- :mod:`.schedule`         GPipe / 1F1B op lists and the executor that walks them
- :mod:`.grad_sync`        asymmetric gradient sum across pipelines; :mod:`.zero`, :mod:`.zero3` for ZeRO
- :mod:`.checkpoint`       plan-independent sharded checkpoints (torch.distributed.checkpoint);
                           :mod:`.checkpoint_layout`, :mod:`.checkpoint_io`
- :mod:`.failure`          heartbeats that name a failed rank; :mod:`.host` (this machine's load, its processes)
- :mod:`.engine`           all of the above behind one object
"""

from lightning_hexiscale._lazy import lazy_exports

__all__ = ["PipelineEngine", "Topology"]

__getattr__, __dir__ = lazy_exports(__name__, {"PipelineEngine": "lightning_hexiscale.runtime.engine",
                                               "Topology": "lightning_hexiscale.runtime.topology"})
