"""How a ``hexiscale`` command or a recipe ends (``cli.common.end_command``): after torch was imported,
a plain run skips the interpreter's teardown (``os._exit`` after the atexit handlers); a program that
goes on after the script (``python -i``, IPython or Jupyter's ``%run``, a test running it with runpy)
gets a ``SystemExit`` instead, which it catches. ``os._exit`` there ended that program too."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lightning_hexiscale.cli import common
from lightning_hexiscale.runtime import host

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for torch (end_command asks only whether it was imported) and an object whose __del__
# runs only if the interpreter finalizes its module
_SCRIPT = """
import sys, types
sys.modules.setdefault("torch", types.ModuleType("torch"))
from lightning_hexiscale.cli.common import end_command

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

kept = Finalized()
print("work done", flush=True)
end_command(3)
"""


def _run(tmp_path: Path, *flags: str, stdin: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / "recipe.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *flags, str(script)], input=stdin, capture_output=True, text=True,
                          env=env, timeout=60, cwd=tmp_path)


def test_inside_pytest_the_script_raises_system_exit(monkeypatch):
    """runpy'd by a test: SystemExit(code), never the fast exit (it would end pytest itself)."""
    fast = []
    monkeypatch.setattr(host, "exit_without_finalizing", lambda code: fast.append(code))
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or types.ModuleType("torch"))
    with pytest.raises(SystemExit) as ended:
        common.end_command(3)
    assert ended.value.code == 3 and fast == []


def test_ipython_is_asked_whether_it_runs_the_script(monkeypatch):
    """IPython imported (tqdm.auto imports it in plain runs too) is a host only when it has a shell."""
    shell: list = []
    ipython = types.SimpleNamespace(get_ipython=lambda: shell[0] if shell else None)
    # what hosted() reads of sys, as a plain run of a script shows it (no _pytest), IPython imported
    modules = {k: v for k, v in sys.modules.items() if k != "_pytest"} | {"IPython": ipython}
    monkeypatch.setattr(common, "sys", types.SimpleNamespace(flags=types.SimpleNamespace(interactive=0),
                                                             modules=modules))
    assert not common.hosted()
    shell.append(object())  # %run in IPython or a Jupyter kernel
    assert common.hosted()
    del modules["IPython"]
    assert not common.hosted()


@pytest.mark.slow
def test_a_plain_run_skips_the_teardown_and_python_i_keeps_its_prompt(tmp_path):
    plain = _run(tmp_path)
    assert plain.returncode == 3 and plain.stdout == "work done\n", (plain.stdout, plain.stderr)
    interactive = _run(tmp_path, "-i", stdin="print('the prompt went on')\n")
    assert "work done\nthe prompt went on\n" in interactive.stdout, (interactive.stdout, interactive.stderr)
    assert "SystemExit: 3" in interactive.stderr
