"""Medusa-1 training (method `medusa`): K heads on the frozen target's last hidden state.

    train_medusa(cfg, accelerator, target, records) -> the drafter directory (kind "medusa")

Reads top to bottom: hold out some prompts' records for calibration; run the frozen target once over
every record to get its last hidden states (the heads' only input; cached in work_dir, the target
never changes); train the heads on the target's own tokens: head k at position t predicts token
t + k + 1 with cross-entropy on the target's token plus KL(target || head) to the target's own
distribution at t + k (the one that produced that token), weighted per head by decay**(k-1); measure
per-head top-k accuracies on the calibration records, choose the sparse tree that maximises the
expected accepted length (decode.proposers.medusa.choose_tree), and save heads + tree as a drafter directory.

Medusa-2 (LoRA on the target trained jointly) is not implemented.
With `draft_vocab` M > 0 the drafter also stores a candidate vocabulary (the training responses' M most
frequent tokens): decoding projects the heads onto those rows only (V / M times cheaper per step), and
training and calibration use the same restriction (CE and KL over the M candidates: what decoding ranks),
which also makes a training step about V / M times cheaper. `medusa.reduced_heads: true` builds the heads with
those M rows only (models.medusa): the other rows are never read, and on a 151,936-token vocabulary they would
be 3.7 GB of fp32 projections for four heads, 15 GB with gradients and AdamW's moments.
`medusa.feature_layers` reads the target's final states from distill.feature_cache, the cache an EAGLE-3 job
over the same teacher data builds with those layers (its `final` column, bf16, staged by the teacher generation
itself), instead of a pass of the target over every record here: on a 1.5B target on 2 cores that pass is
hours (1,508 records: 24 batches of 5.6-7 minutes), the read a few seconds. A Medusa job that writes the teacher
data itself stages the same states while it generates (`feature_staging`), as an EAGLE-3 job does.
With `max_minutes` the step count is sized to the job's time budget (train.step_budget); with held-out prompts
(`eval_prompts`) the calibrated drafter's tau is measured by the engine at the end (and the untrained one's with
`medusa.untrained_dir`), in work_dir/summary.json with the run's steps and peak RSS.
`medusa.sequential: true` trains sequential (Hydra-style) heads, `medusa.prefix_layer: true` adds
Hydra++'s prefix attention layer under them (trained jointly, over each record's whole sequence of
target states), see models.medusa.
Config: the `medusa:` section (MedusaConfig), draft_vocab, and the common optimisation fields.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers import build_proposer
from specdistill.decode.proposers.medusa import choose_tree, expected_accept_length
from specdistill.distill.batching import batches_by_length, collate
from specdistill.distill.feature_capture import FeatureStaging
from specdistill.distill.generation import pad_token_id
from specdistill.distill.losses import cross_entropy_loss, forward_kl
from specdistill.distill.vocab import count_response_tokens, coverage, select_draft_vocab
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.medusa import MedusaHeads
from specdistill.train import distill_steps as steps
from specdistill.train.colbt import split_held_out
from specdistill.train.config import ConfigError, option, to_dict
from specdistill.train.methods import Method, register_method
from specdistill.train.step_budget import StepBudget

log = logging.getLogger("specdistill.medusa")


@dataclass
class MedusaConfig:
    """Method medusa: K heads on the frozen target's last hidden state, with a calibrated sparse tree."""

    heads: int = option(4, "number of heads; head k predicts the token k+1 positions ahead")
    layers: int = option(1, "residual blocks per head")
    sequential: bool = option(False, "sequential (Hydra-style) heads that also read the tree's tokens before their own")
    prefix_layer: bool = option(False, "a causal decoder layer over the target's states under the heads (Hydra++'s "
                                       "prefix attention), trained with them")
    decay: float = option(0.8, "head k's loss weight is decay**(k-1)")
    kl_weight: float = option(1.0, "weight of KL(target || head) beside the CE on the target's tokens")
    tree_nodes: int = option(24, "draft nodes of the calibrated sparse tree (root excluded)")
    topk: int = option(8, "ranks per head measured in calibration (the tree's widest branching)")
    calibration: int = option(16, "prompts held out to measure per-head top-k accuracy")
    untrained_dir: str = option("", "also write the heads as initialised (calibrated on the same held-out prompts) "
                                    "here, the starting point a run's gain is measured against; '' = no")
    reduced_heads: bool = option(False, "with draft_vocab: heads whose projections hold only the draft_vocab candidate "
                                        "rows (the only ones training and decoding read); needed for a large "
                                        "vocabulary, not yet exported to vLLM")
    feature_layers: list[int] = option([], "read the target's final states from the feature cache an EAGLE-3 job "
                                           "with these eagle3.layers built over the same teacher data (built here if "
                                           "absent); [] = a pass of the target over the records, cached in work_dir")

    def __post_init__(self):
        for name in ("heads", "tree_nodes", "topk", "calibration"):
            if getattr(self, name) < 1:
                raise ConfigError(f"medusa.{name}: must be >= 1, got {getattr(self, name)}")
        if self.layers < 0:
            raise ConfigError(f"medusa.layers: must be >= 0, got {self.layers}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"medusa.decay: must be in (0, 1], got {self.decay}")
        if self.kl_weight < 0:
            raise ConfigError(f"medusa.kl_weight: must be >= 0, got {self.kl_weight}")


def check_job(cfg) -> None:
    """The common fields a medusa job needs as they are."""
    if cfg.loss != "ce":
        raise ConfigError(f"loss: medusa trains with ce + medusa.kl_weight * KL, got {cfg.loss!r}")
    if cfg.lora_r:
        raise ConfigError("lora_r: Medusa-2 (LoRA on the target) is not implemented; set lora_r: 0")
    untrained = cfg.medusa.untrained_dir
    if untrained and Path(untrained).resolve() == Path(cfg.output_dir).resolve():
        raise ConfigError(f"medusa.untrained_dir: must differ from output_dir ({cfg.output_dir})")
    if cfg.medusa.reduced_heads and not cfg.draft_vocab:
        raise ConfigError("medusa.reduced_heads: needs draft_vocab > 0 (the candidate rows the heads keep)")

# hidden [T, D]: the target's states at a record's positions up to the last one that predicts a response
# token; its last R rows are the positions predicting the response, labels [R] (the response tokens)
Example = tuple[torch.Tensor, torch.Tensor]
PREFIX_BATCH = 16  # records per prefix-layer forward outside training (calibration)


def train_medusa(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]] | None = None) -> Path:
    """eval_prompts: held-out prompts the engine measures the calibrated drafter's tau on at the end (none: only the
    heads' top-k accuracies on the held-out records, `medusa.calibration`, which choose the tree)."""
    train_records, calibration = split_held_out(records, cfg.medusa.calibration, cfg.seed, key="medusa.calibration")
    train_set, calib_set = hidden_state_sets(cfg, accelerator, target, records, train_records, calibration)
    vocab_map = candidate_vocab(cfg, target, train_records)
    heads = MedusaHeads.from_target(target.model, cfg.medusa.heads, cfg.medusa.layers,
                                    sequential=cfg.medusa.sequential, prefix_layer=cfg.medusa.prefix_layer,
                                    vocab_map=vocab_map if cfg.medusa.reduced_heads else None).float().train()
    heads.requires_grad_(True)
    history = []
    if cfg.medusa.untrained_dir:
        untrained = Path(cfg.medusa.untrained_dir)
        calibrate_and_save(cfg, accelerator, target, heads.eval(), calib_set, vocab_map, untrained,
                           {"untrained": True, "calibration_records": len(calibration)})
        history += held_out_tau(cfg, accelerator, target, untrained, eval_prompts, step=0)
        heads.train()
    total = cfg.max_steps or cfg.epochs * -(-len(train_set) // (cfg.batch_size * accelerator.num_processes))
    optimizer, scheduler = steps.make_optimizer(cfg, heads, total)
    heads, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)
    losses, done = train_heads(cfg, accelerator, target, heads, train_set, optimizer, scheduler, total, vocab_map)
    heads = accelerator.unwrap_model(heads).eval()
    out = Path(cfg.output_dir)
    calibrate_and_save(cfg, accelerator, target, heads, calib_set, vocab_map, out,
                       {"loss_history": losses, "calibration_records": len(calibration)})
    history += held_out_tau(cfg, accelerator, target, out, eval_prompts, step=done)
    write_summary(cfg, accelerator, done, done if cfg.max_minutes else None, history)  # max_minutes: what it decided
    return out


