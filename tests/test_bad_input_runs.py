"""Bad input that only shows when a job is started: an unknown preset or key on the recipe's command
line, a model that fits on no device. Each gives one message (key, value, rule, fix), exit status 2
and no traceback from ``recipes/train.py`` and ``hexiscale plan``; the Python API raises the typed
error. (Malformed files are in test_bad_configs.py; a world size that does not match the plan is
tests/strategy/test_recipes.py::test_world_size_mismatch_is_a_config_error.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main as cli_main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner.estimate import Workload
from lightning_hexiscale.planner.search import SearchSettings, search

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "recipes" / "train.py"

# (command line, what the one message must contain)
RECIPE_CASES = {
    "unknown_cluster": (["cluster=nope"], ["cluster = 'nope'", "Could not find", "cpu_hetero4"]),
    "unknown_model": (["model=llama_99b"], ["model = 'llama_99b'", "llama2_7b"]),
    "key_typo": (["trainer.max_step=3"], ["trainer.max_step", "Key 'max_step' not in 'TrainerConfig'"]),
    "sweep_with_unknown_preset": (["-m", "cluster=cpu2,nope"], ["cluster = 'nope'"]),
    "wrong_type": (["train.global_batch=abc"], ["train.global_batch=abc", "could not be converted to Integer"]),
    "bad_nonfinite_policy": (["trainer.nonfinite=ignore"], ["trainer.nonfinite = 'ignore': must be skip or stop"]),
    "zero_timeout": (["trainer.timeout_s=0"], ["trainer.timeout_s = 0"]),
    "fits_nowhere": (["cluster=cpu2", "model=llama2_70b", "planner.iterations=2"],
                     ["no plan fits in memory", "needs 1.0 TiB", "cluster cpu2 has 8.0 GiB"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_recipe_rejects_bad_command_line(case, tmp_path):
    args, expected = RECIPE_CASES[case]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, str(TRAIN), *args, "dry_run=true", f"hydra.run.dir={tmp_path}",
                          f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Fix:" in errors[0], out.stderr[-2000:]
    for text in expected:
        assert text in errors[0], errors[0]


def test_cli_plan_says_what_memory_is_missing(capsys):
    assert cli_main(["plan", "cluster=cpu2", "model=llama2_70b", "planner.iterations=2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"needs [\d.]+ TiB .* has [\d.]+ GiB", err), err


def test_api_raises_typed_errors():
    with pytest.raises(ConfigError, match="cluster = 'nope'"):
        compose(["cluster=nope"])
    with pytest.raises(InfeasiblePlan, match=r"needs 1.0 TiB.*cluster cpu2 has 8.0 GiB"):
        search(Cluster.load("cpu2"), Workload(LlamaConfig.load("llama2_70b")), 8, SearchSettings(iterations=2))
    with pytest.raises(ConfigError, match="train.global_batch = 0: must be a positive integer"):
        search(Cluster.load("cpu2"), Workload(LlamaConfig.load("llama_tiny")), 0, SearchSettings(iterations=2))
