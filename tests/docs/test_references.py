"""The repository cites only files it contains: no code, test or page points a reader at a design or
notes file that lives outside it (a reason is stated where it is used, or a public source is named).
"""

from __future__ import annotations

import pytest

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRIVATE = re.compile(r"\bDESIGN\.md\b|\bNOTES\b|\bNOTES[\w.-]*\.md\b")
"""Citations of the developers' own notes (``DESIGN.md``, ``NOTES-torch-lightning.md``, "(NOTES)")."""

MD_FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Z][A-Z0-9_-]*\.md)\b|(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.md)\b")
"""A repository-style markdown file name: upper-case (``README.md``, ``STYLE.md``) or a path (``docs/x.md``).
Lower-case bare names (``summary.md``, a file the code writes) are not references to the repository."""


def _sources() -> list[Path]:
    """The repository's tracked and untracked-but-not-ignored .py and .md files (what a clone holds)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.md"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    this = Path(__file__).resolve()  # its examples name such files on purpose
    return [ROOT / p for p in out if (ROOT / p).is_file() and (ROOT / p).resolve() != this]


def private_citations(text: str) -> list[str]:
    return PRIVATE.findall(text)


def missing_md_files(text: str, here: Path) -> list[str]:
    """Markdown files ``text`` names that exist neither from the repository root nor beside ``here``."""
    names = {a or b for a, b in MD_FILE.findall(text)}
    return sorted(n for n in names if not (ROOT / n).is_file() and not (here.parent / n).is_file())


def test_the_patterns_catch_what_they_are_for():
    assert private_citations("ranks hang (see NOTES-torch-lightning.md)") and private_citations("as in DESIGN.md")
    assert private_citations("costs little (NOTES), so") and private_citations('(NOTES, "NCCL")')
    assert not private_citations("the NCCL user guide; notes on release")
    here = ROOT / "README.md"
    assert missing_md_files("read STYLE.md and docs/nowhere.md", here) == ["STYLE.md", "docs/nowhere.md"]
    assert missing_md_files("see README.md, CHANGELOG.md and writes summary.md", here) == []


@pytest.mark.slow
def test_no_source_or_page_cites_a_file_outside_the_repository():
    files = _sources()
    assert any(p.name == "README.md" for p in files) and len(files) > 50
    bad = []
    for p in files:
        text = p.read_text(errors="replace")
        bad += [f"{p.relative_to(ROOT)}: {c}" for c in private_citations(text)]
        bad += [f"{p.relative_to(ROOT)}: {n} (no such file)" for n in missing_md_files(text, p)]
    assert not bad, "references to files the repository does not hold (state the reason or cite a public source):\n" + "\n".join(bad)