def held_out_tau(cfg, accelerator, target, drafter_dir: Path, eval_prompts, step: int) -> list[dict]:
    """[{"step", "tau", "alpha"}] of the saved drafter at `drafter_dir`, greedy speculative decoding of the
    held-out prompts by the engine with its calibrated tree (main process); [] without held-out prompts."""
    if not eval_prompts or not accelerator.is_main_process:
        return []
    drafter = load_drafter(str(drafter_dir), target)
    engine = SpeculativeEngine(target.model, build_proposer(drafter, target.model), target.eos_token_ids,
                               adaptive=False)
    with torch.no_grad():
        result = aggregate_stats([engine.generate(p, cfg.eval_max_new_tokens).stats for p in eval_prompts])
    log.info("step %d held-out tau %.3f alpha %.3f (%s)", step, result["tau"], result["alpha"] or 0.0, drafter_dir)
    return [{"step": step, "tau": result["tau"], "alpha": result["alpha"]}]


def write_summary(cfg, accelerator, step: int, decided_steps: int | None, history: list[dict]) -> None:
    """work_dir/summary.json, as the other methods write it: steps run, the count max_minutes decided (None without
    it), the held-out measurements (the untrained heads' at step 0 with medusa.untrained_dir, the trained ones'
    at the last step) and the peak RSS."""
    if not accelerator.is_main_process:
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    summary = {"finished": True, "step": step, "decided_steps": decided_steps, "history": history,
               "best_tau": history[-1]["tau"] if history else None, "peak_rss_mib_per_process": [peak]}
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.work_dir) / "summary.json").write_text(json.dumps(summary, indent=1))


