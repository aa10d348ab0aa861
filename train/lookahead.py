"""[LA] lookahead training (method `lookahead`, PaSS): k embeddings for the frozen target.

    train_lookahead(cfg, accelerator, target, records, eval_prompts) -> the drafter directory (kind "lookahead")

Reads top to bottom: start the k embeddings at the target's mean input embedding (models.lookahead);
train them on the target's own generations; every `eval_every` steps decode held-out prompts with the
real engine (decode.proposers.lookahead) and keep the embeddings of the best measured tau; save them as a
drafter directory.

One training step, many insertion points. For a batch of sequences the frozen target first runs once
over the real tokens without gradients, keeping its KV cache and final hidden states. Then, for G
sampled positions t per sequence, a group of k [LA] rows is run against that cache in one forward:
LA_j of group t sits at position t + j and attends to the real tokens 0..t and to LA_1..LA_j of its
own group (a 4D additive mask). Its output predicts the token at t + 1 + j: the loss is cross-entropy
on that token (the target's own generation) plus kl_weight x KL(target || LA), where the target's
distribution for that token is its output at the real position t + j, which the first pass already
computed (real rows never attend to [LA] rows, so it is the plain target's), weighted by decay**(j-1).
Backpropagation runs through the [LA] rows only: the first pass holds no graph.

Config: the `lookahead:` section (LookaheadConfig), and the common optimisation and eval_* fields.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers.lookahead import LookaheadProposer
from specdistill.distill.batching import Batch, collate
from specdistill.distill.generation import pad_token_id
from specdistill.distill.losses import cross_entropy_loss, forward_kl
from specdistill.models.drafters import save_drafter
from specdistill.models.hf_compat import cache_argument, output_cache
from specdistill.models.lookahead import LookaheadTokens
from specdistill.train import distill_steps as steps
from specdistill.train.config import ConfigError, option, to_dict
from specdistill.train.medusa import average_gradients
from specdistill.train.methods import Method, register_method

log = logging.getLogger("specdistill.lookahead")


@dataclass
class LookaheadConfig:
    """Method lookahead: [LA] embeddings for the frozen target (PaSS)."""

    tokens: int = option(4, "number k of [LA] embeddings; LA_j predicts the token j+1 after the last real one")
    insertions: int = option(16, "insertion points per training sequence, each a group of k [LA] rows in one forward")
    decay: float = option(0.8, "LA_j's loss weight is decay**(j-1)")
    kl_weight: float = option(1.0, "weight of KL(target || LA) beside the CE on the target's tokens")
    chains: int = option(2, "when decoding, the shallowest tree nodes that get an [LA] chain in each verification "
                            "forward (stored in the drafter)")
    branches: int = option(1, "when decoding, the first draft's b most likely tokens go into the tree as siblings "
                              "(1: a chain; stored in the drafter)")
    init_noise: float = option(0.1, "initial noise around the mean token embedding, in units of its per-dimension std")

    def __post_init__(self):
        for name in ("tokens", "insertions", "chains", "branches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"lookahead.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"lookahead.decay: must be in (0, 1], got {self.decay}")
        for name in ("kl_weight", "init_noise"):
            if getattr(self, name) < 0:
                raise ConfigError(f"lookahead.{name}: must be >= 0, got {getattr(self, name)}")


def check_job(cfg) -> None:
    """The common fields a lookahead job needs as they are."""
    if cfg.loss != "ce":
        raise ConfigError(f"loss: lookahead trains with ce + lookahead.kl_weight * KL, got {cfg.loss!r}")
    if cfg.lora_r:
        raise ConfigError("lora_r: lookahead trains only the [LA] embeddings, the target stays frozen; set lora_r: 0")


def train_lookahead(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]]) -> Path:
    tokens = LookaheadTokens.from_target(target.model, cfg.lookahead.tokens, cfg.seed, cfg.lookahead.init_noise)
    tokens = tokens.float().train().requires_grad_(True)
    shard = records[accelerator.process_index::accelerator.num_processes]
    # the same step count on every process (shards may differ by one record)
    total = cfg.max_steps or cfg.epochs * -(-len(records) // (cfg.batch_size * accelerator.num_processes))
    optimizer, scheduler = steps.make_optimizer(cfg, tokens, total)
    tokens, optimizer, scheduler = accelerator.prepare(tokens, optimizer, scheduler)
    best = BestTokens()
    losses = []
    measure_and_keep(cfg, accelerator, target, tokens, eval_prompts, 0, best)  # the untrained start
    rng = random.Random(cfg.seed + accelerator.process_index)
    pad_id = pad_token_id(target.tokenizer, target.eos_token_ids)
    for step, batch in enumerate(tqdm(batches(shard, cfg, pad_id, rng, total), total=total, desc="lookahead",
                                      disable=not accelerator.is_local_main_process), start=1):
        loss = train_step(cfg, accelerator, target, tokens, batch.to(target.device), optimizer, scheduler, rng)
        if step % cfg.log_every == 0 or step == total:
            log.info("step %d loss %.4f lr %.2e", step, loss, scheduler.get_last_lr()[0])
            losses.append({"step": step, "loss": loss})
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
            measure_and_keep(cfg, accelerator, target, tokens, eval_prompts, step, best)
    return save_best(cfg, accelerator, target, best, losses)


def batches(records: list[dict], cfg, pad_id: int, rng: random.Random, total: int):
    """`total` batches of `batch_size` records, reshuffled every pass."""
    order: list[int] = []
    for _ in range(total):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(records)), len(records))
        chosen = [records[i] for i in order[:cfg.batch_size]]
        del order[:cfg.batch_size]
        yield collate(chosen, pad_id, cfg.max_seq_len)


def train_step(cfg, accelerator, target, tokens, batch: Batch, optimizer, scheduler, rng) -> float:
    module = accelerator.unwrap_model(tokens)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    groups = sample_insertions(batch, cfg.lookahead.insertions, module.num_tokens, gen)
    loss = lookahead_loss(target.model, module(), batch, groups, cfg.lookahead.decay, cfg.lookahead.kl_weight)
    accelerator.backward(loss)
    average_gradients(accelerator, module)
    accelerator.clip_grad_norm_(tokens.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return float(loss.detach())


# ---- insertion points and the [LA] forward --------------------------------------------------------------

class Insertions:
    """G groups of k [LA] rows per sequence. t: [B, G] the last real position each group sees;
    valid: [B, G, K] whether LA_j of that group has a label (token t + 1 + j exists in the response)."""

    def __init__(self, t: torch.Tensor, valid: torch.Tensor):
        self.t, self.valid = t, valid


def sample_insertions(batch: Batch, groups: int, k: int, gen: torch.Generator) -> Insertions:
    """Up to `groups` positions t per sequence, uniformly among those where LA_1 has a label: t + 1 is a
    response token (loss_mask[t]) and t + 2 is a real token."""
    lengths = batch.attention_mask.sum(-1).cpu()  # [B]
    t = torch.zeros(len(lengths), groups, dtype=torch.long)
    chosen = torch.zeros(len(lengths), groups, dtype=torch.bool)
    for row, length in enumerate(lengths.tolist()):
        candidates = batch.loss_mask[row].cpu().nonzero().flatten()
        candidates = candidates[candidates + 2 < length]
        picks = candidates[torch.randperm(len(candidates), generator=gen)[:groups]]
        t[row, :len(picks)], chosen[row, :len(picks)] = picks, True
    offsets = torch.arange(1, k + 1)  # [K]
    valid = chosen[..., None] & (t[..., None] + 1 + offsets < lengths[:, None, None])  # [B, G, K]
    return Insertions(t.to(batch.input_ids.device), valid.to(batch.input_ids.device))


def lookahead_loss(target_model, embeds: torch.Tensor, batch: Batch, groups: Insertions, decay: float,
                   kl_weight: float) -> torch.Tensor:
    """sum_j decay**(j-1) * (CE + kl_weight * KL(target || LA_j)), each a mean over valid groups."""
    la_logits, target_logits = lookahead_logits(target_model, embeds, batch, groups, with_target=kl_weight > 0)
    b, g, k = groups.valid.shape
    label_pos = (groups.t[..., None] + 1 + torch.arange(1, k + 1, device=groups.t.device))  # [B, G, K]
    labels = batch.input_ids.gather(1, label_pos.clamp(max=batch.input_ids.shape[1] - 1).view(b, -1))  # [B, GK]
    mask = groups.valid.view(b, -1)  # [B, GK]
    per_token = cross_entropy_loss(la_logits, labels, mask, reduction="none")  # [B, GK]
    if kl_weight:
        per_token = per_token + kl_weight * forward_kl(la_logits, target_logits, mask, reduction="none")
    weights = decay ** torch.arange(k, device=per_token.device, dtype=per_token.dtype)  # [K]
    per_offset = per_token.view(b, g, k).sum((0, 1)) / groups.valid.sum((0, 1)).clamp_min(1)  # [K]
    return (weights * per_offset).sum()


def lookahead_logits(target_model, embeds: torch.Tensor, batch: Batch, groups: Insertions,
                     with_target: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the [LA] rows' logits [B, GK, V], the target's logits for the same tokens [B, GK, V] or None)."""
    decoder, head = target_model.get_decoder(), target_model.get_output_embeddings()
    with torch.no_grad():  # the real tokens: no graph, their KV cache reused by the [LA] rows
        real = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True)
    b, g, k = groups.valid.shape
    seq_len = batch.input_ids.shape[1]
    offsets = torch.arange(1, k + 1, device=groups.t.device)
    positions = (groups.t[..., None] + offsets).view(b, g * k)  # [B, GK]: LA_j of group t at t + j
    inputs = embeds.to(head.weight.dtype).repeat(g, 1)[None].expand(b, -1, -1)  # [B, GK, D]
    mask = lookahead_mask(groups.t, k, seq_len, head.weight.dtype)  # [B, 1, GK, T + GK]
    out = decoder(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                  **cache_argument(decoder, output_cache(real)), use_cache=True)
    la_logits = head(out.last_hidden_state).float()  # [B, GK, V]
    if not with_target:
        return la_logits, None
    with torch.no_grad():  # the target's own distribution for token t + 1 + j: its output at t + j
        rows = positions.clamp(max=seq_len - 1)[..., None].expand(-1, -1, real.last_hidden_state.shape[-1])
        target_logits = head(real.last_hidden_state.gather(1, rows)).float()  # [B, GK, V]
    return la_logits, target_logits


