"""Elastic training (lightning/launch/elastic.py): a machine leaves, the survivor re-plans and goes on.

The end-to-end test runs the c10d rendezvous store in a process of its own (``hexiscale
rendezvous-store``) and two torchrun agents on localhost as its clients (``--nnodes=1:2``,
``is_host=false``, ``--max-restarts=3``; machines ``a`` and ``b`` of a two-machine CPU cluster, each
agent with its own ``HEXISCALE_MACHINE``), kills agent a, the one that started first (without the
external store it would host the rendezvous and its death would end the job), and its worker with
SIGKILL once step 6 is reached, and checks that agent b's new workers re-planned for machine b
alone, resumed from the newest complete checkpoint and finished; their losses from the resumed step
equal, bit for bit (float64), those of an independent single-process run started from the same
checkpoint with the survivor's plan, and a mutated reference (another corpus) differs (the
comparison can fail). The driver is benchmarks/bench_elastic.py, the worker tests/lightning/elastic_job.py.

The other tests check the pieces without processes: machine names, the rank-ordered subset cluster,
the clear errors (a machine not in the cluster file, no plan fits the devices left, no complete
checkpoint when resuming is required), the choice of the newest complete checkpoint, the report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError, InfeasiblePlan
from lightning_hexiscale.lightning.launch import elastic
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search
from lightning_hexiscale.runtime import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
TINY_FP32 = Workload(LlamaConfig.load("llama_tiny"), dtype="fp32", device="cpu")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_elastic", ROOT / "benchmarks" / "bench_elastic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cluster3() -> Cluster:
    return Cluster.from_config({
        "name": "three", "machines": [
            {"name": "big", "gpu": "CPU-FAST", "count": 2, "intra_bandwidth": "10 GB/s"},
            {"name": "small", "gpu": "CPU-SLOW", "count": 1, "intra_bandwidth": "10 GB/s"},
            {"name": "other", "gpu": "CPU-FAST", "count": 1, "intra_bandwidth": "10 GB/s"}],
        "inter_machine": {"bandwidth": "1 GB/s", "latency": "50us"}})


# ---- end to end: two agents, one killed -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_survivor_replans_resumes_and_matches_a_run_from_the_same_checkpoint(tmp_path, monkeypatch):
    bench = _bench()
    # what an earlier in-process fit of the full suite leaves behind (Lightning's launcher writes it into
    # os.environ): set here so that the children must not inherit it, alone or in `make test`
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(bench.free_port()))
    steps = 12
    f = bench.run(tmp_path, steps=steps, every=4, kill_at=6, sleep_s=0.1, timeout_s=360.0, kill="a", store="external")
    record = f["record"]
    assert f["survivor"] == "b"
    assert record["machines"] == ["b"] and record["devices"] == 1 and record["restart"] >= 1
    report = (tmp_path / "agent-b.log").read_text()
    assert "machines left: a; joined: none" in report
    for log in ("agent-a.log", "agent-b.log"):  # b's join stopped a's workers: planned, not a failure
        assert "stopped by ElasticStop" not in (tmp_path / log).read_text()
    assert "old plan: " in report and "new plan: 1 pipeline(s)" in report and "% kept)" in report
    resumed = record["resumed_step"]
    # the checkpoints written before the kill: every 4 steps, and the one a's workers saved on the
    # SIGTERM of b's join (at whatever step a had reached alone; on a loaded host the kill can land
    # while step 8's save is under way, and then that join checkpoint, e.g. step 7, is the newest)
    joins = {int(s) for log in ("agent-a.log", "agent-b.log")
             for s in re.findall(r"checkpoint of step (\d+) saved", (tmp_path / log).read_text())}
    assert 0 < resumed <= f["reached_step"] and (resumed % 4 == 0 or resumed in joins), \
        f"the newest complete checkpoint (every 4 steps, or the join's: {sorted(joins)}), not {resumed}"
    assert "step(s) redone" in report and f["steps_redone"] == f["reached_step"] - resumed >= 0
    after = [r for r in f["after"] if r["restart"] == record["restart"]]
    assert [r["step"] for r in after] == list(range(resumed + 1, steps + 1)), "the survivor finished, no step skipped"
    assert all(r["world"] == 1 for r in after)

    # the independent reference: one process, the survivor's plan, fit(ckpt_path=the same checkpoint)
    plan_file = tmp_path / f"plan-{record['restart']}.yaml"
    ck = tmp_path / "ckpt" / f"step-{resumed:08d}"
    # not os.environ: an earlier in-process fit of this pytest run left MASTER_PORT there, and the two
    # runs below would both bind it (EADDRINUSE); bench.child_env drops the launch variables
    env = bench.child_env()
    base = [sys.executable, str(ROOT / "tests" / "lightning" / "elastic_job.py"), str(tmp_path),
            str(tmp_path / "cluster.yaml"), str(steps), "0", "0", "--reference", str(ck), str(plan_file), "b"]
    procs = [subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (base, base + ["--mutate"])]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    ref = [json.loads(line) for line in (tmp_path / "reference.jsonl").read_text().splitlines()]
    mutant = [json.loads(line) for line in (tmp_path / "mutant.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ref] == [r["step"] for r in after]
    assert [r["loss"] for r in after] == [r["loss"] for r in ref]
    assert [r["loss"] for r in after] != [r["loss"] for r in mutant], "the comparison can fail"


# ---- membership ------------------------------------------------------------------------------
def test_machine_by_name_or_index_and_clear_errors():
    c = cluster3()
    assert elastic.resolve_machine(c, "small") == 1 and elastic.resolve_machine(c, "2") == 2
    with pytest.raises(ConfigError) as e:
        elastic.resolve_machine(c, "gpu7")
    msg = str(e.value)
    assert "HEXISCALE_MACHINE" in msg and "gpu7" in msg and "not a machine of cluster three" in msg
    assert "big (0), small (1), other (2)" in msg
    with pytest.raises(ConfigError, match="needs each node to say which machine"):
        elastic.resolve_machine(c, None)
    with pytest.raises(ConfigError, match="not a machine"):
        elastic.resolve_machine(c, "3")


def entry(machine, local, host="h"):
    return {"machine": machine, "local_rank": local, "host": host}


def test_present_cluster_follows_the_global_ranks():
    """torchrun gave rank 0 to machine 'other' and ranks 1, 2 to 'big': the subset's device k is the
    device global rank k runs, so a plan over all its devices maps rank r to device r."""
    c = cluster3()
    devices = elastic.present_devices(c, [entry("other", 0), entry("big", 0), entry("big", 1)])
    assert devices == [3, 0, 1]
    sub = c.subset(devices)
    assert [sub.machines[d.machine].name for d in sub.devices] == ["other", "big", "big"]
    assert elastic.machines_of(c, devices) == ["big", "other"]
    plan = search(sub, Workload(LlamaConfig.load("llama_tiny"), dtype="fp32"), 8, SearchSettings(iterations=3)).plan
    assert plan.device_order == (0, 1, 2)
    assert "other:0" in elastic.plan_summary(plan, sub) and "big:1" in elastic.plan_summary(plan, sub)


def test_membership_errors():
    c = cluster3()
    with pytest.raises(ConfigError, match="both claim device 0 of machine big: two nodes name the same machine"):
        elastic.present_devices(c, [entry("big", 0), entry("big", 1), entry("big", 0, "h2")])
    with pytest.raises(ConfigError, match="machine small has 1 device"):
        elastic.present_devices(c, [entry("small", 0), entry("small", 1)])
    with pytest.raises(ConfigError, match="rank 1, host h2.*nope"):
        elastic.present_devices(c, [entry("big", 0), entry("nope", 0, "h2")])


def test_no_plan_fits_the_devices_left_names_the_missing_memory():
    c = Cluster.from_config({
        "name": "tight", "gpu_types": {"TINYMEM": {"flops": "1 TFLOPS", "memory": "24 MB"}},
        "machines": [{"name": "a", "gpu": "TINYMEM", "count": 1, "intra_bandwidth": "10 GB/s"},
                     {"name": "b", "gpu": "TINYMEM", "count": 1, "intra_bandwidth": "10 GB/s"}],
        "inter_machine": {"bandwidth": "1 GB/s", "latency": "50us"}})
    run = elastic.ElasticRun(elastic.ElasticSettings("unused"))
    run.full_cluster, run.devices = c, [0]
    model = LlamaConfig.load("llama_tiny")
    with pytest.raises(InfeasiblePlan) as e:
        search(c.subset([0]), Workload(model, dtype="fp32"), 4, SearchSettings(iterations=2))
    err = run.infeasible(e.value)
    msg = str(err)
    assert "HexiScaleStrategy(elastic)" in msg and "no plan fits the devices present (missing: b)" in msg
    assert "memory" in msg.lower()


# ---- checkpoints and the report -----------------------------------------------------------------
def fake_checkpoint(path: Path, step: int, complete: bool = True) -> None:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    torch.save({"global_step": step, "hexiscale": {}}, path / ckpt.META)
    if complete:
        (path / ckpt.COMPLETE).write_text(ckpt.FORMAT)


def test_newest_complete_checkpoint(tmp_path):
    fake_checkpoint(tmp_path / "step-00000004", 4)
    fake_checkpoint(tmp_path / "step-00000008", 8)
    fake_checkpoint(tmp_path / "step-00000012", 12, complete=False)  # a save the kill interrupted
    fake_checkpoint(tmp_path / "last.ckpt.tmp-1234", 16)
    (tmp_path / "elastic.json").write_text("{}")
    assert [(s, p.name) for s, p in elastic.complete_checkpoints(tmp_path)] == [(4, "step-00000004"),
                                                                               (8, "step-00000008")]
    assert elastic.complete_checkpoints(tmp_path / "missing") == []


def fake_strategy(tmp_path):
    c = cluster3().subset([0, 1])
    plan = search(c, Workload(LlamaConfig.load("llama_tiny"), dtype="fp32"), 8, SearchSettings(iterations=2)).plan
    engine = types.SimpleNamespace(config=LlamaConfig.load("llama_tiny"))
    return types.SimpleNamespace(cluster=c, plan=plan, pipeline_model=types.SimpleNamespace(engine=engine),
                                 global_rank=0, world_size=1, broadcast=lambda v, src: v)


def test_resume_must_without_a_complete_checkpoint_is_a_clear_error(tmp_path):
    fake_checkpoint(tmp_path / "step-00000004.tmp-ab12", 4, complete=False)
    run = elastic.ElasticRun(elastic.ElasticSettings(tmp_path, resume="must"))
    run.full_cluster, run.devices = cluster3(), [0, 1]
    trainer = types.SimpleNamespace(callbacks=[], ckpt_path=None)
    run.before_call(trainer, True, None)
    assert trainer.ckpt_path is None
    with pytest.raises(ConfigError) as e:
        run.start(fake_strategy(tmp_path), trainer, TINY_FP32)
    msg = str(e.value)
    assert "resume" in msg and f"no complete checkpoint under {tmp_path}" in msg and "step-00000004.tmp-ab12" in msg


def test_the_checkpoint_is_handed_to_lightning_before_the_call(tmp_path):
    """fit: the newest complete checkpoint becomes trainer.ckpt_path (Lightning restores it as it
    restores fit(ckpt_path=...)); a ckpt_path the call names wins; the next call takes it back; ranks
    that chose differently (a checkpoint_dir that is not shared) get a clear error."""
    fake_checkpoint(tmp_path / "step-00000004", 4)
    fake_checkpoint(tmp_path / "step-00000008", 8)
    fake_checkpoint(tmp_path / "step-00000012", 12, complete=False)
    run = elastic.ElasticRun(elastic.ElasticSettings(tmp_path))
    run.full_cluster, run.devices = cluster3(), [0, 1]
    trainer = types.SimpleNamespace(callbacks=[], ckpt_path=None)
    run.before_call(trainer, True, None)
    newest = str(tmp_path / "step-00000008")
    assert trainer.ckpt_path == newest and run.chosen == (8, newest)
    run.start(fake_strategy(tmp_path), trainer, TINY_FP32)
    assert run.resumed_from == (8, newest) and "step-00000008" in run.report
    run.before_call(trainer, False, None)  # e.g. trainer.validate() after fit
    assert trainer.ckpt_path is None

    run.before_call(trainer, True, "mine.ckpt")  # the call names its own checkpoint: it wins
    assert trainer.ckpt_path is None and run.chosen == (8, newest)

    run.before_call(trainer, True, None)
    other = fake_strategy(tmp_path)
    other.global_rank, other.broadcast = 1, lambda value, src: (4, str(tmp_path / "step-00000004"))
    with pytest.raises(ConfigError, match=r"rank 1 found step-00000008 .* rank 0 step-00000004: every rank must "
                       r"see the same checkpoints.*Fix: put checkpoint_dir on a filesystem that every node shares"):
        run.start(other, trainer, TINY_FP32)

    never = elastic.ElasticRun(elastic.ElasticSettings(tmp_path, resume="never"))
    trainer.ckpt_path = None
    never.before_call(trainer, True, None)
    assert trainer.ckpt_path is None and never.chosen is None


def test_report_says_who_left_and_joined_and_the_steps_redone(tmp_path):
    run = elastic.ElasticRun(elastic.ElasticSettings(tmp_path))
    run.full_cluster, run.devices = cluster3(), [0, 1]
    (tmp_path / elastic.RECORD).write_text(json.dumps({
        "machines": ["big", "other"], "devices": 3, "plan": "OLD PLAN", "tokens_per_s": 2000.0, "step": 11}))
    trainer = types.SimpleNamespace(callbacks=[], ckpt_path=None)
    run.before_call(trainer, True, None)
    run.start(fake_strategy(tmp_path), trainer, TINY_FP32)  # no checkpoint: from step 0
    assert "machines left: other; joined: none" in run.report and "old plan: OLD PLAN" in run.report
    assert "2,000 -> " in run.report and "starting from step 0 (11 step(s) redone)" in run.report
    assert trainer.callbacks == [run]
    now = json.loads((tmp_path / elastic.RECORD).read_text())
    assert now["machines"] == ["big"] and now["devices"] == 2

    before = {"machines": ["big"], "plan": "P", "tokens_per_s": 10.0, "step": 9}
    text = elastic.describe_change(before, {**now, "machines": ["big", "small"], "restart": 2}, (8, "/c/step-8"))
    assert "machines left: none; joined: small" in text and "(step 8)" in text and "1 step(s) redone" in text


def test_settings_errors():
    with pytest.raises(ConfigError, match="every_n_steps"):
        elastic.ElasticSettings("d", every_n_steps=-1)
    with pytest.raises(ConfigError, match="resume"):
        elastic.ElasticSettings("d", resume="maybe")
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    with pytest.raises(ConfigError, match="elastic training re-plans on the machines of a cluster file"):
        HexiScaleStrategy(elastic="ckpt")
    with pytest.raises(ConfigError, match="a fixed plan cannot be used"):
        HexiScaleStrategy(cluster=cluster3(), plan=fake_strategy(None).plan, elastic="ckpt")


# ---- the recipe --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_recipe_elastic_outside_torchrun_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), "cluster=cpu2", "model=llama_tiny",
                        "trainer.elastic=true", f"trainer.output_dir={tmp_path}", "trainer.max_steps=1"],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=110)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "trainer.elastic" in r.stderr and "torchrun" in r.stderr and "HEXISCALE_MACHINE=<machine>" in r.stderr


# ---- in-process: the elastic collectives under the NCCL-semantics harness --------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elastic_saves_and_resumes_under_nccl_rules(tmp_path, monkeypatch):
    """Two forked ranks on machine 'small' of cpu_demo (HEXISCALE_MACHINE inherited): the membership
    gather, the checkpoint choice, the per-step SIGTERM agreement and the saves replay cleanly under
    NCCL's rules; a second fit resumes (resume='must') from the newest checkpoint and runs only the
    rest. The small devices have 21 MiB beside the planner's 1 GiB reserve: planned as the CPU
    devices they are (no NCCL buffers, Workload.for_cluster), as the strategy plans elsewhere."""
    import lightning.pytorch as pl
    from strategy_helpers import NcclTrace, Recorder, loader, module, read_ranks

    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    monkeypatch.setenv("HEXISCALE_MACHINE", "small")
    ck = tmp_path / "ck"

    def fit(name: str, steps: int, resume: str) -> list[dict]:
        out = tmp_path / name
        out.mkdir()
        strategy = HexiScaleStrategy(cluster="cpu_demo", start_method="fork", timeout=45.0, planner_iterations=2,
                                     elastic=elastic.ElasticSettings(ck, every_n_steps=2, resume=resume))
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[NcclTrace(out), Recorder(out)])
        trainer.fit(module(), loader(8 * 6, 8))
        return read_ranks(out, 2)

    first = fit("first", 4, "never")
    assert len(first[0]["losses"]) == 4
    assert [s for s, _ in elastic.complete_checkpoints(ck)] == [2, 4]
    second = fit("second", 6, "must")
    assert len(second[0]["losses"]) == 2, "steps 5 and 6 only"
    record = json.loads((ck / elastic.RECORD).read_text())
    assert record["resumed_step"] == 4 and record["machines"] == ["small"] and record["step"] == 6
    assert [s for s, _ in elastic.complete_checkpoints(ck)] == [4, 6], "keep=2: the oldest removed"


# ---- messages: a planned stop is not a failure; the end summary counts this worker's steps --------
def test_a_planned_join_is_not_reported_as_a_failure(tmp_path, capsys):
    """SIGTERM (torchrun stops the workers because a machine joins): the workers save, rank 0 says why,
    and the strategy reports no failed rank (its failure watch is not told, nothing says "failed")."""
    from lightning_hexiscale.errors import ElasticStop
    from lightning_hexiscale.lightning.strategy import HexiScaleStrategy

    run = elastic.ElasticRun(elastic.ElasticSettings(tmp_path, every_n_steps=0))
    run.sigterm = True
    saved = []
    strategy = types.SimpleNamespace(global_rank=0, world_size=1, remove_checkpoint=lambda p: None)
    trainer = types.SimpleNamespace(strategy=strategy, global_step=7, save_checkpoint=saved.append)
    with pytest.raises(ElasticStop) as e:
        run.on_train_batch_end(trainer, None, None, None, 0)
    assert saved == [str(tmp_path / "step-00000007")]
    out = capsys.readouterr().out
    assert "hexiscale elastic: SIGTERM" in out and "a machine joins or leaves" in out and "checkpoint of step 7" in out
    assert "fail" not in out + str(e.value)
    reported = []
    watch = types.SimpleNamespace(report=reported.append, explain=lambda: "first rank 1 failed")
    fake = types.SimpleNamespace(_watch=watch, _failure=None)
    assert HexiScaleStrategy.failure_reason(fake, e.value) is None and reported == []
    assert HexiScaleStrategy.failure_reason(fake, RuntimeError("gloo")) == "first rank 1 failed"  # a real failure


def test_sigterm_inside_an_accumulation_window_stops_at_its_end(tmp_path, capsys):
    """accumulate_grad_batches > 1: a batch that ends without an optimizer step (global_step unchanged
    since the batch started) neither agrees, saves nor stops; it used to save step-<N> mid-window
    (the loader past a batch whose gradient the checkpoint lacks) and stop there. The window's last
    batch saves the completed step and stops."""
    from lightning_hexiscale.errors import ElasticStop

    run = elastic.ElasticRun(elastic.ElasticSettings(tmp_path, every_n_steps=0))
    run.sigterm = True
    saved, agreed = [], []
    strategy = types.SimpleNamespace(global_rank=0, world_size=2, remove_checkpoint=lambda p: None,
                                     reduce_boolean_decision=lambda flag, all=True: (agreed.append(flag), flag)[1])
    trainer = types.SimpleNamespace(strategy=strategy, global_step=7, save_checkpoint=saved.append)
    run.on_train_batch_start(trainer, None, None, 14)
    run.on_train_batch_end(trainer, None, None, None, 14)  # first batch of the window of step 8
    assert saved == [] and agreed == []
    run.on_train_batch_start(trainer, None, None, 15)
    trainer.global_step = 8  # the window's last batch: the optimizer stepped
    with pytest.raises(ElasticStop, match="checkpoint of step 8"):
        run.on_train_batch_end(trainer, None, None, None, 15)
    assert saved == [str(tmp_path / "step-00000008")] and agreed == [True]


def test_the_end_summary_counts_the_steps_this_worker_ran(capsys):
    """Resumed at step 15 and stopped at 40: 25 steps ran here, not 40."""
    from lightning_hexiscale.lightning.example import LossPrinter

    trainer = types.SimpleNamespace(global_step=15, is_global_zero=True, accumulate_grad_batches=1,
                                    log_every_n_steps=100, progress_bar_callback=None, callback_metrics={})
    printer = LossPrinter()
    printer.on_train_start(trainer, None)
    for step in range(16, 41):
        trainer.global_step = step
        printer.on_train_batch_end(trainer, None, {"loss": torch.tensor(4.0 - step / 20)}, None, step)
    trainer.callback_metrics = {"train_loss": torch.tensor(2.0)}
    printer.on_train_end(trainer, None)
    out = capsys.readouterr().out
    assert "first 3.2000 -> last 2.0000 after 25 steps (steps 16-40, resumed at step 15)" in out, out
