"""The stage's fast path: which speed changes a run uses, one switch each (pure data, no torch).

Every switch is ``None`` (auto), ``True`` or ``False``; :meth:`FastPath.resolve` turns the autos
into decisions for one stage, with the reason for each, so that the run's log can say what runs
and why (:mod:`lightning_hexiscale.runtime.fast_path` applies them, ``planner/cost/memory.py`` prices
the ones that move memory).

=================  ==========================================================  ==================
switch             what it does                                                 auto
=================  ==========================================================  ==================
compile            ``torch.compile`` of each transformer block where the block  on for CUDA only
                   has no hooks or collectives inside (TP 1, not ZeRO-3), else
                   of regions: RMSNorm, RoPE, SwiGLU
fused_norm         RMSNorm through ``F.rms_norm`` (one fused kernel on CUDA)     on
cast_once          the normed input cast to the autocast dtype once, before q,   on
                   k, v (and gate, up), at TP 1 as under TP (5 casts -> 2)
main_grads         16-bit compute copies of the matmul weights, cast once per    on under mixed
                   step; each micro-batch's weight gradient is added straight     precision, except
                   into the float32 ``.grad`` (FSDP2 / Megatron main grads)      ZeRO-3 and
                                                                                 recomputation
fused_adamw        ``fused=True`` for Adam / AdamW where torch has the kernel    on
                   for the device
chunked_loss       the (vocabulary-parallel) cross-entropy in chunks of tokens:  on
                   never a float32 copy of a whole micro-batch's logits
attention          kernel: auto, flash_attn, sdpa, sdpa_flash, sdpa_cudnn,       auto: flash-attn,
                   sdpa_efficient, sdpa_math or eager                            else the fastest
                                                                                 SDPA backend
=================  ==========================================================  ==================

Why compile is on for CUDA only: on CPU, inductor compiles C++ kernels per graph (minutes on a
2-core host for one tiny stage, measured) and CPU runs here are emulations and tests, where time
to first step matters more than the step; every other switch costs nothing to turn on and is on
everywhere, so the CPU emulation runs the code a GPU runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_hexiscale.errors import ConfigError

ATTENTION_KERNELS = ("auto", "flash_attn", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "eager")
"""``attention`` choices: ``flash_attn`` is the flash-attn package; ``sdpa`` lets torch pick among
its SDPA backends; ``sdpa_<backend>`` forces one of them; ``eager`` is the written-out reference."""

SWITCHES = ("compile", "fused_norm", "cast_once", "main_grads", "fused_adamw", "chunked_loss")

DEFAULT_LOSS_CHUNK_BYTES = 256 * 2**20
"""256 MiB of float32 logits per loss chunk: 523 tokens of Llama 3's 128,256-word vocabulary (16
chunks for an 8,192-token micro-batch), the whole micro-batch for small vocabularies."""


@dataclass(frozen=True)
class FastPath:
    """One switch per change (``None`` = auto, see the module table)."""

    compile: bool | None = None
    """torch.compile: whole blocks where possible, regions otherwise; auto: on for CUDA only."""
    fused_norm: bool | None = None
    """RMSNorm through ``F.rms_norm``."""
    cast_once: bool | None = None
    """Cast the normed input once (acts under autocast only)."""
    main_grads: bool | None = None
    """Compute copies of the matmul weights cast once per step, gradients added into ``.grad``."""
    fused_adamw: bool | None = None
    """``fused=True`` for torch Adam / AdamW where the device has the kernel."""
    chunked_loss: bool | None = None
    """Cross-entropy in chunks of ``loss_chunk_bytes`` of float32 logits."""
    attention: str = "auto"
    """Attention kernel, one of :data:`ATTENTION_KERNELS`."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend (``inductor``; ``aot_eager`` traces without generating kernels)."""
    loss_chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES
    """Float32 logits per loss chunk, in bytes: tokens per chunk = max(1, this // (V_local * 4))."""

    def __post_init__(self) -> None:
        for name in SWITCHES:
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"fast_path.{name}", v, "must be true, false or null (auto)",
                                  f"write fast_path.{name}=false to turn it off")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError("fast_path.attention", self.attention, f"must be one of {ATTENTION_KERNELS}",
                              "use auto, or name a kernel the device has")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ConfigError("fast_path.compile_backend", self.compile_backend, "must name a torch.compile backend",
                              "use inductor")
        if isinstance(self.loss_chunk_bytes, bool) or not isinstance(self.loss_chunk_bytes, int) \
                or self.loss_chunk_bytes < 1:
            raise ConfigError("fast_path.loss_chunk_bytes", self.loss_chunk_bytes, "must be a positive integer",
                              f"use e.g. {DEFAULT_LOSS_CHUNK_BYTES} (256 MiB)")

    @classmethod
    def coerce(cls, value: Any, key: str = "fast_path") -> FastPath:
        """A FastPath from a FastPath, None (all auto), True (all auto), False (every switch off,
        attention ``sdpa``) or a mapping of field names (a Hydra node); unknown keys are errors."""
        if value is None or value is True:
            return cls()
        if value is False:
            return cls.off()
        if isinstance(value, cls):
            return value
        try:
            items = dict(value.items())
        except AttributeError:
            raise ConfigError(key, value, "must be a FastPath, a mapping of its switches, true or false",
                              "pass e.g. {'compile': False}") from None
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(items) - names)
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", items[unknown[0]], f"not a fast-path switch; the switches are "
                              f"{sorted(names)}", "check the spelling")
        try:
            return cls(**items)
        except ConfigError as e:  # named as the caller's key (trainer.fast_path.attention, ...)
            raise ConfigError(key + e.key[len("fast_path"):], e.value, e.rule, e.fix) from None

    @classmethod
    def off(cls) -> FastPath:
        """Every change off: the plain stage (eager, unfused, autocast's casts, SDPA)."""
        return cls(**{n: False for n in SWITCHES}, attention="sdpa")

    def with_compile(self, compile: bool | None) -> FastPath:
        """This fast path with ``compile`` set (``HexiScaleStrategy(compile=...)``); None keeps it."""
        return self if compile is None else FastPath(**{**asdict(self), "compile": compile})

    def resolve(self, device: str, mixed: bool, sharding: str = "ddp", recompute: bool = False) -> ResolvedFastPath:
        """Decisions for a stage on ``device`` (``cuda``, ``cpu``, ...) under mixed precision or not,
        ``sharding`` (ddp / zero2 / zero3) and activation recomputation. Raises :class:`ConfigError`
        for a switch set on where it cannot act (main_grads under ZeRO-3)."""
        cuda = device == "cuda"
        why: dict[str, str] = {}

        def pick(name: str, auto: bool, reason: str) -> bool:
            v = getattr(self, name)
            why[name] = "set" if v is not None else reason
            return auto if v is None else v

        compile_ = pick("compile", cuda, "auto: CUDA" if cuda else "auto: off on CPU (inductor compiles slowly)")
        if self.main_grads and sharding == "zero3":
            raise ConfigError("fast_path.main_grads", True, "ZeRO-3 gathers each block's parameters around each use; "
                              "persistent compute copies of them would undo that", "leave main_grads auto (off "
                              "under zero3) or use dp_sharding=zero2")
        # Under recomputation autocast keeps only the recomputed layer's casts, while the compute
        # copies would hold every layer's for the whole backward (+2 bytes per stage parameter):
        # auto keeps memory first there.
        main_auto = mixed and sharding != "zero3" and not recompute
        main = pick("main_grads", main_auto, "auto: mixed precision" if main_auto else
                    "auto: off without mixed precision" if not mixed else
                    "auto: off under zero3" if sharding == "zero3" else "auto: off under recomputation")
        return ResolvedFastPath(
            compile=compile_, fused_norm=pick("fused_norm", True, "auto"), cast_once=pick("cast_once", True, "auto"),
            main_grads=main, fused_adamw=pick("fused_adamw", True, "auto"),
            chunked_loss=pick("chunked_loss", True, "auto"), attention=self.attention,
            compile_backend=self.compile_backend, loss_chunk_bytes=self.loss_chunk_bytes, why=tuple(why.items()))


@dataclass(frozen=True)
class ResolvedFastPath:
    """What one stage runs: every switch decided (see :class:`FastPath`); ``attention`` may still be
    ``auto`` (the runtime picks the kernel for the device, shapes and dtype)."""

    compile: bool
    fused_norm: bool
    cast_once: bool
    main_grads: bool
    fused_adamw: bool
    chunked_loss: bool
    attention: str
    compile_backend: str
    loss_chunk_bytes: int
    why: tuple[tuple[str, str], ...] = ()
    """(switch, reason): ``set`` where the user decided, else the auto rule that did."""

    def loss_chunk_tokens(self, vocab_local: int, compute_bytes: int = 4) -> int:
        """Tokens per loss chunk: max(1, loss_chunk_bytes // (V_local * compute_bytes))."""
        return max(1, self.loss_chunk_bytes // max(1, vocab_local * compute_bytes))
