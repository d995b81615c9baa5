"""The plan checked while it trains (lightning/plan_check.py), on 2 forked CPU ranks: after the
warm-up, global rank 0 prints one estimate-vs-measured line naming the stage furthest from its price,
and the per-stage times land in plan_check.json in the trainer's log directory; the gather is one
collective at the same step on every rank (the NCCL-semantics replay of read_ranks checks it)."""

from __future__ import annotations

import json

import pytest
from strategy_helpers import hexiscale_trainer, loader, module, plan_of, read_ranks

PLAN = plan_of([(2, 1, [([0], (0, 2)), ([1], (2, 4))])])  # one pipeline, two stages


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank0_prints_the_check_and_writes_the_stage_times(tmp_path, capfd):
    from lightning.pytorch.loggers import CSVLogger

    trainer = hexiscale_trainer(PLAN, tmp_path, strategy_kw={"plan_check": 1}, max_steps=5,
                                logger=CSVLogger(str(tmp_path), name="logs", version=0))
    trainer.fit(module(), loader(20, 2))
    read_ranks(tmp_path, 2)  # every rank's communication replays under NCCL's rules
    out = capfd.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("hexiscale plan check (")]
    assert len(lines) == 1, out  # rank 0 only, once
    assert "3 steps after 1 warm-up" in lines[0] and "furthest from its price: pipeline 0 stage" in lines[0]
    # and, at setup, what priced the plan it is held against (local CPU devices: declared FLOP/s)
    assert out.count("hexiscale plan priced by: ") == 1 and "CPU" in out.split("hexiscale plan priced by: ")[1]
    doc = json.loads((tmp_path / "logs" / "version_0" / "plan_check.json").read_text())  # the log directory
    assert doc["warmup_steps"] == 1 and doc["measured_steps"] == 3 and doc["measured_step_s"] > 0
    assert [(s["pipeline"], s["stage"], s["devices"]) for s in doc["stages"]] == [(0, 0, [0]), (0, 1, [1])]
    assert all(s["measured_s"] > 0 and s["estimated_s"] > 0 for s in doc["stages"])
    assert [len(r["step_s"]) for r in doc["per_rank"]] == [3, 3]
    # busy time (schedule minus exchanges) is part of the step's wall time
    assert all(b <= s for r in doc["per_rank"] for b, s in zip(r["busy_s"], r["step_s"]))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_no_check_before_the_warm_up_ends_or_when_off(tmp_path, capfd):
    hexiscale_trainer(PLAN, tmp_path, max_steps=3, default_root_dir=str(tmp_path)).fit(module(), loader(12, 2))
    hexiscale_trainer(PLAN, tmp_path, strategy_kw={"plan_check": None}, max_steps=5,
                      default_root_dir=str(tmp_path)).fit(module(), loader(20, 2))
    assert "hexiscale plan check (" not in capfd.readouterr().out
    assert not list(tmp_path.rglob("plan_check.json"))
    # no logger, no checkpoints: the line, but no file (the run writes no outputs at all)
    hexiscale_trainer(PLAN, tmp_path, strategy_kw={"plan_check": 1}, max_steps=4,
                      default_root_dir=str(tmp_path)).fit(module(), loader(16, 2))
    out = capfd.readouterr().out
    assert out.count("hexiscale plan check (") == 1 and "written to" not in out
    assert not list(tmp_path.rglob("plan_check.json"))
