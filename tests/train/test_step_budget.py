"""Sizing a run's steps to a wall-clock budget (train.step_budget, config max_minutes): the arithmetic, the
schedule whose length is set after the warm-up (and survives a checkpoint), the config's checks, and EAGLE-3
training that stops where the budget says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import specdistill.train.step_budget as step_budget
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from specdistill.train.distill_steps import WarmupCosine, make_optimizer, set_schedule_length
from specdistill.train.eagle3 import BatchPlan, train_eagle3
from specdistill.train.step_budget import StepBudget, evaluations_after, fit_step_price, steps_within
from tests.train.test_eagle3_train import LAYERS, eagle3_config, records, target  # noqa: F401 (tiny fixtures)


def cost(s, done, per_step, per_eval, every):
    """What s steps from `done` cost when every step costs per_step (a number) or step i costs per_step(i)."""
    steps = sum(per_step(i) for i in range(done, s)) if callable(per_step) else (s - done) * per_step
    return steps + evaluations_after(done, s, every) * per_eval


def alike(per_step, done, cap):
    return [per_step] * (cap - done)


@pytest.mark.parametrize("done,total,every,expected", [(0, 100, 25, 4), (0, 110, 25, 5), (20, 100, 25, 4),
                                                       (25, 100, 25, 3), (99, 100, 0, 1), (100, 100, 25, 0),
                                                       (20, 21, 25, 1)])
def test_evaluations_after_counts_each_multiple_and_an_unaligned_end(done, total, every, expected):
    assert evaluations_after(done, total, every) == expected


@pytest.mark.parametrize("left", [0.0, 0.5, 3.0, 40.0, 99.5, 1e9])
@pytest.mark.parametrize("per_eval", [0.0, 7.0])
def test_steps_within_is_the_most_steps_that_fit(left, per_eval):
    done, per_step, every, cap = 20, 0.9, 25, 400
    s = steps_within(left, done, alike(per_step, done, cap), per_eval, every, cap)
    assert done <= s <= cap
    assert s == done or cost(s, done, per_step, per_eval, every) <= left
    assert s == cap or cost(s + 1, done, per_step, per_eval, every) > left  # one more would not fit


def test_steps_within_grows_with_the_time_left():
    counts = [steps_within(left, 20, alike(1.0, 20, 10_000), 10.0, 50, 10_000) for left in range(0, 2000, 37)]
    assert counts == sorted(counts) and counts[0] == 20 and counts[-1] > 1000


def test_the_decision_waits_for_the_warm_up_and_the_calibration_steps_unless_the_cap_comes_first(monkeypatch):
    monkeypatch.setattr(step_budget, "CALIBRATION_STEPS", 50)
    assert [StepBudget(10, 20, 0, 4000).calibrated(s) for s in (20, 49, 50)] == [False, False, True]
    assert [StepBudget(10, 80, 0, 4000).calibrated(s) for s in (50, 79, 80)] == [False, False, True]
    assert StepBudget(10, 20, 0, cap=12).calibrated(12)


def test_out_of_time_when_a_step_and_the_last_evaluation_would_pass_the_budget(monkeypatch):
    budget = StepBudget(max_minutes=1, warmup_steps=5, eval_every=0, cap=100)
    for step, seconds in enumerate([9.0, 2.0, 2.0]):
        budget.observe_step(seconds, step)
    budget.observe_eval(5.0)
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 52.0)
    assert not budget.out_of_time(3)  # 52 + 2 + 5 = 59
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 54.0)
    assert budget.out_of_time(3)  # 61


def test_out_of_time_prices_the_next_step_by_its_batch(monkeypatch):
    work = [10.0, 10.0, 20.0, 10.0, 20.0, 10.0, 50.0]  # 0.1 s a unit; the next step's batch is long
    budget = StepBudget(max_minutes=1, warmup_steps=5, eval_every=0, cap=100, work_of=work.__getitem__)
    for step, seconds in enumerate([9.0, 1.0, 2.0, 1.0, 2.0, 1.0]):
        budget.observe_step(seconds, step)
    budget.observe_eval(5.0)
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 52.0)
    assert budget.out_of_time(6)  # 52 + 5 + 5 = 62, where the mean step (1.4 s) would say 58.4


def test_decide_prices_steps_by_their_mean_after_the_first_and_evaluations_by_the_slowest(monkeypatch):
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 60.0)  # one minute of ten gone
    budget = StepBudget(max_minutes=10, warmup_steps=5, eval_every=100, cap=10_000)
    for step, seconds in enumerate([30.0, 1.0, 2.0, 1.0, 2.0]):  # the first step is left out: 1.5 s a step
        budget.observe_step(seconds, step)
    budget.observe_eval(12.0)
    budget.observe_eval(18.0)
    total = budget.decide(done=5)
    assert total == steps_within(540.0, 5, alike(1.5, 5, 10_000), 18.0, 100, 10_000)
    assert cost(total, 5, 1.5, 18.0, 100) <= 540.0 < cost(total + 1, 5, 1.5, 18.0, 100)


def test_steps_still_to_come_are_priced_by_their_own_batches(monkeypatch):
    """Calibration on short batches (100 positions: 1.0 s) and a few long ones (300: 2.0 s) fits 0.5 s + 5 ms a
    position; a future of long batches (400 positions: 2.5 s) then buys the steps that fit at 2.5 s, where the
    calibration's mean (about 1.1 s) would have promised more than twice as many."""
    work = lambda step: 100.0 if step < 50 and step % 10 else (300.0 if step < 50 else 400.0)  # noqa: E731
    budget = StepBudget(max_minutes=10, warmup_steps=5, eval_every=0, cap=10_000, work_of=work)
    for step in range(50):
        budget.observe_step(0.5 + 0.005 * work(step), step)
    budget.observe_eval(40.0)
    assert budget.price() == pytest.approx((0.5, 0.005))
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 60.0)
    total = budget.decide(done=50)
    assert cost(total, 50, lambda i: 2.5, 40.0, 0) <= 540.0 < cost(total + 1, 50, lambda i: 2.5, 40.0, 0)
    assert total == 50 + 200


