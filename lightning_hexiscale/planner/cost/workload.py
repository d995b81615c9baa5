"""What is trained: :class:`Workload` (the model and its numeric formats) and the bytes per element
of each dtype name. Shared by the cost model's memory terms (``memory.py``) and ``estimate()``; a
module of its own so that neither imports the other for it.

:meth:`Workload.for_devices` (:meth:`Workload.for_cluster`) is the one place where a run's workload
is made: the strategy's search, elastic restarts, the recipe and the ``hexiscale`` commands all
price a run through it, so that a CPU cluster is priced as CPU (no NCCL buffers) everywhere."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.models.config import LlamaConfig

if TYPE_CHECKING:
    from lightning_hexiscale.config.cluster import Cluster

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class Workload:
    """What is trained: the model and the numeric format (the plan says how it is parallelised)."""

    model: LlamaConfig
    dtype: str = "bf16"
    """Compute precision B_type (activations, matmuls, the wire): bf16, fp16, fp32 or fp64."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state K per parameter: Adam with fp32 master weights = 4 + 4 + 4 (Appendix B's
    default); :meth:`from_precision` gives what the runtime's AdamW keeps."""
    reserve_bytes: float = 1.0 * 2**30
    """Memory per device not available to the model (runtime context, allocator slack)."""
    memory_headroom: float = 0.0
    """Fraction of every device's memory the plan must leave free (``train.memory_headroom``)."""
    device: str = "cuda"
    """What the runtime runs on: ``cuda`` (NCCL buffers, multi-tensor optimizer step) or ``cpu``."""
    comm_buffer_bytes: float = 64 * 2**20
    """Buffers per communicator on CUDA (NCCL: 4 MiB NCCL_BUFFSIZE per channel, protocol and
    direction; 64 MiB is a few channels' worth). 0 to ignore."""
    param_dtype: str | None = None
    """Storage dtype of the parameters and their gradients; None = ``dtype``. Mixed precision
    (``bf16-mixed``) keeps float32 parameters and gradients under bf16 compute: ``fp32``."""
    fast_path: FastPath = FastPath()
    """The runtime's speed switches (all auto by default, as the runtime's default); the memory
    terms price the ones that move memory (main grads, the chunked loss, the cast-once, fused
    AdamW), resolved for ``device``."""
    allow_tf32: bool = False
    """fp32 matmuls on CUDA use TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``). The
    runtime leaves torch's default (off), so ``32-true`` is priced at the FP32 rate."""
    allow_table_mismatch: bool = False
    """``planner.allow_table_mismatch``: a device type whose layer tables were measured on another
    model shape or precision (or lack a TP degree the plan uses) is priced from its FLOP/s with a
    warning saying so, instead of a ConfigError (:mod:`.sources`)."""

    def __post_init__(self) -> None:
        # Every field is checked here, where the workload is built: a wrong type or value was a
        # KeyError / TypeError / AttributeError deep inside estimate() (dtype='abc': KeyError 'abc'),
        # or a silent price (reserve_bytes=nan, a negative optimizer state)
        from lightning_hexiscale.errors import ConfigError, check_argument_types, shown

        def number(v: Any) -> bool:  # numpy's numbers too; a bool is no size
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        check_argument_types("Workload", (("model", self.model, LlamaConfig,
                                           "pass Workload(LlamaConfig.load('llama_tiny'))"),))
        if not (number(self.memory_headroom) and 0.0 <= self.memory_headroom < 1.0):
            raise ConfigError("train.memory_headroom", self.memory_headroom, "must be a fraction in [0, 1)",
                              "use e.g. 0.05 to keep 5 % of every device free, or 0")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError("workload.device", self.device, "must be cuda or cpu", "use cuda for GPU clusters")
        for name, value in (("dtype", self.dtype), ("param_dtype", self.param_dtype)):
            if not (isinstance(value, str) and value in DTYPE_BYTES) and not (name == "param_dtype" and value is None):
                raise ConfigError(f"Workload({name})", value, f"must be one of {', '.join(DTYPE_BYTES)}"
                                  + (" (or None: dtype)" if name == "param_dtype" else ""),
                                  "use Workload.from_precision(model, 'bf16-mixed'), which sets both")
        for name in ("optimizer_bytes_per_param", "reserve_bytes", "comm_buffer_bytes"):
            v = getattr(self, name)
            if not (number(v) and 0 <= v < math.inf):
                raise ConfigError(f"Workload({name})", v, "must be a finite number of bytes >= 0",
                                  f"leave it out for the default ({getattr(type(self), name)})")
        if not isinstance(self.fast_path, FastPath):
            raise ConfigError("Workload(fast_path)", shown(self.fast_path), "must be a FastPath",
                              "leave it out (the runtime's defaults), or pass FastPath.coerce(...)")
        for name in ("allow_tf32", "allow_table_mismatch"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Workload({name})", getattr(self, name), "must be True or False", f"pass {name}=False")

    @property
    def dtype_bytes(self) -> int:
        """Derived: B_type."""
        return DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> int:
        """Derived: P, bytes per stored parameter and gradient element."""
        return DTYPE_BYTES[self.param_dtype or self.dtype]

    @property
    def mixed(self) -> bool:
        """Mixed precision: parameters stored wider than the compute dtype (autocast casts them)."""
        return self.param_bytes > self.dtype_bytes

    @classmethod
    def from_precision(cls, model: LlamaConfig, precision: str, **kwargs: Any) -> Workload:
        """What the runtime allocates under a Lightning ``precision`` (``trainer.precision``):

            precision    dtype (B)   param_dtype (P)   K (AdamW m, v in the parameters' dtype)
            32-true      fp32        fp32              8
            64-true      fp64        fp64              16
            bf16-mixed   bf16        fp32              8
            bf16-true    bf16        bf16              4
            16-true      fp16        fp16              4
        (16-mixed is refused: :data:`~lightning_hexiscale.config.recipe.REFUSED_PRECISIONS`). Other
        fields from ``kwargs``; a run's workload comes from :meth:`for_devices`."""
        from lightning_hexiscale.config.recipe import precision_dtype

        dtype = precision_dtype(precision)
        param = "fp32" if str(precision).endswith("-mixed") else dtype
        kwargs.setdefault("optimizer_bytes_per_param", 2.0 * DTYPE_BYTES[param])
        return cls(model, dtype=dtype, param_dtype=param, **kwargs)

    @classmethod
    def for_devices(cls, model: LlamaConfig, gpu_types: list[str], precision: str | None = None,
                    **kwargs: Any) -> Workload:
        """The workload of a run on devices of ``gpu_types`` (one entry per device or machine) under
        the Lightning ``precision`` (None: the default for those devices, 32-true on emulated CPU
        devices, else bf16-mixed: :func:`~lightning_hexiscale.config.recipe.effective_precision`).
        ``device`` is the devices' kind (:func:`~lightning_hexiscale.config.recipe.device_kind`):
        ``cpu`` for emulated CPU devices, whose runtime has no NCCL buffers to price. Other fields
        (``memory_headroom``, ...) from ``kwargs``."""
        from lightning_hexiscale.config.recipe import device_kind, effective_precision
        from lightning_hexiscale.errors import ConfigError, shown

        # a str was read one letter a device ('CPU': three types C, P, U, so a 'cuda' workload), and
        # no device at all was priced as CUDA: both without a word
        if (isinstance(gpu_types, str) or not isinstance(gpu_types, Sequence) or not gpu_types
                or not all(isinstance(t, str) for t in gpu_types)):
            raise ConfigError("Workload.for_devices(gpu_types)", shown(gpu_types), "must be a non-empty list of "
                              "device type names (one per device or machine)",
                              "pass e.g. ['A800', 'A800'] or ['CPU'], or use Workload.for_cluster(model, cluster)")
        kwargs.setdefault("device", device_kind(gpu_types))
        return cls.from_precision(model, effective_precision(precision, gpu_types), **kwargs)

    @classmethod
    def for_cluster(cls, model: LlamaConfig, cluster: Cluster, precision: str | None = None,
                    **kwargs: Any) -> Workload:
        """:meth:`for_devices` for the devices of ``cluster``."""
        from lightning_hexiscale.config.cluster import Cluster
        from lightning_hexiscale.errors import check_argument_types

        check_argument_types("Workload.for_cluster", (("cluster", cluster, Cluster,  # a name was an AttributeError
                                                       "pass a Cluster: Cluster.load(name_or_path)"),))
        return cls.for_devices(model, [d.gpu_type for d in cluster.devices], precision, **kwargs)

    @property
    def seq_len(self) -> int:
        return self.model.seq_len
