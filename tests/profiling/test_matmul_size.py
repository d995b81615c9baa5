"""``--matmul-size`` (profile, discover): the FLOP/s test's buffers are checked against the ranks' memory
before anything is allocated (``hexiscale profile --matmul-size 100000`` was a 40 GB allocator traceback
from every rank)."""

from __future__ import annotations

import pytest
import torch

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.profiling import discovery_plan as dp


def test_the_three_buffers_must_fit_half_a_ranks_memory():
    from lightning_hexiscale.profiling.measure import check_matmul_size, matmul_size_error

    gib = 2**30
    # 3 x 16384^2 x 4 bytes = 3 GiB: fits half of 8 GiB, not half of 4 GiB
    assert matmul_size_error(16384, torch.float32, 8 * gib, "rank 0's memory") is None
    error = matmul_size_error(16384, torch.float32, 4 * gib, "rank 0's memory")
    assert isinstance(error, ConfigError) and error.key == "--matmul-size" and error.value == 16384
    text = str(error)
    assert "3.0 GiB" in text and "50% of rank 0's memory (4.0 GiB)" in text and "float32" in text
    largest = int(text.split("give --matmul-size ")[1].split()[0])
    assert matmul_size_error(largest, torch.float32, 4 * gib, "x") is None
    assert matmul_size_error(largest + 1, torch.float32, 4 * gib, "x") is not None
    assert matmul_size_error(16384, torch.bfloat16, 4 * gib, "x") is None  # 2 bytes an element: 1.5 GiB
    assert matmul_size_error(None, torch.float32, 1.0, "x") is None  # the default is always measured
    with pytest.raises(ConfigError, match="rank 1's memory"):  # the rank with the least memory is named
        check_matmul_size(16384, torch.float32, [8 * gib, 4 * gib, 6 * gib], cuda=True)


@pytest.mark.parametrize("command", ["profile", "discover"])
def test_a_matmul_size_beyond_the_hosts_memory_is_refused_before_any_rank_starts(command, tmp_path, monkeypatch,
                                                                                  capsys):
    from lightning_hexiscale.cli.main import main
    from lightning_hexiscale.profiling import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(launch, "run_local", no_ranks)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(dp.CACHE_ENV, str(tmp_path / "cache"))
    assert main([command, "--local", "2", "--matmul-size", "100000", "--out", str(tmp_path / "c.yaml"),
                 *(["--model", "llama_tiny"] if command == "discover" else [])]) == 2
    err = capsys.readouterr().err
    assert "--matmul-size = 100000" in err and "111.8 GiB" in err and "give --matmul-size " in err, err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def _profile(rank: int, world: int, n: int):
    from lightning_hexiscale.profiling.measure import profile_process_group

    return profile_process_group(matmul_n=n, matmul_time_s=0.05, sizes=[1024, 4096], reps=1, nics=False)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_ranks_agree_on_the_refusal_under_an_external_launch():
    """torchrun / SLURM / the Python API: no pre-launch check, so every rank gathers the others' memory
    and raises the same error before it allocates; the launcher raises it once."""
    from lightning_hexiscale.profiling.launch import run_local

    with pytest.raises(ConfigError, match=r"--matmul-size = 100000: .* more than 50% of rank \d's memory"):
        run_local(2, _profile, 100000, timeout_s=40)
