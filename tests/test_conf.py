"""Every preset under conf/ composes through Hydra and builds its typed object."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose, preset_names
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import workload_from_config


@pytest.mark.parametrize("model", preset_names("model"))
def test_every_model_preset(model):
    cfg = compose([f"model={model}"])
    m = LlamaConfig.from_config(cfg.model)
    assert m.name == model and m.total_params > 0
    assert workload_from_config(cfg).model == m


def test_root_config_defaults():
    cfg = compose([])
    assert cfg.cluster.name == "cpu_demo" and cfg.model.name == "llama_demo"
    assert cfg.train.schedule == "1f1b" and cfg.planner.iterations > 0
    assert Cluster.from_config(cfg.cluster).num_devices == 4


@pytest.mark.parametrize("override,fragment", [
    ("train.global_batchh=3", "train.global_batchh = '3': no such key in TrainConfig. "
                              "Fix: did you mean train.global_batch? (e.g. train.global_batch=3)"),
    # Hydra adds a +key that no schema has, and nothing reads it: the run would plan the default batch
    ("+train.global_bach=8", "train.global_bach = '8': no such key in TrainConfig"),
    # '+' on a key that exists: Hydra's message named the whole command line and the fix pointed at conf/
    ("+train.global_batch=8", "train.global_batch = '+train.global_batch=8': '+' adds a key the configuration "
                              "does not have, and this one is there already. Fix: drop the '+': train.global_batch=8"),
    # the key of another section (trainer.lr): the fix listed train's keys only
    ("train.lr=1e-3", "train.lr = '1e-3': no such key in TrainConfig. Fix: did you mean trainer.lr? (e.g. trainer.lr=1e-3)"),
    # ... and before a near name of its own section (it said trainer.limit_val_batches)
    ("trainer.global_batch=8", "Fix: did you mean train.global_batch? (e.g. train.global_batch=8)"),
    ("planner.iterations=many", "planner.iterations = 'many': must be an integer. Fix: e.g. planner.iterations=50"),
    ("train.global_batch=1.5", "train.global_batch = '1.5': must be an integer"),
    ("model.hidden_size=abc", "model.hidden_size = 'abc': must be an integer"),
    # OmegaConf's InterpolationResolutionError was a traceback from wherever the value was first read
    ("train.global_batch=${oc.env:HEXISCALE_TEST_UNSET_GB}", "train.global_batch = '${oc.env:HEXISCALE_TEST_UNSET_GB}': "
                                                            "cannot be resolved"),
    # a list index past the end: OmegaConf's "dict is not a subclass of MachineConfig" named every override
    ("cluster.machines.5.count=2", "cluster.machines.5.count = '2': cluster.machines has 1 entry (index 0 to 0)"),
    # a list's entry by its name: OmegaConf's "Index 'host' (str) is not an int" named every override
    ("cluster.machines.host.count=4", "cluster.machines.host.count = '4': cluster.machines is a list, indexed by "
                                      "position (0 to 0), not by a name like 'host'. Fix: write "
                                      "cluster.machines.0.count=4 (cluster.machines.0 is host)"),
    ("+cluster.machines.nope.count=4", "not by a name like 'nope'. Fix: index it by position (0 host): e.g. "
                                       "cluster.machines.0.count=4"),
    # an entry a typed mapping lacks: Hydra advised '+', which OmegaConf then refused ("dict is not a subclass")
    ("cluster.gpu_types.CPU-FAST.flops=1TFLOPS", "cluster.gpu_types.CPU-FAST.flops = '1TFLOPS': cluster.gpu_types "
                                                 "has no entry CPU-FAST (its entries: none); CPU-FAST is the catalog's "
                                                 "built-in type (100 GFLOPS, 4.0 GiB), which a cluster file redefines "
                                                 "under gpu_types, and an override cannot add an entry of GpuTypeConfig. "
                                                 "Fix: write gpu_types: {CPU-FAST: {flops: ..., memory: ...}} in a "
                                                 "cluster file"),
    ("+cluster.gpu_types.X.flops=1TFLOPS", "cluster.gpu_types has no entry X (its entries: none); an override cannot "
                                           "add an entry of GpuTypeConfig. Fix: write the new entry in a cluster file "
                                           "and pass cluster=FILE.yaml"),
    # a key in a section the preset leaves null: OmegaConf's "'NoneType' object has no attribute 'get'"
    ("cluster.machines.0.nics.count=1", "cluster.machines.0.nics.count = '1': cluster.machines.0.nics is null here"),
    ("model.rope_scaling={factor: 8.0}", "model.rope_scaling = '{factor: 8.0}': model.rope_scaling is null here, and "
                                         "an override cannot fill in a null RopeScalingConfig section"),
    ("train.global_batch=${train.nope}", "train.global_batch = '${train.nope}': cannot be resolved: Interpolation key "
                                         "'train.nope' not found"),
    # a section's key at the top: Hydra named the whole command line and advised +max_steps=3
    # Python's list index: "no such key machines[0] ... did you mean machines?"
    ("cluster.machines[0].count=2", "cluster.machines[0].count = '2': a Hydra override indexes a list with a dot, not "
                                    "brackets. Fix: write cluster.machines.0.count=2"),
    # a group set to null: Hydra's "Config group override must be a string or a list" named no group
    ("cluster=null", "cluster = 'null': a config group takes a preset, and null chooses none (every run needs one). "
                     "Fix: name one, e.g. cluster=cpu_hetero4 (presets: case_study,"),
    ("planner=NULL", "planner = 'NULL': a config group takes a preset, and null chooses none"),
    ("max_steps=3", "max_steps = '3': no such key at the top of the config (HexiScaleConfig). "
                    "Fix: did you mean trainer.max_steps? (e.g. trainer.max_steps=3)"),
    ("global_batch=8", "Fix: did you mean train.global_batch? (e.g. train.global_batch=8)"),
    ("globl_batch=8", "Fix: did you mean train.global_batch?"),
    ("dryrun=true", "Fix: did you mean dry_run? (e.g. dry_run=true)"),
    ("zzzz=1", "Fix: the top-level keys are cluster, model, train, planner, trainer, data, plan, dry_run"),
    # ... and on that advice Hydra added a value nothing reads: the run trained the default steps
    ("+max_steps=3", "max_steps = '3': no such key at the top of the config (HexiScaleConfig). "
                     "Fix: did you mean trainer.max_steps?"),
    ("++precision=bf16-mixed", "Fix: did you mean trainer.precision? (e.g. trainer.precision=bf16-mixed)"),
])
def test_typos_and_wrong_types_fail_clearly(override, fragment):
    """One key named, with the closest field or the type (Hydra's message named the whole command line)."""
    import re

    from lightning_hexiscale.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        compose(["cluster=cpu2", override])


def test_a_config_group_of_the_users_own_still_composes_at_the_top(tmp_path):
    """A top-level key Hydra refuses gets the key it meant, but a group the user adds (``+experiment=x``
    of ``@package _global_``, the usual way to keep experiments) composes as before: only plain values
    are refused."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "short.yaml").write_text("# @package _global_\ntrain:\n  global_batch: 8\n")
    where = f"hydra.searchpath=[file://{tmp_path}]"
    cfg = compose(["cluster=cpu2", where, "+experiment=short"])
    assert cfg.train.global_batch == 8


def test_presets_listed():
    assert {"case_study", "hetero1", "hetero2", "hetero3", "large_240", "cpu_hetero4"} <= set(preset_names("cluster"))
    assert {"homo_a800_2x8_eth", "homo_a800_2x8_rdma", "homo_a800_4x8_eth", "homo_a800_4x8_rdma"} <= set(preset_names("cluster"))
    assert {"h800_h20_16", "h800_h20_24", "h800_h20_32"} <= set(preset_names("cluster"))
    assert {"llama_tiny", "llama2_7b", "llama2_13b", "llama_30b", "llama2_70b"} <= set(preset_names("model"))


def test_presets_are_package_data_and_the_env_var_overrides(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    import lightning_hexiscale
    from lightning_hexiscale.config.schema import conf_dir, packaged_file
    from lightning_hexiscale.errors import ConfigError
    from lightning_hexiscale.planner import Plan

    monkeypatch.delenv("HEXISCALE_CONF_DIR", raising=False)
    assert conf_dir() == Path(lightning_hexiscale.__file__).resolve().parent / "conf"
    monkeypatch.chdir(tmp_path)  # checkout-style paths resolve to the packaged presets from anywhere
    assert Plan.load("conf/plans/hetero3_llama30b_tab7.yaml").meta["cluster"] == "hetero3"
    assert packaged_file("plans/hetero3_llama30b_tab7.yaml") == conf_dir() / "plans" / "hetero3_llama30b_tab7.yaml"
    assert packaged_file("conf/plans/nowhere.yaml") is None and packaged_file(tmp_path / "x.yaml") is None
    with pytest.raises(ConfigError, match="no such plan file"):
        Plan.load("conf/plans/nowhere.yaml")
    other = tmp_path / "myconf"
    shutil.copytree(conf_dir(), other)
    (other / "cluster" / "cpu2.yaml").write_text((other / "cluster" / "cpu2.yaml").read_text().replace("name: cpu2", "name: mine"))
    monkeypatch.setenv("HEXISCALE_CONF_DIR", str(other))
    assert conf_dir() == other.resolve() and compose(["cluster=cpu2"]).cluster.name == "mine"


def _my_conf_dir(tmp_path):
    """A user's own config directory holding one cluster preset, ``mine`` (the cpu2 machines renamed)."""
    from lightning_hexiscale.config.schema import conf_dir

    mine = tmp_path / "myconf" / "cluster" / "mine.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text((conf_dir() / "cluster" / "cpu2.yaml").read_text().replace("name: cpu2", "name: mine"))
    return mine.parent.parent


def test_presets_of_a_users_config_dir_pass_the_command_line_check(tmp_path):
    """Hydra's --config-dir (and hydra.searchpath) adds a user's presets; the train app's check of the
    command line composed the package's presets only and refused cluster=mine ("Could not find
    'cluster/mine'") before Hydra, which would have found it, ran."""
    import re

    from lightning_hexiscale.cli.train_job import check_overrides
    from lightning_hexiscale.errors import ConfigError

    mine = _my_conf_dir(tmp_path)
    for flags in (["--config-dir", str(mine)], [f"--config-dir={mine}"], ["-cd", str(mine)],
                  [f"hydra.searchpath=[file://{mine}]"]):
        check_overrides([*flags, "cluster=mine", "model=llama_tiny", "train.global_batch=8"])
        check_overrides(["-m", *flags, "cluster=mine,cpu2", "model=llama_tiny"])
    with pytest.raises(ConfigError, match=re.escape("trainer.max_step = '3': no such key")):
        check_overrides(["--config-dir", str(mine), "cluster=mine", "+trainer.max_step=3"])
    with pytest.raises(ConfigError, match=re.escape("cluster = 'nope'")):
        check_overrides(["--config-dir", str(mine), "cluster=nope"])
    # Hydra's own answer: "Additional config directory ... not found", exit status 1, after a UserWarning
    with pytest.raises(ConfigError, match=re.escape(f"--config-dir = '{tmp_path}/nowhere': no such directory")):
        check_overrides(["--config-dir", str(tmp_path / "nowhere"), "cluster=cpu2"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_recipe_plans_on_a_preset_of_a_users_config_dir(tmp_path, monkeypatch, capfd):
    from test_bad_input_runs import run_recipe

    mine = _my_conf_dir(tmp_path)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, stdout, stderr = run_recipe(["--config-dir", str(mine), "cluster=mine", "model=llama_tiny", "dry_run=true",
                                       "planner.iterations=2", f"hydra.run.dir={tmp_path / 'run'}"],
                                      tmp_path, monkeypatch, capfd)
    assert code == 0, stderr[-3000:]
    assert "cluster mine: 2 devices" in stdout and (tmp_path / "run" / "plan.yaml").is_file()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_recipe_applies_key_overrides_to_cluster_and_model_files(tmp_path, monkeypatch, capfd):
    """cluster=FILE cluster.KEY=V (and model=FILE model.KEY=V): Hydra applied the key to the default
    preset that the file then replaced, so the run planned on the file's own 10 GB/s and 4 layers
    while `hexiscale plan` with the same command line used the override."""
    import yaml
    from test_bad_input_runs import run_recipe

    from lightning_hexiscale.config.schema import conf_dir

    cluster, model = _my_conf_dir(tmp_path) / "cluster" / "mine.yaml", tmp_path / "tiny.yaml"
    model.write_text((conf_dir() / "model" / "llama_tiny.yaml").read_text())
    assert yaml.safe_load(model.read_text())["num_layers"] != 2 and "10 GB/s" in cluster.read_text()
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, stdout, stderr = run_recipe([f"cluster={cluster}", "cluster.machines.0.intra_bandwidth=1 GB/s",
                                       f"model={model}", "model.num_layers=2", "dry_run=true", "planner.iterations=2",
                                       f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, monkeypatch, capfd)
    assert code == 0, stderr[-3000:]
    assert "intra 1 GB/s" in stdout, stdout[-3000:]
    ran = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert ran["cluster"]["machines"][0]["intra_bandwidth"] == "1 GB/s" and ran["model"]["num_layers"] == 2
    assert yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["num_layers"] == 2


def test_a_sweep_takes_a_cluster_file_and_refuses_a_sweep_over_files(tmp_path, monkeypatch):
    """-m with cluster=FILE: Hydra looked for a preset of that name ("Could not find", exit 1); the file
    now stands for every point, as in a single run. A sweep over files names the way that works."""
    import json
    import os
    import re

    from lightning_hexiscale.cli.train_job import FILES_ENV, take_file_overrides
    from lightning_hexiscale.errors import ConfigError

    monkeypatch.delenv(FILES_ENV, raising=False)
    mine = _my_conf_dir(tmp_path) / "cluster" / "mine.yaml"
    assert take_file_overrides(["-m", f"cluster={mine}", "train.global_batch=8,16"]) == ["-m", "train.global_batch=8,16"]
    assert json.loads(os.environ[FILES_ENV]) == {"cluster": str(mine.resolve())}
    with pytest.raises(ConfigError, match=re.escape("a -m sweep chooses among presets") + ".*"
                       + re.escape("--config-dir DIR cluster=mine,cpu2")):
        take_file_overrides(["-m", f"cluster={mine},cpu2"])


def _reference_rows() -> dict[str, str]:
    """key -> default cell of every table row of the configuration reference whose first cell names
    keys (``| `train.global_batch` | `32` | ... |``; ``, `.fused_norm``` continues the first key's parent)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md").read_text()
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        keys = re.findall(r"`([\w.]+)`", cells[0]) if len(cells) == 3 else []
        if not keys or not re.fullmatch(r"(train|planner|trainer|data|model)\.[\w.]+|plan|dry_run", keys[0]):
            continue
        parent = keys[0].rsplit(".", 1)[0]
        for k in keys:
            rows[parent + k if k.startswith(".") else k] = cells[1].strip("`")
    return rows


def test_the_configuration_reference_lists_every_key_with_its_default():
    """docs/reference/configuration.md's key tables against the composed config (train, planner,
    trainer, data, plan, dry_run: the presets' values) and ModelConfig's fields: no key missing, none
    that the schema lacks, every default as the user gets it."""
    import dataclasses
    import math

    import yaml
    from omegaconf import MISSING, OmegaConf

    from lightning_hexiscale.config.schema import ModelConfig

    cfg = OmegaConf.to_container(compose(["cluster=cpu2"]))
    want: dict[str, object] = {"plan": cfg["plan"], "dry_run": cfg["dry_run"]}

    def leaves(node: dict, prefix: str) -> None:
        for k, v in node.items():
            leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else want.__setitem__(prefix + k, v)

    for top in ("train", "planner", "trainer", "data"):
        leaves(cfg[top], top + ".")
    for f in dataclasses.fields(ModelConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        want[f"model.{f.name}"] = "required" if default == MISSING else default
    rows = _reference_rows()
    assert sorted(set(want) - set(rows)) == [], "keys the reference does not list"
    assert sorted(set(rows) - set(want)) == [], "keys the reference lists that the schema does not have"
    for key, cell in rows.items():
        got = yaml.safe_load(cell) if cell != "required" else cell
        if isinstance(want[key], float) and isinstance(got, str):
            got = float(got)  # YAML 1.1 reads 1e-08 (no dot) as a string
        same = got == want[key] or (isinstance(got, float) and math.isclose(got, float(want[key])))
        assert same, f"{key}: the reference says {cell}, the config has {want[key]!r}"


@pytest.mark.parametrize("override, message", [
    ("planner.seed=-1", "planner.seed = -1: must be a non-negative integer"),  # was numpy's ValueError traceback
    ("planner.balance=nan", "planner.balance = nan: a balance factor (max / mean compute) is a finite number of at least 1"),
    ("planner.group_balance=0", "planner.group_balance = 0.0: a balance factor (max / mean compute) is a finite number of at least 1"),
    ("model.rms_norm_eps=nan", "model.rms_norm_eps = nan: must be a small positive number"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps = 0.0: must be a small positive number"),
    ("model.rope_theta=inf", "model.rope_theta = inf: the RoPE base must be a number above 1 and at most 1e+12"),
    ("model.rope_theta=1e308", "model.rope_theta = 1e+308: the RoPE base must be a number above 1"),  # was planned on
    ("model.rope_theta=1", "model.rope_theta = 1.0: the RoPE base must be a number above 1"),  # every pair turned alike
    ("model.rope_theta=0.5", "model.rope_theta = 0.5: the RoPE base must be a number above 1"),
])
def test_planner_and_model_numbers_out_of_range_are_refused(override, message, capsys):
    """Each was planned on (nan, 0, inf) or ended in a traceback (a negative seed)."""
    from lightning_hexiscale.cli.main import main

    assert main(["plan", "cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "planner.iterations=2",
                 "planner.progress=false", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("override", ["trainer.weight_decay=nan", "trainer.weight_decay=inf", "trainer.lr=inf",
                                      "trainer.adam_eps=inf", "trainer.timeout_s=inf"])
def test_the_train_apps_numbers_must_be_finite(override):
    """nan and inf passed the checks made before planning (nan < 0 is false): AdamW took a nan weight
    decay and an infinite learning rate, and timeout_s=inf came back after planning as the strategy's
    own `HexiScaleStrategy(timeout)` error."""
    import re

    from lightning_hexiscale.cli.train_run import check_early
    from lightning_hexiscale.errors import ConfigError

    key, value = override.split("=")
    with pytest.raises(ConfigError, match=re.escape(f"{key} = {float(value)}: ") + r".*finite"):
        check_early(compose(["cluster=cpu2", override]))


@pytest.mark.timeout(120)
def test_a_later_train_job_in_the_same_process_uses_its_own_cluster(tmp_path, monkeypatch, capsys):
    """The cluster file of one `hexiscale train` call (given, or discovered) stayed in the process's
    environment, and the next call's cluster=cpu_demo planned on that file's cluster."""
    from lightning_hexiscale.cli.train import main

    monkeypatch.chdir(tmp_path)
    mine = _my_conf_dir(tmp_path) / "cluster" / "mine.yaml"
    common = ["model=llama_tiny", "dry_run=true", "planner.iterations=1", "planner.progress=false"]
    assert main([f"cluster={mine}", *common, f"hydra.run.dir={tmp_path / 'a'}"]) == 0
    assert main(["cluster=cpu_demo", *common, f"hydra.run.dir={tmp_path / 'b'}"]) == 0
    planned = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("planning for")]
    assert [ln.split(" on cluster ")[1].split()[0] for ln in planned] == ["mine", "cpu_demo"], planned


def test_cfg_job_prints_the_cluster_file_the_job_runs_on(tmp_path, monkeypatch, capsys):
    """`hexiscale train cluster=FILE --cfg job` printed the cpu_demo preset that the file replaces in the
    job (the file is taken out of Hydra's command line), not the file nor its cluster.* overrides."""
    import yaml

    from lightning_hexiscale.cli.train import main

    monkeypatch.chdir(tmp_path)
    mine = _my_conf_dir(tmp_path) / "cluster" / "mine.yaml"
    assert main([f"cluster={mine}", "cluster.inter_machine.bandwidth=3 GB/s", "model=llama_tiny", "--cfg", "job"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["cluster"]["name"] == "mine" and shown["cluster"]["inter_machine"]["bandwidth"] == "3 GB/s"
    assert shown["model"]["name"] == "llama_tiny" and not list(tmp_path.glob("outputs"))


def test_a_sweep_with_one_fixed_output_dir_is_refused(tmp_path):
    """-m train.global_batch=8,16 trainer.output_dir=DIR: both jobs wrote plan.yaml, config.yaml and
    checkpoints into DIR, the second over the first. A per-job directory, or one job, is fine."""
    import re

    from lightning_hexiscale.cli.train_job import check_overrides
    from lightning_hexiscale.errors import ConfigError

    base = ["-m", "cluster=cpu2", "model=llama_tiny"]
    with pytest.raises(ConfigError, match=re.escape(f"trainer.output_dir = '{tmp_path}': the sweep runs 2 jobs")
                       + ".*" + re.escape(f"trainer.output_dir='{tmp_path}/${{hydra:job.num}}'")):
        check_overrides([*base, "train.global_batch=8,16", f"trainer.output_dir={tmp_path}"])
    check_overrides([*base, "train.global_batch=8,16", f"trainer.output_dir={tmp_path}/${{hydra:job.num}}"])
    check_overrides([*base, "train.global_batch=8", f"trainer.output_dir={tmp_path}"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_trains_on_a_cluster_file_with_key_overrides(tmp_path):
    """cluster=FILE cluster.KEY=V trained on no rank but the first: the launcher's other ranks re-run the
    command line without the file (taken out for Hydra), read it as cluster=auto, and refused the
    cluster.* override ("changes a preset or file, and discovery measures the cluster")."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    mine = _my_conf_dir(tmp_path) / "cluster" / "mine.yaml"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "recipes" / "train.py"),
                          f"cluster={mine}", "cluster.machines.0.intra_bandwidth=1 GB/s", "model=llama_tiny",
                          "train.global_batch=8", "trainer.max_steps=1", "trainer.val_every=0", "planner.iterations=2",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=280, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0 and "changes a preset or file" not in out.stderr, out.stderr[-3000:]
    assert "intra 1 GB/s" in out.stdout and "final metrics:" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("override,fix", [
    ("trainer.devices=4", "the devices come from the cluster"),
    ("+trainer.accelerator=gpu", "the devices come from the cluster"),
    ("trainer.num_nodes=2", "the devices come from the cluster"),
    ("trainer.strategy=ddp", "always runs the hexiscale strategy"),
    ("trainer.max_epochs=2", "trainer.max_steps=N"),
    ("trainer.val_check_interval=50", "trainer.val_every"),
    ("data.batch_size=4", "the batch is train.global_batch"),
    ("train.batch_size=4", "did you mean train.global_batch?"),
    ("devices=4", "the devices come from the cluster"),  # was "did you mean planner.use_all_devices?"
    ("batch_size=8", "the batch is train.global_batch"),  # was "did you mean train.micro_batch_size?"
    ("max_epochs=3", "trainer.max_steps"),
])
def test_a_lightning_trainer_argument_is_refused_with_where_the_recipe_takes_it(override, fix):
    """A Lightning user's first overrides: ``trainer.devices=4`` listed the trainer's 27 keys, none of
    which sets the devices; the fix now says where the recipe takes it (or why it does not)."""
    from lightning_hexiscale.cli.train_job import check_overrides
    from lightning_hexiscale.errors import ConfigError

    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError) as caught:
        check_overrides(["cluster=cpu2", override])
    assert caught.value.key == key and "no such key" in caught.value.rule and fix in caught.value.fix
