"""A run's optimizer steps sized to a wall-clock budget from its own measured costs (config `max_minutes`).

The budget is the whole job's, counted from `start_job_clock()` (train/distill.py calls it first thing): the
teacher data and the target's states take what they take on the machine at hand, and training gets the rest.
The step count is decided once, after the learning rate's warm-up and at least CALIBRATION_STEPS steps, from
their measured seconds and the first in-loop evaluation's; it is capped by max_steps (or the epochs' steps) and
then fixed, so the cosine decay has one length and `--resume` continues with the decided count (it is in the
scheduler's state and in TrainState.total_steps). Should the machine slow down after that, training stops
early rather than overrun (`out_of_time`), its last step evaluated and the best drafter published as always.

    steps_within(seconds_left, done, seconds_per_step, seconds_per_eval, eval_every, cap) -> steps
    StepBudget(max_minutes, warmup_steps, eval_every, cap): observe_step / observe_eval / calibrated / decide /
        out_of_time
"""

from __future__ import annotations

import logging
import statistics
import time

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


def steps_within(seconds_left: float, done: int, seconds_per_step: float, seconds_per_eval: float, eval_every: int,
                 cap: int) -> int:
    """The most optimizer steps s, done <= s <= cap, whose remaining steps and evaluations fit seconds_left
    ((s - done) * seconds_per_step + evaluations_after(done, s) * seconds_per_eval <= seconds_left); `done`
    when not even one more step fits."""
    def cost(s: int) -> float:
        return (s - done) * seconds_per_step + evaluations_after(done, s, eval_every) * seconds_per_eval

    low, high = done, cap  # cost(low) = 0 fits; cost grows with s
    if cost(high) <= seconds_left:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= seconds_left else (low, mid)
    return low


CALIBRATION_STEPS = 50  # steps timed before deciding, at least (a step's cost varies by about 15% with its batch)


class StepBudget:
    """Times a run's steps and evaluations, decides its step count once (`decide`, at `calibrated`), and says
    when the job would overrun anyway (`out_of_time`: a machine that slowed down after the decision)."""

    def __init__(self, max_minutes: float, warmup_steps: int, eval_every: int, cap: int):
        self.max_seconds = 60.0 * max_minutes
        self.warmup_steps, self.eval_every, self.cap = warmup_steps, eval_every, cap
        self.step_seconds: list[float] = []
        self.eval_seconds: list[float] = []

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def observe_eval(self, seconds: float) -> None:
        self.eval_seconds.append(seconds)

    def calibrated(self, step: int) -> bool:
        """Whether enough steps are timed to decide: the warm-up's and at least CALIBRATION_STEPS (the cosine
        decay's first steps barely depend on its length: 0.03% for 50 of 2,000 steps against 4,000), or the
        cap reached."""
        return step >= min(max(self.warmup_steps, CALIBRATION_STEPS), self.cap)

    def per_step(self) -> float:
        """Seconds a step: the mean of the timed steps after the first (memory first touched, the first shard
        read), whose cost varies with their batch's lengths."""
        timed = self.step_seconds[1:] or self.step_seconds
        return statistics.fmean(timed) if timed else 0.0

    def per_eval(self) -> float:
        """Seconds an evaluation (and a checkpoint beside it): the slowest measured, else 30 steps."""
        return max(self.eval_seconds) if self.eval_seconds else 30 * self.per_step()

    def decide(self, done: int) -> int:
        """The run's total steps, from the costs measured so far and the job's seconds left."""
        left, per_step, per_eval = self.max_seconds - seconds_since_start(), self.per_step(), self.per_eval()
        total = steps_within(left, done, per_step, per_eval, self.eval_every, self.cap)
        if total == done:
            log.warning("max_minutes: %.1f of %.1f minutes are gone after %d steps; training stops here",
                        (self.max_seconds - left) / 60, self.max_seconds / 60, done)
        else:
            log.info("max_minutes: %d steps fit the %.1f minutes left (%.2f s a step, %.1f s an evaluation; "
                     "cap %d)", total, left / 60, per_step, per_eval, self.cap)
        return total

    def out_of_time(self) -> bool:
        """Whether one more step and the last evaluation would end the job past max_minutes."""
        return seconds_since_start() + self.per_step() + self.per_eval() > self.max_seconds
