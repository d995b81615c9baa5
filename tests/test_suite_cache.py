"""The suite discovers into a cache folder of its own (``tests/conftest.py``), so a test sees the same
cache on a developer's host as on CI, and the developer's ``~/.cache/lightning_hexiscale`` is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hexiscale.profiling import discovery_plan as dp


def test_the_suite_caches_discoveries_under_its_own_temporary_folder(tmp_path_factory):
    folder = dp.cache_dir()
    assert folder.is_relative_to(tmp_path_factory.getbasetemp()), folder
    assert not folder.is_relative_to(Path.home() / ".cache"), folder


@pytest.mark.slow
def test_commands_the_tests_start_inherit_that_folder(tmp_path_factory):
    code = "from lightning_hexiscale.profiling import discovery_plan as dp; print(dp.cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ)).stdout.strip()
    assert Path(out) == dp.cache_dir() and Path(out).is_relative_to(tmp_path_factory.getbasetemp()), out