def calibrate_and_save(cfg, accelerator, target, heads, calib_set: list[Example], vocab_map, out: Path,
                       extra: dict) -> None:
    """Choose the sparse tree from the heads' top-k accuracies on the held-out records and write the drafter
    directory (the tree and accuracies go in its manifest). The heads keep their dtype; a copy is saved."""
    embed = target.model.get_input_embeddings()
    accuracy = topk_accuracy(heads, calib_set, cfg.medusa.topk, vocab_map, embed)
    tree = choose_tree(accuracy, cfg.medusa.tree_nodes)
    log.info("calibrated tree (%s): %d nodes, expected accepted drafts %.2f per step; top-1 accuracy per head %s",
             out, len(tree), expected_accept_length(tree, accuracy), [round(a[0], 3) for a in accuracy])
    config = {**heads.config, **to_dict(cfg)}
    if accelerator.is_main_process:
        save_drafter(out, copy.deepcopy(heads).to(target.dtype), target, "medusa", config=config, vocab_map=vocab_map,
                     extra={"tree": tree, "topk_accuracy": accuracy,
                            "expected_accept_length": expected_accept_length(tree, accuracy), **extra})
    accelerator.wait_for_everyone()


# ---- data: the target's hidden states ------------------------------------------------------------------

def hidden_state_sets(cfg, accelerator, target, records: list[dict], train_records: list[dict],
                      calibration: list[dict]) -> tuple[list[Example], list[Example]]:
    """(training, calibration) examples: from the feature cache of medusa.feature_layers over all the records
    (the training and held-out ones are sub-lists of them), else from a pass of the target over each set."""
    if not cfg.medusa.feature_layers:
        return (target_hidden_states(cfg, target, train_records, "train"),
                target_hidden_states(cfg, target, calibration, "calibration"))
    examples = cached_final_states(cfg, accelerator, target, records)
    position = {id(record): i for i, record in enumerate(records)}
    return ([examples[position[id(r)]] for r in train_records], [examples[position[id(r)]] for r in calibration])


