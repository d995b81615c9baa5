"""Every file under tests/bad_configs/ is rejected by the CLI with exit status 2, no traceback, and a
message that contains the file's `# expect:` line (key, value and rule) and a fix.

Cluster files are checked with `hexiscale cluster cluster=FILE`, model files with `hexiscale
estimate` of a valid plan and `model=FILE`, plan files with `hexiscale estimate --plan FILE ARGS`
where ARGS comes from the file's `# args:` line. The Python API raises the typed error instead.
"""

from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import HexiScaleError

ROOT = Path(__file__).parent / "bad_configs"
GOOD_TINY_PLAN = "tests/bad_configs/good_tiny_plan.yaml"


def _header(path: Path, key: str) -> str:
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():  # not_utf8.yaml's header is text
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].strip()
    return ""


def _cases(kind):
    return sorted(ROOT.glob(f"{kind}/*.yaml"), key=lambda p: p.name)


def _check(argv, path, capsys):
    assert main(argv) == 2, f"{path.name} was accepted"
    err = capsys.readouterr().err
    assert _header(path, "expect") in err, err
    assert "Fix:" in err and "Traceback" not in err


@pytest.mark.parametrize("path", _cases("cluster"), ids=lambda p: p.stem)
def test_bad_cluster(path, capsys):
    _check(["cluster", f"cluster={path.relative_to(Path.cwd()) if path.is_absolute() else path}"], path, capsys)
    with pytest.raises(HexiScaleError):
        Cluster.load(str(path))


@pytest.mark.parametrize("path", _cases("model"), ids=lambda p: p.stem)
def test_bad_model(path, capsys):
    _check(["estimate", "--plan", GOOD_TINY_PLAN, "cluster=cpu_hetero4", f"model={path}"], path, capsys)


@pytest.mark.parametrize("path", _cases("plan"), ids=lambda p: p.stem)
def test_bad_plan(path, capsys):
    _check(["estimate", "--plan", str(path), *_header(path, "args").split()], path, capsys)


def test_good_plan_passes(capsys):
    assert main(["estimate", "--plan", GOOD_TINY_PLAN, "cluster=cpu_hetero4", "model=llama_tiny"]) == 0
