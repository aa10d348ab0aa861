"""Collective boost-tuning (SpecInfer, Miao et al. 2023): the maths of weighting the data of drafter i
toward what drafters 1..i-1 fail to propose.

Coverage. At a response position (a place where the target emitted `label`), a drafter *covers* the
target's token when it would propose it there, teacher-forced on the target's own prefix:
    top1   its argmax is the label (what a greedy chain drafts);
    topm   the label is among its m most likely tokens (what a tree holding its top-m branches drafts).
With a reduced head, the drafter's indices are mapped to target ids through its `vocab_map` first.

Weights for the next drafter, per loss position, from the coverage of the earlier drafters K:
    linear   w_raw = 1 + strength * (1 - covered_by_any)     a miss of all K counts 1 + strength
    exp      w_raw = exp(strength * misses)                   misses = how many of the K missed (AdaBoost-like)
then normalised over the loss positions passed in (the whole training set, so that batches keep
their relative weight):  w = w_raw * n / sum(w_raw),  n = number of loss positions,
so that mean(w) = 1 and sum(w) = n exactly. The token-normalised weighted loss sum(w * ce) / n
thus has the scale of the unweighted one, and the learning rate means the same with and without
boosting. With no earlier drafter, strength 0, or everything covered, every weight is exactly 1.
Positions outside the loss mask get weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdistill.distill.batching import Batch, collate

__all__ = ["RULES", "SCHEMES", "covers", "boost_weights", "coverage_report", "weighted_token_ce",
           "teacher_forced_coverage", "split_by_record", "collate_weighted"]

RULES = ("top1", "topm")
SCHEMES = ("linear", "exp")


def covers(draft_logits: torch.Tensor, labels: torch.Tensor, rule: str = "top1", m: int = 1,
           vocab_map: torch.Tensor | None = None) -> torch.Tensor:
    """[..., V_d] draft logits and [...] target token ids -> [...] bool: the drafter proposes the label."""
    if rule not in RULES:
        raise ValueError(f"unknown coverage rule {rule!r}; choose one of {RULES}")
    if rule == "topm" and m < 1:
        raise ValueError(f"coverage rule topm needs m >= 1, got {m}")
    width = 1 if rule == "top1" else min(m, draft_logits.shape[-1])
    proposed = draft_logits.topk(width, dim=-1).indices  # [..., m] draft indices
    if vocab_map is not None:
        proposed = vocab_map.to(proposed.device)[proposed]  # [..., m] target ids
    return (proposed == labels.unsqueeze(-1)).any(-1)


def boost_weights(covered: torch.Tensor, strength: float, scheme: str = "linear",
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """covered: [K, ...] bool, earlier drafter k covers the position -> [...] weights, mean 1 over
    `mask` (default: every position) and 0 outside it. K = 0 gives uniform weights."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown boosting scheme {scheme!r}; choose one of {SCHEMES}")
    if strength < 0:
        raise ValueError(f"boosting strength must be >= 0, got {strength}")
    shape = covered.shape[1:]
    mask = torch.ones(shape, dtype=torch.bool) if mask is None else mask.bool()
    if covered.shape[0] == 0 or strength == 0:
        return mask.float()
    misses = (~covered.bool()).sum(0).float()  # [...] earlier drafters that missed
    if scheme == "linear":
        raw = 1.0 + strength * (misses == covered.shape[0]).float()  # missed by all = covered by none
    else:
        # shifted by the largest exponent so large strength * K cannot overflow; normalisation cancels it
        raw = torch.exp(strength * (misses - misses[mask].max())) if mask.any() else misses
    return normalise_to_mean_one(raw, mask)


def normalise_to_mean_one(raw: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """raw * n / sum(raw over mask) on the mask, 0 elsewhere (n = mask positions)."""
    raw = raw.masked_fill(~mask, 0.0)
    n, total = int(mask.sum()), raw.sum()
    if n == 0:
        return raw
    return raw * (n / total)


def coverage_report(covered: torch.Tensor) -> dict:
    """covered: [K, N] bool over N held-out positions -> the fraction each drafter covers and the
    fraction drafters 0..k cover together (cumulative), for k = 0..K-1."""
    covered = covered.bool()
    n = covered.shape[1]
    if n == 0:
        return {"per_drafter": [0.0] * covered.shape[0], "cumulative": [0.0] * covered.shape[0], "positions": 0}
    per = covered.float().mean(1)  # [K]
    cumulative = covered.cummax(0).values.float().mean(1)  # [K] any of 0..k
    return {"per_drafter": per.tolist(), "cumulative": cumulative.tolist(), "positions": n}


def weighted_token_ce(draft_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """sum over masked positions of w * -log q(label): [B, T, V], [B, T], [B, T], [B, T] -> scalar.
    Divide by the (global) number of loss positions for the token-normalised loss."""
    ce = F.cross_entropy(draft_logits.float().flatten(0, -2), labels.flatten(), reduction="none")  # [B*T]
    w = weights.flatten().to(ce.dtype) * mask.flatten().to(ce.dtype)
    return (ce * w).sum()


@torch.no_grad()
def teacher_forced_coverage(model: torch.nn.Module, records: Sequence[dict], rule: str, m: int,
                            vocab_map: torch.Tensor | None, pad_id: int, max_len: int,
                            batch_size: int = 8) -> list[list[bool]]:
    """Per record, per (fitted) response token: does `model`, reading the target's own prefix, cover it?
    The response is cut as `distill.batching.collate` cuts it (max_len), so the lists align with training."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[list[bool]] = []
    for start in range(0, len(records), batch_size):
        chunk = list(records[start:start + batch_size])
        batch = collate(chunk, pad_id, max_len).to(device)  # labels in target ids (no head mapping)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V_d]
        hit = covers(logits, batch.labels, rule, m, vocab_map)  # [B, T]
        out += split_by_record(hit.cpu(), batch.loss_mask.cpu())
    model.train(was_training)
    return [[bool(x) for x in row] for row in out]


def split_by_record(values: torch.Tensor, loss_mask: torch.Tensor) -> list[list]:
    """[B, T] values -> per row, the values at its loss positions, in order (= its fitted response tokens)."""
    return [row[keep].tolist() for row, keep in zip(values, loss_mask)]


def collate_weighted(records: Sequence[dict], pad_id: int, max_len: int,
                     target_to_draft: torch.Tensor | None = None) -> tuple[Batch, torch.Tensor]:
    """`distill.batching.collate` and its [B, T] weight tensor on the response positions, from each
    record's "weights" list (one float per fitted response token; missing = all 1). Positions that leave
    the loss (e.g. labels outside a reduced head) keep their weight, which the mask then zeroes."""
    batch = collate(list(records), pad_id, max_len, target_to_draft, with_weights=True)
    return batch, batch.weights

