"""Every runnable example of README.md and docs/**/*.md runs, and what the docs show it printing is what
it prints now, numbers included (convention: tests/docs/doctool.py, docs/writing-docs.md). A failure
lists every stale block of the file with its line and a diff, so that a change of the planner's
numbers shows which documented outputs to update.

Not run (marked ``skip`` in the files, each with its reason): anything that needs GPUs, root, other
machines, downloaded weights, a checkpoint of an earlier run, or minutes of CPU (``make demo``'s
training, the benchmarks, the profiler, sweeps)."""

from __future__ import annotations

from pathlib import Path

import pytest
from doctool import Runner, check_file

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(ROOT, tmp_path_factory.mktemp("docs-work"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_documented_examples_run_and_print_what_the_docs_show(path, runner):
    found = check_file(path, runner, str(path.relative_to(ROOT)))
    assert not found, f"{len(found)} problem(s):\n\n" + "\n\n".join(found)
