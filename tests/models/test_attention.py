"""The attention dispatch (models/attention.py): the kernel choice, the flash-attn gate, the
fallback to SDPA with one warning when flash-attn is installed but broken, and the kernels'
agreement with each other. The GPU check's comparison and its mutations are in
tests/runtime/test_check_gpu_recipe.py."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings

import pytest
import torch

from lightning_hexiscale.models import attention as attn_mod
from lightning_hexiscale.models.attention import FlashAttnFallbackWarning, attention, kernel_fn


@pytest.fixture
def fresh_gates():
    """Clear the per-process caches before and after (each test decides anew what is installed)."""
    def clear():
        attn_mod.flash_attn_available.cache_clear()
        attn_mod.flash_attn_supported.cache_clear()
        attn_mod.load_flash_attn.cache_clear()
    clear()
    yield
    clear()


def qkv(nq=4, nkv=2, s=8, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, nq, s, d, generator=g, dtype=dtype), torch.randn(2, nkv, s, d, generator=g, dtype=dtype),
            torch.randn(2, nkv, s, d, generator=g, dtype=dtype))


def test_kernels_agree_with_gqa():
    q, k, v = qkv()
    ref = attention(q, k, v, kernel="eager")
    assert torch.allclose(attention(q, k, v, kernel="sdpa"), ref, atol=1e-12)
    assert torch.allclose(attention(q, k, v), ref, atol=1e-12)  # auto on CPU = SDPA
    assert torch.allclose(kernel_fn("eager")(q, k, v), ref)


def test_eager_is_causal():
    """Changing a later key/value leaves earlier outputs alone (and changes the later ones)."""
    q, k, v = qkv()
    out = attention(q, k, v, kernel="eager")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = 5.0, 5.0
    out2 = attention(q, k2, v2, kernel="eager")
    assert torch.equal(out[:, :, :-1], out2[:, :, :-1]) and not torch.equal(out[:, :, -1], out2[:, :, -1])


def test_unknown_kernel():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="'tiled'.*must be one of"):
        attention(q, k, v, kernel="tiled")
    with pytest.raises(ValueError, match="must be one of"):
        kernel_fn("tiled")


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device (the gate reads only is_cuda, dtype and device)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", self._index)


def _fake(index, dtype=torch.bfloat16):
    t = torch.zeros(1, 2, 4, 8, dtype=dtype).as_subclass(_FakeCuda)
    t._index = index
    return t


def test_flash_gate(monkeypatch, fresh_gates):
    """flash-attn only when it imports, on a CUDA tensor in fp16/bf16 and compute capability >= 8.0;
    the package lookup happens once per process and the capability once per device."""
    lookups, capabilities = [], {0: (7, 5), 1: (8, 0), 2: (9, 0)}
    monkeypatch.setattr(attn_mod.importlib.util, "find_spec", lambda name: lookups.append(name) or object())
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn",
                        type(sys)("flash_attn"))  # a working fake package
    sys.modules["flash_attn"].flash_attn_func = lambda q, k, v, causal: calls.append(causal) or q
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capabilities[i])
    assert [attn_mod.flash_attn_supported(i) for i in (0, 1, 2, 1)] == [False, True, True, True]
    assert lookups == ["flash_attn"]
    monkeypatch.setattr(attn_mod, "sdpa_attention", lambda q, k, v: calls.append("sdpa") or q)
    attention(_fake(0), _fake(0), _fake(0))
    attention(_fake(1), _fake(1), _fake(1))
    attention(_fake(1, torch.float32), _fake(1, torch.float32), _fake(1, torch.float32))
    assert calls == ["sdpa", True, "sdpa"]


def test_not_installed_never_flash(monkeypatch, fresh_gates):
    monkeypatch.setattr(attn_mod.importlib.util, "find_spec", lambda name: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not installed is not worth a warning
        assert not attn_mod.flash_attn_supported(1)
    with pytest.raises(RuntimeError, match="kernel 'flash' requested"):
        attention(*qkv(), kernel="flash")


class _BrokenFlashFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder that 'installs' a flash_attn whose import raises ``error`` (as a wheel
    built against another torch does: an OSError/ImportError naming an undefined symbol)."""

    def __init__(self, error: BaseException):
        self.error, self.imports = error, 0

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.imports += 1
        raise self.error


@pytest.mark.parametrize("error", [OSError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice"),
                                   RuntimeError("CUDA driver version is insufficient"),
                                   ImportError("No module named 'flash_attn_2_cuda'")])
