"""DFlash training (method `dflash`): a few decoder layers over the frozen target's features, drafting blocks.

    train_dflash(cfg, accelerator, target, records, eval_prompts) -> the drafter directory (kind "dflash")

Reads top to bottom, as EAGLE-3's recipe (train/eagle3.py), whose data it shares: the draft vocabulary (the teacher
responses' `draft_vocab` most frequent tokens); the target's states at the fused layers for every record, once
(distill.feature_cache, read from what the teacher generation staged where it did); the drafter (models.dflash);
then each step draws `dflash.anchors` random anchor positions per sequence among those followed by a response token
(by any token with dflash.prompt_weight > 0, those rows weighted by it), puts a block of block_size rows at each
(the anchor's token, then mask rows), every block attending to the context before its anchor and to its own rows
(DFlashDrafter.blocks: all the sequence's blocks in one forward), and takes the cross-entropy of block row k's
distribution against the target's distribution of that token (its head on its final state, restricted to the draft
vocabulary), weighted exp(-(k - 1) / gamma) as the paper weights block positions (early positions decide how much
of a block is accepted). Every `eval_every` steps the real engine decodes held-out prompts
(decode.proposers.dflash, full block, no adaptation) and the drafter of best measured tau is published at the end.
`--resume` is exact: the batch and its anchors are functions of the seed and the step. With max_minutes the step
count follows the measured costs (train.step_budget), as EAGLE-3's.

Config: the `dflash:` section (DFlashConfig), draft_vocab, and the common optimisation, eval_* and checkpoint fields.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers.dflash import DFlashProposer
from specdistill.distill.feature_cache import FeatureRecord
from specdistill.distill.feature_capture import FeatureStaging
from specdistill.models.dflash import MAX_BLOCK_SIZE, MAX_LAYERS, DFlashDrafter, default_target_layers
from specdistill.train import distill_steps as steps
from specdistill.train.checkpoints import resume_or_start, save_checkpoint
from specdistill.train.config import ConfigError, check_choice, option
from specdistill.train.eagle3 import (
    BatchPlan,
    apply_gradients,
    budget_spent,
    check_job,
    decided_steps,
    keep_if_best,
    pad_batch,
    position_weights,
    snapshot,
    target_head_rows,
)
from specdistill.train.medusa import candidate_vocab
from specdistill.train.methods import Method, register_method
from specdistill.train.step_budget import StepBudget

log = logging.getLogger("specdistill.dflash")

PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # the paper's loss decay per block size


@dataclass
class DFlashConfig:
    """Method dflash: decoder layers over the frozen target's fused features that draft a block in one forward."""

    layers: int = option(1, f"decoder layers of the drafter (1..{MAX_LAYERS})")
    block_size: int = option(8, f"rows per block: the verified token and block_size - 1 drafts (2..{MAX_BLOCK_SIZE})")
    target_layers: list[int] = option([], "target layers whose inputs are fused (1..L-1 of an L-layer target); "
                                          "empty: the paper's spread, as many as `layers`")
    anchors: int = option(16, "blocks per sequence in a training step, anchored at random response positions")
    prompt_weight: float = option(0.0, "loss weight of block rows drafting a prompt token (the target's "
                                       "distribution there); > 0 also anchors blocks inside the prompt")
    gamma: float = option(0.0, "block row k's loss weight is exp(-(k - 1) / gamma); 0: the paper's for the block "
                               "size (4 at 8, 5 at 10, 7 at 16; else block_size / 2 - 1)")
    init: str = option("target_layers", "how the layers start: target_layers (the target's layers after its deepest "
                                        "fused one, fc passing that feature through) or random (Llama's init)")
    intermediate_size: int = option(0, "the layers' MLP width (0: the target's)")
    depth: int = option(0, "decoding's deepest draft (stored in the drafter); 0: block_size - 1")
    topk: int = option(1, "decoding's tokens kept per block position (1: a chain; more: the alternatives as leaves)")
    tree_nodes: int = option(0, "decoding's most nodes besides the root; 0: depth x topk")

    def __post_init__(self):
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"dflash.block_size: must be in 2..{MAX_BLOCK_SIZE} (the verified token and at least "
                              f"one draft), got {self.block_size}")
        if not 1 <= self.layers <= MAX_LAYERS:
            raise ConfigError(f"dflash.layers: must be in 1..{MAX_LAYERS}, got {self.layers}")
        if any(int(i) < 1 for i in self.target_layers):
            raise ConfigError(f"dflash.target_layers: layer inputs 1..L-1 (0 is the embedding), got "
                              f"{self.target_layers}")
        if self.anchors < 1:
            raise ConfigError(f"dflash.anchors: must be >= 1, got {self.anchors}")
        if not 0 <= self.prompt_weight <= 1:
            raise ConfigError(f"dflash.prompt_weight: must be in [0, 1], got {self.prompt_weight}")
        if self.gamma < 0:
            raise ConfigError(f"dflash.gamma: must be >= 0 (0: the paper's), got {self.gamma}")
        check_choice("dflash.init", self.init, ("target_layers", "random"))  # models.dflash.DFLASH_INITS
        if self.intermediate_size < 0:
            raise ConfigError(f"dflash.intermediate_size: must be >= 0 (0: the target's), got {self.intermediate_size}")
        if not 0 <= self.depth < self.block_size:
            raise ConfigError(f"dflash.depth: must be in 0..{self.block_size - 1} (block_size - 1), got {self.depth}")
        if self.topk < 1 or self.tree_nodes < 0:
            raise ConfigError(f"dflash.topk must be >= 1 and dflash.tree_nodes >= 0, got {self.topk}, "
                              f"{self.tree_nodes}")

    def decay(self) -> float:
        """gamma, the paper's where unset."""
        return self.gamma or PAPER_GAMMA.get(self.block_size, max(1.0, self.block_size / 2 - 1))