@pytest.mark.parametrize("seconds, work, expected", [
    ([1.0, 2.0, 3.0], [10.0, 20.0, 30.0], (0.0, 0.1)),  # exactly proportional
    ([1.5, 1.5, 1.5], [10.0, 20.0, 30.0], (1.5, 0.0)),  # the work explains nothing: the mean
    ([3.0, 2.0, 1.0], [10.0, 20.0, 30.0], (2.0, 0.0)),  # longer batches faster (noise): the mean, never a discount
    ([1.0, 1.0, 2.0], [1.0, 1.0, 1.0], (4 / 3, 0.0)),  # every batch alike: the mean
    ([0.5, 2.0, 3.5], [10.0, 20.0, 30.0], (0.0, 6.0 / 60.0)),  # the fit's fixed part negative: the sums' ratio
    ([], [], (0.0, 0.0))])
def test_fit_step_price(seconds, work, expected):
    assert fit_step_price(seconds, work) == pytest.approx(expected)


def test_the_plan_knows_each_batch_s_counted_positions_before_reading_it(target, records, tmp_path, monkeypatch):
    """BatchPlan.work equals the counted positions of the batch BatchPlan.batch then reads."""
    from specdistill.distill.feature_cache import open_or_build
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    cache = open_or_build(target, records[:40], LAYERS, 48, 8, 0)
    plan = BatchPlan(cache, 4, seed=3)
    for index in range(plan.batches_per_epoch + 3):
        batch = plan.batch(index)
        assert plan.work(index) == sum(int(r.mask.sum()) for r in batch)
        assert plan.work(index, prompt_weight=0.5) == sum(r.ids.numel() - 1 for r in batch)


def test_the_schedule_keeps_its_warm_up_and_carries_its_length_through_a_checkpoint():
    cfg = DistillConfig(method="eagle3", lr=1e-3, warmup_steps=4, prompts=["self:4"])
    model = torch.nn.Linear(2, 2)
    _, scheduler = make_optimizer(cfg, model, total_steps=1000)
    warm = [scheduler.lr_lambdas[0](s) for s in range(4)]
    set_schedule_length(scheduler, 40)
    assert [scheduler.lr_lambdas[0](s) for s in range(4)] == warm  # the warm-up does not depend on the length
    assert scheduler.lr_lambdas[0](40) == pytest.approx(0.1) and scheduler.lr_lambdas[0](39) > 0.1
    state = scheduler.state_dict()
    _, fresh = make_optimizer(cfg, torch.nn.Linear(2, 2), total_steps=1000)
    fresh.load_state_dict(state)
    assert isinstance(fresh.lr_lambdas[0], WarmupCosine) and fresh.lr_lambdas[0].total == 40


