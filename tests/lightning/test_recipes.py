"""`hexiscale train` through recipes/train.py: every conf/ preset composes and plans (dry_run, in-process); a real training run
with the default popen launcher under Hydra makes the loss fall (bf16-mixed); a GPU cluster on this
CPU machine exits 3 with the hardware it needs; a world-size mismatch is a clear ConfigError."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from omegaconf import OmegaConf
from strategy_helpers import PG_TIMEOUT, loader, module, plan_of

from lightning_hexiscale.cli import train_fit, train_run
from lightning_hexiscale.config.schema import compose, preset_names
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"


def _dry_run(tmp_path, *overrides: str) -> int:
    cfg = compose(["dry_run=true", "planner.iterations=2", f"trainer.output_dir={tmp_path}", *overrides])
    return train_run.run(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", preset_names("cluster"))
def test_every_cluster_preset_plans(tmp_path, cluster, capsys):
    # A global batch big enough that every device of the largest preset (240 GPUs) gets work.
    assert _dry_run(tmp_path, f"cluster={cluster}", "model=llama_tiny", "train.global_batch=512") == 0
    assert (tmp_path / "plan.yaml").is_file() and "planned only" in capsys.readouterr().out


@pytest.mark.parametrize("model", preset_names("model"))
def test_every_model_preset_plans_on_hetero3(tmp_path, model):
    from lightning_hexiscale.errors import InfeasiblePlan
    from lightning_hexiscale.models.config import LlamaConfig

    if LlamaConfig.load(model).total_params * 16 > 1.8 * 2**40:  # llama3_1_405b: 5.9 TiB of states > hetero3's 1.8 TiB
        with pytest.raises(InfeasiblePlan, match="no plan fits in memory.*cluster hetero3 has 1.8 TiB"):
            _dry_run(tmp_path, "cluster=hetero3", f"model={model}", "train.global_batch=64")
        return
    assert _dry_run(tmp_path, "cluster=hetero3", f"model={model}", "train.global_batch=64") == 0


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    return subprocess.run([sys.executable, str(TRAIN), *args, f"hydra.run.dir={cwd}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_train_recipe_loss_falls(tmp_path):
    # The cluster as a file (cluster=PATH.yaml, as from `hexiscale profile`): the popen children get it too.
    out = _run([f"cluster={ROOT / 'conf' / 'cluster' / 'cpu2.yaml'}", "model=llama_tiny", "train.global_batch=8", "trainer.max_steps=8", "trainer.precision=bf16-mixed",
                "trainer.val_every=4", "trainer.lr=1e-2", "trainer.progress_bar=false", "data.num_samples=256"],
               tmp_path, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"training loss: first ([\d.]+) -> last ([\d.]+)", out.stdout).groups())
    assert last < first - 0.5, out.stdout[-2000:]
    assert "pipeline  batch/mb" in out.stdout  # the plan table
    assert (tmp_path / "checkpoints" / "last.ckpt" / "COMPLETE").is_file()
    # config.yaml records what ran: the precision and the plan's dp_sharding, not the defaults.
    ran, plan = OmegaConf.load(tmp_path / "config.yaml"), OmegaConf.load(tmp_path / "plan.yaml")
    assert ran.trainer.precision == "bf16-mixed" and ran.train.dp_sharding == plan.dp_sharding
    assert ran.train.global_batch == 8 and ran.cluster.name == "cpu2"
    # After 5 warm-up steps the run holds its step against the plan's estimate (lightning/plan_check.py):
    # one line on stdout; cpu2's figures are nominal (not these CPU processes'), so the step is far off
    # its price and the one warning says so. Otherwise a normal run prints nothing on stderr (no other
    # warning, no notice) and no Lightning tip.
    assert out.stdout.count("hexiscale plan check (3 steps after 5 warm-up)") == 1, out.stdout[-3000:]
    other = [ln for ln in out.stderr.splitlines() if "than priced" not in ln and ln.strip()]
    assert other == [], out.stderr[-3000:]
    assert "Tip:" not in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_recipe_async_checkpoints_resume(tmp_path):
    """trainer.async_checkpoint=true: step checkpoints written in the background are complete and a
    second run resumes from one (the step count goes on from it)."""
    common = ["cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "trainer.progress_bar=false",
              "data.num_samples=256", "trainer.checkpoint_every=2", "trainer.async_checkpoint=true"]
    first = tmp_path / "first"
    first.mkdir()
    out = _run([*common, "trainer.max_steps=4"], first, timeout=70)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = sorted(p for p in (first / "checkpoints").iterdir() if p.name != "last.ckpt")
    assert saved and all((p / "COMPLETE").is_file() for p in saved), saved
    assert (first / "checkpoints" / "last.ckpt" / "COMPLETE").is_file()
    assert OmegaConf.load(first / "config.yaml").trainer.async_checkpoint is True
    step2 = next(p for p in saved if "step=2" in p.name)
    second = tmp_path / "second"
    second.mkdir()
    out = _run([*common, "trainer.max_steps=6", f"trainer.resume='{step2}'"], second, timeout=70)
    assert out.returncode == 0, out.stderr[-3000:]
    names = {p.name for p in (second / "checkpoints").iterdir()}
    assert any("step=6" in n for n in names) and not any("step=2" in n for n in names), names


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_gpu_cluster_on_cpu_exits_with_hardware_message(tmp_path, monkeypatch, capfd):
    from test_bad_input_runs import run_recipe  # in this process: it stops before any launch

    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, stdout, stderr = run_recipe(["cluster=hetero3", "model=llama_30b", "planner.iterations=3",
                                       f"hydra.run.dir={tmp_path}"], tmp_path, monkeypatch, capfd)
    assert code == 3, stderr[-2000:]
    assert "Traceback" not in stderr
    for needed in ("56 processes", "A800", "RTX4090", "RTX3090", "torchrun", "srun", "dry_run=true"):
        assert needed in stderr
    assert "iteration" in stdout  # the estimate was printed before


@pytest.mark.timeout(60)
def test_world_size_mismatch_is_a_config_error(tmp_path):
    plan = plan_of([(4, 2, [([0, 1], (0, 4))]), (2, 1, [([2], (0, 2)), ([3], (2, 4))])], cluster="cpu_hetero4")
    strategy = HexiScaleStrategy(plan=plan, start_method="fork", timeout=PG_TIMEOUT)
    with pytest.raises(ConfigError, match=r"the plan runs 4 processes.*devices=4"):  # before any process starts
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False)


def test_bad_recipe_key_exits_2(tmp_path):
    with pytest.raises(ConfigError, match="max_step"):
        compose(["trainer.max_step=3"])
    with pytest.raises(ConfigError, match="data.kind"):
        train_fit.make_data(compose(["data.kind=csv"]), module().config, 8)


def test_the_recipe_drops_a_last_validation_batch_the_strategy_would_leave_out():
    """256 sequences: the last 25 validate, in batches of 8, 8, 8 and 1. Over two pipelines the last
    one cannot give each a sample (the strategy leaves it out and warns): the recipe's loader drops it
    itself, so the same 24 samples validate without a warning. One pipeline can take it: kept."""
    cfg = compose(["data.num_samples=256", "model=llama_tiny"])
    _, two = train_fit.make_data(cfg, module().config, 8, pipeline_batches=[4, 4])
    _, one = train_fit.make_data(cfg, module().config, 8, pipeline_batches=[8])
    assert len(two.dataset) == len(one.dataset) == 25
    assert (two.drop_last, one.drop_last) == (True, False)


def test_fewer_held_out_sequences_than_pipelines_train_and_the_run_says_so(capsys):
    """A 15-sequence corpus holds out 1 to validate; over two pipelines that one batch cannot give
    each a sample, so the strategy left it out: the run said "1 sequence validate", then warned about
    a batch size the recipe sets, and validated nothing. Now it says so and the sequence trains."""
    cfg = compose(["data.num_samples=15", "model=llama_tiny"])
    train, val = train_fit.make_data(cfg, module().config, 8, pipeline_batches=[4, 4])
    assert val is None and len(train.dataset) == 15
    assert ("data.val_samples=64: 1 held-out sequence cannot give each of the plan's 2 pipelines one, so nothing "
            "validates (they train); hold out at least 2") in capsys.readouterr().out
    _, val = train_fit.make_data(cfg, module().config, 8, pipeline_batches=[8])  # one pipeline takes it
    assert len(val.dataset) == 1


def test_too_little_data_counts_the_held_out_sequences(tmp_path):
    """75 sequences against a global batch of 72 said "data = '75 sequences': fewer than one global
    batch (72)" (the 7 held out to validate went unmentioned) and, for a text file, "Fix: use more
    data (data.num_samples)", a key that only the generated corpus reads."""
    book = tmp_path / "book.txt"
    book.write_text("x" * (75 * module().config.seq_len + 1))
    cfg = compose(["data.kind=text", f"data.path={book}", "model=llama_tiny"])
    with pytest.raises(ConfigError, match=r"data = '75 sequences': 68 train \(75 less the 7 held out to validate\), "
                                          r"fewer than one global batch \(72\). Fix: use more data \(a longer "
                                          r"data.path file .*\) or data.val_samples=0, or a smaller"):
        train_fit.make_data(cfg, module().config, 72)
    with pytest.raises(ConfigError, match=r"Fix: use more data \(data.num_samples=79\) or data.val_samples=0"):
        train_fit.make_data(compose(["data.num_samples=75", "model=llama_tiny"]), module().config, 72)


