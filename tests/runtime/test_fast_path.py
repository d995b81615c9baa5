"""The stage's fast path, change by change, on one process (no compilation here: see
test_fast_path_compile.py; multi-rank training: test_fast_path_equivalence.py).

Float64 exactness for every change that is not compilation, against the plain code (the reference
formulas of ``models/llama.py``, ``F.cross_entropy``, autocast's own casts); the chunked loss's
peak memory measured with torch's MemTracker; the switches' rules and errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_hexiscale.config.fast_path import FastPath
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.models.attention import kernel_fn
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.models.llama import Llama, fused_rms_norm, rms_norm
from lightning_hexiscale.runtime.chunked_loss import chunked_cross_entropy
from lightning_hexiscale.runtime.fast_path import apply_fast_path, choose_attention, fuse_adam
from lightning_hexiscale.runtime.parallelize import build_stage

CFG = LlamaConfig(name="fast", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                  vocab_size=80, seq_len=16)
SEED = 7


def make_stage(fast: FastPath, dtype=torch.float64, mixed: bool = False, sharding: str = "ddp", config=CFG):
    """The whole model as one TP-1 stage (bit-identical to Llama.init_weights(SEED)), fast path applied."""
    with torch.device("meta"):
        model = Llama(config)
    stage = build_stage(model, (0, config.num_layers), True, True, 1, 0, None, dtype=dtype, seed=SEED)
    info, main = apply_fast_path(stage, fast.resolve("cpu", mixed, sharding),
                                 compute_dtype=torch.bfloat16 if mixed else dtype, zero3=sharding == "zero3",
                                 mixed=mixed)
    return stage, info, main


def batch(config=CFG, b: int = 2, step: int = 0):
    gen = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, config.vocab_size, (b, config.seq_len + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def grads_of(stage, micro_batches: int = 2, autocast: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and accumulated gradients of ``micro_batches`` forward+backward passes."""
    losses = []
    for i in range(micro_batches):
        tok, tgt = batch(step=i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = stage.loss(stage(tok), tgt)
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_fused_rms_norm_is_the_formula_float64():
    x = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, dtype=torch.float64, requires_grad=True)
    a, b = rms_norm(x, w, 1e-5), fused_rms_norm(x, w, 1e-5)
    assert (a - b).abs().max().item() < 1e-15
    ga, gb = torch.autograd.grad(a.square().sum(), (x, w)), torch.autograd.grad(b.square().sum(), (x, w))
    assert all((p - q).abs().max().item() < 1e-13 for p, q in zip(ga, gb))


def test_stage_float64_every_non_compile_change_equals_plain():
    """fused norm + cast-once + main grads (compute copies in float64) + chunked loss of 5 tokens:
    losses and gradients of two accumulated micro-batches equal the plain stage's to 1e-12."""
    plain, _, _ = make_stage(FastPath.off())
    fast, info, main = make_stage(FastPath(fused_norm=True, cast_once=True, main_grads=True, chunked_loss=True,
                                           loss_chunk_bytes=5 * CFG.vocab_size * 8, compile=False))
    assert info.main_grads and info.loss_chunk_tokens == 5 and main.numel > 0
    lp, gp = grads_of(plain)
    lf, gf = grads_of(fast)
    assert lf == pytest.approx(lp, abs=1e-12)
    for name in gp:
        assert (gp[name] - gf[name]).abs().max().item() < 1e-12, name


def test_main_grads_bf16_equal_autocast_and_fire_param_hooks():
    """Under bf16 autocast over float32 weights the main-grad gradients are autocast's, bit for bit
    (the same bf16 products summed in float32), and every hook on a weight fires once per backward
    (the data-parallel sync starts its buckets from those hooks)."""
    auto, _, _ = make_stage(FastPath(main_grads=False), dtype=torch.float32, mixed=True)
    main, info, mg = make_stage(FastPath(main_grads=True), dtype=torch.float32, mixed=True)
    assert info.main_grads and all(c.dtype == torch.bfloat16 for c in mg.copies)
    fired: dict[str, int] = {}
    for name, p in main.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.__setitem__(n, fired.get(n, 0) + 1))
    la, ga = grads_of(auto, autocast=True)
    lm, gm = grads_of(main, autocast=True)
    assert la == lm
    for name in ga:
        assert torch.equal(ga[name], gm[name]), name
        assert gm[name].dtype == torch.float32
    assert set(fired) == set(ga) and set(fired.values()) == {2}, fired


