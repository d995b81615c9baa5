"""Causal attention kernels and the dispatch every attention layer calls: :func:`attention`.

All kernels take q (B, nq, S, d) and k, v (B, nkv, S, d) with nq a multiple of nkv (grouped-query
attention: query head j reads key/value head ``j // (nq / nkv)``) and return (B, nq, S, d):

- ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)``, torch picking its backend;
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``: the same call restricted to
  one SDPA backend (``torch.nn.attention.sdpa_kernel``); torch raises where that backend cannot
  run the inputs (device, dtype, head size, grouped-query heads);
- ``flash``: flash-attn 2's ``flash_attn_func`` (it takes (B, S, heads, d), so the layout is
  transposed around the call); CUDA, fp16/bf16 and compute capability >= 8.0 only;
- ``eager``: softmax(q k^T / sqrt(d) + causal mask) v written out in matmuls, in the inputs' dtype
  (a readable reference; O(S^2) memory).

``attention(q, k, v)`` (kernel ``auto``) takes flash-attn when it imports, the tensors are on a
capable CUDA device and in fp16/bf16, and SDPA otherwise. A flash-attn install that is present but
broken (its import raises anything: an ImportError, an undefined CUDA symbol, an ABI mismatch's
RuntimeError) is not a crash at the first layer: the dispatch falls back to SDPA and says so once
per process, naming the import error.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Callable

import torch

from lightning_hexiscale.torch_compat import sdpa_causal

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

KERNELS = ("auto", "sdpa", "flash", "eager", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")

SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
"""Kernel name -> ``torch.nn.attention.SDPBackend`` member."""

FLASH_MIN_CAPABILITY = (8, 0)
"""flash-attn 2 runs on Ampere (sm_80) and newer; older GPUs (V100 sm_70, T4 sm_75) fall back to SDPA."""

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttnFallbackWarning(RuntimeWarning):
    """flash-attn is installed but does not import; SDPA is used instead."""


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on (B, heads, S, d) tensors; k and v may have fewer heads (GQA)."""
    return sdpa_causal(q, k, v)


def sdpa_backend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> torch.Tensor:
    """:func:`sdpa_attention` with torch restricted to the one SDPA backend ``kernel`` names."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[kernel])]):
        return sdpa_attention(q, k, v)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + M) v with M[i, j] = -inf for j > i; k/v heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


@functools.lru_cache(maxsize=1)
def flash_attn_available() -> bool:
    """True when a ``flash_attn`` package is installed (it may still fail to import, see
    :func:`load_flash_attn`). Decided once per process: a ``find_spec`` per call walks sys.path."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.lru_cache(maxsize=1)
def load_flash_attn() -> Callable | None:
    """flash-attn's ``flash_attn_func``, or None when it is not installed or its import fails.

    Imported once per process; a failing import warns once (:class:`FlashAttnFallbackWarning`,
    naming the error) because the cache never runs this again. Any exception counts: a wheel built
    for another torch raises ImportError with an undefined symbol, but also OSError or RuntimeError.
    """
    if not flash_attn_available():
        return None
    try:
        from flash_attn import flash_attn_func  # optional GPU extra
    except Exception as e:  # noqa: BLE001 (a broken build raises anything)
        warnings.warn(f"flash-attn is installed but does not import ({type(e).__name__}: {e}); "
                      "using torch's scaled_dot_product_attention instead. Fix: reinstall flash-attn "
                      "built for this torch/CUDA, or uninstall it", FlashAttnFallbackWarning, stacklevel=3)
        return None
    return flash_attn_func


@functools.lru_cache(maxsize=None)
def flash_attn_supported(device_index: int) -> bool:
    """flash-attn imports and the CUDA device's compute capability >= :data:`FLASH_MIN_CAPABILITY`.
    Decided once per device."""
    if load_flash_attn() is None:
        return False
    return tuple(torch.cuda.get_device_capability(device_index)) >= FLASH_MIN_CAPABILITY


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """flash-attn on (B, heads, S, d): it takes (B, S, heads, d) and supports GQA when nq % nkv == 0.
    flash-attn aligns the causal mask bottom-right, SDPA top-left: the same here, q and k have one length."""
    func = load_flash_attn()
    if func is None:
        raise RuntimeError("kernel 'flash' requested but flash-attn is not installed or does not import; "
                           "use kernel 'auto' (falls back to SDPA) or 'sdpa'")
    return func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """Causal attention on (B, heads, S, d); k/v may have fewer heads (GQA). ``kernel`` is one of
    :data:`KERNELS`; ``auto``: flash-attn when usable for these tensors (see the module docstring),
    else SDPA. Both gates are cached per process / device."""
    if kernel == "auto":
        use_flash = q.is_cuda and q.dtype in _FLASH_DTYPES and flash_attn_supported(q.device.index or 0)
        kernel = "flash" if use_flash else "sdpa"
    if kernel == "sdpa":
        return sdpa_attention(q, k, v)
    if kernel == "flash":
        return flash_attention(q, k, v)
    if kernel == "eager":
        return eager_attention(q, k, v)
    if kernel in SDPA_BACKENDS:
        return sdpa_backend_attention(q, k, v, kernel)
    raise ValueError(f"attention kernel {kernel!r}: must be one of {KERNELS}")


def kernel_fn(kernel: str) -> AttentionFn:
    """``attention`` with the kernel fixed (an ``Attention.attention_fn``), still through the dispatch."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: must be one of {KERNELS}")
    return functools.partial(attention, kernel=kernel)
