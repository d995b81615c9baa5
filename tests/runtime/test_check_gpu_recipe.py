"""recipes/check_gpu.py: its help, its no-CUDA path (exit 0, says so), its watchdog (a hanging
rank is killed and named), and its table. The GPU checks themselves run on GPU nodes only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE = RECIPES / "check_gpu.py"


def test_help():
    out = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--timeout" in out.stdout and "CUDA" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(RECIPES))
    import check_gpu

    assert check_gpu.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "nothing to check" in out


@pytest.mark.timeout(60)
def test_watchdog_kills_a_hang_and_names_the_missing_ranks(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES))
    import check_gpu

    # fork here (no CUDA in this process): the deadline then measures the ranks, not interpreter start-up
    status, missing = check_gpu.run_spawned(check_gpu._sleep_rank, 2, (60.0,), timeout=3.0, start_method="fork")
    assert status == "hang" and list(missing) == [1], (status, missing)


def test_table_lists_every_row(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES))
    import check_gpu

    rows = [check_gpu.Row("a check", "cuda:0", "PASS", "err 1e-9", "atol 1e-6"),
            check_gpu.Row("zero3, 2 pipelines, NCCL", "cuda:0-1", "HANG", "killed", "")]
    text = check_gpu.table(rows)
    assert text.splitlines()[0].split() == ["check", "devices", "result", "measured", "criterion"]
    assert "HANG" in text and "zero3, 2 pipelines, NCCL" in text
    assert set(check_gpu.plans()) == {"1F1B, 2 stages, NCCL", "TP-2 stage, NCCL", "ddp, 2 pipelines, NCCL",
                                      "zero2, 2 pipelines, NCCL", "zero3, 2 pipelines, NCCL"}


@pytest.mark.timeout(120)
def test_checks_pass_on_cpu_stand_ins(monkeypatch):
    """The checks' own logic, on the CPU: the bf16 stage vs float64 comparison (SDPA) and the
    zero3 equivalence across two pipelines on forked gloo ranks both PASS."""
    monkeypatch.syspath_prepend(str(RECIPES))
    import check_gpu

    row = check_gpu.check_stage_accuracy("SDPA", device="cpu")
    assert row.result == "PASS", row
    name = "zero3, 2 pipelines, NCCL"
    row = check_gpu.check_nccl(name, check_gpu.plans()[name], steps=2, timeout=60, cuda=False)
    assert row.result == "PASS", row