def test_main_grads_refresh_casts_the_current_weights():
    stage, _, mg = make_stage(FastPath(main_grads=True), dtype=torch.float32, mixed=True)
    w = stage.layers["0"].attn.q_proj.weight
    with torch.no_grad():
        w.add_(1.0)
    c = stage.layers["0"].attn.q_proj.compute_weight
    assert not torch.equal(c, w.to(torch.bfloat16))
    mg.refresh()
    assert torch.equal(c, w.detach().to(torch.bfloat16))
    mg.release()  # the executor frees the copies after a run's last backward
    assert c.untyped_storage().nbytes() == 0
    mg.refresh()
    assert c.untyped_storage().nbytes() == c.numel() * 2 and torch.equal(c, w.detach().to(torch.bfloat16))
    grads_of(stage, micro_batches=1, autocast=True)  # usable again
    # the run's last backward frees each copy once its gradient is added (before the gradient
    # sync's buckets, which start during that backward, can meet all of them)
    sizes = []
    stage.layers["1"].mlp.down_proj.weight.register_post_accumulate_grad_hook(
        lambda _p: sizes.append([x.untyped_storage().nbytes() for x in mg.copies]))
    mg.free_after_use()
    grads_of(stage, micro_batches=1, autocast=True)
    assert 0 < sizes[-1].count(0) < len(mg.copies)  # layer 1's copy gone when its gradient lands, layer 0's not yet
    assert all(x.untyped_storage().nbytes() == 0 for x in mg.copies)


def test_cast_once_at_tp1_saves_three_fewer_casts_per_block():
    """The normed input is cast once (not by q, k, v and gate, up each): autograd keeps 3 fewer
    bf16 (B, S, H) tensors per block, and the loss moves by bf16 rounding only."""
    def saved_casts(stage) -> tuple[int, float]:
        ptrs = set()
        tok, tgt = batch()

        def pack(t):
            if t.dtype == torch.bfloat16 and t.numel() == tok.numel() * CFG.hidden_size:
                ptrs.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = stage.loss(stage(tok), tgt)
        return len(ptrs), loss.item()

    n_plain, l_plain = saved_casts(make_stage(FastPath(cast_once=False), torch.float32, mixed=True)[0])
    n_once, l_once = saved_casts(make_stage(FastPath(cast_once=True), torch.float32, mixed=True)[0])
    assert n_plain - n_once == 3 * CFG.num_layers
    assert l_once == pytest.approx(l_plain, rel=1e-2)


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_cross_entropy_float64_equals_cross_entropy(chunk):
    z = torch.randn(4, 8, 50, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (4, 8))
    ref = F.cross_entropy(z.reshape(-1, 50), t.reshape(-1))
    got = chunked_cross_entropy(z, t, chunk_tokens=chunk)
    assert abs(ref.item() - got.item()) < 1e-14
    (g_ref,), (g_got,) = torch.autograd.grad(ref, z), torch.autograd.grad(got * 1.0, z)
    assert (g_ref - g_got).abs().max().item() < 1e-15
    z2 = z.detach().clone().requires_grad_(True)  # the logits are not modified in place
    chunked_cross_entropy(z2, t, chunk_tokens=chunk).backward()
    assert torch.equal(z2.detach(), z.detach())


def test_chunked_cross_entropy_peak_memory_measured():
    """512 tokens x 4096 words, bf16 logits. Beyond the logits themselves, plain (F.cross_entropy
    of the float32 upcast) peaks at about 3 float32 copies of the logits; the chunked loss at their
    bf16 gradient and one float32 chunk of 64 tokens: below ONE float32 copy of the micro-batch."""
    n, v, chunk = 512, 4096, 64
    z = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,))
    fp32_logits = n * v * 4

    def peak(fn) -> int:
        tracker = MemTracker()
        with tracker:
            fn().backward()
        z.grad = None
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - z.nbytes  # beyond the input

    plain = peak(lambda: F.cross_entropy(z.float(), t))
    chunked = peak(lambda: chunked_cross_entropy(z, t, chunk_tokens=chunk))
    assert plain >= 2.5 * fp32_logits  # the measurement sees the float32 copies
    assert chunked < fp32_logits
    # the gradient (bf16) + one float32 chunk, within 10 %
    assert chunked == pytest.approx(n * v * 2 + chunk * v * 4, rel=0.1)


def test_attention_choice_and_kernels_on_cpu():
    assert choose_attention("auto", torch.device("cpu"), torch.float32, 4, 2, 16) == ("sdpa", "auto: CPU")
    assert choose_attention("sdpa_math", torch.device("cpu"), torch.float32, 4, 2, 16) == ("sdpa_math", "set")
    with pytest.raises(ConfigError, match="fast_path.attention"):
        choose_attention("flash_attn", torch.device("cpu"), torch.bfloat16, 4, 2, 16)
    q = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 16, dtype=torch.float64), torch.randn(2, 2, 9, 16, dtype=torch.float64)
    assert (kernel_fn("sdpa_math")(q, k, v) - kernel_fn("eager")(q, k, v)).abs().max().item() < 1e-12
    stage, info, _ = make_stage(FastPath(attention="eager"))
    assert info.attention == "eager" and "attention eager (set)" in info.describe()
    assert all(b.attn.attention_fn.keywords == {"kernel": "eager"} for b in stage.layers.values())