def test_a_capped_validation_split_is_said(capsys):
    """data.val_samples above a tenth of the corpus is cut to the tenth: the run says so (it was silent)."""
    _, val = train_fit.make_data(compose(["data.num_samples=120", "model=llama_tiny"]), module().config, 8)
    assert len(val.dataset) == 12
    assert "data.val_samples=64: 12 sequences validate, a tenth of the 120-sequence corpus" in capsys.readouterr().out
    train_fit.make_data(compose(["data.num_samples=1000", "model=llama_tiny"]), module().config, 8)
    assert "data.val_samples" not in capsys.readouterr().out  # 64 of 1000: as asked


def test_a_resume_path_that_is_no_checkpoint_is_refused_before_planning(tmp_path):
    """trainer.resume=outputs/run/checkpoints (the folder, not last.ckpt in it) passed the early check
    (it exists and is a directory); the ranks refused it after the search and the launch, naming
    ``ckpt_path``, a key the recipe does not have."""
    folder = tmp_path / "checkpoints"
    (folder / "last.ckpt").mkdir(parents=True)
    (folder / "last.ckpt" / "COMPLETE").write_text("hexiscale-checkpoint/2")
    empty, other = tmp_path / "empty", tmp_path / "logs"
    empty.mkdir()
    (other / "version_0").mkdir(parents=True)
    # a run's directory, an empty one and one of logs were "partial checkpoint ... the save was interrupted"
    run_dir = f"a run's directory, not a checkpoint: its checkpoints are in {re.escape(str(folder))} \\(last.ckpt\\)"
    for bad, what in ((folder, "a folder of checkpoints"), (tmp_path, run_dir),
                      (empty, "an empty directory, not a checkpoint"), (other, "holds none of a checkpoint's files")):
        cfg = compose(["cluster=cpu2", "model=llama_tiny", f"trainer.resume={bad}"])
        with pytest.raises(ConfigError, match=f"^trainer.resume = .*{what}"):
            train_run.check_early(cfg)


