"""What the online daemon computes: the target's view of logged requests, the drafter's acceptance on
them, and KD updates that weight the positions the drafter gets wrong.

Held-out acceptance is the engine's greedy acceptance at a fixed draft depth, computed exactly from one
teacher-forced drafter forward instead of a generation: under greedy verification a chain drafter's
j-th draft after the bonus token is accepted iff it and all earlier drafts equal the target's tokens,
and while they do, the drafter has seen exactly the target's tokens. So with match[t] = (drafter's
greedy token at output position t == the target's greedy token there), the engine accepts, at each
step, the run of matches from its position, capped at the depth; the step then emits one more token
(the bonus). `simulate_chain_acceptance` replays that loop (tests check it against the engine). It
costs a drafter forward per request, no target forward, which is what lets the daemon judge every
candidate while the server keeps the CPU busy. Exact for greedy-served requests whose drafter drafts
no EOS; for sampled requests it measures agreement with the target's greedy choice along the sampled path.
"""

from __future__ import annotations

import hashlib
import random

import torch

from specdistill.distill.batching import collate, with_absent_column
from specdistill.distill.generation import generate_batch
from specdistill.distill.losses import TopK, distill_loss
from specdistill.distill.prompt_vocab import (
    draft_logits,
    extended_logits,
    extra_id_matrix,
    indices_to_target,
    prompt_only_tokens,
    with_prompt_vocab,
)
from specdistill.distill.replay import Entry, mismatch_priority
from specdistill.distill.teacher_data import teacher_forced_topk

KD_LOSSES = ("fkl", "rkl", "mix", "ce")


# ---- the target's distributions --------------------------------------------------------------------------

def score_requests(target, records: list[dict], k: int, pad_id: int, batch_size: int = 8,
                   with_prompt: bool = False, teacher=None) -> list[Entry]:
    """Entries with the target's top-k at every output position, and with_prompt at every prompt position
    after the first too (the same single teacher-forced target forward over prompt + output). `teacher`, when
    given, scores instead of the local target: a callable with teacher_forced_topk's contract
    (contexts, scored, k) -> [(ids, logprobs)], such as distill.teacher_openai.OpenAIScorer."""
    if teacher is None:
        def teacher(contexts, scored, top):
            return teacher_forced_topk(target.model, contexts, scored, top, pad_id)
    entries = []
    for start in range(0, len(records), batch_size):
        batch = records[start:start + batch_size]
        if with_prompt:  # score prompt[1:] + output from prompt[:1]: the same sequence, more positions kept
            contexts = [r["prompt_ids"][:1] for r in batch]
            scored = [list(r["prompt_ids"][1:]) + list(r["output_ids"]) for r in batch]
        else:
            contexts, scored = [r["prompt_ids"] for r in batch], [r["output_ids"] for r in batch]
        topk = teacher(contexts, scored, k)
        for rec, (ids, logprobs) in zip(batch, topk):
            max_new = rec.get("sampling", {}).get("max_tokens", 0)
            split = len(ids) - len(rec["output_ids"])  # 0 without the prompt
            entries.append(Entry(rec["id"], list(rec["prompt_ids"]), list(rec["output_ids"]), ids[split:],
                                 logprobs[split:], max_new if isinstance(max_new, int) else 0,
                                 prompt_topk_ids=ids[:split], prompt_topk_logprobs=logprobs[:split]))
    return entries


