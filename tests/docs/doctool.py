"""Documentation that cannot go stale: run the examples of a markdown file and compare what they print.

The convention (docs/writing-docs.md has it for writers, with examples): an HTML comment
``<!-- doc: KIND key=value ... -->`` on the line before a fenced block, a paragraph or an image
says what the test does with it (values with spaces in double quotes; a key may repeat):

- ``run``: the fenced ``bash``/``sh``/``console`` block runs command by command (a trailing ``\\``
  continues a line, ``# ...`` is a comment; a comment saying ``exits N`` expects status N, else 0),
  a ``python`` block runs as a script. ``skip="TEXT: reason"`` leaves out the commands containing
  TEXT; ``replace="OLD => NEW"`` with ``why="..."`` runs a shortened variant (e.g. fewer steps);
  ``timeout=S`` (default 180 s per command).
- ``output``: the fenced block is printed output: of the previous ``run`` block's commands, or of
  ``of="COMMAND"`` (run here, any exit status unless ``exit=N``). It must appear in what the command
  prints now (stdout or stderr, progress bars' carriage returns resolved), as consecutive lines,
  numbers included; a line ``...`` stands for any lines, ``...`` inside a line for any text.
- ``skip``: the fenced block is not run or compared; ``because="..."`` is required.
- ``numbers``: every number of the next paragraph is printed by one of the ``of="COMMAND"``
  commands (equal, or equal once rounded to the paragraph's digits: "24.5" matches 24.515): prose
  that quotes figures goes stale with them.
- ``picture``: the next image (``![...](PATH)``) is the PNG that ``of="COMMAND"`` writes to
  ``file="PATH"``: compared by the description ``cli/picture.py`` embeds (labels, plan, bottleneck),
  not by pixels, which change with the matplotlib version and its fonts.

Every fenced block in a runnable language (bash, sh, shell, console, python, py) and every block
without a language (or ``text``) must carry a marker; data blocks (yaml, json, toml, ...) need none.

Commands run in a scratch directory that links the repository's top-level entries (``conf/``,
``recipes/``, ...), so relative paths work and nothing is written into the checkout. ``hexiscale
ARGS`` runs in this process through the same entry point (``lightning_hexiscale.cli.main.main``),
which saves seconds of imports per command, and so does ``python recipes/train.py ARGS`` (the same
app under the recipe's name); anything else in ``bash``, with the virtual environment's ``bin``
first on ``PATH``. A command runs once per session; later references reuse
its output.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MARKER = re.compile(r"^\s*<!--\s*doc:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py"}
FREE = {"", "text"}
KINDS = {"run", "output", "skip", "numbers", "picture"}
NUMBER = re.compile(r"\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
DEFAULT_TIMEOUT = 180.0


@dataclass
class Marker:
    kind: str
    attrs: dict[str, list[str]]
    line: int

    def one(self, key: str) -> str | None:
        vals = self.attrs.get(key)
        return vals[-1] if vals else None


@dataclass
class Element:
    """A fenced block, a paragraph or an image line of the file, with the marker before it (if any)."""

    kind: str  # fence | paragraph | image
    line: int  # 1-based line of the fence / first line
    text: str
    lang: str = ""
    marker: Marker | None = None


@dataclass
class Result:
    command: str
    code: int
    stdout: str
    stderr: str
    seconds: float


@dataclass
class Problems:
    file: str
    items: list[str] = field(default_factory=list)

    def add(self, line: int, message: str) -> None:
        self.items.append(f"{self.file}:{line}: {message}")


def parse_marker(body: str, line: int) -> Marker:
    tokens = shlex.split(body)
    if not tokens or tokens[0] not in KINDS:
        raise ValueError(f"unknown doc marker {body!r}: the first word must be one of {sorted(KINDS)}")
    attrs: dict[str, list[str]] = {}
    for tok in tokens[1:]:
        key, eq, value = tok.partition("=")
        if not eq:
            raise ValueError(f"doc marker {body!r}: {tok!r} is not key=value")
        attrs.setdefault(key, []).append(value)
    return Marker(tokens[0], attrs, line)


def parse(text: str) -> list[Element]:
    """The file's fenced blocks, paragraphs and image lines, each with the marker just before it."""
    lines = text.splitlines()
    out: list[Element] = []
    pending: Marker | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        if m:
            if pending is not None:
                raise ValueError(f"line {i + 1}: two doc markers in a row (line {pending.line} and {i + 1})")
            pending = parse_marker(m.group(1), i + 1)
            i += 1
            continue
        f = FENCE.match(line)
        if f:
            close = re.compile(rf"^\s*{re.escape(f.group(2)[0])}{{{len(f.group(2))},}}\s*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            out.append(Element("fence", i + 1, "\n".join(lines[i + 1:j]), f.group(3).lower(), pending))
            pending, i = None, j + 1
            continue
        if not line.strip():
            i += 1
            continue
        if IMAGE.fullmatch(line.strip()):
            out.append(Element("image", i + 1, line.strip(), marker=pending))
            pending, i = None, i + 1
            continue
        j = i
        while j < len(lines) and lines[j].strip() and not FENCE.match(lines[j]) and not MARKER.match(lines[j]):
            j += 1
        out.append(Element("paragraph", i + 1, "\n".join(lines[i:j]), marker=pending))
        pending, i = None, j
    if pending is not None:
        raise ValueError(f"line {pending.line}: a doc marker with nothing after it")
    return out


# ---- commands ---------------------------------------------------------------------------------
def split_comment(line: str) -> tuple[str, str]:
    """(command, comment) of one shell line: ``#`` outside quotes, at the start or after a space."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip(), line[k + 1:].strip()
    return line.rstrip(), ""


def commands(block: str) -> list[tuple[str, int]]:
    """(command, expected exit status) of each command of a shell block."""
    out, buf, comments = [], "", []
    for raw in block.splitlines():
        cmd, comment = split_comment(raw)
        comments.append(comment)
        if cmd.endswith("\\"):
            buf += cmd[:-1] + " "
            continue
        cmd = (buf + cmd).strip()
        buf = ""
        if cmd.startswith("$ "):  # a console prompt
            cmd = cmd[2:]
        if cmd:
            said = re.search(r"\bexits?(?: with)?(?: status)? (\d+)\b", " ".join(comments))
            out.append((cmd, int(said.group(1)) if said else 0))
        comments = []
    return out


RECIPE = "recipes/train.py"
"""The recipe whose runs go through ``hexiscale train``'s entry point in this process."""


class Runner:
    """Runs commands in a scratch directory linked to the repository; one result per command."""

    def __init__(self, root: Path, workdir: Path):
        self.root, self.workdir = root, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        for entry in root.iterdir():
            if entry.name in (".git", "outputs", "multirun") or (workdir / entry.name).exists():
                continue
            (workdir / entry.name).symlink_to(entry)
        self.cache: dict[str, Result] = {}
        bindir = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
        self.env.update(PATH=bindir + os.pathsep + self.env.get("PATH", ""), PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(root), self.env.get("PYTHONPATH", "")]))

    def shell(self, command: str, timeout: float = DEFAULT_TIMEOUT) -> Result:
        if command not in self.cache:
            t0 = time.time()
            words = command.split()
            simple = not re.search(r"[|&;<>$`]|^\w+=", command)
            if words[0] == "hexiscale" and simple:
                code, out, err = self._in_process(shlex.split(command)[1:])
            elif words[:2] == ["python", RECIPE] and simple:  # `hexiscale train` under the recipe's name
                code, out, err = self._in_process(shlex.split(command)[2:], recipe=True)
            else:
                p = subprocess.run(["bash", "-c", command], cwd=self.workdir, env=self.env, capture_output=True,
                                   text=True, timeout=timeout)
                code, out, err = p.returncode, p.stdout, p.stderr
            self.cache[command] = Result(command, code, out, err, time.time() - t0)
        return self.cache[command]

    def python(self, source: str, line: int, timeout: float = DEFAULT_TIMEOUT) -> Result:
        key = f"python <<block at line {line}>>\n{source}"
        if key not in self.cache:
            script = self.workdir / f"doc_snippet_{line}.py"
            script.write_text(source + "\n")
            t0 = time.time()
            p = subprocess.run([sys.executable, script.name], cwd=self.workdir, env=self.env, capture_output=True,
                               text=True, timeout=timeout)
            self.cache[key] = Result(f"python {script.name}", p.returncode, p.stdout, p.stderr, time.time() - t0)
        return self.cache[key]

    def _in_process(self, argv: list[str], recipe: bool = False) -> tuple[int, str, str]:
        """``hexiscale ARGV``, or (``recipe``) ``python recipes/train.py ARGV`` with the script as
        ``sys.argv[0]`` (what a launch would re-run, as from a shell)."""
        from lightning_hexiscale.cli.main import main
        from lightning_hexiscale.cli.train import main as train_main
        from lightning_hexiscale.cli.train_job import RECIPE as RECIPE_APP

        out, err = io.StringIO(), io.StringIO()
        here, program = Path.cwd(), sys.argv[0]
        os.chdir(self.workdir)
        if recipe:
            sys.argv[0] = RECIPE
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = train_main(argv, app=RECIPE_APP, launch_prefix=()) if recipe else main(argv)
                except SystemExit as e:  # argparse: --help, usage errors
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        finally:
            os.chdir(here)
            sys.argv[0] = program
        return int(code or 0), out.getvalue(), err.getvalue()


