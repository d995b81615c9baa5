"""The step's phases and the gradient reducer, without processes (runtime/step.py, runtime/reducers.py,
lightning/step_adapter.py). That the phases are the ones ``Trainer.fit`` runs, call for call, is
tests/lightning/test_fit_step_trace.py; that they equal one device is tests/runtime/test_fit_step.py."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_hexiscale.errors import ConfigError, NonFiniteError
from lightning_hexiscale.lightning.step_adapter import StepAdapter
from lightning_hexiscale.runtime.reducers import (DDPReducer, GradReducer, ZeroReducer, build_reducer,
                                                   gathers_parameters)
from lightning_hexiscale.runtime.step import FitStep, Step

ENGINE = Path(__file__).resolve().parents[2] / "lightning_hexiscale" / "runtime" / "engine.py"
FLAVOUR_BRANCH = re.compile(r"self\.zero\b|sharding ==")


def flavour_branches(source: str) -> list[str]:
    """Lines of ``source`` that ask which data-parallel flavour runs."""
    return [line.strip() for line in source.splitlines() if FLAVOUR_BRANCH.search(line)]


def test_the_engine_does_not_branch_on_the_flavour():
    assert flavour_branches(ENGINE.read_text()) == []


def test_the_branch_check_finds_one():
    assert flavour_branches("x = 1\n        if self.zero is not None:\n    if self.sharding == 'ddp':\n") == [
        "if self.zero is not None:", "if self.sharding == 'ddp':"]


def test_the_reducer_is_chosen_by_the_plans_sharding():
    assert [gathers_parameters(s) for s in ("ddp", "zero2", "zero3")] == [False, False, True]
    assert DDPReducer.sharding == "ddp" and issubclass(DDPReducer, GradReducer) and issubclass(ZeroReducer, GradReducer)
    with pytest.raises(ValueError, match=r"plan.dp_sharding='zero4': must be 'ddp', 'zero2' or 'zero3'"):
        build_reducer("zero4", None, None, None, bucket_cap_bytes=1, reduce_dtype=torch.float32,
                      wire_dtype=torch.float32, executor=None)


class _RecordingStep(Step):
    """A Step whose phases record their calls instead of communicating."""

    def __init__(self, bad: dict[int, int] | None = None):  # no stage, no process group
        self.calls, self.bad = [], bad or {}

    def open_window(self):
        self.calls.append("open")

    def micro_step(self, tokens, targets, *, accumulate=1, last=False):
        self.calls.append(("micro", accumulate, last))
        return 2.5

    def close_window(self, loss=None):
        self.calls.append(("close", float(loss)))
        return self.bad

    def clip(self, max_norm):
        self.calls.append(("clip", max_norm))
        return 7.0

    def update(self, optimizer):
        self.calls.append("update")


def test_run_is_the_phases_in_a_row():
    step = _RecordingStep()
    out = step.run(None, None, object(), clip_norm=1.0, before_update=lambda: step.calls.append("before_update"))
    assert step.calls == ["open", ("micro", 1, True), ("close", 2.5), "before_update", ("clip", 1.0), "update"]
    assert out == FitStep(2.5, 7.0, {})


def test_a_nonfinite_step_skips_the_update_or_stops():
    step = _RecordingStep(bad={3: 2})
    assert step.run(None, None, object(), clip_norm=1.0, nonfinite="skip") == FitStep(2.5, None, {3: 2})
    assert step.calls == ["open", ("micro", 1, True), ("close", 2.5)]
    with pytest.raises(NonFiniteError, match=r"rank\(s\) \[3\]"):
        _RecordingStep(bad={3: 2}).run(None, None, object())
    with pytest.raises(ConfigError, match=r"fit_step\(nonfinite\)"):
        _RecordingStep().run(None, None, object(), nonfinite="ignore")


def _trainer(batch_idx: int, k: int, batches: int = 100):
    """The fit loop's public counters at training batch ``batch_idx`` of an epoch of ``batches``."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=batch_idx + 1), is_last_batch=batch_idx + 1 == batches)
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=batch_idx, batch_progress=progress))
    return SimpleNamespace(accumulate_grad_batches=k, fit_loop=loop, num_training_batches=batches,
                           strategy=SimpleNamespace(handles_gradient_accumulation=False))


def test_the_adapter_maps_a_window_of_three_batches():
    """accumulate_grad_batches=3: the first batch opens the window, the third arms the sync, and the
    loss shown for each batch is its own mean (the step returns it / k)."""
    step = _RecordingStep()
    adapter = StepAdapter(SimpleNamespace(step=step))
    shown = []
    for i in range(3):
        adapter.begin_batch(_trainer(i, 3))
        shown.append(adapter.micro_step(None, None))
    assert step.calls == ["open", ("micro", 3, False), ("micro", 3, False), ("micro", 3, True)]
    assert shown == [7.5, 7.5, 7.5]
    adapter.micro_step(None, None)  # a micro-step without a new batch does not arm again
    assert step.calls[-1] == ("micro", 3, False)


def test_the_adapter_closes_the_window_after_the_closure():
    step = _RecordingStep(bad={})
    out, bad = StepAdapter(SimpleNamespace(step=step)).close_window(lambda: torch.tensor(1.5))
    assert float(out) == 1.5 and bad == {} and step.calls == [("close", 1.5)]