def request_seed(seed: int, request_id: str) -> int:
    """A sampling seed per (daemon seed, request): a re-ingest after a crash draws the same answers."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{request_id}".encode()).digest()[:8], "little") % 2**63


def attach_samples(target, entries: list[Entry], k: int, temperature: float, topk: int, pad_id: int, seed: int,
                   batch_size: int = 8) -> int:
    """Give each entry k of the target's own sampled answers to its prompt, with the target's top-k along
    each (sequence-level KD on the live prompts: more in-domain text per logged request). An answer is as
    long as its request allowed (its max_tokens, else its logged output's length); an EOS ends it early.
    Sampling is seeded by each batch's first request (request_seed), so re-ingesting the same read batch
    after a crash draws the same answers. Returns the number of tokens sampled."""
    made = 0
    for start in range(0, len(entries), batch_size):
        batch = entries[start:start + batch_size]
        limits = [e.max_new_tokens or len(e.response_ids) for e in batch]
        answers: list[list[list[int]]] = [[] for _ in batch]  # [B][k] token ids
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(request_seed(seed, batch[0].id))
            for _ in range(k):
                drawn = generate_batch(target.model, [e.prompt_ids for e in batch], max_new_tokens=max(limits),
                                       pad_id=pad_id, eos_token_ids=target.eos_token_ids, do_sample=True,
                                       temperature=temperature)
                for row, (tokens, limit) in enumerate(zip(drawn, limits)):
                    answers[row].append(tokens[:limit])
        owners = [row for row, mine in enumerate(answers) for _ in mine]  # each answer has >= 1 token
        flat = [a for mine in answers for a in mine]                       # [B * k]
        prompts = [batch[row].prompt_ids for row in owners]
        scored = [row for at in range(0, len(flat), batch_size)  # batch_size rows a target forward
                  for row in teacher_forced_topk(target.model, prompts[at:at + batch_size],
                                                 flat[at:at + batch_size], topk, pad_id)]
        for entry in batch:
            entry.samples = []
        for row, answer, (ids, logprobs) in zip(owners, flat, scored):
            batch[row].samples.append({"response_ids": answer, "topk_ids": ids, "topk_logprobs": logprobs})
            made += len(answer)
    return made


# ---- the drafter's greedy tokens, teacher-forced ----------------------------------------------------------

@torch.no_grad()
def drafter_greedy_tokens(model, vocab_map: torch.Tensor | None, entries: list[Entry], pad_id: int,
                          max_len: int, batch_size: int = 8, prompt_vocab: bool = False) -> list[list[int]]:
    """Per entry, the drafter's greedy target-vocabulary token at each response position; with prompt_vocab
    (a reduced head only) the head extended by the entry's own prompt tokens, as the engine drafts."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    head_ids = set(vocab_map.tolist()) if prompt_vocab and vocab_map is not None else None
    out = []
    for start in range(0, len(entries), batch_size):
        chunk = entries[start:start + batch_size]
        batch = collate([{"prompt_ids": e.prompt_ids, "response_ids": e.response_ids} for e in chunk], pad_id,
                        max_len).to(device)
        if head_ids is not None:
            extra = extra_id_matrix([prompt_only_tokens(e.prompt_ids, head_ids) for e in chunk]).to(device)
            logits = extended_logits(model, batch.input_ids, batch.attention_mask, extra)  # [B, T, M + N]
            tokens = indices_to_target(logits.argmax(-1), vocab_map.to(device), extra)
        else:
            tokens = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.argmax(-1)  # [B, T]
            if vocab_map is not None:
                tokens = vocab_map.to(device)[tokens]
        for row in range(len(chunk)):
            out.append(tokens[row][batch.loss_mask[row]].tolist())
    model.train(was_training)
    return out


def target_greedy_tokens(entry: Entry) -> list[int]:
    return [ids[0] for ids in entry.topk_ids]


def simulate_chain_acceptance(match: list[bool], max_new_tokens: int, gamma: int) -> tuple[int, int]:
    """(drafted, accepted) of the engine's greedy loop at fixed depth over an output of len(match) tokens."""
    n_out, pos = len(match), 1  # the prefill forward emits the first token
    drafted = accepted = 0
    while pos < n_out:
        depth = min(gamma, max_new_tokens - pos - 1)
        run = 0
        while run < depth and pos + run < n_out and match[pos + run]:
            run += 1
        drafted += max(depth, 0)
        accepted += run
        pos += run + 1
    return drafted, accepted


def acceptance(model, vocab_map, entries: list[Entry], pad_id: int, max_len: int, gamma: int,
               prompt_vocab: bool = False) -> dict:
    """alpha (accepted / drafted) and first-position acceptance over entries, plus per-entry priorities."""
    drafts = drafter_greedy_tokens(model, vocab_map, entries, pad_id, max_len, prompt_vocab=prompt_vocab)
    drafted = accepted = first_hits = first_n = 0
    priorities = {}
    for entry, mine in zip(entries, drafts):
        truth = target_greedy_tokens(entry)[:len(mine)]
        match = [d == t for d, t in zip(mine, truth)]
        limit = entry.max_new_tokens or len(match) + 1
        d, a = simulate_chain_acceptance(match, limit, gamma)
        drafted, accepted = drafted + d, accepted + a
        first_hits, first_n = first_hits + sum(match[1:]), first_n + max(len(match) - 1, 0)
        priorities[entry.id] = mismatch_priority(mine, truth)
    return {"alpha": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "token_match": first_hits / first_n if first_n else None, "requests": len(entries),
            "priorities": priorities}


# ---- the update -----------------------------------------------------------------------------------

def kd_step_loss(model, batch, loss: str, mix_weight: float, right_weight: float) -> torch.Tensor:
    """Position-weighted KD on a batch with the target's top-k: positions the drafter gets wrong weigh 1,
    the others `right_weight` (they still count, so what it does well is not forgotten). `loss` is a
    divergence to the top-k distribution (fkl, rkl, their mix) or cross-entropy on its top-1 (ce)."""
    logits = draft_logits(model, batch)  # [B, T, V_d] (+ N prompt-only columns with batch.extra_ids)
    top1 = batch.topk_ids[..., 0]  # [B, T] the target's greedy token, in the head's indices
    mask = batch.loss_mask
    if int(batch.topk_ids.max()) >= logits.shape[-1]:
        if loss == "ce":  # a greedy token the head cannot draft has no finite cross-entropy: it leaves the loss
            mask = mask & (top1 < logits.shape[-1])
        logits = with_absent_column(logits)
    target = TopK(batch.topk_ids, batch.topk_logprobs)
    with torch.no_grad():
        wrong = logits.argmax(-1) != top1  # [B, T]
    weights = torch.where(wrong, 1.0, right_weight) * mask  # [B, T]
    if batch.weights is not None:  # e.g. prompt positions at prompt_weight
        weights = weights * batch.weights
    per_token = 0.0
    if loss == "ce":  # the target's greedy token: exactly what greedy verification accepts
        per_token = distill_loss("ce", logits, labels=top1, mask=mask, reduction="none")
    if loss in ("fkl", "mix"):
        w = 1.0 if loss == "fkl" else mix_weight
        per_token = per_token + w * distill_loss("fkl", logits, target=target, mask=mask, reduction="none")
    if loss in ("rkl", "mix"):
        w = 1.0 if loss == "rkl" else 1.0 - mix_weight
        per_token = per_token + w * distill_loss("rkl", logits, target=target, mask=mask, reduction="none")
    return (per_token * weights).sum() / weights.sum().clamp_min(1e-6)


def anchor_loss(model, batch) -> torch.Tensor:
    """Cross-entropy on general-domain target generations: a rehearsal term against forgetting."""
    return distill_loss("ce", draft_logits(model, batch), labels=batch.labels, mask=batch.loss_mask)


def pick_variant(entry: Entry, rng: random.Random) -> int:
    """The logged output (0) or one of the entry's sampled answers, uniformly; draws nothing without them."""
    return rng.randrange(entry.variants) if entry.samples else 0


def train_candidate(model, vocab_map_inverse, buffer, anchors: list[dict], cfg, pad_id: int,
                    rng: random.Random, prompt_vocab: bool = False) -> float:
    """cfg.steps_per_update AdamW steps on priority-sampled buffer batches (+ anchor rehearsal). With
    prompt_vocab (a reduced head: vocab_map_inverse given) every row's head is extended by its request's
    prompt tokens, as the engine drafts with `prompt_vocab`, so copying from the prompt is learned too."""
    if prompt_vocab and vocab_map_inverse is None:
        raise ValueError("prompt_vocab extends a reduced draft head; this drafter has the full vocabulary")
    head = torch.nonzero(vocab_map_inverse >= 0).flatten() if prompt_vocab else None  # the head's target ids
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=0.0)
    device = next(model.parameters()).device
    total = 0.0
    for _ in range(cfg.steps_per_update):
        drawn = buffer.sample(cfg.batch_size, rng)
        records = [e.record(cfg.prompt_weight, cfg.max_seq_len, pick_variant(e, rng)) for e in drawn]
        if head is not None:  # the request's whole prompt, also where prompt_weight moved part of it
            records = with_prompt_vocab(records, head, prompts=[e.prompt_ids for e in drawn])
        batch = collate(records, pad_id, cfg.max_seq_len, vocab_map_inverse).to(device)
        loss = kd_step_loss(model, batch, cfg.loss, cfg.mix_weight, cfg.right_weight)
        if anchors and cfg.anchor_weight > 0:
            picked = rng.sample(anchors, min(cfg.anchor_batch_size, len(anchors)))
            if head is not None:
                picked = with_prompt_vocab(picked, head)
            anchor = collate(picked, pad_id, cfg.max_seq_len, vocab_map_inverse).to(device)
            loss = loss + cfg.anchor_weight * anchor_loss(model, anchor)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        total += float(loss.detach())
    model.eval()
    return total / max(cfg.steps_per_update, 1)
