"""The wheel is complete on its own: built from the sources, installed into a fresh venv outside the
checkout, it plans and trains from another working directory with its packaged presets, no
``HEXISCALE_CONF_DIR`` and no checkout on the path.

No network: the wheel builds with the checkout venv's setuptools (``--no-build-isolation``), the new
venv sees the already-installed dependencies through a ``.pth`` file naming the checkout venv's
site-packages (a directory named in a ``.pth`` is put on ``sys.path`` but its own ``.pth`` files are
not run, so the editable install's import hook there stays inactive), and the package itself is
installed from the wheel with ``--no-deps --no-index``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lightning_hexiscale"
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "lightning_hexiscale"]
"""What the build reads: the project metadata, the readme and license it names, and the package."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TRAIN = """
import lightning.pytorch as pl
from torch.utils.data import DataLoader

import lightning_hexiscale
from lightning_hexiscale import HexiScaleStrategy, LlamaLitModule
from lightning_hexiscale.data import generated_corpus

loader = DataLoader(generated_corpus(8 * 4, 128), batch_size=8)
module = LlamaLitModule("llama_tiny", lr=1e-3)
strategy = HexiScaleStrategy(cluster="cpu_demo", global_batch=8, planner_iterations=2, use_all_devices=True)
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, loader)
if trainer.is_global_zero:
    print(strategy.plan.table(strategy.cluster))
    print(f"STEPS {trainer.global_step} LOSS {float(trainer.callback_metrics['train_loss']):.4f}")
    print(f"PACKAGE {lightning_hexiscale.__file__}")
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, wheel, work dir, env): the wheel built from a copy of the sources, installed into a venv."""
    base = tmp_path_factory.mktemp("wheel")
    assert not base.resolve().is_relative_to(ROOT), "the test venv must lie outside the checkout"
    src, dist, venv, work = base / "src", base / "dist", base / "venv", base / "work"
    src.mkdir()
    work.mkdir()
    for name in SOURCES:  # a copy, so the build writes its build/ and egg-info there, not in the checkout
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HEXISCALE_CONF_DIR", "VIRTUAL_ENV")}
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], base, env, 180)
    (wheel,) = dist.glob("lightning_hexiscale-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], base, env, 60)
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        base, env, 60).stdout.strip())
    deps = Path(sysconfig.get_paths()["purelib"])  # the checkout venv's installed dependencies
    assert deps.resolve() != ROOT and deps.resolve() != PKG.parent
    (purelib / "checkout_deps.pth").write_text(f"{deps}\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         base, env, 180)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, wheel, work, env


def test_wheel_holds_every_preset_and_the_license(installed):
    _, wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {p.relative_to(PKG.parent).as_posix() for p in (PKG / "conf").rglob("*.yaml")}
    assert len(presets) > 20 and "lightning_hexiscale/conf/config.yaml" in presets
    assert not presets - names, f"presets missing from the wheel: {sorted(presets - names)}"
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses and "Apache License" in zipfile.ZipFile(wheel).read(licenses[0]).decode()


def test_installed_package_comes_from_the_wheel(installed):
    venv, _, work, env = installed
    out = _run([str(venv / "bin" / "python"), "-c",
                "import lightning_hexiscale as m; from lightning_hexiscale.config import conf_dir; "
                "print(m.__file__); print(conf_dir())"], work, env, 120).stdout.split()
    for path in map(Path, out):
        assert path.resolve().is_relative_to(venv.resolve()), f"{path} is not inside the new venv {venv}"
        assert not path.resolve().is_relative_to(ROOT)


def test_installed_hexiscale_plan_runs_outside_the_checkout(installed):
    venv, _, work, env = installed
    # two search iterations: what is checked is that the packaged presets plan, not the search (50: 12 s of CPU more)
    out = _run([str(venv / "bin" / "hexiscale"), "plan", "cluster=hetero3", "model=llama_30b", "planner.iterations=2"],
               work, env, 300).stdout
    assert "pipeline" in out and "stage" in out and "A800" in out, out[-2000:]
    listed = _run([str(venv / "bin" / "hexiscale"), "list"], work, env, 120).stdout
    assert "hetero3" in listed and "conf/plans/hetero3_llama30b_tab7.yaml" in listed
    # the plan paths `hexiscale list` prints load from any working directory
    _run([str(venv / "bin" / "hexiscale"), "estimate", "--plan", "conf/plans/hetero3_llama30b_tab7.yaml",
          "cluster=hetero3", "model=llama_30b"], work, env, 120)


def test_installed_strategy_trains_two_cpu_steps(installed):
    venv, _, work, env = installed
    (work / "train_two_steps.py").write_text(TRAIN)
    out = _run([str(venv / "bin" / "python"), "train_two_steps.py"], work, env, 300).stdout
    assert "STEPS 2 LOSS" in out, out[-3000:]
    loss = float(out.split("STEPS 2 LOSS ")[1].split()[0])
    assert 0 < loss < 10, loss  # finite, near ln(256) = 5.5 for an untrained byte-level model
    package = Path(out.split("PACKAGE ")[1].split()[0])
    assert package.resolve().is_relative_to(venv.resolve()) and not package.resolve().is_relative_to(ROOT)
    assert not list(ROOT.glob("train_two_steps*")), "nothing is written into the checkout"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_installed_first_the_wheel_pulls_no_other_torch(installed, tmp_path):
    """docs/getting-started.md, without the checkout: torch first (from the CPU or CUDA index), then
    the wheel. pip resolving the wheel's dependencies then keeps that torch: offline, every
    requirement is already met, nothing (no torch, no nvidia-* CUDA stack) is to be installed."""
    venv, wheel, _, env = installed
    report = tmp_path / "report.json"
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--dry-run", "--no-index",
          "--report", str(report), "-q", str(wheel)], tmp_path, env, 240)
    names = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert not [n for n in names if n == "torch" or n.startswith("nvidia")], names
