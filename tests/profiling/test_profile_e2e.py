"""A real 2-rank CPU profile, end to end through the CLI: forked gloo ranks -> YAML -> Cluster."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.cluster import Cluster


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_profile_local_two_ranks(tmp_path, capsys):
    out = tmp_path / "cpu2_profiled.yaml"
    rc = main(["profile", "--local", "2", "--out", str(out), "--sizes", "1KiB,1MiB,8MiB",
               "--reps", "3", "--matmul-size", "256", "--matmul-time", "0.2", "--timeout", "45"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rank   1" in text and "wrote" in text
    c = Cluster.load(str(out))
    assert c.num_devices == 2 and len(c.machines) == 1 and c.devices[0].gpu_type == "CPU"
    # Plausible figures for one CPU core and loopback TCP, not exact ones (shared machine).
    assert 1e8 < c.devices[0].flops < 1e13
    assert 0 < c.memory[0] <= c.memory.sum() / 2 * 1.0001
    assert np.isfinite(c.bandwidth[0, 1]) and 1e7 < c.bandwidth[0, 1] < 1e12
    assert 0 <= c.latency[0, 1] < 0.1
    assert c.bandwidth[0, 1] == c.bandwidth[1, 0]


def test_profile_errors_without_a_launcher(monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert main(["profile", "--out", "x.yaml"]) == 2
    assert "--local N" in capsys.readouterr().err


def test_profile_rejects_one_size(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--local", "2", "--sizes", "1KiB"])
    assert "two distinct sizes" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["profile", "discover"])
def test_a_message_size_without_its_unit_is_refused_with_a_message_size_example(command, capsys):
    """The size parser's own example is a memory size ("80 GiB"); ``--sizes`` names message sizes."""
    extra = ["--model", "llama_tiny"] if command == "discover" else []
    for bad, rule in (("1024,4MiB", "needs a unit"), ("1KiB,4Gbps", "unknown size unit 'Gbps'")):
        with pytest.raises(SystemExit):
            main([command, "--local", "2", *extra, "--sizes", bad])
        err = capsys.readouterr().err
        assert rule in err and "1KiB,64KiB,1MiB,4MiB" in err and "80 GiB" not in err, err
