"""Bad input that only shows when a job is started: the recipe's command line (unknown presets and keys,
wrong values of trainer.*, a checkpoint, data or plan file that is not there or not valid, bad
cluster files given by path, a model that fits on no device) and the Python API (strategy
arguments, Trainer settings, DataLoaders, ckpt_path, the module). Every case is refused: the recipe
and ``hexiscale plan`` exit with status 2 and ONE message naming the key, with a fix and no traceback;
the Python API raises the typed error naming the key. None is silently accepted (the valid
counterparts pass: tests/lightning/test_recipes.py, test_good_api_input_passes below). Malformed
cluster/model/plan files through ``hexiscale`` are in test_bad_configs.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from lightning_hexiscale.cli.main import main as cli_main
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "recipes" / "train.py"

BAD = ROOT / "tests" / "bad_configs"

# (command line, what the one message must contain). {tmp} is the test's directory; a case with
# "dry_run=false" fails before planning or launching, every other runs with dry_run=true.
RECIPE_CASES = {
    "unknown_cluster": (["cluster=nope"], ["cluster = 'nope'", "Could not find", "cpu_demo"]),
    "unknown_model": (["model=llama_99b"], ["model = 'llama_99b'", "llama2_7b"]),
    "key_typo": (["trainer.max_step=3"], ["trainer.max_step = '3': no such key in TrainerConfig",
                                          "did you mean trainer.max_steps? (e.g. trainer.max_steps=3)"]),
    # Hydra's own advice for the typo: it would add a key nothing reads and train the default 40 steps
    "key_typo_with_plus": (["+trainer.max_step=3"], ["trainer.max_step = '3': no such key in TrainerConfig",
                                                     "did you mean trainer.max_steps?"]),
    "cluster_key_typo": (["cluster.inter_machine.bandwith=1GB/s"], ["no such key in InterMachineConfig",
                                                                    "did you mean cluster.inter_machine.bandwidth?"]),
    "cluster_file_key_typo": ([f"cluster={BAD}/cluster/key_typo.yaml"], ["cluster.inter_machine.bandwith",
                                                                          "did you mean bandwidth?"]),
    "model_file_key_typo": ([f"model={BAD}/model/key_typo.yaml"], ["model.n_layers = 4: no such key in ModelConfig",
                                                                    "did you mean num_layers?"]),
    "negative_lr": (["trainer.lr=-0.001"], ["trainer.lr = -0.001: the AdamW learning rate must be a positive number"]),
    "zero_adam_eps": (["trainer.adam_eps=0"], ["trainer.adam_eps = 0"]),
    "negative_warmup": (["trainer.warmup_steps=-1"], ["trainer.warmup_steps = -1: must not be negative"]),
    "negative_weight_decay": (["trainer.weight_decay=-0.1"], ["trainer.weight_decay = -0.1"]),
    "zero_clip": (["trainer.gradient_clip_val=0"], ["trainer.gradient_clip_val = 0", "or null for no clipping"]),
    "no_samples": (["data.num_samples=0"], ["data.num_samples = 0: must be at least 1"]),
    "huge_val_samples": (["data.val_samples=1180591620717411303424"],  # 2**70 was cut to a tenth in the ranks
                         ["data.val_samples = 1180591620717411303424: must be at most 134,217,728 sequences"]),
    "sweep_with_unknown_preset": (["-m", "cluster=cpu2,nope"], ["cluster = 'nope'"]),
    "wrong_type": (["train.global_batch=abc"], ["train.global_batch = 'abc': must be an integer",
                                                "e.g. train.global_batch=32"]),
    # a field that is null by default: was "must be the field's type. Fix: see the configuration reference"
    "wrong_type_of_an_unset_field": (["train.micro_batch_size=abc"], ["train.micro_batch_size = 'abc': must be an "
                                                                     "integer. Fix: give an integer, or null"]),
    "wrong_type_float": (["trainer.lr=fast"], ["trainer.lr = 'fast': must be a number", "e.g. trainer.lr=0.003"]),
    "bad_nonfinite_policy": (["trainer.nonfinite=ignore"], ["trainer.nonfinite = 'ignore': must be skip or stop"]),
    "zero_timeout": (["trainer.timeout_s=0"], ["trainer.timeout_s = 0"]),
    "unknown_precision": (["trainer.precision=fp8"], ["trainer.precision = 'fp8': must be one of"]),
    "fp16_mixed": (["trainer.precision=16-mixed"],  # refused, not trained as bf16-mixed on CPU
                   ["trainer.precision = '16-mixed'", "gradient scaler", "use bf16-mixed"]),
    "unknown_launcher": (["trainer.launcher=mpirun"], ["trainer.launcher = 'mpirun'"]),
    "zero_steps": (["trainer.max_steps=0"], ["trainer.max_steps = 0"]),
    "fast_path_typo": (["trainer.fast_path.complie=false"], ["trainer.fast_path.complie",
                                                             "no such key in FastPathConfig",
                                                             "did you mean trainer.fast_path.compile?"]),
    "fast_path_bad_attention": (["trainer.fast_path.attention=flash3"],
                                ["trainer.fast_path.attention = 'flash3': must be one of"]),
    "resume_nowhere": (["trainer.resume={tmp}/gone/last.ckpt"], ["trainer.resume = ", "no such checkpoint"]),
    # a complete checkpoint of llama_tiny: refused before planning (the ranks found it after their setup and
    # every process printed it)
    "resume_another_model": (["model=llama_demo", "trainer.resume={tmp}/tiny.ckpt"],
                             ["model.hidden_size = 256", "was saved for hidden_size=128", "(llama_tiny)"]),
    "resume_a_file": (["trainer.resume={tmp}/a_file.ckpt"], ["trainer.resume = ", "is a directory"]),
    "resume_unquoted_equals": (["trainer.resume={tmp}/checkpoints/epoch=0-step=2.ckpt"],
                               ["trainer.resume = ", "must be quoted", "trainer.resume='"]),
    "output_dir_unwritable": (["trainer.output_dir=/proc/hexiscale_run"], ["trainer.output_dir = '/proc/hexiscale_run': "
                                                                         "cannot create the run's directory"]),
    "plan_nowhere": (["plan={tmp}/gone.yaml"], ["plan = ", "no such plan file"]),
    "plan_for_another_cluster": ([f"plan={BAD}/tiny_plan_for_cpu_hetero4.yaml", "cluster=cpu2", "model=llama_tiny"],
                                 ["device 2 does not exist", "was made for cluster cpu_hetero4",
                                  "cluster=cpu_hetero4", "or leave plan= out to plan for cluster cpu2"]),
    "cluster_file_nowhere": (["cluster={tmp}/gone.yaml"], ["cluster = ", "gone.yaml': no such file"]),
    "model_file_typo": (["model=llama_tny.yaml"], ["model = 'llama_tny.yaml': no such file", "model=llama_tiny"]),
    "plan_for_another_model": ([f"plan={BAD}/good_tiny_plan.yaml", "model=llama2_7b"],
                               ["plan.num_layers = 4: the model llama2_7b has 32 layers"]),
    "text_nowhere": (["data.kind=text", "data.path={tmp}/gone.txt", "dry_run=false"], ["data.path = ", "no such text file"]),
    "bin_odd_size": (["data.kind=bin", "data.path={tmp}/odd.bin", "dry_run=false"],
                     ["data.path = ", "1001 bytes is not a whole number of uint16 tokens"]),
    "bin_without_path": (["data.kind=bin", "dry_run=false"], ["data.path = None: data.kind=bin reads a local file"]),
    "unknown_data_kind": (["data.kind=csv", "dry_run=false"], ["data.kind = 'csv'"]),
    # dry_run=true skipped data.* and said "planned only"; the settings are checked, the file not
    "unknown_data_kind_dry_run": (["data.kind=csv"], ["data.kind = 'csv': must be one of generated, text, bin"]),
    "data_path_without_kind_dry_run": (["data.path=book.txt"], ["data.path = 'book.txt': data.kind=generated",
                                                                "set data.kind=text"]),
    # uint8 passed a dry run ("planned only"): the width is a setting, checked without the file
    "data_dtype_dry_run": (["data.kind=bin", "data.path=tokens.bin", "data.dtype=uint8"],
                           ["data.dtype = 'uint8': must be one of uint16, uint32", "use uint16 or uint32"]),
    # a dry run (a pre-launch check) said "planned only" to a data file that training then refused: where
    # the file is here it is read as training reads it; a text file named as token ids is refused by name
    "bin_odd_size_dry_run": (["data.kind=bin", "data.path={tmp}/odd.bin"],
                             ["data.path = ", "1001 bytes is not a whole number of uint16 tokens"]),
    "text_folder_dry_run": (["data.kind=text", "data.path={tmp}"], ["data.path = ", "is a directory; data.kind=text"]),
    "bin_of_a_text_name_dry_run": (["data.kind=bin", "data.path=nowhere/notes.txt"],
                                   ["data.path = 'nowhere/notes.txt': is a text file (.txt)"]),
    "empty_cluster_file": ([f"cluster={BAD}/cluster/empty.yaml"], ["cluster = ", "the file is empty"]),
    "duplicate_machine_names": ([f"cluster={BAD}/cluster/duplicate_names.yaml"],
                                ["cluster.machines[1].name = 'a': machine names must be unique"]),
    "count_1e30": ([f"cluster={BAD}/cluster/count_1e30.yaml"], ["cluster.machines[1].count = 1e+30"]),
    "unset_env_var": (["train.global_batch=${oc.env:HEXISCALE_TEST_UNSET_GB}"],  # was a traceback, exit 1
                      ["train.global_batch = '${oc.env:HEXISCALE_TEST_UNSET_GB}': cannot be resolved",
                       "set HEXISCALE_TEST_UNSET_GB in the environment, or give a default"]),
    # the search does not run with a plan file: the override changed nothing, without a word
    "planner_override_beside_a_plan_file": ([f"plan={BAD}/good_tiny_plan.yaml", "cluster=cpu_hetero4", "model=llama_tiny",
                                             "planner.iterations=5"],
                                            ["planner.iterations = '5': sets the planner's search, which a plan file skips",
                                             "drop planner.iterations=..., or drop plan="]),
    "fits_nowhere": (["cluster=cpu2", "model=llama2_70b", "planner.iterations=2"],
                     ["no plan fits in memory", "needs 1.0 TiB", "cluster cpu2 has 8.0 GiB"]),
}


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_recipe_rejects_bad_command_line(case, tmp_path, monkeypatch, capfd):
    args, expected = RECIPE_CASES[case]
    (tmp_path / "a_file.ckpt").write_text("not a checkpoint directory")
    (tmp_path / "odd.bin").write_bytes(bytes(1001))  # 500.5 uint16 tokens
    fake_checkpoint(tmp_path / "tiny.ckpt", LlamaConfig.load("llama_tiny"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if not any(a.startswith("dry_run=") for a in args):
        args.append("dry_run=true")
    if not any(a.split("=", 1)[0] == "cluster" for a in args):
        args.insert(0, "cluster=cpu_demo")  # the demo's preset: the default (cluster=auto) would discover first
    code, stdout, stderr = run_recipe([*args, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/sweep"],
                                       tmp_path, monkeypatch, capfd)
    assert code == 2, (code, stderr[-2000:])
    assert "Traceback" not in stderr and "HYDRA_FULL_ERROR" not in stderr, stderr[-2000:]
    errors = [ln for ln in stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Fix:" in errors[0], stderr[-2000:]
    for text in expected:
        assert text in errors[0], errors[0]
    assert "Initializing distributed" not in stderr + stdout  # refused before any rank started


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_dry_run_plans_for_a_data_file_that_is_elsewhere(tmp_path, monkeypatch, capfd):
    """dry_run plans anywhere: the data file may be on the training machines only, so it is not read."""
    code, stdout, stderr = run_recipe(["cluster=cpu_demo", "dry_run=true", "data.kind=text",
                                       f"data.path={tmp_path}/on_the_cluster.txt", f"hydra.run.dir={tmp_path}"],
                                      tmp_path, monkeypatch, capfd)
    assert code == 0 and "dry_run=true: planned only." in stdout, stderr[-2000:]


def run_recipe(argv: list[str], cwd: Path, monkeypatch, capfd) -> tuple[int, str, str]:
    """``python recipes/train.py ARGV`` run in this process (its argv, working directory and environment
    without launch variables), as the docs runner runs ``hexiscale``: a fresh interpreter per case cost
    about a second each (Hydra's imports, and torch's for the cases that read a checkpoint or plan).
    The exit status the script would have, and what it printed."""
    from lightning_hexiscale.cli.train import main
    from lightning_hexiscale.cli.train_job import RECIPE

    monkeypatch.chdir(cwd)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "argv", [str(TRAIN), *argv])  # a launch would re-run the recipe, as from a shell
    capfd.readouterr()
    try:
        code = main(app=RECIPE, launch_prefix=())
    except SystemExit as e:  # what `sys.exit(main(...))` in the script would have ended with
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capfd.readouterr()
    return code, out.out, out.err


def fake_checkpoint(path: Path, model: LlamaConfig) -> None:
    """A complete checkpoint's files as far as the recipe reads them before launching: its marker, DCP's
    index (empty here) and meta.pt naming the model it was saved for."""
    import torch

    from lightning_hexiscale.runtime import checkpoint as ckpt

    path.mkdir()
    (path / ckpt.COMPLETE).write_text(ckpt.FORMAT)
    (path / ".metadata").write_bytes(b"")
    torch.save({"hexiscale": {"format": ckpt.FORMAT, "model": model.to_dict()}}, path / ckpt.META)


def test_cli_plan_says_what_memory_is_missing(capsys):
    assert cli_main(["plan", "cluster=cpu2", "model=llama2_70b", "planner.iterations=2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"needs [\d.]+ TiB .* has [\d.]+ GiB", err), err


def test_only_planner_overrides_the_command_line_gave_are_refused_beside_a_plan_file():
    """The base config always has planner.* (conf/planner/default.yaml): only the command line's overrides
    count, and planner.allow_table_mismatch, which the plan file's estimate reads, passes."""
    from lightning_hexiscale.cli.train_plan import check_search_overrides

    cfg = compose(["cluster=cpu_hetero4", "model=llama_tiny", f"plan={BAD}/good_tiny_plan.yaml"])
    check_search_overrides(cfg, ["cluster=cpu_hetero4", "planner.allow_table_mismatch=true", "train.schedule=gpipe"])
    for given in (["planner.seed=3"], ["+planner.use_all_devices=true"]):
        with pytest.raises(ConfigError, match=r"^planner\.(seed|use_all_devices) = .*which a plan file skips"):
            check_search_overrides(cfg, given)
    check_search_overrides(compose(["cluster=cpu_hetero4"]), ["planner.iterations=5"])  # no plan: the search's


def test_api_raises_typed_errors():
    with pytest.raises(ConfigError, match="cluster = 'nope'"):
        compose(["cluster=nope"])
    with pytest.raises(InfeasiblePlan, match=r"needs 1.0 TiB.*cluster cpu2 has 8.0 GiB"):
        search(Cluster.load("cpu2"), Workload(LlamaConfig.load("llama2_70b")), 8, SearchSettings(iterations=2))
    with pytest.raises(ConfigError, match="train.global_batch = 0: must be a positive integer"):
        search(Cluster.load("cpu2"), Workload(LlamaConfig.load("llama_tiny")), 0, SearchSettings(iterations=2))
