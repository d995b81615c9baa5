"""Python API errors surface once and clearly: a wrong cluster or plan file when the strategy is
built, a world size that does not match the plan when the Trainer is built, a bad training loader
or ckpt_path before any process starts, and an error every rank finds in setup as that one typed
error from ``trainer.fit`` (not Lightning's teardown "Cannot copy out of meta tensor", not one
traceback per rank), with the fork launcher and with the default popen launcher (a script, since
popen re-runs its script per rank). A rank that dies makes ``fit`` raise one RankFailure naming it,
and the launching process is not killed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from strategy_helpers import PG_TIMEOUT, TINY, loader, module, plan_of

from lightning_hexiscale.errors import ConfigError, HexiScaleError, PlanError
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

HERE = Path(__file__).parent
PLAN = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])


def _trainer(strategy, devices=2):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_files_are_read_when_the_strategy_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(cluster\) = 'nonexistent': no such preset"):
        HexiScaleStrategy(cluster="nonexistent")
    with pytest.raises(ConfigError, match=r"HexiScaleStrategy\(plan\) = '.*nope.yaml': no such plan file"):
        HexiScaleStrategy(plan=str(tmp_path / "nope.yaml"))
    with pytest.raises(PlanError, match="device 2"):  # a device the cluster does not have
        HexiScaleStrategy(cluster="cpu2", plan=plan_of([(2, 1, [([0, 2], (0, 4))])]))


def test_world_size_is_checked_when_the_trainer_is_built():
    with pytest.raises(ConfigError, match=r"Trainer\(num_nodes, devices\) = '3 processes.*the plan runs 2"):
        _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork"), devices=3)


def test_loader_and_checkpoint_are_checked_before_launch(tmp_path, capfd):
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(ConfigError, match=r"train_dataloader.batch_size = 4: the plan takes 6"):
        trainer.fit(module(), loader(12, 4))
    with pytest.raises(ConfigError, match=r"ckpt_path = '.*gone.ckpt': no such checkpoint"):
        trainer.fit(module(), loader(12, 6), ckpt_path=str(tmp_path / "gone.ckpt"))
    # what every rank refused after its setup (the fork workers had started; with cluster=auto after
    # the discovery and the search): a save killed before COMPLETE, and another model's checkpoint
    from lightning_hexiscale.runtime import checkpoint as ckpt

    partial, other = tmp_path / "partial.ckpt", tmp_path / "other.ckpt"
    (partial / "meta.pt").parent.mkdir()
    (partial / "meta.pt").write_bytes(b"")
    other.mkdir()
    (other / ckpt.COMPLETE).write_text(ckpt.FORMAT)
    (other / ".metadata").write_bytes(b"")
    saved_for = {**TINY.to_dict(), "hidden_size": 32}
    torch.save({"hexiscale": {"format": ckpt.FORMAT, "model": saved_for}}, other / ckpt.META)
    with pytest.raises(ConfigError, match=r"ckpt_path = '.*partial.ckpt': partial checkpoint"):
        trainer.fit(module(), loader(12, 6), ckpt_path=str(partial))
    with pytest.raises(ConfigError, match=r"model.hidden_size = 64: the checkpoint .*other.ckpt was saved for "
                                          r"hidden_size=32"):
        trainer.validate(module(), loader(12, 6), ckpt_path=str(other))
    assert "Initializing distributed" not in capfd.readouterr().err  # no process was started


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_one_device_checkpoint_file_is_refused_with_the_way_to_its_weights(tmp_path):
    """A checkpoint Lightning saved on one device is one file: the error said only 'give the directory
    ModelCheckpoint wrote under the hexiscale strategy', which such a user does not have. Its way
    (load the weights into the module, then evaluate without ckpt_path) gives one device's val_loss."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hexiscale.lightning.example import LlamaLitModule

    one = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_last=True)])
    mod = module()
    one.fit(mod, loader(12, 6))
    val = loader(12, 6, seed=1)
    want = one.validate(mod, val, verbose=False)[0]["val_loss"]
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(ConfigError, match=r"not a file \(a one-file checkpoint, as Lightning writes on one device or "
                                          r"under DDP, .*LlamaLitModule.load_from_checkpoint\(path, config=...\)"):
        trainer.validate(module(), val, ckpt_path=str(tmp_path / "last.ckpt"))
    loaded = LlamaLitModule.load_from_checkpoint(str(tmp_path / "last.ckpt"), config=TINY, dtype=torch.float64)
    assert trainer.validate(loaded, val, verbose=False)[0]["val_loss"] == pytest.approx(want, abs=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_setup_error_of_every_rank_is_raised_once_fork(capfd):
    plan6 = plan_of([(4, 2, [([0], (0, 6))]), (2, 1, [([1], (0, 6))])], num_layers=6)
    trainer = _trainer(HexiScaleStrategy(plan=plan6, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(PlanError, match=r"plan.num_layers = 6: the model tiny_test has 4 layers"):
        trainer.fit(module(), loader(12, 6))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "meta tensor" not in err and "Terminating process" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_setup_error_of_every_rank_is_raised_once_spawn(capfd):
    """spawn (what a Hydra multirun sweep uses) pickles the launcher into fresh processes."""
    plan6 = plan_of([(4, 2, [([0], (0, 6))]), (2, 1, [([1], (0, 6))])], num_layers=6)
    trainer = _trainer(HexiScaleStrategy(plan=plan6, start_method="spawn", timeout=PG_TIMEOUT))
    with pytest.raises(PlanError, match=r"plan.num_layers = 6: the model tiny_test has 4 layers"):
        trainer.fit(module(), loader(12, 6))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Terminating process" not in err, err[-3000:]


def _job(case: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_", "MASTER_", "WORLD_", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (HERE, HERE.parent, HERE.parents[1])))  # lightning/, tests/, root
    return subprocess.run([sys.executable, str(HERE / "api_error_job.py"), case], env=env, capture_output=True,
                          text=True, timeout=100)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_setup_error_of_every_rank_is_raised_once_popen():
    out = _job("layers")
    caught = [ln for ln in out.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert out.returncode == 0 and "ALIVE" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
    assert caught == ["CAUGHT PlanError: plan.num_layers = 6: the model tiny_test has 4 layers. Fix: plan for the "
                      "same model, or choose the model the plan was made for"], out.stdout
    assert "Traceback" not in out.stderr and "meta tensor" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dead_rank_is_one_rank_failure_popen():
    out = _job("kill")
    caught = [ln for ln in out.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert out.returncode == 0 and "ALIVE" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
    assert len(caught) == 1 and caught[0].startswith("CAUGHT RankFailure: rank 0 stopped because another rank "
                                                      "failed: rank 1 stopped without reporting an error"), caught
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.fixture(scope="module")
def new_trainers_job() -> subprocess.CompletedProcess:
    """One popen job for the two tests below: after fit, a new Trainer validates, then another is refused."""
    return _job("new_trainers")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_new_trainer_validates_the_trained_stage_popen(new_trainers_job):
    """Under popen each rank keeps its stage (the module's trained weights) after fit. A new Trainer
    whose strategy plans nothing yet (cluster=None) validating that module stopped with a bare
    AssertionError (its strategy had no plan); it takes the stage's plan, and val_loss is one
    device's after the same 3 steps."""
    one = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
    mod = module()
    one.fit(mod, loader(36, 6))
    want = one.validate(mod, loader(12, 6, seed=1), verbose=False)[0]["val_loss"]
    out = new_trainers_job
    got = dict(ln.split()[1:] for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    assert set(got) == {"0", "1"}, (out.stdout, out.stderr[-3000:])
    for value in got.values():
        assert float(value) == pytest.approx(want, abs=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_new_trainer_with_another_plan_is_refused_popen(new_trainers_job):
    """Its data would be cut by the new plan while the stage runs the old one (the same job, after the
    validation above: the stage is still the fit's)."""
    out = new_trainers_job
    caught = [ln for ln in out.stdout.splitlines() if ln.startswith("CAUGHT")]  # one error, rank 0's
    assert caught == ["CAUGHT 0 ConfigError: HexiScaleStrategy(plan) = '2 pipeline(s), batches [3, 3], micro-batches "
                      "[1, 1], 1f1b, ddp': the module's Llama is already each rank's stage of another plan (2 "
                      "pipeline(s), batches [4, 2], micro-batches [2, 1], 1f1b, ddp), built by an earlier Trainer "
                      "call, and it holds the trained weights. Fix: pass the same plan and overrides (or none: the "
                      "stage's plan is taken), or start from a new module with ckpt_path=... to resume under this "
                      "plan"], (out.stdout, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_new_strategy_overriding_the_stages_plan_is_refused():
    """cluster=None with dp_sharding='zero2' after a fit under ddp: the stage (its reducer, its
    optimizer's sharding) is ddp's; the override would have been dropped without a word."""
    from types import SimpleNamespace

    from lightning_hexiscale.lightning.plan_resolution import reuse_stage

    stage = SimpleNamespace(engine=SimpleNamespace(plan=PLAN), built_for=("cluster", "workload"))

    def strategy(**overrides):
        return SimpleNamespace(settings=SimpleNamespace(plan=None, overrides=overrides), world_size=2)

    assert reuse_stage(stage, strategy(dp_sharding=None, schedule="auto")) == (stage, PLAN, "cluster", "workload")
    with pytest.raises(ConfigError, match=r"^HexiScaleStrategy\(dp_sharding/schedule/...\) = '2 pipeline\(s\), "
                                          r"batches \[4, 2\], micro-batches \[2, 1\], 1f1b, zero2': .* another plan "
                                          r"\(2 pipeline\(s\), batches \[4, 2\], micro-batches \[2, 1\], 1f1b, ddp\)"):
        reuse_stage(stage, strategy(dp_sharding="zero2"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_graceful_interrupt_is_raised_once_popen():
    """Every rank stops at the same step (GracefulInterrupt): rank 0 raises TrainingInterrupted to the
    caller, the rank the launcher started ends quietly (it printed a TrainingInterrupted traceback)."""
    out = _job("interrupt")
    caught = [ln for ln in out.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert out.returncode == 0 and "ALIVE" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
    assert caught == ["CAUGHT TrainingInterrupted: interrupted (Ctrl-C) after step 3; no checkpoint was written "
                      "(trainer.save_on_interrupt=true, or GracefulInterrupt(save_to=...), saves the interrupted "
                      "step)"], out.stdout
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


# ---- the Python API's bad-input corpus: each case raises the typed error naming the key ----------
class ManualOptimization(type(module())):
    def __init__(self):
        super().__init__(module().config, dtype=module().param_dtype)
        self.automatic_optimization = False


class NoLlama(type(module())):
    def configure_model(self):
        import torch

        self.model = torch.nn.Linear(2, 2)


def _fit(strategy_kw=None, trainer_kw=None, data=None, mod=None, **fit_kw):
    strategy = HexiScaleStrategy(**{"plan": PLAN, "start_method": "fork", "timeout": PG_TIMEOUT, **(strategy_kw or {})})
    kw = dict(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, **(trainer_kw or {}))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=PLAN.world_size, **kw)
    trainer.fit(mod if mod is not None else module(), data if data is not None else loader(12, 6), **fit_kw)


def _sampler_loader(kind: str):
    import torch
    from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler

    from lightning_hexiscale.data import generated_corpus

    ds = generated_corpus(12, 16)
    if kind == "replacement":
        return DataLoader(ds, batch_size=6, sampler=RandomSampler(ds, replacement=True))
    if kind == "weighted":
        return DataLoader(ds, batch_size=6, sampler=WeightedRandomSampler(torch.ones(12), 12))
    return DataLoader(ds, batch_size=None)


def _long_rows():
    """Rows of 2 x seq_len tokens: the plan priced memory and time for seq_len (they trained silently)."""
    from torch.utils.data import DataLoader

    from lightning_hexiscale.data import generated_corpus

    return DataLoader(generated_corpus(12, 2 * TINY.seq_len), batch_size=6)


API_CASES = {
    "unknown_cluster": (lambda t: HexiScaleStrategy(cluster="nonexistent"), ConfigError, "HexiScaleStrategy(cluster)"),
    "cluster_of_wrong_type": (lambda t: HexiScaleStrategy(cluster=123), ConfigError, "HexiScaleStrategy(cluster)"),
    "plan_nowhere": (lambda t: HexiScaleStrategy(plan=str(t / "gone.yaml")), ConfigError, "HexiScaleStrategy(plan)"),
    "plan_device_not_in_cluster": (lambda t: HexiScaleStrategy(cluster="cpu2", plan=plan_of([(2, 1, [([0, 5], (0, 4))])])),
                                   PlanError, "plan.pipelines[0].stages[0].devices"),
    "zero_timeout": (lambda t: HexiScaleStrategy(timeout=0), ConfigError, "HexiScaleStrategy(timeout)"),
    "unknown_nonfinite": (lambda t: HexiScaleStrategy(nonfinite="ignore"), ConfigError, "HexiScaleStrategy(nonfinite)"),
    "unknown_schedule": (lambda t: HexiScaleStrategy(schedule="zigzag"), ConfigError, "HexiScaleStrategy(schedule)"),
    "unknown_dp_sharding": (lambda t: HexiScaleStrategy(dp_sharding="zero4"), ConfigError,
                            "HexiScaleStrategy(dp_sharding)"),
    "zero_global_batch": (lambda t: HexiScaleStrategy(global_batch=0), ConfigError, "HexiScaleStrategy(global_batch)"),
    "zero_threads": (lambda t: HexiScaleStrategy(num_threads=0), ConfigError, "HexiScaleStrategy(num_threads)"),
    "use_all_devices_not_bool": (lambda t: HexiScaleStrategy(use_all_devices="yes"), ConfigError,
                                 "HexiScaleStrategy(use_all_devices)"),
    "world_size": (lambda t: _trainer(HexiScaleStrategy(plan=PLAN), devices=3), ConfigError, "Trainer(num_nodes, devices)"),
    "loader_batch": (lambda t: _fit(data=loader(12, 4)), ConfigError, "train_dataloader.batch_size"),
    "loader_without_batch_size": (lambda t: _fit(data=_sampler_loader("none")), ConfigError,
                                  "train_dataloader.batch_size"),
    "sampler_with_replacement": (lambda t: _fit(data=_sampler_loader("replacement")), ConfigError, "DataLoader.sampler"),
    "custom_sampler": (lambda t: _fit(data=_sampler_loader("weighted")), ConfigError, "DataLoader.sampler"),
    "rows_longer_than_seq_len": (lambda t: _fit(data=_long_rows()), ConfigError, "model.seq_len"),
    "ckpt_nowhere": (lambda t: _fit(ckpt_path=str(t / "gone.ckpt")), ConfigError, "ckpt_path"),
    "ckpt_a_file": (lambda t: (t / "f.ckpt").write_text("x") and _fit(ckpt_path=str(t / "f.ckpt")), ConfigError,
                    "ckpt_path"),
    "manual_optimization": (lambda t: _fit(mod=ManualOptimization()), ConfigError,
                            "LightningModule.automatic_optimization"),
    "module_without_llama": (lambda t: _fit(mod=NoLlama(module().config)), ConfigError, "NoLlama.model"),
}


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(API_CASES))
def test_api_refuses_bad_input(case, tmp_path, capfd):
    make, exc_type, key = API_CASES[case]
    with pytest.raises(exc_type) as info:
        make(tmp_path)
    assert str(info.value).startswith(key) and "Fix:" in str(info.value), str(info.value)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "meta tensor" not in err, err[-2000:]


def test_good_api_input_passes(tmp_path):
    """The corpus's valid counterparts are accepted (the harness can tell good from bad)."""
    strategy = HexiScaleStrategy(cluster="cpu_hetero4", plan=PLAN, timeout=30, nonfinite="skip", schedule="gpipe",
                                 dp_sharding="zero2", global_batch=6, num_threads=1, use_all_devices=True)
    assert strategy.plan is not None and strategy.cluster.name == "cpu_hetero4"
    _trainer(HexiScaleStrategy(plan=PLAN), devices=2)
    strategy.check_before_launch(True, {"model": module(), "train_dataloaders": loader(12, 6),
                                                "ckpt_path": None})


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_several_optimizers_are_refused_once(capfd):
    """Lightning's own error says to switch to manual optimisation, which the strategy refuses: the
    strategy's says what it supports instead, once (not a traceback from every rank)."""

    class TwoOptimizers(type(module())):
        def configure_optimizers(self):
            params = list(self.parameters())
            return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]

    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(ConfigError, match=r"configure_optimizers = 'several optimizers'.*one optimizer"):
        trainer.fit(TwoOptimizers(TINY, dtype=torch.float64), loader(12, 6))
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_call_after_a_fork_fit_refuses_the_initial_weights(capfd):
    """The trained weights stay in the fork workers (the model exists only as their shards): a later
    ``validate(model)`` ran the module's initial weights without a word (val_loss 5.575 after a fit
    that reached 4.384 on one device). Refused before any process starts; a module no fork fit trained
    is not."""
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    trained = module()
    trainer.fit(trained, loader(12, 6))
    capfd.readouterr()
    with pytest.raises(ConfigError, match=r"^ckpt_path = None: \w+ was trained by a fit whose ranks ran in "
                                          r"start_method='fork' worker processes.*Fix: pass ckpt_path='last'"):
        trainer.validate(trained, loader(12, 6, seed=1), verbose=False)
    assert "Initializing distributed" not in capfd.readouterr().err  # refused before any process started
    assert trainer.validate(module(), loader(12, 6, seed=1), verbose=False)[0]["val_loss"] > 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_save_checkpoint_after_a_fork_fit_says_where_the_weights_are(tmp_path):
    """On one device trainer.save_checkpoint after fit saves the trained model; after a fit in fork
    workers this process holds none of it, and the call said 'HexiScaleStrategy.setup has not run
    yet' (a RuntimeError) although setup had run, in the workers."""
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    trainer.fit(module(), loader(12, 6))
    with pytest.raises(ConfigError, match=r"^trainer.save_checkpoint = '.*after.ckpt': the ranks of the last Trainer "
                                          r"call ran in start_method='fork' worker processes.*Fix: save during fit: "
                                          r"ModelCheckpoint"):
        trainer.save_checkpoint(str(tmp_path / "after.ckpt"))
    assert not (tmp_path / "after.ckpt").exists()


def test_the_trained_weights_check_lets_a_checkpoint_or_new_weights_through():
    from lightning_hexiscale.lightning.launch.guard import check_trained_weights, fit_ran_in_workers

    class Trainer:
        ckpt_path = None

    m = module()
    check_trained_weights(Trainer(), {"model": m})  # no fit in workers: nothing to say
    fit_ran_in_workers(m, "spawn")
    with pytest.raises(ConfigError, match=r"start_method='spawn'"):
        check_trained_weights(Trainer(), {"model": m})
    check_trained_weights(Trainer(), {"model": m, "ckpt_path": "last"})  # Lightning loads it
    check_trained_weights(Trainer(), {"model": None})  # Lightning picks the best checkpoint itself
    Trainer.ckpt_path = "set.ckpt"  # trainer.ckpt_path = ...: Lightning loads it
    check_trained_weights(Trainer(), {"model": m})
    Trainer.ckpt_path = None
    m.init_state_dict = {}  # weights given since (weights.attach_weights)
    check_trained_weights(Trainer(), {"model": m})


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_learning_rate_finder_under_fork_is_refused_before_launch(capfd):
    """Lightning's learning-rate finder ends its search inside fit with a private exception that
    Lightning catches in the process that called fit: a fork worker raised it to torch's join
    instead (ProcessRaisedException: lightning...._TunerExitException, a traceback from inside
    Lightning), and the suggestion would stay in the workers. Under popen it equals one device's."""
    from lightning.pytorch.tuner import Tuner

    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(ConfigError, match=r"^HexiScaleStrategy\(start_method\) = 'fork': Lightning's learning-rate "
                                          r"finder.*Fix: .*start_method='popen'"):
        Tuner(trainer).lr_find(module(), loader(36, 6), num_training=3)
    assert "Initializing distributed" not in capfd.readouterr().err  # refused before any process started


class _TwoLosses(type(module())):
    """A second, auxiliary loss: one device trains on loss + 0.5 * aux."""

    def training_step(self, batch, batch_idx):
        return self._loss(batch) + 0.5 * self._loss(batch[:, :9])


class _Scaled(type(module())):
    """A factor on the loss: one device's gradients are scaled by it."""

    def training_step(self, batch, batch_idx):
        return 0.1 * self._loss(batch)


class _Detached(type(module())):
    """The loss returned in Lightning's dict form, detached: the same value."""

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        return {"loss": loss.detach().clone()}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case, match", [
    (_TwoLosses, r"^LightningModule.training_step = 'self.model.loss called twice'"),
    (_Scaled, r"^LightningModule.training_step = 'returned 0.5\d+': under the hexiscale strategy self.model.loss "
              r"gave 5.5\d+ and ran the backward")])
def test_a_loss_the_strategy_cannot_train_on_is_refused_once(case, match, capfd):
    """self.model.loss runs the forward and the backward of the batch inside the call: a second
    call (an auxiliary loss) added its whole gradient whatever the step did with the values, and a
    factor or a term added afterwards never reached the gradients; both trained silently otherwise
    (loss after one step 8.11101 where one device gives 8.122592 for loss + 0.5 * aux)."""
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(ConfigError, match=match + r".*Fix: return the value of one self.model.loss call"):
        trainer.fit(case(TINY, dtype=torch.float64, init_seed=7), loader(12, 6))
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_loss_returned_as_a_dict_or_detached_trains(tmp_path):
    from strategy_helpers import assert_matches, hexiscale_trainer, read_ranks, single_trainer

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    single_trainer(ref_dir, max_steps=2).fit(module(), loader(12, 6))
    hexiscale_trainer(PLAN, run_dir, max_steps=2).fit(_Detached(TINY, dtype=torch.float64, init_seed=7, lr=1e-2),
                                                      loader(12, 6))
    assert_matches(read_ranks(run_dir, 2), read_ranks(ref_dir, 1)[0], atol=1e-6)


class _FrozenInConfigureOptimizers(type(module())):
    def configure_optimizers(self):
        for name, p in self.named_parameters():
            if "layers.0." in name:
                p.requires_grad_(False)
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class _FrozenInConfigureModel(type(module())):
    def configure_model(self):
        super().configure_model()
        self.model.embed.requires_grad_(False)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case, names", [(_FrozenInConfigureOptimizers, "layers.0.attn_norm.weight"),
                                         (_FrozenInConfigureModel, "embed.weight")])
def test_frozen_parameters_are_refused_once(case, names, capfd):
    """Parameters with requires_grad=False (frozen for fine-tuning) trained on one device as frozen;
    frozen in configure_optimizers they stopped the first step with torch's "cannot register a hook
    on a tensor that doesn't require gradient" from inside the gradient sync, on the ranks that hold
    them (under a plan whose other ranks hold none, those waited for them); frozen on the Llama in
    configure_model they were trained, since each rank's stage is built anew from the Llama's shape."""
    plan = plan_of([(4, 2, [([0], (0, 2)), ([1], (2, 4))]), (2, 1, [([2], (0, 4))])])
    trainer = _trainer(HexiScaleStrategy(plan=plan, start_method="fork", timeout=PG_TIMEOUT), devices=3)
    with pytest.raises(ConfigError, match=r"^[\w.]+\.requires_grad = False: .*" + re.escape(names) +
                       r".*Fix: .*lr=0 and weight_decay=0"):
        trainer.fit(case(TINY, dtype=torch.float64, init_seed=7), loader(12, 6))
    assert "Traceback" not in capfd.readouterr().err


class _NormsLeftOut(type(module())):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for name, p in self.named_parameters() if "norm" not in name], lr=1e-2)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("dp_sharding", ["ddp", "zero2"])
def test_parameters_left_out_of_the_optimizer_are_refused_once(dp_sharding, capfd):
    """One device keeps parameters outside its optimizer as they are and clips by the norm of the
    optimizer's parameters only. The strategy's clipping norm counts every parameter (ddp with
    gradient_clip_val=0.3: loss 4.43177496 at the third step where one device gives 4.43176454),
    and under zero2 the first step stopped with a ValueError from inside the runtime on every rank."""
    strategy = HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT, dp_sharding=dp_sharding)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3, gradient_clip_val=0.3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(ConfigError, match=r"^_NormsLeftOut.configure_optimizers = 'an optimizer without 9 "
                                          r"parameter\(s\) \(model.stage.layers.0.attn_norm.weight, .*Fix: .*lr=0 "
                                          r"and weight_decay=0"):
        trainer.fit(_NormsLeftOut(TINY, dtype=torch.float64, init_seed=7), loader(18, 6))
    assert "Traceback" not in capfd.readouterr().err


def _optimizing_with(name: str, **kw):
    class Module(type(module())):
        def configure_optimizers(self):
            return getattr(torch.optim, name)(self.parameters(), **kw)

    return Module(TINY, dtype=torch.float64, init_seed=7)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name, dp_sharding, match", [
    ("LBFGS", "ddp", r"^configure_optimizers = 'LBFGS': its step evaluates the closure \(a forward and a backward "
                     r"of the batch\) several times.*Fix: use an optimizer that evaluates it once per step"),
    ("Adagrad", "zero2", r"^configure_optimizers = 'Adagrad': it creates its state when it is built \(per parameter: "
                         r"\['step', 'sum'\]\), and dp_sharding=zero2 .*Fix: use dp_sharding='ddp'")])