def test_fused_adamw_flips_only_plain_adam():
    p = [torch.nn.Parameter(torch.randn(5, dtype=torch.float64))]
    adamw = torch.optim.AdamW(p, lr=1e-2)
    assert fuse_adam(adamw, torch.device("cpu")) and adamw.param_groups[0]["fused"]
    assert not fuse_adam(torch.optim.SGD(p, lr=0.1), torch.device("cpu"))
    assert not fuse_adam(torch.optim.AdamW(p, lr=1e-2, foreach=True), torch.device("cpu"))  # the user's choice
    # float64: the fused step is the for-loop step to rounding
    a = [torch.nn.Parameter(torch.randn(64, dtype=torch.float64)) for _ in range(3)]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    oa, ob = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert fuse_adam(ob, torch.device("cpu"))
    for step in range(3):
        for x, y in zip(a, b):
            x.grad = torch.sin(x.detach() * (step + 1))
            y.grad = x.grad.clone()
        oa.step()
        ob.step()
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-13


def test_fast_path_switches_resolve_and_errors():
    cpu, gpu = FastPath().resolve("cpu", mixed=True), FastPath().resolve("cuda", mixed=True)
    assert not cpu.compile and gpu.compile  # compile: CUDA only
    assert all(getattr(r, k) for r in (cpu, gpu) for k in ("fused_norm", "cast_once", "main_grads", "fused_adamw",
                                                           "chunked_loss"))
    assert not FastPath().resolve("cuda", mixed=False).main_grads  # nothing to cast without mixed precision
    assert not FastPath().resolve("cuda", mixed=True, sharding="zero3").main_grads
    assert not any(getattr(FastPath.off().resolve("cuda", True), k) for k in ("compile", "fused_norm", "main_grads"))
    assert FastPath.coerce({"compile": False}).resolve("cuda", True).compile is False
    with pytest.raises(ConfigError, match="fast_path.main_grads"):
        FastPath(main_grads=True).resolve("cuda", mixed=True, sharding="zero3")
    with pytest.raises(ConfigError, match="fast_path.complie"):
        FastPath.coerce({"complie": False})
    with pytest.raises(ConfigError, match="fast_path.compile"):
        FastPath(compile="yes")
    with pytest.raises(ConfigError, match="fast_path.attention"):
        FastPath(attention="flash3")
    with pytest.raises(ConfigError, match="loss_chunk_bytes"):
        FastPath(loss_chunk_bytes=0)
    with pytest.raises(ConfigError, match=r"^trainer\.fast_path\.attention = 'x'"):  # named as the caller's key
        FastPath.coerce({"attention": "x"}, key="trainer.fast_path")


def test_strategy_compile_argument():
    from lightning_hexiscale.lightning.fast_path import strategy_fast_path

    assert strategy_fast_path(False, None).compile is False
    assert strategy_fast_path(None, {"main_grads": False}).main_grads is False
    assert strategy_fast_path(True, False).compile is True and strategy_fast_path(True, False).fused_norm is False
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(compile\)"):
        strategy_fast_path("no", None)
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(fast_path\).bogus"):
        strategy_fast_path(None, {"bogus": 1})


def test_hydra_fast_path_node_matches_the_switches():
    """trainer.fast_path.* (the recipe's Hydra node) has exactly FastPath's fields and defaults."""
    from dataclasses import fields

    from lightning_hexiscale.config.recipe import FastPathConfig

    assert [(f.name, f.default) for f in fields(FastPathConfig)] == [(f.name, f.default) for f in fields(FastPath)]


def test_run_log_line(capsys):
    """What rank 0 prints: the stage's switches, the attention kernel, fused AdamW (one process here;
    several ranks print one line per distinct setting with their ranks)."""
    from types import SimpleNamespace

    from lightning_hexiscale.lightning.fast_path import _ranges, log_fast_path

    _, info, _ = make_stage(FastPath(), torch.float32, mixed=True)
    out = log_fast_path(SimpleNamespace(fast_path=info), [True], global_rank=0, world_size=1)
    printed = capsys.readouterr().out
    assert printed.startswith("hexiscale all ranks: fast path: compile off, fused RMSNorm, normed input cast once, "
                              "main grads") and "attention sdpa (auto: CPU)" in printed
    assert printed.rstrip().endswith("fused AdamW") and out == [(printed.split(": ", 1)[1].strip(), [0])]
    log_fast_path(SimpleNamespace(fast_path=info), [], global_rank=1, world_size=1)
    assert capsys.readouterr().out == ""  # other ranks print nothing
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