def lookahead_mask(t: torch.Tensor, k: int, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, GK, T + GK]: LA_j of group (b, g) sees real columns 0..t[b, g] and
    LA_1..LA_j of its own group; nothing else."""
    b, g = t.shape
    cols = torch.arange(seq_len, device=t.device)
    sees_real = cols[None, None, None, :] <= t[..., None, None]  # [B, G, 1, T]
    sees_real = sees_real.expand(b, g, k, seq_len).reshape(b, g * k, seq_len)  # [B, GK, T]
    own = torch.block_diag(*[torch.ones(k, k, dtype=torch.bool, device=t.device).tril()] * g)  # [GK, GK]
    allowed = torch.cat([sees_real, own[None].expand(b, -1, -1)], dim=-1)  # [B, GK, T + GK]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=t.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


# ---- measuring, keeping the best, saving ----------------------------------------------------------------

class BestTokens:
    def __init__(self):
        self.tau: float | None = None  # the best measured held-out tau (None: nothing measured)
        self.step, self.state, self.history = -1, None, []


@torch.no_grad()
def measure_acceptance(target, tokens, prompts: list[list[int]], max_new_tokens: int, chains: int,
                       branches: int = 1) -> dict:
    """Greedy [LA] decoding of each prompt with the real engine at full depth (no adaptation)."""
    proposer = LookaheadProposer(tokens, target.model, chains=chains, branches=branches)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    return aggregate_stats([engine.generate(p, max_new_tokens).stats for p in prompts])


def measure_and_keep(cfg, accelerator, target, tokens, prompts, step: int, best: BestTokens) -> None:
    """Measure on the main process; keep the best embeddings (all of them when there are no prompts)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        module = accelerator.unwrap_model(tokens)
        tau = None
        if prompts:
            result = measure_acceptance(target, module, prompts, cfg.eval_max_new_tokens, cfg.lookahead.chains,
                                        cfg.lookahead.branches)
            tau = result["tau"]
            best.history.append({"step": step, "tau": tau, "alpha": result["alpha"]})
            log.info("step %d held-out tau %.3f alpha %.3f", step, tau, result["alpha"] or 0.0)
        if tau is None or best.tau is None or tau > best.tau:  # unmeasured: the latest is kept
            best.tau, best.step, best.state = tau, step, copy.deepcopy(module.state_dict())
    accelerator.wait_for_everyone()


def save_best(cfg, accelerator, target, best: BestTokens, losses: list) -> Path:
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        tokens = LookaheadTokens(cfg.lookahead.tokens, target.model.get_input_embeddings().weight.shape[1])
        tokens.load_state_dict(best.state)
        save_drafter(out, tokens.to(target.dtype), target, "lookahead", config={**tokens.config, **to_dict(cfg)},
                     extra={"chains": cfg.lookahead.chains, "branches": cfg.lookahead.branches,
                            "best_step": best.step, "held_out_tau": best.tau, "history": best.history,
                            "loss_history": losses})
        log.info("lookahead drafter written to %s (step %d, held-out tau %s)", out, best.step, best.tau)
    accelerator.wait_for_everyone()
    return out


register_method(Method("lookahead", train_lookahead, LookaheadConfig, check=check_job))