def test_broken_flash_falls_back_to_sdpa_with_one_warning(monkeypatch, fresh_gates, error):
    finder = _BrokenFlashFinder(error)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert attn_mod.flash_attn_available()  # installed ...
    calls = []
    monkeypatch.setattr(attn_mod, "sdpa_attention", lambda q, k, v: calls.append("sdpa") or q)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warning, not just the first per location
        for index in (0, 0, 1):  # every layer call, on two devices
            attention(_fake(index), _fake(index), _fake(index))
    flash_warnings = [w for w in caught if issubclass(w.category, FlashAttnFallbackWarning)]
    assert len(flash_warnings) == 1, [str(w.message) for w in caught]
    message = str(flash_warnings[0].message)
    assert type(error).__name__ in message and str(error) in message and "scaled_dot_product_attention" in message
    assert calls == ["sdpa"] * 3 and finder.imports == 1  # ... broken: SDPA every time, one import attempt


def test_broken_flash_through_the_model(monkeypatch, fresh_gates):
    """A Llama forward with a broken flash-attn runs (SDPA) and equals the eager-kernel forward."""
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.models.llama import Llama

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFlashFinder(ImportError("boom")), *sys.meta_path])
    attn_mod.load_flash_attn.cache_clear()
    cfg = LlamaConfig(name="t", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                      vocab_size=64, seq_len=8)
    model = Llama(cfg).to(torch.float64).init_weights(0)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU tensors never ask for flash: no warning expected either way
        out = model(tokens)
    for block in model.layers:
        block.attn.attention_fn = kernel_fn("eager")
    assert torch.allclose(out, model(tokens), atol=1e-12)


# ---- the GPU check's accuracy comparison (lightning_hexiscale/bench/gpu_checks.py) can fail ----------------------------
def _checker(monkeypatch):
    from lightning_hexiscale.bench import gpu_checks

    return gpu_checks


def _non_causal(q, k, v):
    """Every position attends to the future too (a missing or wrong mask)."""
    group = q.shape[1] // k.shape[1]  # GQA by repeated k/v heads: SDPA's enable_gqa needs torch >= 2.5
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)


def _layout_swapped(q, k, v):
    """A (B, T, H, D) kernel handed (B, H, T, D) tensors (flash-attn without its transposes): heads
    are taken for positions and positions for heads."""
    return kernel_fn("sdpa")(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_checker_passes_the_runtime_dispatch_and_fails_mutated_attention(monkeypatch):
    """The comparison the GPU check runs (bf16 autocast stage vs float64 reference), here on the CPU:
    the runtime's dispatch (auto, and SDPA forced through it) PASSes with a wide margin; a non-causal
    and a layout-swapped attention FAIL on the loss, the logits and the gradients."""
    checks = _checker(monkeypatch)
    cfg = checks.accuracy_config(small=True)
    good = checks.compare_forward(None, "cpu", cfg)  # the model's default attention_fn: the dispatch
    assert checks.accuracy_ok(good), good
    assert good["loss_diff"] <= checks.LOSS_TOL / 3 and good["logits_cos"] >= 0.9999, good
    assert checks.accuracy_ok(checks.compare_forward(kernel_fn("sdpa"), "cpu", cfg))
    for mutant in (_non_causal, _layout_swapped):
        m = checks.compare_forward(mutant, "cpu", cfg)
        assert not checks.accuracy_ok(m), (mutant.__name__, m)
        assert m["loss_diff"] > 10 * checks.LOSS_TOL and m["logits_cos"] < 0.95 and m["grad_cos"] < 0.9, \
            (mutant.__name__, m)
    row = checks.check_accuracy("auto", device="cpu", config=cfg)
    assert row.result == "PASS" and "loss diff" in row.measured


def test_checker_uses_the_dispatch(monkeypatch):
    """With no attention_fn the checked stage calls models.attention.attention (the runtime's own
    dispatch), not a kernel of its own."""
    checks = _checker(monkeypatch)
    calls = []
    real = attn_mod.attention

    def spy(q, k, v, kernel="auto"):
        calls.append(kernel)
        return real(q, k, v, kernel)

    from lightning_hexiscale.models import llama as llama_mod

    monkeypatch.setattr(attn_mod, "attention", spy)
    monkeypatch.setattr(llama_mod, "attention", spy)  # Attention() binds the name at construction
    checks.compare_forward(None, "cpu", checks.accuracy_config(small=True))
    assert calls.count("auto") == 2  # one call per layer of the checked stage (the reference uses eager)
