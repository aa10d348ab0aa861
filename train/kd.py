"""Distillation into a drafter model (methods `seqkd` and `kd`): the drafter is a small causal LM of its own.

    train_kd(cfg, accelerator, target, records, eval_prompts) -> the drafter directory, or None when stopped

Reads top to bottom: build the drafter (optionally with a reduced head, `draft_vocab`, and LoRA), train it on
the teacher data with the job's loss (seqkd: cross-entropy on the target's tokens; kd: a divergence from the
target's stored top-k log-probabilities, or, with on_policy_lambda, from the target scoring the drafter's own
samples), measuring acceptance with the real engine every `eval_every` steps and keeping the best drafter by
measured tau, published at `output_dir` at the end. `--resume` continues from the last checkpoint.

Neither method has a config section: they read the common fields (loss, jsd_beta, kd_temperature,
on_policy_lambda, topk and the optimisation ones).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from specdistill.models.draft_models import merged_copy
from specdistill.train import distill_steps as steps
from specdistill.train.checkpoints import resume_or_start, save_checkpoint
from specdistill.train.config import ConfigError
from specdistill.train.methods import Method, register_method
from specdistill.train.step_budget import StepBudget

log = logging.getLogger("specdistill.distill")


def train_kd(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]] | None = None) -> Path | None:
    """eval_prompts: not given (Method.measures is False); the held-out prompts are built here, after the drafter
    and its optimizer, so that what they draw from the seeded generators leaves the drafter's start as it was."""
    with steps.unpartitioned(accelerator):
        drafter, vocab_map = steps.build_drafter(cfg, target, records)
    whole = steps.WholeDrafter(accelerator, drafter)
    loader = steps.make_loader(cfg, records, target, vocab_map)
    total = steps.total_steps(cfg, len(loader), accelerator.num_processes)
    optimizer, scheduler = steps.make_optimizer(cfg, drafter, total)
    drafter, optimizer, loader, scheduler = accelerator.prepare(drafter, optimizer, loader, scheduler)
    state = resume_or_start(cfg, accelerator)
    eval_prompts = steps.eval_prompt_ids(cfg, target) if accelerator.is_main_process else []
    finished = train(cfg, accelerator, target, drafter, vocab_map, loader, optimizer, scheduler, state,
                     eval_prompts, total, whole)
    out = steps.publish_best(cfg, accelerator, target, vocab_map, state) if finished else None
    steps.write_summary(cfg, accelerator, drafter, state, finished, whole)
    return out


def train(cfg, accelerator, target, drafter, vocab_map, loader, optimizer, scheduler, state, eval_prompts,
          total: int, whole: steps.WholeDrafter) -> bool:
    """Train to `total` steps, or with max_minutes as many as the job's time left allows (decided once after the
    warm-up, train.step_budget; a resumed run keeps the decided count); False when stopped early at
    `stop_at_step` (resume to continue)."""
    total = state.total_steps or total
    budget = StepBudget(cfg.max_minutes, cfg.warmup_steps, cfg.eval_every, total) if cfg.max_minutes else None
    if cfg.eval_every and state.step == 0:  # the starting point, so the gain is visible
        started = time.perf_counter()
        evaluate(cfg, accelerator, target, whole.of(drafter), vocab_map, state, eval_prompts)
        if budget:
            budget.observe_eval(time.perf_counter() - started)
    bar = tqdm(total=total, initial=state.step, desc="distill", disable=not accelerator.is_local_main_process)
    drafter.train()
    while state.step < total:
        batches = steps.epoch_batches(accelerator, loader, state)
        for window in steps.accumulation_windows(batches, cfg.grad_accum):
            started = time.perf_counter()
            loss = steps.train_window(cfg, accelerator, target, drafter, vocab_map, window, optimizer,
                                      scheduler, state)
            state.step += 1
            bar.update(1)
            if budget:
                budget.observe_step(time.perf_counter() - started, state.step - 1)
                total, decided = steps.budget_after_step(accelerator, budget, scheduler, state.step, total,
                                                         bool(state.total_steps))
                state.total_steps = total if decided else 0
                bar.total = total
            lr = scheduler.get_last_lr()[0]
            started = time.perf_counter()
            after_step(cfg, accelerator, target, drafter, vocab_map, state, loss, lr, eval_prompts, bar, whole)
            if budget and cfg.eval_every and state.step % cfg.eval_every == 0:  # it evaluated (and checkpointed)
                budget.observe_eval(time.perf_counter() - started)
            if state.step == cfg.stop_at_step:
                save_checkpoint(accelerator, state, cfg.work_dir)
                log.info("stopped at step %d as asked; continue with --resume", state.step)
                return False
            if state.step >= total:
                break
        else:
            state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    bar.close()
    if not (cfg.eval_every and state.step % cfg.eval_every == 0):  # the last step was not measured yet (the same
        evaluate(cfg, accelerator, target, whole.of(drafter), vocab_map, state, eval_prompts)  # on every rank)
    return True


def after_step(cfg, accelerator, target, drafter, vocab_map, state, loss, lr, eval_prompts, bar,
               whole: steps.WholeDrafter) -> None:
    if state.step % cfg.log_every == 0:
        bar.set_postfix(loss=f"{loss:.4f}")
        log.info("step %d loss %.4f lr %.2e", state.step, loss, lr)
        accelerator.log({"train/loss": loss, "train/lr": lr}, step=state.step)
    if cfg.eval_every and state.step % cfg.eval_every == 0:
        evaluate(cfg, accelerator, target, whole.of(drafter), vocab_map, state, eval_prompts)
    if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
        save_checkpoint(accelerator, state, cfg.work_dir)


def evaluate(cfg, accelerator, target, model, vocab_map, state, eval_prompts) -> None:
    """Measure tau/alpha on held-out prompts (main process) and keep the best drafter so far.
    `model`: the whole drafter (WholeDrafter.of, called by every process)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # a LoRA drafter is measured merged: the engine's runner computes plain linears, not PEFT's wrappers
        result = steps.measure(cfg, target, merged_copy(model), vocab_map, eval_prompts)
        state.history.append({"step": state.step, "tau": result["tau"], "alpha": result["alpha"]})
        log.info("step %d held-out tau %.3f alpha %.3f", state.step, result["tau"], result["alpha"] or 0.0)
        accelerator.log({"eval/tau": result["tau"], "eval/alpha": result["alpha"] or 0.0}, step=state.step)
        if result["tau"] > state.best_tau:
            state.best_tau, state.best_step = result["tau"], state.step
            steps.save_best(cfg, target, model, vocab_map, state)
    accelerator.wait_for_everyone()


def check_seqkd(cfg) -> None:
    if cfg.loss != "ce":
        raise ConfigError(f"loss: seqkd trains with ce on the target's tokens, got {cfg.loss!r} (use method: kd)")


def check_kd(cfg) -> None:
    if cfg.loss == "ce":
        raise ConfigError("loss: kd needs a divergence (fkl, rkl, jsd or tvd), got 'ce' (use method: seqkd)")
    if cfg.topk <= 0 and cfg.on_policy_lambda < 1.0:
        raise ConfigError("topk: kd on teacher data needs the target's stored top-k log-probs (topk > 0)")


# measures=False: train_kd builds its held-out prompts itself (see there)
register_method(Method("seqkd", train_kd, check=check_seqkd, measures=False, deepspeed_stages=(2, 3),
                       budgeted=True))
register_method(Method("kd", train_kd, check=check_kd, measures=False, deepspeed_stages=(2, 3), budgeted=True))