def test_an_optimizer_the_step_cannot_run_is_refused_once(name, dp_sharding, match, capfd):
    """LBFGS evaluates the closure several times per step; the strategy runs the batch's forward and
    backward once, so its further evaluations got the same loss and gradients and it trained silently
    (loss 5.5768 after 2 steps where one device gives 4.8446). Adagrad creates its state when built:
    under ZeRO over empty stand-ins of the chunks, and the first step stopped inside torch with 'The
    size of tensor a (0) must match the size of tensor b (8224)' on every rank (under ddp it trains)."""
    strategy = HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT, dp_sharding=dp_sharding)
    with pytest.raises(ConfigError, match=match):
        _trainer(strategy).fit(_optimizing_with(name, lr=0.05), loader(12, 6))
    assert "Traceback" not in capfd.readouterr().err


class _AccuracyFromLogits(type(module())):
    def validation_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        self.log("acc", (logits.argmax(-1) == batch[:, 1:]).float().mean())


class _CrossEntropyOfLogits(type(module())):
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.model(batch[:, :-1]), batch[:, 1:])


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case, call", [(_AccuracyFromLogits, "validate"), (_CrossEntropyOfLogits, "fit")])
def test_the_logits_placeholder_used_as_a_tensor_is_one_error(case, call, capfd):
    """Every rank runs the same step and stops at the placeholder alike: the caller got torch's
    ProcessRaisedException with a worker's traceback and the other rank's TCPStore 'Connection reset
    by peer' C++ frames, instead of the contract's HexiScaleError once."""
    trainer = _trainer(HexiScaleStrategy(plan=PLAN, start_method="fork", timeout=PG_TIMEOUT))
    with pytest.raises(HexiScaleError, match=r"^(logits.argmax|cross_entropy\(logits\)): under the hexiscale "
                                             r"strategy the logits of self.model\(tokens\) exist only on the last"):
        getattr(trainer, call)(case(TINY, dtype=torch.float64, init_seed=7), loader(12, 6))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_frozen_parameters_may_be_evaluated():
    """Evaluation trains nothing: a module with frozen parameters validates as on one device."""
    plan = plan_of([(4, 2, [([0], (0, 4))]), (2, 1, [([1], (0, 4))])])
    got = _trainer(HexiScaleStrategy(plan=plan, start_method="fork", timeout=PG_TIMEOUT)).validate(
        _FrozenInConfigureModel(TINY, dtype=torch.float64, init_seed=7), loader(12, 6), verbose=False)
    want = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False).validate(
        _FrozenInConfigureModel(TINY, dtype=torch.float64, init_seed=7), loader(12, 6), verbose=False)
    assert got[0]["val_loss"] == pytest.approx(want[0]["val_loss"], abs=1e-9)