@pytest.mark.parametrize("override, message", [(dict(max_minutes=-1.0), "max_minutes: must be >= 0"),
                                               (dict(max_minutes=30.0, method="lookahead"),
                                                "max_minutes: method lookahead")])
def test_bad_budgets_name_the_field(override, message):
    fields = dict(method="eagle3", prompts=["self:4"])
    fields.update(override)
    with pytest.raises(ConfigError, match=message):
        DistillConfig(**fields)


@pytest.fixture(autouse=True)
def decide_after_the_warm_up(monkeypatch):
    """The tiny runs below decide at the end of their 5 warm-up steps."""
    monkeypatch.setattr(step_budget, "CALIBRATION_STEPS", 0)


def run_with_clock(target, records, tmp_path, monkeypatch, minutes_gone: float, **overrides):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 60.0 * minutes_gone)
    cfg = eagle3_config(tmp_path, max_minutes=10.0, warmup_steps=5, max_steps=30, eval_every=0, **overrides)
    out = train_eagle3(cfg, Accelerator(cpu=True), target, records[:40], [])
    return out, json.loads((Path(cfg.work_dir) / "summary.json").read_text())


def test_a_spent_budget_stops_training_after_the_warm_up_and_still_publishes(target, records, tmp_path, monkeypatch):
    out, summary = run_with_clock(target, records, tmp_path, monkeypatch, minutes_gone=10.5)
    assert summary["finished"] and summary["step"] == 5 and summary["decided_steps"] == 5
    assert (Path(out) / "manifest.json").is_file()


def test_an_ample_budget_trains_to_max_steps(target, records, tmp_path, monkeypatch):
    _, summary = run_with_clock(target, records, tmp_path, monkeypatch, minutes_gone=0.0)
    assert summary["finished"] and summary["step"] == 30 and summary["decided_steps"] == 30


def test_a_machine_that_slows_after_the_decision_stops_early_and_still_publishes(target, records, tmp_path,
                                                                                monkeypatch):
    clock = {"seconds": 0.0}
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: clock["seconds"])
    decide = StepBudget.decide

    def decide_then_slow_down(self, done):
        total = decide(self, done)
        clock["seconds"] = 60.0 * 10.5  # the rest of the budget gone at once
        return total

    monkeypatch.setattr(StepBudget, "decide", decide_then_slow_down)
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    cfg = eagle3_config(tmp_path, max_minutes=10.0, warmup_steps=5, max_steps=30, eval_every=0)
    out = train_eagle3(cfg, Accelerator(cpu=True), target, records[:40], [])
    summary = json.loads((Path(cfg.work_dir) / "summary.json").read_text())
    assert summary["finished"] and summary["step"] == 6  # decided 30 at step 5, stopped after the next
    assert (Path(out) / "manifest.json").is_file()


def test_a_resumed_run_keeps_the_step_count_it_decided(target, records, tmp_path, monkeypatch):
    """Decided at the end of the warm-up (12 of max_steps 30), stopped at step 8: the resume trains to 12 with
    the schedule of 12, whatever its own clock says."""
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(step_budget.StepBudget, "decide", lambda self, done: 12)
    short = dict(max_minutes=10.0, warmup_steps=5, max_steps=30, eval_every=0, checkpoint_every=4)
    stopped = eagle3_config(tmp_path, stop_at_step=8, **short)
    assert train_eagle3(stopped, Accelerator(cpu=True), target, records[:40], []) is None
    monkeypatch.setattr(step_budget.StepBudget, "decide", lambda self, done: pytest.fail("decided again"))
    cfg = eagle3_config(tmp_path, resume=True, **short)
    train_eagle3(cfg, Accelerator(cpu=True), target, records[:40], [])
    assert json.loads((Path(cfg.work_dir) / "summary.json").read_text())["step"] == 12
