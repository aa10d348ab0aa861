"""A run's optimizer steps sized to a wall-clock budget from its own measured costs (config `max_minutes`).

The budget is the whole job's, counted from `start_job_clock()` (train/distill.py calls it first thing): the
teacher data and the target's states take what they take on the machine at hand, and training gets the rest.
The step count is decided once, after the learning rate's warm-up and at least CALIBRATION_STEPS steps, from
their measured seconds and the first in-loop evaluation's: each step still to come is priced by its own batch's
work (a fixed part plus a part per counted position, fitted to the timed steps), so a data order that starts
with short batches does not make the rest look cheap. The count is capped by max_steps (or the epochs' steps) and
then fixed, so the cosine decay has one length and `--resume` continues with the decided count (it is in the
scheduler's state and in TrainState.total_steps). Should the machine slow down after that, training stops
early rather than overrun (`out_of_time`), its last step evaluated and the best drafter published as always.

    steps_within(seconds_left, done, step_seconds, seconds_per_eval, eval_every, cap) -> steps
    fit_step_price(seconds, work) -> (fixed, per_unit)
    StepBudget(max_minutes, warmup_steps, eval_every, cap, work_of): observe_step / observe_eval / calibrated /
        decide / out_of_time
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("specdistill.budget")

_job_start: float | None = None


def start_job_clock() -> None:
    """Start the job's clock (train/distill.py, before it loads the target)."""
    global _job_start
    _job_start = time.monotonic()


def seconds_since_start() -> float:
    """Seconds since start_job_clock(); a job that never started it starts it now (a trainer called directly)."""
    if _job_start is None:
        start_job_clock()
    return time.monotonic() - _job_start


def evaluations_after(done: int, total: int, eval_every: int) -> int:
    """In-loop evaluations a run from step `done` to `total` still runs: one at each multiple of eval_every in
    (done, total], and one at the end when total is not such a multiple (the trainers measure the last step)."""
    if total <= done:
        return 0
    if not eval_every:
        return 1
    return total // eval_every - done // eval_every + (1 if total % eval_every else 0)


def steps_within(seconds_left: float, done: int, step_seconds: Sequence[float], seconds_per_eval: float,
                 eval_every: int, cap: int) -> int:
    """The most optimizer steps s, done <= s <= cap, whose remaining steps and evaluations fit seconds_left
    (sum(step_seconds[:s - done]) + evaluations_after(done, s) * seconds_per_eval <= seconds_left);
    step_seconds[i]: the price of step done + i + 1 (at least cap - done of them). `done` when not even one
    more step fits."""
    spent = [0.0, *itertools.accumulate(step_seconds[:cap - done])]  # spent[n]: the next n steps

    def cost(s: int) -> float:
        return spent[s - done] + evaluations_after(done, s, eval_every) * seconds_per_eval

    low, high = done, cap  # cost(low) = 0 fits; cost grows with s
    if cost(high) <= seconds_left:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= seconds_left else (low, mid)
    return low


def fit_step_price(seconds: Sequence[float], work: Sequence[float]) -> tuple[float, float]:
    """(fixed, per_unit): a step's seconds as fixed + per_unit * its batch's work, by least squares over the
    timed steps. Where the work does not vary, or it explains none of the time (a slope <= 0), every step is
    priced at the mean (0 per unit); where the fit needs a negative fixed part, by the ratio of the sums."""
    if not seconds:
        return 0.0, 0.0
    mean_s, mean_w = statistics.fmean(seconds), statistics.fmean(work)
    spread = sum((w - mean_w) ** 2 for w in work)
    if spread == 0:
        return mean_s, 0.0
    slope = sum((w - mean_w) * (s - mean_s) for w, s in zip(work, seconds)) / spread
    if slope <= 0:
        return mean_s, 0.0
    fixed = mean_s - slope * mean_w
    return (fixed, slope) if fixed >= 0 else (0.0, sum(seconds) / sum(work))


