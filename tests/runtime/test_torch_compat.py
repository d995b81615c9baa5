"""Torch versions: the runtime on a torch without the names added after the package's floor.

``dist.all_gather_single`` / ``dist.reduce_scatter_single`` exist only from torch 2.13; the ZeRO
path and the equal-TP stage hop reach them through ``lightning_hexiscale.torch_compat``, which falls
back to ``all_gather_into_tensor`` / ``reduce_scatter_tensor``. Here the new names are deleted from
``torch.distributed`` before the ranks fork (so every worker process runs without them, as on an
older torch) and the ZeRO-2, ZeRO-3 and scatter/gather equivalence checks run against the
single-process reference, under the NCCL-semantics replay. The fallback must also put the same
collectives on the wire: same groups, order, sizes and dtypes as under the new names.

SDPA's ``enable_gqa`` (torch >= 2.5) has its fallback checked against the eager reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_equivalence import check_equivalence, plan_of
from test_equivalence_zero import PLANS, check_zero

import nccl_semantics
from lightning_hexiscale import torch_compat
from lightning_hexiscale.models.attention import eager_attention

NEW_NAMES = ("all_gather_single", "reduce_scatter_single")
"""torch >= 2.13 collectives the runtime uses; older torch has only the *_into_tensor / *_tensor forms."""
OLD_NAME = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}

SCATTER_GATHER = plan_of([(4, 2, [([0, 1], (0, 1)), ([2, 3], (1, 4))])], 4, schedule="gpipe", recompute=True)
"""Two adjacent TP-2 stages: activations and gradients take the scatter/gather hop (an all-gather)."""

CASES = {
    # (run, needed collectives): fig. 1's plan mixes a TP-2 pipeline and a 3-stage TP-1 one, AdamW
    "zero2": (lambda run, cfg: check_zero(run, PLANS["fig1_bottom"][0], cfg, "zero2", "adamw"), NEW_NAMES),
    "zero3": (lambda run, cfg: check_zero(run, PLANS["fig1_bottom"][0], cfg, "zero3", "adamw"), NEW_NAMES),
    "scatter_gather": (lambda run, cfg: check_equivalence(run, SCATTER_GATHER, cfg), ("all_gather_single",)),
}


def _recording(run_ranks_traced, traces: list):
    """A ``run_ranks`` that also keeps the traces (judged under NCCL's rules, as ``run_ranks`` does)."""

    def run(world, fn, *args, timeout: float = 90.0):
        results, got = run_ranks_traced(world, fn, *args, timeout=timeout)
        nccl_semantics.check(got)
        traces.extend(got)
        return results

    return run


def _wire(traces: list) -> list[list[tuple]]:
    """Per rank, every all-gather / reduce-scatter as (name under the old torch, group, input
    elements, output elements, dtype, reduce op), in issue order."""
    return [[(OLD_NAME.get(s.coll, s.coll), s.group, s.numel, s.out_numel, s.dtype, s.detail) for s in trace
             if s.coll in nccl_semantics.ALL_GATHERS + nccl_semantics.REDUCE_SCATTERS] for trace in traces]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_runtime_without_torch_2_13_collectives(run_ranks_traced_fixture, tiny_gqa, monkeypatch, case):
    run, needed = CASES[case]
    had_new_names = all(hasattr(dist, n) for n in NEW_NAMES)
    new_traces: list = []
    if had_new_names:  # the reference wire traffic: this torch's own names
        run(_recording(run_ranks_traced_fixture, new_traces), tiny_gqa)
    for name in NEW_NAMES:  # deleted before the fork: the worker processes run as on torch < 2.13
        monkeypatch.delattr(dist, name, raising=False)
    old_traces: list = []
    run(_recording(run_ranks_traced_fixture, old_traces), tiny_gqa)

    used = {s.coll for trace in old_traces for s in trace}
    assert {OLD_NAME[n] for n in needed} <= used, f"{case}: the fallback collectives were not exercised: {used}"
    assert not used & set(NEW_NAMES)
    if had_new_names:
        assert _wire(old_traces) == _wire(new_traces), "the fallback changed what goes on the wire"


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 1), (3, 3)])
def test_sdpa_without_enable_gqa_matches_reference(monkeypatch, heads, kv_heads):
    """torch < 2.5: k/v heads repeated before SDPA equal eager GQA attention (and SDPA's own
    ``enable_gqa`` where this torch has it), forward and backward, in float64."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 7, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 7, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    native = torch_compat.sdpa_causal(q, k, v) if torch_compat.SDPA_ENABLE_GQA else None
    monkeypatch.setattr(torch_compat, "SDPA_ENABLE_GQA", False)
    got = torch_compat.sdpa_causal(q, k, v)
    want = eager_attention(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if native is not None:
        torch.testing.assert_close(got, native, rtol=0, atol=1e-12)
    g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("new_api", [True, False])
def test_dcp_save_load_without_a_process_group(tmp_path, monkeypatch, new_api):
    """``no_dist`` through DCP's ``save``/``load`` (torch >= 2.7) or, as on older torch, through
    the deprecated ``save_state_dict``/``load_state_dict``: the tensors come back, with no warning."""
    import warnings

    import torch.distributed.checkpoint as dcp

    if new_api and not torch_compat.dcp_takes_no_dist():
        pytest.skip(f"torch {torch.__version__}: dcp.save has no no_dist")
    monkeypatch.setattr(torch_compat, "dcp_takes_no_dist", lambda: new_api)
    state = {"a": torch.arange(6, dtype=torch.float64).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        torch_compat.dcp_save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), planner=None,
                              process_group=None, no_dist=True)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        torch_compat.dcp_load(back, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_store_clone_without_clone_is_a_second_connection(monkeypatch):
    """torch < 2.5 has no ``Store.clone``: a new TCPStore client under the prefix wrappers, with its
    own timeout; a store that is not TCP is refused with the fix."""
    import datetime

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    store = dist.PrefixStore("default_pg", dist.PrefixStore("/worker/attempt_0", server))
    monkeypatch.delattr(dist.Store, "clone", raising=False)
    other = torch_compat.store_clone(store)
    assert other is not store and isinstance(other, dist.TCPStore)
    other.set_timeout(datetime.timedelta(seconds=1))
    assert store.timeout == datetime.timedelta(seconds=30)  # the main connection keeps its timeout
    assert other.add("hexiscale/k", 2) == 2 and server.add("hexiscale/k", 1) == 3  # one server
    with pytest.raises(RuntimeError, match="rendezvous over TCP"):
        torch_compat.store_clone(dist.PrefixStore("p", dist.HashStore()))


def test_dcp_stage_is_a_copy_even_where_torch_stages_cpu_tensors_as_they_are(tmp_path, monkeypatch):
    """torch 2.4's stager returns CPU tensors themselves; the staged state must not follow later
    in-place updates (an asynchronous save writes the values of its step)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(tmp_path))
    monkeypatch.setattr(type(writer), "stage", lambda self, sd: dict(sd))  # torch 2.4 on CPU
    state = {"w": torch.ones(3), "step": 7}
    staged = torch_compat.dcp_stage(writer, state)
    state["w"].add_(1.0)
    assert torch.equal(staged["w"], torch.ones(3)) and staged["step"] == 7
