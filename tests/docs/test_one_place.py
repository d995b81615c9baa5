"""The README and the pages under docs/ say each thing in one place: no sentence of prose appears
twice, in one file or across files (a copy goes stale while the other is updated; link instead)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from doctool import parse

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
MIN_CHARS = 80
"""Shorter sentences (a lead-in such as "Tested:", a one-line link) may repeat."""
SENTENCE_END = re.compile(r"(?<=[.;:])\s+(?=[A-Z(`*])")


def sentences(text: str) -> list[tuple[int, str]]:
    """(line of its paragraph, normalised text) of every prose sentence of a markdown file of at
    least MIN_CHARS (whitespace collapsed; fenced blocks, tables, images and doc markers are not prose)."""
    out = []
    for el in parse(text):
        if el.kind != "paragraph" or el.text.lstrip().startswith("|"):  # tables: data, e.g. a results row
            continue
        norm = " ".join(re.sub(r"<!--.*?-->", "", el.text).split())
        out += [(el.line, s) for s in SENTENCE_END.split(norm) if len(s) >= MIN_CHARS]
    return out


def repeated(files: dict[str, str]) -> list[str]:
    """Every sentence that appears more than once, with each place it appears."""
    seen: dict[str, list[str]] = defaultdict(list)
    for name, text in files.items():
        for line, para in sentences(text):
            seen[para].append(f"{name}:{line}")
    return [f"{' and '.join(places)}: {para[:100]}..." for para, places in seen.items() if len(places) > 1]


def test_the_check_finds_a_copied_sentence():
    para = "A sentence long enough to count as prose, which says one thing and then says it again at length."
    assert repeated({"a.md": f"# A\n\n{para}\n", "b.md": f"# B\n\n{para}\n\nSomething else entirely.\n"})
    assert repeated({"a.md": f"{para}\n\n{para}\n"})
    assert not repeated({"a.md": f"{para}\n", "b.md": para.replace("one thing", "another") + "\n"})
    assert not repeated({"a.md": "short\n", "b.md": "short\n"})
    # one sentence copied into another paragraph
    assert repeated({"a.md": f"Intro. {para}\n", "b.md": f"Other words here. {para} And more.\n"})


def test_readme_and_docs_say_each_thing_in_one_place():
    found = repeated({str(p.relative_to(ROOT)): p.read_text() for p in FILES})
    assert not found, "sentences said twice (keep one, link to it from the other place):\n" + "\n".join(found)
