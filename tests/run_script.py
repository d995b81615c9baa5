"""A script of the repository run in the test's process as ``python SCRIPT ARGS`` would run it (as
``__main__``, its folder first on ``sys.path``, those ``sys.argv``), for the checks of its command line
(``--help``, a refused argument): a fresh interpreter cost each such check about 2 s of torch's
imports on 2 cores, for an answer that comes before any of the script's work."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def run_script(path: Path, args: list[str], capsys) -> tuple[int, str, str]:
    """The exit status the script would end with (0 when it returns), its stdout and its stderr."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    capsys.readouterr()
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    out = capsys.readouterr()
    return code, out.out, out.err
