"""The docs checker itself (tests/docs/doctool.py) on small markdown files: each rule of the convention
passes what is current and fails what is stale or unmarked, with the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest
from doctool import Runner, check_file, commands, compare_output, parse, printed_lines, stale_numbers, Result

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner(tmp_path):
    return Runner(ROOT, tmp_path / "work")


def problems(tmp_path: Path, runner: Runner, text: str) -> list[str]:
    md = tmp_path / "page.md"
    md.write_text(text)
    return check_file(md, runner, "page.md")


@pytest.mark.slow
def test_current_examples_pass(tmp_path, runner):
    page = """# Page

<!-- doc: run -->
```bash
echo hello            # prints hello
printf 'a\\nb\\nc\\n'
bash -c 'exit 3'      # exits 3
echo "a # not a comment" \\
    continued
```

<!-- doc: output -->
```
a
...
c
```

<!-- doc: output of="echo 'iteration 0.250 s, 16,354 tokens/s'" -->
```
iteration ... s, 16,354 tokens/s
```

<!-- doc: run -->
```python
print(6 * 7)
```

<!-- doc: output -->
```
42
```

<!-- doc: numbers of="echo 'iteration 24.515 s, 16,354 tokens/s'" -->
The search finds 24.5 s per iteration, 16,354 tokens/s.

<!-- doc: skip because="needs 8 GPUs" -->
```bash
torchrun --nproc-per-node=8 train.py
```

```yaml
unmarked: data blocks need no marker
```
"""
    assert problems(tmp_path, runner, page) == []
    assert runner.cache["echo \"a # not a comment\"      continued"].stdout.strip() == "a # not a comment continued"


@pytest.mark.slow
def test_stale_output_fails_with_a_diff(tmp_path, runner):
    page = """<!-- doc: output of="printf 'plan\\n0  15/15\\n1  17/1\\n'" -->
```
plan
0  14/14
1  18/1
```
"""
    found = problems(tmp_path, runner, page)
    assert len(found) == 1 and found[0].startswith("page.md:2: the documented output is not what")
    assert "-0  14/14" in found[0] and "+0  15/15" in found[0] and "-1  18/1" in found[0]


@pytest.mark.slow
@pytest.mark.parametrize("page,message", [
    ("```bash\necho hi\n```\n", "page.md:1: a bash block without a doc marker"),
    ("```\nsome output\n```\n", "page.md:1: a plain block without a doc marker"),
    ("<!-- doc: skip -->\n```bash\necho hi\n```\n", "page.md:1: a skip marker needs because="),
    ("<!-- doc: run -->\n```bash\nfalse\n```\n", "page.md:2: `false` exited 1, the docs say 0"),
    ("<!-- doc: run -->\n```python\nraise SystemExit(4)\n```\n", "page.md:2: the python block exited 4"),
    ("<!-- doc: run skip=\"echo\" -->\n```bash\necho hi\n```\n", "skip='echo' needs a reason"),
    ("<!-- doc: run replace=\"a => b\" -->\n```bash\necho a\n```\n", "replace=... needs why="),
    ("<!-- doc: numbers of=\"echo 24.515\" -->\nThe search finds 23.1 s.\n", "quotes 23.1, which echo 24.515"),
    ("<!-- doc: runs -->\n```bash\necho\n```\n", "unknown doc marker"),
    ("<!-- doc: output -->\n```\nx\n```\n", "an output block with no run block before it"),
])
def test_each_rule_can_fail(tmp_path, runner, page, message):
    found = problems(tmp_path, runner, page)
    assert len(found) == 1 and message in found[0], found


@pytest.mark.slow
def test_skip_and_replace_shorten_what_runs(tmp_path, runner):
    page = """<!-- doc: run skip="sleep 600: would take ten minutes" replace="steps=100 => steps=2" why="fast" -->
```bash
echo steps=100
sleep 600
```

<!-- doc: output -->
```
steps=2
```
"""
    assert problems(tmp_path, runner, page) == []
    assert not any("sleep" in c for c in runner.cache)


def test_pieces():
    assert commands("a x \\\n  y   # exits 2\nb  # c\n\n") == [("a x    y", 2), ("b", 0)]
    assert printed_lines("search: 10%\rsearch: 100%\ndone\r\n") == ["search: 100%", "done", ""]
    r = Result("c", 0, "one\ntwo\nthree\n", "", 0)
    assert compare_output("one\n...\nthree", r) is None and compare_output("t...o", r) is None
    assert compare_output("one\nthree", r) is not None  # not consecutive
    assert stale_numbers("15 and 17 of 32; 0.25 s", [Result("c", 0, "batch 15/15 17/1 32 0.250", "", 0)]) == []
    assert stale_numbers("14 and 18", [Result("c", 0, "15 17", "", 0)]) == ["14", "18"]
    with pytest.raises(ValueError, match="two doc markers in a row"):
        parse("<!-- doc: run -->\n<!-- doc: skip because=x -->\n```bash\n```\n")


@pytest.mark.slow
def test_a_picture_is_compared_by_what_it_shows(tmp_path, runner):
    from lightning_hexiscale.cli.picture import draw_plan
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.planner import Plan

    cluster = Cluster.load("cpu2")

    def plan(batches):
        return Plan.from_dict({"num_layers": 4, "pipelines": [
            {"batch_size": b, "micro_batch_size": 1, "stages": [{"devices": [d], "layers": [0, 4]}]}
            for d, b in enumerate(batches)]})

    draw_plan(plan([4, 4]), cluster, runner.workdir / "drawn.png", title="t")
    page = '<!-- doc: picture of="true" file="drawn.png" -->\n![plan](shown.png)\n'
    draw_plan(plan([4, 4]), cluster, tmp_path / "shown.png", title="t")  # another drawing of the same plan
    assert problems(tmp_path, runner, page) == []
    draw_plan(plan([5, 3]), cluster, tmp_path / "shown.png", title="t")  # the docs show an older plan
    found = problems(tmp_path, runner, page)
    assert len(found) == 1 and "shown.png is not the picture `true` draws now" in found[0]
    assert '"pipeline 0: batch 5 = 5 micro-batches of 1"' in found[0] and "make docs-picture" in found[0]