# ---- comparing ----------------------------------------------------------------------------------
def printed_lines(text: str) -> list[str]:
    """Lines as a terminal shows them: a carriage return (progress bars) keeps what follows it."""
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        pieces = [p for p in line.split("\r") if p.strip()]
        lines.append((pieces[-1] if pieces else "").rstrip())
    return lines


def expected_lines(block: str) -> list[str]:
    lines = [ln.rstrip() for ln in block.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _pattern(expected: list[str]) -> re.Pattern:
    parts = []
    for line in expected:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(r"[^\n]*".join(re.escape(p) for p in line.split("...")) + r"\n")
    return re.compile(r"(?m)^" + "".join(parts))


def compare_output(expected_block: str, result: Result) -> str | None:
    """None when the documented lines appear in what the command printed; else a diff against the
    closest stretch of its output."""
    expected = expected_lines(expected_block)
    if not expected:
        return "an empty output block"
    pattern = _pattern(expected)
    streams = [printed_lines(result.stdout), printed_lines(result.stderr),
               printed_lines(result.stdout) + printed_lines(result.stderr)]
    if any(pattern.search("\n".join(s) + "\n") for s in streams):
        return None
    actual = streams[2]
    n = len(expected)
    best, start = -1.0, 0
    for k in range(max(1, len(actual) - n + 1)):
        score = difflib.SequenceMatcher(None, expected, actual[k:k + n]).ratio()
        if score > best:
            best, start = score, k
    diff = "\n".join(difflib.unified_diff(expected, actual[start:start + n], "documented", "printed now", lineterm=""))
    return f"the documented output is not what `{result.command}` prints now (exit {result.code}):\n{diff}"


def numbers_in(text: str) -> list[str]:
    return NUMBER.findall(text)


def stale_numbers(paragraph: str, outputs: list[Result]) -> list[str]:
    """Numbers of ``paragraph`` that no output prints (equal, or equal rounded to the paragraph's digits)."""
    printed = [float(n.replace(",", "")) for r in outputs for n in numbers_in(r.stdout + "\n" + r.stderr)]
    missing = []
    for token in numbers_in(re.sub(r"<!--.*?-->", "", paragraph)):
        value = float(token.replace(",", ""))
        digits = len(token.split(".")[1]) if "." in token else 0
        if not any(round(p, digits) == value for p in printed):
            missing.append(token)
    return missing


# ---- one file -------------------------------------------------------------------------------------
def check_file(path: Path, runner: Runner, rel: str | None = None) -> list[str]:
    """Every problem of one markdown file (unmarked blocks, failed commands, stale output, numbers and
    pictures), each with its file and line."""
    problems = Problems(rel or str(path))
    try:
        elements = parse(path.read_text())
    except ValueError as e:
        problems.add(0, str(e))
        return problems.items
    last_run: list[Result] = []
    for el in elements:
        m = el.marker
        if el.kind == "fence" and m is None and (el.lang in RUNNABLE or el.lang in FREE):
            problems.add(el.line, f"a {el.lang or 'plain'} block without a doc marker: put <!-- doc: run -->, "
                                  "<!-- doc: output ... --> or <!-- doc: skip because=\"...\" --> before it "
                                  "(docs/writing-docs.md)")
            continue
        if m is None:
            continue
        try:
            last_run = _check(el, m, runner, problems, last_run, path)
        except subprocess.TimeoutExpired as e:
            problems.add(el.line, f"`{e.cmd}` ran past its timeout of {e.timeout:g} s (mark it skip, or timeout=)")
    return problems.items


def _check(el: Element, m: Marker, runner: Runner, problems: Problems, last_run: list[Result],
           path: Path) -> list[Result]:
    timeout = float(m.one("timeout") or DEFAULT_TIMEOUT)
    if m.kind == "skip":
        if not (m.one("because") or "").strip():
            problems.add(m.line, "a skip marker needs because=\"...\" (why the block is not run)")
        return last_run
    if m.kind == "run":
        if el.kind != "fence" or el.lang not in RUNNABLE:
            problems.add(m.line, f"<!-- doc: run --> must precede a fenced block in one of {sorted(RUNNABLE)}")
            return last_run
        source = el.text
        replaces = m.attrs.get("replace", [])
        if replaces and not (m.one("why") or "").strip():
            problems.add(m.line, "replace=... needs why=\"...\" (why the test runs a variant)")
        for rep in replaces:
            old, sep, new = rep.partition(" => ")
            if not sep or old not in source:
                problems.add(m.line, f"replace={rep!r}: 'OLD => NEW' with OLD in the block")
            source = source.replace(old, new)
        if el.lang in ("python", "py"):
            r = runner.python(source, el.line, timeout)
            if r.code != 0:
                problems.add(el.line, f"the python block exited {r.code}:\n{(r.stdout + r.stderr)[-3000:]}")
            return [r]
        skips = [s.partition(": ") for s in m.attrs.get("skip", [])]
        for text, sep, why in skips:
            if not sep or not why.strip():
                problems.add(m.line, f"skip={text!r} needs a reason: skip=\"TEXT: reason\"")
        ran = []
        for cmd, want in commands(source):
            if any(text and text in cmd for text, _, _ in skips):
                continue
            r = runner.shell(cmd, timeout)
            ran.append(r)
            if r.code != want:
                problems.add(el.line, f"`{cmd}` exited {r.code}, the docs say {want}:\n{(r.stdout + r.stderr)[-3000:]}")
        return ran
    if m.kind == "output":
        if el.kind != "fence":
            problems.add(m.line, "<!-- doc: output --> must precede a fenced block")
            return last_run
        of = m.one("of")
        results = [runner.shell(of, timeout)] if of else last_run
        if not results:
            problems.add(m.line, "an output block with no run block before it and no of=\"COMMAND\"")
            return last_run
        if of and m.one("exit") is not None and results[0].code != int(m.one("exit")):
            problems.add(el.line, f"`{of}` exited {results[0].code}, expected {m.one('exit')}")
        merged = Result(" && ".join(r.command for r in results), results[-1].code,
                        "".join(r.stdout for r in results), "".join(r.stderr for r in results), 0.0)
        why = compare_output(el.text, merged)
        if why:
            problems.add(el.line, why)
        return last_run
    if m.kind == "numbers":
        ofs = m.attrs.get("of", [])
        if el.kind != "paragraph" or not ofs:
            problems.add(m.line, "<!-- doc: numbers of=\"COMMAND\" --> must precede a paragraph and name a command")
            return last_run
        missing = stale_numbers(el.text, [runner.shell(c, timeout) for c in ofs])
        if missing:
            problems.add(el.line, f"the paragraph quotes {', '.join(missing)}, which {' / '.join(ofs)} does not print "
                                  "now:\n" + el.text)
        return last_run
    # picture
    from lightning_hexiscale.cli.picture import read_description

    of, file = m.one("of"), m.one("file")
    if el.kind != "image" or not of or not file:
        problems.add(m.line, "<!-- doc: picture of=\"COMMAND\" file=\"PATH\" --> must precede an image")
        return last_run
    runner.shell(of, timeout)
    shown = (path.parent / IMAGE.search(el.text).group(1)).resolve()
    drawn = runner.workdir / file
    if not drawn.is_file():
        problems.add(m.line, f"`{of}` wrote no {file}")
        return last_run
    want, have = read_description(drawn), read_description(shown) if shown.is_file() else None
    if want != have:
        import json

        diff = "\n".join(difflib.unified_diff(json.dumps(have, indent=1, sort_keys=True).splitlines(),
                                              json.dumps(want, indent=1, sort_keys=True).splitlines(),
                                              f"{shown.name} (in the docs)", "drawn now", lineterm=""))
        problems.add(el.line, f"{shown.name} is not the picture `{of}` draws now; regenerate it (make docs-picture):\n"
                              f"{diff}")
    return last_run
