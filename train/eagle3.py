"""EAGLE-3 training (method `eagle3`): one decoder layer over the frozen target's hidden states.

    train_eagle3(cfg, accelerator, target, records, eval_prompts) -> the drafter directory (kind "eagle3")

Reads top to bottom: choose the draft vocabulary (the teacher responses' `draft_vocab` most frequent tokens);
the target's states at the three layers for every record, once (distill.feature_cache: on disk,
content-addressed, streamed a shard at a time; read from what the teacher generation staged as it ran,
distill.feature_capture, where it made the records in this job, else computed); build the drafter
(models.eagle3); train it with the training-time test: each batch is unrolled `eagle3.steps` drafting steps
(Eagle3Drafter.unroll), step j feeding the drafter its own step j-1 output with the token j further on, as
decoding does, and its loss is the cross-entropy of the drafter's distribution against the target's next-token
distribution (the target's head on its final state, restricted to the draft vocabulary and renormalised) on
the response positions (and the prompt's, weighted eagle3.prompt_weight; those where the target continues an
earlier occurrence of the last two tokens, copying from its context, weighted eagle3.copy_weight times),
weighted by eagle3.decay**j; with eagle3.feature_noise > 0 the target's features get Gaussian noise in
training (`noisy_features`); only the positions some step counts are unrolled (`counted_rows`: every position
is context, a response-only loss computes about half a batch's rows); every `eval_every` steps decode held-out
prompts with the real engine (decode.proposers.eagle3, full depth, no adaptation) and keep the drafter of best
measured tau, published atomically at the end. `--resume` continues exactly from the last checkpoint (data
order is a function of the seed, the epoch and the batch index).

With max_minutes the step count is decided after the warm-up from the measured costs (train.step_budget), at
most max_steps, and training stops early should the job still be about to overrun.

Config: the `eagle3:` section (Eagle3Config), draft_vocab, and the common optimisation (max_minutes too),
eval_* and checkpoint fields.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers.eagle3 import Eagle3Proposer
from specdistill.distill.feature_cache import FeatureCache, FeatureRecord
from specdistill.distill.feature_capture import FeatureStaging
from specdistill.models.drafters import save_drafter
from specdistill.models.eagle3 import Eagle3Drafter, default_target_layers
from specdistill.train import distill_steps as steps
from specdistill.train.checkpoints import resume_or_start, save_checkpoint
from specdistill.train.config import ConfigError, check_choice, option, to_dict
from specdistill.train.medusa import average_gradients, candidate_vocab
from specdistill.train.methods import Method, register_method
from specdistill.train.step_budget import StepBudget

log = logging.getLogger("specdistill.eagle3")


@dataclass
class Eagle3Config:
    """Method eagle3: one decoder layer over the frozen target's hidden states at three layers."""

    layers: list[int] = option([], "the three target layers whose inputs are fused (low, middle, high); empty: "
                                   "EAGLE-3's choice, 2, L // 2 and L - 3 of an L-layer target")
    steps: int = option(7, "drafting steps unrolled per position in training (the training-time test)")
    decay: float = option(0.8, "step j's loss weight is decay**j")
    prompt_weight: float = option(0.0, "loss weight of positions whose next token is a prompt token (the target's "
                                       "distribution there is as real; 0: response positions only)")
    copy_weight: float = option(1.0, "loss weight, times the position's, where the target's next token continues an "
                                     "earlier occurrence of the last two tokens (it copies from its context; 1: as "
                                     "any other position)")
    feature_noise: float = option(0.0, "std of the Gaussian noise added to the target's features in training, as a "
                                       "share of each dimension's median |value| (0: none; EAGLE trains on noised "
                                       "features)")
    init: str = option("target_layer", "how the layer and fc start: target_layer (the target's high layer over its "
                                       "own high feature) or random (Llama's init)")
    intermediate_size: int = option(0, "the drafter layer's MLP width (0: the target's); a wider one starts as the "
                                       "target's layer with the new units' outputs at zero")
    depth: int = option(0, "decoding's deepest draft (stored in the drafter); 0: the per-device default")
    topk: int = option(0, "decoding's top-k per expanded node and nodes expanded per depth; 0: the default")
    tree_nodes: int = option(0, "decoding's tree size (nodes besides the root); 0: the per-device default")

    def __post_init__(self):
        if self.layers and len(self.layers) != 3:
            raise ConfigError(f"eagle3.layers: three target layers (low, middle, high) or none, got {self.layers}")
        if any(int(i) < 0 for i in self.layers):
            raise ConfigError(f"eagle3.layers: layer indices must be >= 0, got {self.layers}")
        if self.steps < 1:
            raise ConfigError(f"eagle3.steps: must be >= 1, got {self.steps}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"eagle3.decay: must be in (0, 1], got {self.decay}")
        if not 0 <= self.prompt_weight <= 1:
            raise ConfigError(f"eagle3.prompt_weight: must be in [0, 1], got {self.prompt_weight}")
        if not 0 < self.copy_weight <= 100:
            raise ConfigError(f"eagle3.copy_weight: must be in (0, 100], got {self.copy_weight}")
        if not 0 <= self.feature_noise < 1:
            raise ConfigError(f"eagle3.feature_noise: must be in [0, 1), got {self.feature_noise}")
        check_choice("eagle3.init", self.init, ("target_layer", "random"))  # models.eagle3.EAGLE3_INITS
        if self.intermediate_size < 0:
            raise ConfigError(f"eagle3.intermediate_size: must be >= 0 (0: the target's), got {self.intermediate_size}")
        for name in ("depth", "topk", "tree_nodes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"eagle3.{name}: must be >= 0 (0: the default), got {getattr(self, name)}")


def check_job(cfg) -> None:
    """The common fields an eagle3 job needs as they are (a dflash job's too: their method names them)."""
    if cfg.loss != "ce":
        raise ConfigError(f"loss: {cfg.method} trains with ce against the target's distribution, got {cfg.loss!r}")
    if cfg.lora_r:
        raise ConfigError(f"lora_r: {cfg.method} trains its own layers fully, the target stays frozen; set lora_r: 0")


def target_layers(cfg, target) -> list[int]:
    """The target layers whose inputs the drafter reads: eagle3.layers, else EAGLE-3's low, middle and high."""
    return list(cfg.eagle3.layers or default_target_layers(target.model.config.get_text_config().num_hidden_layers))


def feature_staging(cfg, target) -> FeatureStaging:
    """Where the teacher generation stages the target's states at the drafter's layers (distill.feature_capture)."""
    return FeatureStaging(target.fingerprint, target_layers(cfg, target))


def train_eagle3(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]]) -> Path:
    vocab_map = candidate_vocab(cfg, target, records)  # the draft_vocab most frequent response tokens, EOS in
    drafter = Eagle3Drafter.for_target(target.model, vocab_map, target_layers(cfg, target), seed=cfg.seed,
                                       init=cfg.eagle3.init,
                                       intermediate_size=cfg.eagle3.intermediate_size).float().train()
    cache = steps.target_states(cfg, accelerator, target, records, drafter.target_layers,
                                staging=feature_staging(cfg, target))
    plan = BatchPlan(cache, cfg.batch_size, cfg.seed)
    total = cfg.max_steps or cfg.epochs * -(-plan.batches_per_epoch // accelerator.num_processes)
    optimizer, scheduler = steps.make_optimizer(cfg, drafter, total)
    whole = steps.WholeDrafter(accelerator, drafter)  # under ZeRO-3: the gathered copy the main process measures
    steps.declare_micro_batch(accelerator, cfg.batch_size)  # DeepSpeed cannot read it from a dataloader here
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    state = resume_or_start(cfg, accelerator)
    total = state.total_steps or total  # a resumed run whose length max_minutes decided keeps it
    budget = None
    if cfg.max_minutes:  # a step priced by the main process's batch (the one it times)
        budget = StepBudget(cfg.max_minutes, cfg.warmup_steps, cfg.eval_every, total,
                            lambda step: plan.work(step * accelerator.num_processes, cfg.eagle3.prompt_weight))
    head_rows = target_head_rows(target, vocab_map)
    if state.step == 0:  # the untrained start, to measure what training gained
        start = whole.of(drafter)  # every process: a collective gather under ZeRO-3
        if accelerator.is_main_process:
            save_snapshot(cfg, target, start, state, "initial")
    if cfg.eval_every and state.step == 0:  # its held-out tau, so that the gain is visible in the log
        started = time.perf_counter()
        evaluate(cfg, accelerator, target, whole.of(drafter), state, eval_prompts)
        if budget:
            budget.observe_eval(time.perf_counter() - started)
    bar = tqdm(total=total, initial=state.step, desc="eagle3", disable=not accelerator.is_local_main_process)
    while state.step < total:
        index = state.step * accelerator.num_processes + accelerator.process_index
        started = time.perf_counter()  # a step's price includes reading its batch (a new shard every 8 steps)
        batch = plan.batch(index)
        loss, accuracy = train_step(cfg, accelerator, target, drafter, head_rows, batch, optimizer, scheduler,
                                    noise_seed=cfg.seed * 1_000_003 + index)
        state.step += 1
        bar.update(1)
        if budget:
            budget.observe_step(time.perf_counter() - started, state.step - 1)
            if not state.total_steps and budget.calibrated(state.step):
                total = state.total_steps = decided_steps(accelerator, budget, state.step)
                steps.set_schedule_length(scheduler, total)
            elif state.total_steps and state.step < total and budget_spent(accelerator, budget, state.step):
                log.warning("max_minutes: stopping at step %d of %d, the budget is spent", state.step, total)
                total = state.step
            bar.total = total
        started = time.perf_counter()
        after_step(cfg, accelerator, target, drafter, state, eval_prompts, loss, accuracy, scheduler, total, whole)
        if budget and cfg.eval_every and state.step % cfg.eval_every == 0:  # it evaluated (and checkpointed)
            budget.observe_eval(time.perf_counter() - started)
        if state.step == cfg.stop_at_step and state.step < total:
            save_checkpoint(accelerator, state, cfg.work_dir)
            log.info("stopped at step %d as asked; continue with --resume", state.step)
            return None
    bar.close()
    if not (cfg.eval_every and state.step % cfg.eval_every == 0):  # the last step is not measured yet (a condition
        evaluate(cfg, accelerator, target, whole.of(drafter), state, eval_prompts)  # the same on every rank)
    steps.write_summary(cfg, accelerator, drafter, state, True, whole)
    return steps.publish_best(cfg, accelerator, target, None, state)


def decided_steps(accelerator, budget: StepBudget, done: int) -> int:
    """The run's step count from the main process's measurements, the same on every process."""
    decided = [budget.decide(done) if accelerator.is_main_process else 0]
    return broadcast_object_list(decided, from_process=0)[0]


def budget_spent(accelerator, budget: StepBudget, done: int) -> bool:
    """The main process's `out_of_time`, the same on every process."""
    spent = [budget.out_of_time(done) if accelerator.is_main_process else False]
    return broadcast_object_list(spent, from_process=0)[0]


def target_head_rows(target, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """[M, D] the target's output rows of the draft vocabulary (its logits restricted to it), fp32."""
    weight = target.model.get_output_embeddings().weight.detach()
    rows = weight if vocab_map is None else weight[vocab_map.to(weight.device)]
    return rows.float()


# ---- data order ------------------------------------------------------------------------------------------

class BatchPlan:
    """Batch b of the run, a pure function of (seed, b): epochs of shards in a seeded order, each shard's
    records in a seeded order cut into batches (a batch never spans two shards, so one shard is read at
    a time). Resuming at step s reads exactly the batches an uninterrupted run reads after s."""

    def __init__(self, cache: FeatureCache, batch_size: int, seed: int):
        self.cache, self.batch_size, self.seed = cache, batch_size, seed
        self.per_shard = [-(-cache.shard_size(i) // batch_size) for i in range(cache.num_shards)]
        self.batches_per_epoch = sum(self.per_shard)
        self.loaded: tuple[int, list[FeatureRecord]] | None = None
        self.sizes: dict[int, list[tuple[int, int]]] = {}  # shard -> its records' (length, response positions)

    def locate(self, index: int) -> tuple[int, list[int]]:
        """Batch `index` -> (shard, the record indices within it)."""
        epoch, within = divmod(index, self.batches_per_epoch)
        shards = list(range(self.cache.num_shards))
        random.Random(self.seed * 7919 + epoch).shuffle(shards)
        for shard in shards:
            if within < self.per_shard[shard]:
                order = list(range(self.cache.shard_size(shard)))
                random.Random(self.seed * 104729 + epoch * 1009 + shard).shuffle(order)
                return shard, order[within * self.batch_size:(within + 1) * self.batch_size]
            within -= self.per_shard[shard]
        raise AssertionError("unreachable: within < batches_per_epoch")

    def work(self, index: int, prompt_weight: float = 0.0) -> int:
        """Batch `index`'s positions that the loss counts, known before it is read: its records' response
        positions, or every position that has a next token when prompt tokens are weighted too. A training
        step's time grows with it (the shipped recipe: 0.39 s + 0.63 ms a position, correlation 0.90 over 120
        steps; docs/journal.md, stop 53)."""
        shard, rows = self.locate(index)
        if shard not in self.sizes:
            self.sizes[shard] = self.cache.response_counts(shard)
        return sum(length - 1 if prompt_weight > 0 else response
                   for length, response in (self.sizes[shard][i] for i in rows))

    def batch(self, index: int) -> list[FeatureRecord]:
        shard, rows = self.locate(index)
        if self.loaded is None or self.loaded[0] != shard:
            self.loaded = (shard, self.cache.shard(shard))
        return [self.loaded[1][i] for i in rows]


def pad_batch(records: list[FeatureRecord], device) -> tuple[torch.Tensor, ...]:
    """Right-padded ids [B, T], features [B, T, 3D], final [B, T, D], mask [B, T], lengths [B]."""
    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad([r.ids for r in records], batch_first=True)
    features = pad([r.features for r in records], batch_first=True).float()
    final = pad([r.final for r in records], batch_first=True).float()
    mask = pad([r.mask for r in records], batch_first=True)
    lengths = torch.tensor([r.ids.numel() for r in records])
    return ids.to(device), features.to(device), final.to(device), mask.to(device), lengths.to(device)


# ---- the loss --------------------------------------------------------------------------------------------

def lengths_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] True at each record's real positions (t < its length)."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x [B, T, ...] moved `by` positions to the left along T (row t holds x[t + by]), padded with fill."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, :x.shape[1] - by] = x[:, by:]
    return out


def position_weights(mask: torch.Tensor, lengths: torch.Tensor, prompt_weight: float) -> torch.Tensor:
    """[B, T] the loss weight of each position's next-token prediction: 1 where the next token is a response
    token (mask), prompt_weight where it is a prompt token (position t < length - 1), 0 past the end."""
    has_next = lengths_mask(lengths - 1, mask.shape[1])  # [B, T]
    return torch.where(mask, 1.0, has_next.float() * prompt_weight)


def repeats_context(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, T] True at position p when its next token continues an earlier occurrence of the two tokens ending
    at p: some s < p with x[s-1] = x[p-1], x[s] = x[p] and x[s+1] = x[p+1] (the token a 2-gram prompt lookup
    can propose there). The positions where the target copies from its context. ids [B, T], lengths [B]."""
    real = lengths_mask(lengths, ids.shape[1])  # [B, T]
    before, after = ids.roll(1, dims=1), shifted(ids, 1)  # [B, T]: x[p-1], x[p+1]
    has_both = real & shifted(real, 1, fill=False)  # x[p+1] is real
    has_both[:, 0] = False  # no x[p-1] at p = 0
    same = ((ids[:, :, None] == ids[:, None, :]) & (before[:, :, None] == before[:, None, :])
            & (after[:, :, None] == after[:, None, :]))  # [B, P, S]
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril(-1)  # s < p
    return (same & earlier & has_both[:, :, None] & has_both[:, None, :]).any(-1)


def counted_rows(weight: torch.Tensor, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions t whose unrolled steps some loss term counts (weight[t + 1 + j] > 0 for a j < num_steps),
    per record in increasing order: (rows [B, W], in_rows [B, W] bool, False on the filler that pads a
    record with fewer such positions than the most). With a response-only loss this is the response
    and the num_steps positions before it, about half of a right-padded batch's rows."""
    needed = torch.zeros_like(weight, dtype=torch.bool)  # [B, T]
    for j in range(num_steps):
        needed |= shifted(weight, 1 + j) > 0
    counts = needed.sum(1)  # [B]
    width = max(int(counts.max()), 1)
    rows = torch.sort((~needed).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # needed ones first
    in_rows = torch.arange(width, device=weight.device)[None, :] < counts[:, None]
    return rows, in_rows


def noisy_features(features: torch.Tensor, mask: torch.Tensor, scale: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """features [B, T, F] plus Gaussian noise whose std in each feature dimension is `scale` times that
    dimension's median |value| over the batch's real positions (mask [B, T]); padding stays as it is. Per
    dimension and by the median, because the target's states differ in size by orders of magnitude across
    layers and dimensions, and a few dimensions hold values of 10^4 at a few positions (attention sinks:
    measured on the default target's layers 15 and 27) that would swamp a mean. EAGLE trains on noised
    features so that the drafter tolerates the error its own predicted features carry a few steps on."""
    if scale <= 0:
        return features
    real = features[mask.bool()] if mask.any() else features.flatten(0, 1)  # [N, F]
    size = real.abs().median(dim=0).values  # [F]
    noise = torch.randn(features.shape, generator=generator, device=features.device)  # [B, T, F]
    return features + noise * (scale * size) * mask[..., None]


def eagle3_loss(drafter: Eagle3Drafter, embed: torch.nn.Module, head_rows: torch.Tensor, records: list[FeatureRecord],
                num_steps: int, decay: float, prompt_weight: float = 0.0, *, copy_weight: float = 1.0,
                every_row: bool = False, feature_noise: float = 0.0,
                noise: torch.Generator | None = None) -> tuple[torch.Tensor, list[float]]:
    """sum_j decay**j * the weighted mean over rows of CE(target's restricted distribution, drafter step j).

    Step j at row t reads e(x_{t+1+j}) and predicts x_{t+2+j}, whose target distribution is the target's
    head on its final state at t+1+j; the row's weight is that position's (`position_weights`: 1 when it
    predicts a response token, prompt_weight when a prompt token), times copy_weight where the next token
    continues an earlier occurrence of the last two (`repeats_context`). every_row: unroll every position, not
    only the counted ones (the same loss, slower: docs/journal.md, stop 34, "EAGLE-3 training unrolls only the
    positions its loss counts"). feature_noise: `noisy_features`' scale (0: the features as the target computed
    them), drawn from `noise`. Returns (the loss, per step the share of response rows where the drafter's argmax
    is the target's)."""
    device = drafter.fc.weight.device
    ids, features, final, mask, lengths = pad_batch(records, device)
    if feature_noise > 0:
        features = noisy_features(features, lengths_mask(lengths, mask.shape[1]), feature_noise, noise)
    weight = position_weights(mask, lengths, prompt_weight)  # [B, T]
    if copy_weight != 1.0:
        weight = weight * torch.where(repeats_context(ids, lengths), copy_weight, 1.0)
    counted = weight > 0
    with torch.no_grad():
        embeds = [embed(shifted(ids, 1 + j)).float() for j in range(num_steps)]  # per step [B, T, D]
        target_p = torch.softmax(final[counted] @ head_rows.T, dim=-1)  # [N, M] once: every step reads it
        target_best = target_p.argmax(-1)  # [N]: the target's token, for the accuracy
        row_of = torch.full(mask.shape, -1, dtype=torch.long, device=device)  # [B, T] position -> its row
        row_of[counted] = torch.arange(target_p.shape[0], device=device)
    if every_row:
        rows, in_rows = torch.arange(mask.shape[1], device=device).expand_as(mask), torch.ones_like(mask)
    else:
        rows, in_rows = counted_rows(weight, num_steps)  # [B, W]: the positions some step counts
    outputs = drafter.unroll(embeds, features, rows)  # per step [B, W, D]
    total, accuracy = torch.zeros((), device=device), []
    for j, out in enumerate(outputs):
        ahead = rows + 1 + j  # [B, W]: row t of step j is weighted as position t + 1 + j
        inside = in_rows & (ahead < weight.shape[1])
        ahead = ahead.clamp(max=weight.shape[1] - 1)
        row_weight = weight.gather(1, ahead) * inside  # [B, W]
        valid = row_weight > 0
        response = (mask.gather(1, ahead) & inside)[valid]  # [N_j]: rows that predict a response token
        if not response.any():
            break
        at = row_of.gather(1, ahead)[valid]  # [N_j]: each row's target distribution
        logq = torch.log_softmax(drafter.logits(out[valid]).float(), dim=-1)  # [N_j, M]
        w = row_weight[valid]  # [N_j]
        loss = (-(target_p[at] * logq).sum(-1) * w).sum() / w.sum()
        total = total + decay ** j * loss
        hits = logq.detach().argmax(-1) == target_best[at]
        accuracy.append(float(hits[response].float().mean()))
    return total, accuracy


def train_step(cfg, accelerator, target, drafter, head_rows, records, optimizer, scheduler, noise_seed: int = 0):
    """noise_seed: the feature noise's seed, a function of the batch (the same draws after --resume)."""
    module = accelerator.unwrap_model(drafter)
    noise = torch.Generator(device=module.fc.weight.device).manual_seed(noise_seed)
    with accelerator.autocast():  # the loss calls the drafter's parts, not the prepared forward accelerate wraps
        loss, accuracy = eagle3_loss(module, target.model.get_input_embeddings(), head_rows, records,
                                     cfg.eagle3.steps, cfg.eagle3.decay, cfg.eagle3.prompt_weight,
                                     copy_weight=cfg.eagle3.copy_weight, feature_noise=cfg.eagle3.feature_noise,
                                     noise=noise)
    apply_gradients(accelerator, drafter, module, loss, optimizer, scheduler)
    return float(loss.detach()), accuracy


def apply_gradients(accelerator, drafter, module, loss, optimizer, scheduler) -> None:
    """One optimizer step of a drafter whose loss calls its parts (`module`, unwrapped) rather than the prepared
    forward: under DDP the gradients are averaged by hand; under DeepSpeed its backward does that, clips and steps."""
    accelerator.backward(loss)
    if not steps.deepspeed(accelerator):
        average_gradients(accelerator, module)
    accelerator.clip_grad_norm_(drafter.parameters(), 1.0)  # a no-op under DeepSpeed (its gradient_clipping)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def after_step(cfg, accelerator, target, drafter, state, eval_prompts, loss, accuracy, scheduler, total,
               whole: steps.WholeDrafter) -> None:
    if state.step % cfg.log_every == 0 or state.step == total:
        lr = scheduler.get_last_lr()[0]
        log.info("step %d loss %.4f lr %.2e top-1 per step %s", state.step, loss, lr,
                 [round(a, 3) for a in accuracy])
        accelerator.log({"train/loss": loss, "train/lr": lr, "train/top1_step0": accuracy[0] if accuracy else 0.0},
                        step=state.step)
    if cfg.eval_every and state.step % cfg.eval_every == 0:
        evaluate(cfg, accelerator, target, whole.of(drafter), state, eval_prompts)
    if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < total:
        save_checkpoint(accelerator, state, cfg.work_dir)


# ---- measuring and keeping the best ---------------------------------------------------------------------

@torch.no_grad()
def measure_acceptance(cfg, target, drafter: Eagle3Drafter, prompts: list[list[int]]) -> dict:
    """Greedy EAGLE-3 decoding of each prompt with the real engine at full depth (no adaptation)."""
    was_training = drafter.training
    drafter.eval()
    proposer = Eagle3Proposer(drafter, target.model.get_input_embeddings(), **decoding_options(cfg),
                              eos_token_ids=target.eos_token_ids)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    stats = [engine.generate(p, cfg.eval_max_new_tokens).stats for p in prompts]
    drafter.train(was_training)
    return aggregate_stats(stats)


def decoding_options(cfg) -> dict:
    """The tree shape stored with the drafter (0: the proposer's per-device default)."""
    return {"depth": cfg.eagle3.depth or None, "topk": cfg.eagle3.topk or None,
            "tree_nodes": cfg.eagle3.tree_nodes or None}


def evaluate(cfg, accelerator, target, module: Eagle3Drafter | None, state, eval_prompts) -> None:
    """Measure tau on held-out prompts; keep the drafter when it is the best so far."""
    keep_if_best(cfg, accelerator, target, module, state, eval_prompts, measure_acceptance, save_snapshot)


def keep_if_best(cfg, accelerator, target, module, state, eval_prompts, measure, save, logger=log) -> None:
    """Measure tau on held-out prompts (main process, `measure(cfg, target, module, prompts)`); save the drafter
    when it is the best so far (`save(cfg, target, module, state, "best")`). `module`: the whole drafter
    (WholeDrafter.of, called by every process; None on the others under ZeRO-3)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tau, alpha = 1.0, None
        if eval_prompts:
            result = measure(cfg, target, module, eval_prompts)
            tau, alpha = result["tau"], result["alpha"]
        state.history.append({"step": state.step, "tau": tau, "alpha": alpha})
        logger.info("step %d held-out tau %.3f alpha %.3f", state.step, tau, alpha or 0.0)
        accelerator.log({"eval/tau": tau}, step=state.step)
        if tau > state.best_tau or not eval_prompts:  # unmeasured: the latest is kept
            state.best_tau, state.best_step = tau, state.step
            save(cfg, target, module, state, "best")
    accelerator.wait_for_everyone()


def save_snapshot(cfg, target, drafter: Eagle3Drafter, state, name: str) -> Path:
    """The drafter as it is now, as a complete drafter directory under work_dir/<name> (atomic)."""
    return snapshot(cfg, target, drafter, state, name, "eagle3", decoding_options(cfg))


def snapshot(cfg, target, drafter, state, name: str, kind: str, decoding: dict) -> Path:
    """A copy of `drafter` (its class rebuilt from its config) saved as a drafter directory of `kind` under
    work_dir/<name>, with the set decoding options and the run's held-out history."""
    copy = type(drafter)(drafter.config)
    copy.load_state_dict(drafter.state_dict())
    options = {key: value for key, value in decoding.items() if value}
    return save_drafter(Path(cfg.work_dir) / name, copy.to(target.dtype), target, kind,
                        config={**drafter.config, **to_dict(cfg)},
                        extra={"decoding": options, "step": state.step, "held_out_tau": state.best_tau,
                               "history": state.history})


# mixed_precision auto trains EAGLE-3 under bf16 autocast on a CPU with native bf16 GEMMs: a step 1.5x faster and
# drafters as fast as fp32's (docs/journal.md, "EAGLE-3 training in bf16 on the CPU")
register_method(Method("eagle3", train_eagle3, Eagle3Config, check=check_job, staging=feature_staging,
                       deepspeed_stages=(2, 3), budgeted=True, cpu_bf16=True))
