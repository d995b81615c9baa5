"""The documentation site (``mkdocs.yml``, pages under ``docs/``) builds with ``mkdocs build --strict``:
every page is in the navigation, every link between pages points at a page and an anchor that exist.
mkdocs and mkdocs-material come with the dev extras (``make install``); without them the build is
skipped, saying so."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (they come with the dev extras: make install)")


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site`` (never into the checkout)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about MkDocs 2.0
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_the_site_builds_strictly(tmp_path):
    r = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    for page in ("index.html", "getting-started/index.html", "guide/lightning/index.html",
                 "reference/configuration/index.html", "concepts/planner/index.html", "results/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert (tmp_path / "site" / "demo_plan.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The strict build is the check: a link to a missing page, or to a missing anchor, fails it."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "concepts" / "planner.md"
    page.write_text(page.read_text() + "\nSee [nowhere](nowhere.md) and [the cost model](cost-model.md#no-such-part).\n")
    r = build(copy / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0
    assert "nowhere.md" in r.stderr and "no-such-part" in r.stderr, r.stderr
