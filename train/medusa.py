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
which also makes a training step about V / M times cheaper.
`medusa.sequential: true` trains sequential (Hydra-style) heads, `medusa.prefix_layer: true` adds
Hydra++'s prefix attention layer under them (trained jointly, over each record's whole sequence of
target states), see models.medusa.
Config: the `medusa:` section (MedusaConfig), draft_vocab, and the common optimisation fields.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdistill.decode.proposers.medusa import choose_tree, expected_accept_length
from specdistill.distill.batching import batches_by_length, collate
from specdistill.distill.generation import pad_token_id
from specdistill.distill.losses import cross_entropy_loss, forward_kl
from specdistill.distill.vocab import count_response_tokens, coverage, select_draft_vocab
from specdistill.models.drafters import save_drafter
from specdistill.models.medusa import MedusaHeads
from specdistill.train import distill_steps as steps
from specdistill.train.colbt import split_held_out
from specdistill.train.config import ConfigError, option, to_dict
from specdistill.train.methods import Method, register_method

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

# hidden [T, D]: the target's states at a record's positions up to the last one that predicts a response
# token; its last R rows are the positions predicting the response, labels [R] (the response tokens)
Example = tuple[torch.Tensor, torch.Tensor]
PREFIX_BATCH = 16  # records per prefix-layer forward outside training (calibration)


def train_medusa(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]] | None = None) -> Path:
    """eval_prompts: unused; the heads are measured on held-out records (`medusa.calibration`), not decoded."""
    train_records, calibration = split_held_out(records, cfg.medusa.calibration, cfg.seed, key="medusa.calibration")
    train_set = target_hidden_states(cfg, target, train_records, "train")
    calib_set = target_hidden_states(cfg, target, calibration, "calibration")
    heads = MedusaHeads.from_target(target.model, cfg.medusa.heads, cfg.medusa.layers,
                                    sequential=cfg.medusa.sequential,
                                    prefix_layer=cfg.medusa.prefix_layer).float().train()
    heads.requires_grad_(True)
    vocab_map = candidate_vocab(cfg, target, train_records)
    if cfg.medusa.untrained_dir:
        calibrate_and_save(cfg, accelerator, target, heads.eval(), calib_set, vocab_map, Path(cfg.medusa.untrained_dir),
                           {"untrained": True, "calibration_records": len(calibration)})
        heads.train()
    total = cfg.max_steps or cfg.epochs * -(-len(train_set) // (cfg.batch_size * accelerator.num_processes))
    optimizer, scheduler = steps.make_optimizer(cfg, heads, total)
    heads, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)
    losses = train_heads(cfg, accelerator, target, heads, train_set, optimizer, scheduler, total, vocab_map)
    heads = accelerator.unwrap_model(heads).eval()
    out = Path(cfg.output_dir)
    calibrate_and_save(cfg, accelerator, target, heads, calib_set, vocab_map, out,
                       {"loss_history": losses, "calibration_records": len(calibration)})
    return out


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
                kl_weight: float, vocab_map: torch.Tensor | None = None, embed=None) -> torch.Tensor:
    """sum_k decay**(k-1) * (CE + kl_weight * KL(target || head k)), each a mean over positions.

    Head k at row i of an example predicts label i + k; the target's distribution for that token is
    its head at row i + k. With vocab_map [M], both distributions are over those M tokens (decoding
    proposes no others) and positions whose label is outside them are left out of the CE."""
    device = next(heads.parameters()).device
    index = None if vocab_map is None else vocab_index(vocab_map, target_head.weight.shape[0]).to(device)
    target_logits = None
    if kl_weight:
        with torch.no_grad():
            # per example [R, V or M]
            target_logits = [project(target_head.weight, h[h.shape[0] - labels.shape[0]:].to(
                device, target_head.weight.dtype), vocab_map).float() for h, labels in examples]
    total = torch.zeros((), device=device)
    for k, head, states, labels, used in head_rows(heads, examples, embed):
        logits = project(head.proj.weight, states, vocab_map)  # [N, V or M]
        targets = labels if index is None else index[labels]  # [N] (-1: not a candidate)
        inside = targets >= 0
        loss = cross_entropy_loss(logits[inside], targets[inside]) if inside.any() else logits.sum() * 0
        if kl_weight:
            teacher = torch.cat([target_logits[e][k:] for e in used])  # [N, V or M]: rows i + k
            loss = loss + kl_weight * forward_kl(logits, teacher)
        total = total + decay ** (k - 1) * loss
    return total


def vocab_index(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] target id -> its row in vocab_map, -1 for tokens outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_map.long().cpu()] = torch.arange(vocab_map.numel())
    return index


def train_heads(cfg, accelerator, target, heads, examples: list[Example], optimizer, scheduler, total: int,
                vocab_map: torch.Tensor | None = None) -> list:
    """`total` optimizer steps over shuffled batches of examples (this process's shard)."""
    rng = random.Random(cfg.seed)
    shard = examples[accelerator.process_index::accelerator.num_processes]
    target_head = target.model.get_output_embeddings()
    embed = target.model.get_input_embeddings()
    order: list[int] = []
    history = []
    for step in tqdm(range(total), desc="medusa", disable=not accelerator.is_local_main_process):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(shard)), len(shard))
        batch = [shard[i] for i in order[:cfg.batch_size]]
        del order[:cfg.batch_size]
        module = accelerator.unwrap_model(heads)
        loss = medusa_loss(module, target_head, batch, cfg.medusa.decay, cfg.medusa.kl_weight, vocab_map, embed)
        accelerator.backward(loss)
        average_gradients(accelerator, module)
        accelerator.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if (step + 1) % cfg.log_every == 0 or step + 1 == total:
            log.info("step %d loss %.4f lr %.2e", step + 1, loss.item(), scheduler.get_last_lr()[0])
            history.append({"step": step + 1, "loss": loss.item()})
    return history


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
    tokens, EOS always in), or None for the full vocabulary. Training keeps the full vocabulary."""
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
            logits = project(head.proj.weight, states, vocab_map)  # [N, V or M]
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


register_method(Method("medusa", train_medusa, MedusaConfig, check=check_job, measures=False))