def cached_final_states(cfg, accelerator, target, records: list[dict]) -> list[Example]:
    """(hidden [T, D] bf16, response [R]) per record, as `target_hidden_states` gives them, read from the
    distill.feature_cache of these records with medusa.feature_layers (built first if absent): its `final`
    column is the target's final normed state at each position of the record's training window."""
    cache = steps.target_states(cfg, accelerator, target, records, list(cfg.medusa.feature_layers),
                                staging=feature_staging(cfg, target))  # what the teacher generation staged
    log.info("target final states read from the feature cache %s", cache.directory)
    examples: list[Example] = []
    for index in range(cache.num_shards):
        for record in cache.shard(index):
            positions = record.mask.nonzero().flatten()  # [R], consecutive: the rows predicting the response
            end = int(positions[-1]) + 1 if positions.numel() else 0
            examples.append((record.final[:end].clone(), record.ids[positions + 1].clone()))
    return examples


@torch.no_grad()
def target_hidden_states(cfg, target, records: list[dict], name: str) -> list[Example]:
    """(hidden [T, D], response [R]) per record: the target's final-norm hidden states at every position
    up to the last whose next token is a response token (the prefix layer reads the prompt's too; the
    last R rows are the response's). Cached in work_dir (the target is frozen)."""
    cache = Path(cfg.work_dir) / f"medusa_hidden_{name}.pt"
    key = (target.fingerprint, len(records), sum(len(r["response_ids"]) for r in records), cfg.max_seq_len,
           "whole sequence")
    if cache.is_file():
        saved = torch.load(cache, weights_only=False)
        if saved.get("key") == key:
            return saved["examples"]
    pad_id = pad_token_id(target.tokenizer, target.eos_token_ids)
    examples: list[Example | None] = [None] * len(records)
    for indices in tqdm(batches_by_length(records, cfg.gen_batch_size), desc=f"target hidden ({name})"):
        batch = collate([records[i] for i in indices], pad_id, cfg.max_seq_len).to(target.device)
        hidden = target.model.get_decoder()(input_ids=batch.input_ids,
                                            attention_mask=batch.attention_mask).last_hidden_state  # [B, T, D]
        for row, index in enumerate(indices):
            positions = batch.loss_mask[row].nonzero().flatten()  # [R], consecutive
            if positions.numel() and positions[-1] - positions[0] + 1 != positions.numel():
                raise ValueError(f"record {index}: its response positions are not consecutive")
            end = int(positions[-1]) + 1 if positions.numel() else 0
            examples[index] = (hidden[row][:end].float().cpu(), batch.labels[row][positions].cpu())
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "examples": examples}, cache)
    return examples


# ---- the loss ------------------------------------------------------------------------------------------

def head_sources(heads, examples: list[Example]) -> list[torch.Tensor]:
    """Per example s_0 [R, D] at its response rows: the target's states, or with a prefix layer its
    output over the example's whole sequence (right-padded batches; causal, so padding is unseen)."""
    device = next(heads.parameters()).device
    dtype = heads.heads[0].proj.weight.dtype
    if heads.prefix is None:
        return [h[h.shape[0] - labels.shape[0]:].to(device, dtype) for h, labels in examples]
    batch = torch.nn.utils.rnn.pad_sequence([h.to(device, dtype) for h, _ in examples], batch_first=True)  # [B, T, D]
    out = heads.source(batch)  # [B, T, D]
    return [out[b, h.shape[0] - labels.shape[0]:h.shape[0]] for b, (h, labels) in enumerate(examples)]


def head_rows(heads, examples: list[Example], embed=None):
    """Per head k (1-based): (k, head, states [N, D], labels [N], examples used) teacher-forced.

    Head k at response row i of an example reads s_0 at row i (`head_sources`; a sequential head:
    head k-1's state at row i and the embedding of the target's token i + k - 1, the response token
    before its own) and predicts label i + k; rows are consecutive positions, so an example of R
    rows gives R - k of them."""
    device = next(heads.parameters()).device
    previous = head_sources(heads, examples)  # per example [R, D]: s_0
    for k, head in enumerate(heads.heads, start=1):
        keep = [e for e, (_, labels) in enumerate(examples) if labels.shape[0] > k]
        if not keep:
            return
        source = torch.cat([previous[e][:examples[e][1].shape[0] - k] for e in keep])  # [N, D]
        labels = torch.cat([examples[e][1][k:] for e in keep]).to(device)  # [N]
        tokens = None
        if heads.sequential:
            before = torch.cat([examples[e][1][k - 1:-1] for e in keep]).to(device)  # [N] token i + k - 1
            tokens = embed(before)  # [N, D]
        states = head.state(source, tokens)  # [N, D]
        if heads.sequential:  # head k + 1 continues from these states
            lengths = [examples[e][1].shape[0] - k for e in keep]
            previous = [None] * len(examples)
            for e, part in zip(keep, states.split(lengths)):
                previous[e] = part
        yield k, head, states, labels, keep  # rows 0 .. R - k - 1 of each kept example, in order


