"""Apply a :class:`~lightning_hexiscale.config.fast_path.FastPath` to this rank's stage.

Order (each step only sets attributes the model and the runtime's layers expose, so the model code
stays plain PyTorch):

1. kernels: ``norm_fn`` of every RMSNorm (``F.rms_norm`` with ``fused_norm``), ``attention_fn``
   of every attention (the chosen kernel, :func:`choose_attention`), ``cast_once`` of the norms
   that feed the TP region (at TP 1 too);
2. main grads (:class:`~.main_grads.MainGrads`): compute copies of the matmul weights;
3. compile, last, so that it traces what the steps above set: each block's ``forward`` where the
   block has no hooks or collectives inside (TP 1 and not ZeRO-3: ZeRO-3 swaps the block's
   parameters in its forward pre-hook, TP runs all-reduces between the matmuls), else regions:
   the norms, RoPE and SwiGLU. Only ``forward`` is compiled, never ``__call__``, so module hooks
   (the gradient sync's block boundaries) stay outside the graph and run as before.

The chunked loss and fused AdamW are read by :class:`~.parallelize.StageModule` and
:func:`fuse_adam`. :class:`StageFastPath` is what runs, for the run's log.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_hexiscale.config.fast_path import ResolvedFastPath
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models import attention as attn
from lightning_hexiscale.models.llama import RMSNorm, fused_rms_norm, rms_norm, rope_qk, swiglu
from lightning_hexiscale.runtime.main_grads import MainGrads

_SIXTEEN = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StageFastPath:
    """What one stage runs (decided by :func:`apply_fast_path`), for the log and the tests."""

    compile: str
    """``blocks`` (each block's forward), ``regions`` (norms, RoPE, SwiGLU) or ``off``."""
    fused_norm: bool
    cast_once: bool
    """The normed input is cast to the autocast dtype once (under mixed precision only)."""
    main_grads: bool
    attention: str
    """The kernel every attention layer calls (a :data:`~lightning_hexiscale.models.attention.KERNELS` name)."""
    attention_reason: str
    loss_chunk_tokens: int | None
    """Tokens per chunk of the chunked loss (last stages); None: the plain loss, or no loss here."""
    compile_backend: str = "inductor"
    mixed: bool = False
    """Under autocast (the casts and main grads only matter then)."""
    is_last: bool = True

    def describe(self) -> str:
        """One line: ``fast path: compile blocks (inductor), fused RMSNorm, ...``."""
        on = [f"compile {self.compile}" + (f" ({self.compile_backend})" if self.compile != "off" else ""),
              "fused RMSNorm" if self.fused_norm else "RMSNorm unfused"]
        if self.mixed:
            on.append("normed input cast once" if self.cast_once else "autocast casts per linear")
            on.append("main grads (16-bit weights cast once per step, fp32 .grad)" if self.main_grads
                      else "autocast weight casts")
        elif self.main_grads:
            on.append("main grads (compute copies in the parameter dtype)")
        on.append(f"attention {self.attention} ({self.attention_reason})")
        if self.is_last:
            on.append(f"chunked loss ({self.loss_chunk_tokens} tokens per chunk)" if self.loss_chunk_tokens
                      else "plain loss")
        return "fast path: " + ", ".join(on)


def choose_attention(requested: str, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[str, str]:
    """(kernel, reason) for ``requested`` (a :data:`~lightning_hexiscale.config.fast_path.ATTENTION_KERNELS`
    name) on ``device`` for q, k, v in ``dtype`` with these head counts.

    ``auto``: SDPA on CPU (torch's own CPU flash kernel); on CUDA, flash-attn where it imports and
    the device and dtype suit it, else the first SDPA backend of cuDNN (Hopper and newer), flash,
    memory-efficient that runs a forward and backward of these head shapes, else plain ``sdpa``.
    A named kernel is checked the same way on CUDA: one that cannot run these shapes is a
    ConfigError here, not an error in the first step.
    """
    if requested != "auto":
        kernel = "flash" if requested == "flash_attn" else requested
        if kernel == "flash" and (device.type != "cuda" or attn.load_flash_attn() is None):
            raise ConfigError("fast_path.attention", requested, "flash-attn needs CUDA and the flash-attn package",
                              "install flash-attn on the GPU machines, or use auto / sdpa")
        if device.type == "cuda" and kernel != "eager" and not _runs(kernel, device, dtype, num_heads, num_kv_heads,
                                                                      head_dim):
            raise ConfigError("fast_path.attention", requested, f"this kernel does not run {dtype} attention with "
                              f"{num_heads}/{num_kv_heads} heads of {head_dim} on {torch.cuda.get_device_name(device)}",
                              "use auto, or another kernel (recipes/mfu_probe.py times each one)")
        return kernel, "set"
    if device.type != "cuda":
        return "sdpa", "auto: CPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if dtype in _SIXTEEN and attn.flash_attn_supported(index):
        return "flash", "auto: flash-attn installed"
    candidates = (["sdpa_cudnn"] if torch.cuda.get_device_capability(index) >= (9, 0) else []) + \
        ["sdpa_flash", "sdpa_efficient"]
    for kernel in candidates:
        if _runs(kernel, device, dtype, num_heads, num_kv_heads, head_dim):
            return kernel, f"auto: first of {candidates} to run these shapes"
    return "sdpa", f"auto: none of {candidates} runs these shapes"


def _runs(kernel: str, device: torch.device, dtype: torch.dtype, nq: int, nkv: int, d: int) -> bool:
    """Whether ``kernel`` runs a causal forward and backward of (1, heads, 256, d) q, k, v here."""
    try:
        q = torch.randn(1, nq, 256, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, nkv, 256, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, nkv, 256, d, device=device, dtype=dtype, requires_grad=True)
        attn.attention(q, k, v, kernel=kernel).sum().backward()
        return bool(torch.isfinite(q.grad).all())
    except RuntimeError:  # "No available kernel", unsupported head size or GQA, ...
        return False


@functools.lru_cache(maxsize=None)
def compiled(fn, backend: str):
    """``torch.compile(fn, backend=backend)``, one wrapper per (function, backend)."""
    return torch.compile(fn, backend=backend)


def apply_fast_path(stage, fp: ResolvedFastPath, *, compute_dtype: torch.dtype, zero3: bool = False,
                    mixed: bool = False) -> tuple[StageFastPath, MainGrads | None]:
    """Set the fast path's kernels, main grads and compilation on ``stage`` (a
    :class:`~.parallelize.StageModule`), in the order of the module docstring. ``compute_dtype``:
    the dtype the matmuls run in (the autocast dtype under mixed precision, else the parameters');
    ``mixed``: whether autocast narrows it."""
    device = next(stage.parameters()).device
    blocks = list(stage.layers.values())
    norm_fn = fused_rms_norm if fp.fused_norm else rms_norm
    norms = [m for m in stage.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.norm_fn = norm_fn
        if hasattr(m, "cast_once"):
            m.cast_once = fp.cast_once
    kernel, reason = "sdpa", "no attention on this stage"
    if blocks:
        a = blocks[0].attn
        kernel, reason = choose_attention(fp.attention, device, compute_dtype, a.num_heads, a.num_kv_heads,
                                          a.head_dim)
        fn = attn.kernel_fn(kernel)
        for b in blocks:
            b.attn.attention_fn = fn
    main = MainGrads(stage, compute_dtype) if fp.main_grads else None
    mode = "off"
    if fp.compile:
        mode = "blocks" if stage.tp == 1 and not zero3 else "regions"
        region_norm = compiled(norm_fn, fp.compile_backend)
        if stage.norm is not None:  # the final norm is outside every block: a region of its own
            stage.norm.norm_fn = region_norm
        for b in blocks:
            if mode == "blocks":
                b.forward = torch.compile(b.forward, backend=fp.compile_backend)
            else:
                b.attn_norm.norm_fn = b.mlp_norm.norm_fn = region_norm
                b.attn.rope_fn = compiled(rope_qk, fp.compile_backend)
                b.mlp.act_fn = compiled(swiglu, fp.compile_backend)
    chunk = None
    if fp.chunked_loss and stage.is_last:
        vocab_local = stage.config.vocab_split(stage.tp)[stage.tp_rank]
        cdt = torch.promote_types(compute_dtype, torch.float32)  # the loss's dtype
        chunk = fp.loss_chunk_tokens(vocab_local[1] - vocab_local[0], cdt.itemsize)
    stage.loss_chunk_tokens = chunk
    info = StageFastPath(compile=mode, fused_norm=fp.fused_norm, cast_once=fp.cast_once and mixed,
                         main_grads=main is not None, attention=kernel, attention_reason=reason,
                         loss_chunk_tokens=chunk, compile_backend=fp.compile_backend, mixed=mixed,
                         is_last=stage.is_last)
    return info, main


def fuse_adam(optimizer, device: torch.device) -> bool:
    """Turn on torch's fused Adam / AdamW kernel for ``optimizer`` (before its first step) where
    the device has it and the user left ``fused`` and ``foreach`` unset; returns whether it did.
    Other optimizers, and an explicit ``fused`` / ``foreach`` / ``differentiable``, are left as they are."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if device.type not in _get_fused_kernels_supported_devices() or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") or g.get("differentiable") or g.get("capturable")
           for g in groups):
        return False
    if any(not (p.is_floating_point() and p.device.type == device.type) for g in groups for p in g["params"]):
        return False
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    # Not ``_step_supports_amp_scaling`` (Adam.__init__ sets it with fused=True): only an fp16
    # GradScaler reads it (the strategy refuses 16-mixed), and Lightning's bf16-mixed plugin would
    # refuse gradient clipping for an optimizer that has it.
    return True