def target_layers(cfg, target) -> list[int]:
    """The fused target layers: dflash.target_layers, else the paper's spread; checked against the target."""
    count = target.model.config.get_text_config().num_hidden_layers
    layers = list(cfg.dflash.target_layers or default_target_layers(count, cfg.dflash.layers))
    if not all(1 <= i < count for i in layers):
        raise ConfigError(f"dflash.target_layers: {layers} out of range for a target of {count} layers "
                          f"(1..{count - 1}: the input of that layer)")
    return layers


def feature_staging(cfg, target) -> FeatureStaging:
    """Where the teacher generation stages the target's states at the fused layers (distill.feature_capture)."""
    return FeatureStaging(target.fingerprint, target_layers(cfg, target))


def build_drafter(cfg, target, vocab_map) -> DFlashDrafter:
    section = cfg.dflash
    return DFlashDrafter.for_target(target.model, vocab_map, section.layers, section.block_size,
                                    target_layers(cfg, target), seed=cfg.seed, init=section.init,
                                    intermediate_size=section.intermediate_size).float().train()


def train_dflash(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]]) -> Path | None:
    vocab_map = candidate_vocab(cfg, target, records)  # the draft_vocab most frequent response tokens, EOS in
    drafter = build_drafter(cfg, target, vocab_map)
    cache = steps.target_states(cfg, accelerator, target, records, drafter.target_layers,
                                staging=feature_staging(cfg, target))
    plan = BatchPlan(cache, cfg.batch_size, cfg.seed)
    total = cfg.max_steps or cfg.epochs * -(-plan.batches_per_epoch // accelerator.num_processes)
    optimizer, scheduler = steps.make_optimizer(cfg, drafter, total)
    whole = steps.WholeDrafter(accelerator, drafter)
    steps.declare_micro_batch(accelerator, cfg.batch_size)
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    state = resume_or_start(cfg, accelerator)
    total = state.total_steps or total
    budget = None
    if cfg.max_minutes:  # a step priced by its batch's positions (every position is context)
        budget = StepBudget(cfg.max_minutes, cfg.warmup_steps, cfg.eval_every, total,
                            lambda step: plan.work(step * accelerator.num_processes, 1.0))
    head_rows = target_head_rows(target, vocab_map)
    if cfg.eval_every and state.step == 0:  # the untrained drafter's tau, so that the gain is visible
        started = time.perf_counter()
        evaluate(cfg, accelerator, target, whole.of(drafter), state, eval_prompts)
        if budget:
            budget.observe_eval(time.perf_counter() - started)
    bar = tqdm(total=total, initial=state.step, desc="dflash", disable=not accelerator.is_local_main_process)
    while state.step < total:
        index = state.step * accelerator.num_processes + accelerator.process_index
        started = time.perf_counter()
        loss, accuracy = train_step(cfg, accelerator, target, drafter, head_rows, plan.batch(index), optimizer,
                                    scheduler, anchor_seed=cfg.seed * 1_000_003 + index)
        state.step += 1
        bar.update(1)
        if budget:
            total = follow_budget(accelerator, budget, state, total, time.perf_counter() - started, scheduler)
            bar.total = total
        started = time.perf_counter()
        after_step(cfg, accelerator, target, drafter, state, eval_prompts, loss, accuracy, scheduler, total, whole)
        if budget and cfg.eval_every and state.step % cfg.eval_every == 0:
            budget.observe_eval(time.perf_counter() - started)
        if state.step == cfg.stop_at_step and state.step < total:
            save_checkpoint(accelerator, state, cfg.work_dir)
            log.info("stopped at step %d as asked; continue with --resume", state.step)
            return None
    bar.close()
    if not (cfg.eval_every and state.step % cfg.eval_every == 0):  # the last step is not measured yet
        evaluate(cfg, accelerator, target, whole.of(drafter), state, eval_prompts)
    steps.write_summary(cfg, accelerator, drafter, state, True, whole)
    return steps.publish_best(cfg, accelerator, target, None, state)


def follow_budget(accelerator, budget: StepBudget, state, total: int, seconds: float, scheduler) -> int:
    """max_minutes: after the warm-up, the run's step count from the measured costs; later, stop early should
    the job be about to overrun. Returns the step count now."""
    budget.observe_step(seconds, state.step - 1)
    if not state.total_steps and budget.calibrated(state.step):
        total = state.total_steps = decided_steps(accelerator, budget, state.step)
        steps.set_schedule_length(scheduler, total)
    elif state.total_steps and state.step < total and budget_spent(accelerator, budget, state.step):
        log.warning("max_minutes: stopping at step %d of %d, the budget is spent", state.step, total)
        total = state.step
    return total


# ---- the loss --------------------------------------------------------------------------------------------

def sample_anchors(mask: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct random anchors per sequence among the positions a >= 1 marked in mask [B, T] (those
    whose next token is trained on): (anchors [B, A], valid [B, A]); a sequence with fewer such positions repeats
    one, marked invalid. A = min(count, T)."""
    eligible = mask.clone()
    eligible[:, 0] = False  # a block needs at least one context position before it (decoding always has one)
    scores = torch.rand(mask.shape, generator=generator, device=mask.device)  # [B, T]
    scores = torch.where(eligible, scores, -1.0)
    picked = scores.topk(min(count, mask.shape[1]), dim=1)  # [B, A]
    anchors, valid = picked.indices, picked.values >= 0
    order = anchors.sort(dim=1).indices
    return anchors.gather(1, order), valid.gather(1, order)


def block_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[block_size - 1] the paper's weight of block row k = 1 .. B-1: exp(-(k - 1) / gamma)."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def dflash_loss(drafter: DFlashDrafter, embed: torch.nn.Module, head_rows: torch.Tensor, records: list[FeatureRecord],
                anchors_per_sequence: int, gamma: float, generator: torch.Generator | None = None,
                prompt_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """The weighted mean over blocks and rows of CE(target's restricted distribution, block row k's).

    Block row k at anchor a drafts the token at a + k, whose target distribution is the target's head on its
    final state at a + k - 1; a row counts where that token is inside the record, weighted by `block_weights`
    times 1 for a response token and prompt_weight for a prompt token (eagle3.position_weights); anchors are
    drawn where block row 1 counts. Returns (the loss, per block row the share of counted rows where the
    drafter's argmax is the target's)."""
    device = drafter.fc.weight.device
    ids, features, final, mask, lengths = pad_batch(records, device)  # [B, T], [B, T, KD], [B, T, D], [B, T], [B]
    positional = position_weights(mask, lengths, prompt_weight)  # [B, T]: the weight of predicting token t + 1
    anchors, valid = sample_anchors(positional > 0, anchors_per_sequence,
                                    generator or torch.Generator(device=device))
    size, t = drafter.block_size, ids.shape[1]
    with torch.no_grad():
        first = embed(ids.gather(1, anchors)).float()  # [B, A, D]
    out = drafter.blocks(features, first, anchors)[:, :, 1:]  # [B, A, B-1, D]: the drafting rows
    drafted = anchors[..., None] + torch.arange(1, size, device=device)  # [B, A, B-1]: their positions
    source = (drafted - 1).clamp(max=t - 1)  # where the target's distribution of each drafted token is
    row_weight = positional.gather(1, source.flatten(1)).view_as(source)  # [B, A, B-1]
    counted = (drafted < lengths[:, None, None]) & (row_weight > 0) & valid[..., None]
    weight = (block_weights(size, gamma, device) * row_weight)[counted]  # [N]
    with torch.no_grad():
        states = final.gather(1, source.flatten(1)[..., None].expand(-1, -1, final.shape[-1]))  # [B, A(B-1), D]
        target_p = torch.softmax(states.view(*source.shape, -1)[counted] @ head_rows.T, dim=-1)  # [N, M]
    logq = torch.log_softmax(drafter.logits(out[counted]).float(), dim=-1)  # [N, M]
    loss = (-(target_p * logq).sum(-1) * weight).sum() / weight.sum().clamp(min=1e-6)
    hits = (logq.detach().argmax(-1) == target_p.argmax(-1)).float()  # [N]
    row = torch.arange(1, size, device=device).expand_as(drafted)[counted]  # [N]: each counted row's k
    accuracy = [float(hits[row == k].mean()) if bool((row == k).any()) else math.nan for k in range(1, size)]
    return loss, accuracy


def train_step(cfg, accelerator, target, drafter, head_rows, records, optimizer, scheduler, anchor_seed: int = 0):
    """anchor_seed: the anchors' seed, a function of the batch (the same draws after --resume)."""
    module = accelerator.unwrap_model(drafter)
    generator = torch.Generator(device=module.fc.weight.device).manual_seed(anchor_seed)
    with accelerator.autocast():  # the loss calls the drafter's parts, not the prepared forward accelerate wraps
        loss, accuracy = dflash_loss(module, target.model.get_input_embeddings(), head_rows, records,
                                     cfg.dflash.anchors, cfg.dflash.decay(), generator, cfg.dflash.prompt_weight)
    apply_gradients(accelerator, drafter, module, loss, optimizer, scheduler)
    return float(loss.detach()), accuracy


def after_step(cfg, accelerator, target, drafter, state, eval_prompts, loss, accuracy, scheduler, total,
               whole: steps.WholeDrafter) -> None:
    if state.step % cfg.log_every == 0 or state.step == total:
        lr = scheduler.get_last_lr()[0]
        log.info("step %d loss %.4f lr %.2e top-1 per block row %s", state.step, loss, lr,
                 [round(a, 3) for a in accuracy])
        accelerator.log({"train/loss": loss, "train/lr": lr, "train/top1_row1": accuracy[0]}, step=state.step)
    if cfg.eval_every and state.step % cfg.eval_every == 0:
        evaluate(cfg, accelerator, target, whole.of(drafter), state, eval_prompts)
    if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < total:
        save_checkpoint(accelerator, state, cfg.work_dir)


# ---- measuring and keeping the best ---------------------------------------------------------------------

def decoding_options(cfg) -> dict:
    """The decoding shape stored with the drafter (unset: the proposer's defaults)."""
    section = cfg.dflash
    return {key: value for key, value in (("depth", section.depth), ("topk", section.topk),
                                          ("tree_nodes", section.tree_nodes)) if value}


@torch.no_grad()
def measure_acceptance(cfg, target, drafter: DFlashDrafter, prompts: list[list[int]]) -> dict:
    """Greedy DFlash decoding of each prompt with the real engine at the stored depth (no adaptation)."""
    was_training = drafter.training
    drafter.eval()
    proposer = DFlashProposer(drafter, target.model.get_input_embeddings(), eos_token_ids=target.eos_token_ids,
                              **decoding_options(cfg))
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    stats = [engine.generate(p, cfg.eval_max_new_tokens).stats for p in prompts]
    drafter.train(was_training)
    return aggregate_stats(stats)


def evaluate(cfg, accelerator, target, module: DFlashDrafter | None, state, eval_prompts) -> None:
    """Measure tau on held-out prompts; keep the drafter when it is the best so far."""
    keep_if_best(cfg, accelerator, target, module, state, eval_prompts, measure_acceptance, save_snapshot, log)


def save_snapshot(cfg, target, drafter: DFlashDrafter, state, name: str) -> Path:
    """The drafter as it is now, as a complete drafter directory under work_dir/<name> (atomic)."""
    return snapshot(cfg, target, drafter, state, name, "dflash", decoding_options(cfg))


# ZeRO-2 only: the mask embedding is a bare parameter the blocks read directly, which ZeRO-3's per-module gathering
# would leave partitioned; bf16 autocast on CPUs with native bf16 GEMMs as EAGLE-3 (the same kind of loss)
register_method(Method("dflash", train_dflash, DFlashConfig, check=check_job, staging=feature_staging,
                       deepspeed_stages=(2,), budgeted=True, cpu_bf16=True))
