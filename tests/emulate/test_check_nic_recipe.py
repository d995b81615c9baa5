"""benchmarks/check_nic.py: the prices it holds the emulator's measurements against, and a run on plain
local ranks (no root, unshaped: the plumbing, not the figures)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "benchmarks" / "check_nic.py"


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import check_nic
    finally:
        sys.path.remove(str(RECIPE.parent))
    return check_nic


def test_prices_with_and_without_the_nic_term(check):
    """emu_4to1 at 2x: links and the one NIC per machine at 80 MB/s, alpha 0.5 ms; 2 MiB activation."""
    from lightning_hexiscale.config.cluster import Cluster

    c = check.scaled(Cluster.load("emu_4to1"), 2.0)
    B, alpha, size = 80e6, 0.5e-3, 2 << 20
    gather = 50e-6 + (size / 2) / 2e9  # intra-machine all-gather of the other half: as written (loopback)
    p = check.prices(c, size)
    assert p["scatter"][0] == pytest.approx(2 * (alpha + (size / 2) / (B / 2) + gather))
    assert p["scatter"][1] == pytest.approx(2 * (alpha + (size / 2) / B + gather))
    assert p["alone"][0] == p["alone"][1] == pytest.approx(2 * (alpha + size / B))
    assert p["together"][0] == pytest.approx(2 * (alpha + size / (B / 2)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_run_prints_both_errors(check, tmp_path, capsys):
    out = tmp_path / "nic.json"
    assert check.main(["--launcher", "local", "--sizes", "65536", "--reps", "1", "--warmup", "0",
                       "--out", str(out), "--timeout", "240"]) == 0
    figures = json.loads(out.read_text())
    assert {r["scenario"] for r in figures["rows"]} == {"scatter", "alone", "together"}
    assert all(r["measured_s"] > 0 and r["with_nic_s"] > 0 and r["per_pair_s"] > 0 for r in figures["rows"])
    text = capsys.readouterr().out
    assert "with the NIC term" in text and "with every transfer on a link of its own" in text and "load average" in text


def test_sizes_must_split_into_two_float32_halves(check):
    with pytest.raises(SystemExit):
        check.parse_args(["--sizes", "1000,12"])