CALIBRATION_STEPS = 50  # steps timed before deciding, at least: enough batch sizes for fit_step_price's line


class StepBudget:
    """Times a run's steps and evaluations, decides its step count once (`decide`, at `calibrated`), and says
    when the job would overrun anyway (`out_of_time`: a machine that slowed down after the decision).

    work_of(i): the work in the batch of step i (the one that takes the run from i to i + 1 steps), known
    before the step runs, for example its counted positions: a step costs a fixed part plus a part per unit
    of work (`fit_step_price`), so the steps still to come are priced by their own batches, not by the mean
    of the first ones (a seeded data order can start with short batches). None: every step alike."""

    def __init__(self, max_minutes: float, warmup_steps: int, eval_every: int, cap: int,
                 work_of: Callable[[int], float] | None = None):
        self.max_seconds = 60.0 * max_minutes
        self.warmup_steps, self.eval_every, self.cap = warmup_steps, eval_every, cap
        self.work_of = work_of or (lambda step: 1.0)
        self.step_seconds: list[float] = []
        self.step_work: list[float] = []
        self.eval_seconds: list[float] = []

    def observe_step(self, seconds: float, step: int) -> None:
        """Step `step` (0-based: it took the run to step + 1) took `seconds`."""
        self.step_seconds.append(seconds)
        self.step_work.append(self.work_of(step))

    def observe_eval(self, seconds: float) -> None:
        self.eval_seconds.append(seconds)

    def calibrated(self, step: int) -> bool:
        """Whether enough steps are timed to decide: the warm-up's and at least CALIBRATION_STEPS (the cosine
        decay's first steps barely depend on its length: 0.03% for 50 of 2,000 steps against 4,000), or the
        cap reached."""
        return step >= min(max(self.warmup_steps, CALIBRATION_STEPS), self.cap)

    def price(self) -> tuple[float, float]:
        """(fixed, per unit of work) seconds of a step, fitted to the timed steps after the first (memory
        first touched, the first shard read)."""
        timed = slice(1, None) if len(self.step_seconds) > 1 else slice(None)
        return fit_step_price(self.step_seconds[timed], self.step_work[timed])

    def step_cost(self, step: int, price: tuple[float, float] | None = None) -> float:
        """The predicted seconds of step `step`."""
        fixed, per_unit = price or self.price()
        return fixed + per_unit * self.work_of(step)

    def per_eval(self) -> float:
        """Seconds an evaluation (and a checkpoint beside it): the slowest measured, else 30 mean steps."""
        if self.eval_seconds:
            return max(self.eval_seconds)
        return 30 * statistics.fmean(self.step_seconds[1:] or self.step_seconds or [0.0])

    def decide(self, done: int) -> int:
        """The run's total steps, from the costs measured so far and the job's seconds left."""
        left, price, per_eval = self.max_seconds - seconds_since_start(), self.price(), self.per_eval()
        costs = [self.step_cost(step, price) for step in range(done, self.cap)]
        total = steps_within(left, done, costs, per_eval, self.eval_every, self.cap)
        if total == done:
            log.warning("max_minutes: %.1f of %.1f minutes are gone after %d steps; training stops here",
                        (self.max_seconds - left) / 60, self.max_seconds / 60, done)
        else:
            fixed, per_unit = price
            log.info("max_minutes: %d steps fit the %.1f minutes left (a step %.2f s + %.3f ms per unit of its "
                     "batch's work: %.2f s on average to come; %.1f s an evaluation; cap %d)", total, left / 60,
                     fixed, 1e3 * per_unit, statistics.fmean(costs[:total - done]), per_eval, self.cap)
        return total

    def out_of_time(self, done: int) -> bool:
        """Whether the next step (the run is at step `done`) and the last evaluation would end the job past
        max_minutes."""
        return seconds_since_start() + self.step_cost(done) + self.per_eval() > self.max_seconds