def test_resume_last_or_best_that_finds_nothing_is_refused_before_planning(tmp_path, capsys):
    """trainer.resume=best failed on every rank after planning and launching (the recipe monitors no
    metric). trainer.resume=last that finds nothing starts from step 0 and says so in a directory the
    user fixed (the first run of a command that resumes on every later one); in Hydra's new per-run
    directory, where it can never find anything, it is refused (test_resume_last_in_hydras_own_directory...)."""
    earlier = tmp_path / "earlier"
    (earlier / "checkpoints" / "last.ckpt").mkdir(parents=True)
    (earlier / "checkpoints" / "last.ckpt" / "COMPLETE").write_text("hexiscale-checkpoint/2")
    base = ["cluster=cpu2", "model=llama_tiny"]
    train_run.check_early(compose([*base, f"trainer.output_dir={tmp_path / 'new'}", "trainer.resume=last"]))
    assert f"trainer.resume=last: no last.ckpt in {tmp_path / 'new' / 'checkpoints'} yet, so training starts " \
           "from step 0" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="^trainer.resume = 'best': the recipe's ModelCheckpoint monitors no metric"):
        train_run.check_early(compose([*base, f"trainer.output_dir={earlier}", "trainer.resume=best"]))
    train_run.check_early(compose([*base, f"trainer.output_dir={earlier}", "trainer.resume=last"]))  # finds it
    assert "no last.ckpt" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_resume_last_in_hydras_own_directory_is_refused_before_planning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    out = subprocess.run([sys.executable, str(TRAIN), "cluster=cpu2", "model=llama_tiny", "trainer.resume=last"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.search(r"trainer.resume = 'last': .*/outputs/.*/checkpoints holds none: Hydra gives every run a new "
                     r"directory.*Fix: .*trainer.output_dir=<its output dir> trainer.resume=last", out.stderr), out.stderr
    assert "Traceback" not in out.stderr and "pipeline  batch/mb" not in out.stdout
