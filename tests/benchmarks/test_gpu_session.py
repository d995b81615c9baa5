"""benchmarks/gpu_session.sh, the one prepared call for a lent GPU machine, cannot rot unseen: it
parses, every test, benchmark and recipe it names exists (a renamed test would make the lent minutes
run nothing), and its checks' limits fit the device tool's 10 minutes a call."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
CALL_LIMIT_S = 600
"""The device tool's limit on one command."""


@pytest.mark.slow  # starts bash
def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_everything_it_names_exists():
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b((?:tests|benchmarks|recipes)/[\w/]+\.py)(?:::(\w+))?", text))
    assert {p for p, _ in named} >= {"benchmarks/bench_one_gpu.py", "recipes/check_gpu.py",
                                     "tests/profiling/test_discover_local.py"}
    for path, test in named:
        assert (ROOT / path).is_file(), path
        if test:
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{path}::{test}"


def test_the_limits_fit_one_call_and_the_wheels_have_a_target():
    limits = [int(s) for s in re.findall(r"^check \w+ (\d+) ", SCRIPT.read_text(), re.M)]
    assert len(limits) == 3 and sum(limits) + 30 <= CALL_LIMIT_S, limits  # 30 s: the install and the header
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-wheels:", makefile, re.M) and ".whl/" in (ROOT / ".gitignore").read_text()