def project(weight: torch.Tensor, states: torch.Tensor, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """states [N, D] through an output layer's weight [V, D] -> logits [N, V], or [N, M] over
    vocab_map's rows only (the candidates decoding can propose)."""
    if vocab_map is not None:
        weight = weight[vocab_map.to(weight.device)]  # [M, D]
    return torch.nn.functional.linear(states, weight)


def medusa_loss(heads, target_head: torch.nn.Module, examples: list[Example], decay: float,
                kl_weight: float, vocab_map: torch.Tensor | None = None, embed=None,
                target_rows: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k decay**(k-1) * (CE + kl_weight * KL(target || head k)), each a mean over positions.

    Head k at row i of an example predicts label i + k; the target's distribution for that token is
    its head at row i + k. With vocab_map [M], both distributions are over those M tokens (decoding
    proposes no others) and positions whose label is outside them are left out of the CE.
    target_rows: the target head's rows over the candidates ([M, D], `candidate_rows`), when the caller
    already has them (a training loop: one copy of them, not one per step)."""
    device = next(heads.parameters()).device
    index = None if vocab_map is None else vocab_index(vocab_map, target_head.weight.shape[0]).to(device)
    if target_rows is None:
        target_rows = candidate_rows(target_head.weight, vocab_map)
    target_logits = None
    if kl_weight:
        with torch.no_grad():
            # per example [R, V or M]
            target_logits = [torch.nn.functional.linear(h[h.shape[0] - labels.shape[0]:].to(
                device, target_rows.dtype), target_rows).float() for h, labels in examples]
    head_map = None if getattr(heads, "reduced", False) else vocab_map  # a reduced head holds the M rows already
    total = torch.zeros((), device=device)
    for k, head, states, labels, used in head_rows(heads, examples, embed):
        logits = project(head.proj.weight, states, head_map)  # [N, V or M]
        targets = labels if index is None else index[labels]  # [N] (-1: not a candidate)
        inside = targets >= 0
        loss = cross_entropy_loss(logits[inside], targets[inside]) if inside.any() else logits.sum() * 0
        if kl_weight:
            teacher = torch.cat([target_logits[e][k:] for e in used])  # [N, V or M]: rows i + k
            loss = loss + kl_weight * forward_kl(logits, teacher)
        total = total + decay ** (k - 1) * loss
    return total


def candidate_rows(weight: torch.Tensor, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """An output layer's weight [V, D] restricted to vocab_map's rows, [M, D] (all of it without one), detached."""
    weight = weight.detach()
    return weight if vocab_map is None else weight[vocab_map.to(weight.device)]


def vocab_index(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] target id -> its row in vocab_map, -1 for tokens outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_map.long().cpu()] = torch.arange(vocab_map.numel())
    return index


def train_heads(cfg, accelerator, target, heads, examples: list[Example], optimizer, scheduler, total: int,
                vocab_map: torch.Tensor | None = None) -> tuple[list, int]:
    """`total` optimizer steps over shuffled batches of examples (this process's shard), or with max_minutes as
    many as the job's time left allows (decided once after the warm-up, train.step_budget): (loss history,
    steps run)."""
    rng = random.Random(cfg.seed)
    shard = examples[accelerator.process_index::accelerator.num_processes]
    target_head = target.model.get_output_embeddings()
    target_rows = candidate_rows(target_head.weight, vocab_map)  # [M, D], once
    embed = target.model.get_input_embeddings()
    budget = StepBudget(cfg.max_minutes, cfg.warmup_steps, 0, total) if cfg.max_minutes else None
    decided = False
    order: list[int] = []
    history = []
    bar = tqdm(total=total, desc="medusa", disable=not accelerator.is_local_main_process)
    step = 0
    while step < total:
        started = time.perf_counter()
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(shard)), len(shard))
        batch = [shard[i] for i in order[:cfg.batch_size]]
        del order[:cfg.batch_size]
        module = accelerator.unwrap_model(heads)
        loss = medusa_loss(module, target_head, batch, cfg.medusa.decay, cfg.medusa.kl_weight, vocab_map, embed,
                           target_rows)
        accelerator.backward(loss)
        average_gradients(accelerator, module)
        accelerator.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        bar.update(1)
        if budget:
            budget.observe_step(time.perf_counter() - started, step - 1)
            total, decided = steps.budget_after_step(accelerator, budget, scheduler, step, total, decided)
            bar.total = total
        if step % cfg.log_every == 0 or step == total:
            log.info("step %d loss %.4f lr %.2e", step, loss.item(), scheduler.get_last_lr()[0])
            history.append({"step": step, "loss": loss.item()})
    bar.close()
    return history, step


def average_gradients(accelerator, module) -> None:
    """The loss calls the heads' submodules directly (not the DDP wrapper's forward), so DDP's hooks
    do not sync them: average the gradients across processes here."""
    if accelerator.num_processes == 1:
        return
    for p in module.parameters():
        if p.grad is not None:
            p.grad = accelerator.reduce(p.grad, "mean")


def candidate_vocab(cfg, target, records: list[dict]) -> torch.Tensor | None:
    """[M] target ids the heads may propose at decoding (cfg.draft_vocab most frequent response
    tokens, EOS always in), or None for the full vocabulary."""
    if not cfg.draft_vocab:
        return None
    counts = count_response_tokens(records)
    vocab_map = select_draft_vocab(counts, cfg.draft_vocab, target.vocab_size, always=target.eos_token_ids)
    log.info("candidate vocabulary: %d tokens, %.1f%% of the training responses' tokens",
             cfg.draft_vocab, 100 * coverage(counts, vocab_map))
    return vocab_map


# ---- calibration ---------------------------------------------------------------------------------------

@torch.no_grad()
def topk_accuracy(heads, examples: list[Example], k_ranks: int, vocab_map: torch.Tensor | None = None,
                  embed=None) -> list[list[float]]:
    """accuracy[k][r]: how often head k+1's r-th choice is the target's token (teacher-forced: a
    sequential head reads the target's own tokens before it, so this is its accuracy given that the
    path above it was right), the choices restricted to vocab_map's rows when given, as decoding
    restricts them."""
    hits: list[torch.Tensor] = []  # per head [ranks]: right choices at each rank
    counts: list[int] = []
    for start in range(0, len(examples), PREFIX_BATCH):  # the prefix layer's activations, a batch at a time
        for k, head, states, labels, _ in head_rows(heads, examples[start:start + PREFIX_BATCH], embed):
            logits = project(head.proj.weight, states, None if heads.reduced else vocab_map)  # [N, V or M]
            ranks = logits.topk(k_ranks, dim=-1).indices  # [N, ranks]
            if vocab_map is not None:
                ranks = vocab_map.to(ranks.device)[ranks]  # target ids
            right = (ranks == labels[:, None]).float().sum(0).cpu()  # [ranks]
            if k > len(hits):
                hits.append(torch.zeros(k_ranks))
                counts.append(0)
            hits[k - 1] += right
            counts[k - 1] += labels.shape[0]
    return [(h / max(n, 1)).tolist() for h, n in zip(hits, counts)]


def feature_staging(cfg, target) -> FeatureStaging | None:
    """With medusa.feature_layers, where the teacher generation stages the target's states (distill.feature_capture),
    so that the feature cache is built from them rather than by a second pass of the target; else None."""
    layers = list(cfg.medusa.feature_layers)
    return FeatureStaging(target.fingerprint, layers) if layers else None


register_method(Method("medusa", train_medusa, MedusaConfig, check=check_job, budgeted=True,
                       staging=feature_staging))
