"""Distillation losses as pure functions: masked, token-normalized, on full logits or a stored top-k.

Alignment: position t of `draft_logits` and of the target (logits, top-k or `labels`) describe the same
next token; these functions never shift. Shapes use any leading dims; the docs say [B, T, ...].

Target distribution p, draft distribution q (both after `temperature`), per masked position:

    ce   -log q(label)                                  Seq-KD on the target's own tokens
    fkl  KL(p || q) = sum p (log p - log q)             mode-covering
    rkl  KL(q || p) = sum q (log q - log p)             mode-seeking
    jsd  generalized JSD of GKD, rescaled (see `jsd`)   beta=0 -> fkl, beta=1 -> rkl
    tvd  0.5 * sum |p - q|                              in [0, 1]; 1 - tvd is the greedy-free acceptance rate

Top-k targets (`TopK`): the target is known only on K token ids, so both distributions are collapsed to a
K+1 categorical (the K ids, then one tail bucket with the remaining mass) and every divergence runs on
that. When the draft equals the target the loss is exactly zero; with K = V it equals the full version;
for K < V it is a lower bound of the full divergence (collapsing outcomes never increases an f-divergence).

Reduction and gradient accumulation: `reduction="mean"` (default) divides the masked sum by this call's
masked token count. Over an accumulation window of micro-batches of different lengths, the right loss is
the sum over the window divided by the window's token count, not the mean of per-batch means. Either
  * count first: `n = sum(count_tokens(m) for m in window_masks)` (all-reduced across processes), then
    `loss = distill_loss(..., normalizer=n)` per micro-batch and backward each: gradients add up to the
    gradient of the window mean; or
  * `reduction="sum"` per micro-batch and `token_normalized([(sum, count), ...])` at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "LOSS_KINDS", "TopK", "distill_loss", "cross_entropy_loss", "forward_kl", "reverse_kl", "jsd",
    "total_variation", "count_tokens", "token_normalized",
]

LOSS_KINDS = ("ce", "fkl", "rkl", "jsd", "tvd")
# A tail bucket lighter than this is fp32 rounding of a sum over the vocabulary (K close to V), not mass:
# treat it as empty, so that tempering cannot inflate rounding noise into a visible outcome.
TAIL_EPS = 1e-6
Reduction = Literal["mean", "sum", "none"]


@dataclass
class TopK:
    """The target's distribution stored as its K most likely ids per position (distinct ids per position)."""
    ids: torch.Tensor       # [B, T, K] long
    logprobs: torch.Tensor  # [B, T, K] full-vocabulary log-softmax at temperature 1 of those ids

    def __post_init__(self):
        if self.ids.shape != self.logprobs.shape:
            raise ValueError(f"TopK ids {tuple(self.ids.shape)} and logprobs {tuple(self.logprobs.shape)} differ")


TargetDist = torch.Tensor | TopK   # full target logits [B, T, V] or its stored top-k


# ---- entry point --------------------------------------------------------------------------------

def distill_loss(kind: str, draft_logits: torch.Tensor, target: TargetDist | None = None,
                 labels: torch.Tensor | None = None, mask: torch.Tensor | None = None, beta: float = 0.5,
                 temperature: float = 1.0, reduction: Reduction = "mean",
                 normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """One loss by name. `kind` in LOSS_KINDS; "ce" needs `labels`, the others `target` (logits or TopK)."""
    if kind == "ce":
        if labels is None:
            raise ValueError("distill_loss kind 'ce' needs labels (the target's tokens)")
        if temperature != 1.0:
            raise ValueError(f"distill_loss kind 'ce' trains on hard labels; temperature={temperature} must be 1.0")
        return cross_entropy_loss(draft_logits, labels, mask, reduction=reduction, normalizer=normalizer)
    if kind not in LOSS_KINDS:
        raise ValueError(f"unknown distillation loss kind {kind!r}; choose one of {LOSS_KINDS}")
    if target is None:
        raise ValueError(f"distill_loss kind {kind!r} needs target (full logits or TopK)")
    common = dict(temperature=temperature, reduction=reduction, normalizer=normalizer)
    if kind == "jsd":
        return jsd(draft_logits, target, mask, beta=beta, **common)
    fn = {"fkl": forward_kl, "rkl": reverse_kl, "tvd": total_variation}[kind]
    return fn(draft_logits, target, mask, **common)


# ---- the losses -----------------------------------------------------------------------------------

def cross_entropy_loss(draft_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None,
                       reduction: Reduction = "mean", normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """-log q(label) at masked positions. Labels at unmasked positions may be anything (e.g. -100)."""
    draft_logp = F.log_softmax(draft_logits.float(), dim=-1)          # [B, T, V]
    safe_labels = labels.clamp(0, draft_logp.shape[-1] - 1)            # masked labels may be -100
    per_token = -draft_logp.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return reduce_tokens(per_token, mask, reduction, normalizer)


def forward_kl(draft_logits: torch.Tensor, target: TargetDist, mask: torch.Tensor | None = None,
               temperature: float = 1.0, reduction: Reduction = "mean",
               normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """KL(p_target || q_draft)."""
    draft_logp, target_logp = paired_log_probs(draft_logits, target, temperature)
    return reduce_tokens(kl_per_token(target_logp, draft_logp), mask, reduction, normalizer)


def reverse_kl(draft_logits: torch.Tensor, target: TargetDist, mask: torch.Tensor | None = None,
               temperature: float = 1.0, reduction: Reduction = "mean",
               normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """KL(q_draft || p_target)."""
    draft_logp, target_logp = paired_log_probs(draft_logits, target, temperature)
    return reduce_tokens(kl_per_token(draft_logp, target_logp), mask, reduction, normalizer)


def jsd(draft_logits: torch.Tensor, target: TargetDist, mask: torch.Tensor | None = None, beta: float = 0.5,
        temperature: float = 1.0, reduction: Reduction = "mean",
        normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), rescaled to be continuous in beta.

    With M = beta * p + (1 - beta) * q, GKD (and TRL's `generalized_jsd_loss`) define
        JSD_beta = beta * KL(p || M) + (1 - beta) * KL(q || M),
    which tends to 0 at both ends; TRL then special-cases beta=0 as KL(p||q) and beta=1 as KL(q||p), a jump.
    Here the loss is JSD_beta / (beta * (1 - beta)) for 0 < beta < 1, whose limits are exactly
    KL(p || q) as beta -> 0 and KL(q || p) as beta -> 1, and those are returned at the endpoints. So
    jsd(beta=0) == forward_kl, jsd(beta=1) == reverse_kl, and small beta is close to forward KL; at
    beta = 0.5 the value is 4x the classic JSD. Multiply by beta * (1 - beta) to get GKD's/TRL's value.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    draft_logp, target_logp = paired_log_probs(draft_logits, target, temperature)
    if beta == 0.0:
        per_token = kl_per_token(target_logp, draft_logp)
    elif beta == 1.0:
        per_token = kl_per_token(draft_logp, target_logp)
    else:
        # log M computed in log space: M = beta * p + (1 - beta) * q. Outcomes with no mass on either side
        # (-inf on both, e.g. an empty tail or an id outside a reduced head) would give logaddexp a NaN
        # gradient; a floor of -1e4 is still exactly 0 probability in fp32, with finite gradients.
        mix_logp = torch.logaddexp(target_logp.clamp(min=-1e4) + math.log(beta),
                                   draft_logp.clamp(min=-1e4) + math.log1p(-beta))
        gkd = beta * kl_per_token(target_logp, mix_logp) + (1 - beta) * kl_per_token(draft_logp, mix_logp)
        per_token = gkd / (beta * (1 - beta))
    return reduce_tokens(per_token, mask, reduction, normalizer)


def total_variation(draft_logits: torch.Tensor, target: TargetDist, mask: torch.Tensor | None = None,
                    temperature: float = 1.0, reduction: Reduction = "mean",
                    normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """0.5 * sum |p - q|, in [0, 1]. One minus it is the speculative-sampling acceptance probability."""
    draft_logp, target_logp = paired_log_probs(draft_logits, target, temperature)
    per_token = 0.5 * (target_logp.exp() - draft_logp.exp()).abs().sum(-1)   # [B, T]
    return reduce_tokens(per_token.clamp(max=1.0), mask, reduction, normalizer)


# ---- reductions -----------------------------------------------------------------------------------

def count_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Number of positions that count in a loss (a 0-dim tensor, so it can be all-reduced)."""
    return mask.to(torch.float32).sum()


def token_normalized(losses_and_counts: Iterable[tuple[torch.Tensor, torch.Tensor | float]]) -> torch.Tensor:
    """Window mean from per-micro-batch (reduction="sum" loss, count_tokens(mask)) pairs."""
    pairs = list(losses_and_counts)
    if not pairs:
        raise ValueError("token_normalized needs at least one (loss_sum, n_tokens) pair")
    total = sum(loss for loss, _ in pairs)
    count = sum(float(n) for _, n in pairs)
    return total / max(count, 1.0)


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor | None, reduction: Reduction,
                  normalizer: float | torch.Tensor | None) -> torch.Tensor:
    """Zero out unmasked positions, then mean / sum / none; `normalizer` replaces the mean's denominator."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"unknown reduction {reduction!r}; choose 'mean', 'sum' or 'none'")
    if mask is None:
        mask = torch.ones_like(per_token, dtype=torch.bool)
    if mask.shape != per_token.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the loss positions {tuple(per_token.shape)}")
    # where, not multiply: a non-finite value at a masked position must not leak into the sum
    masked = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))   # [B, T]
    if reduction == "none":
        return masked
    total = masked.sum()
    if normalizer is not None:
        return total / normalizer
    if reduction == "sum":
        return total
    return total / count_tokens(mask).clamp(min=1.0)


# ---- distributions --------------------------------------------------------------------------------

def kl_per_token(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position over the last dim; terms with p = 0 are 0 (and carry no NaN gradient)."""
    floor = torch.finfo(p_logp.dtype).min
    # clamping -inf log-probs (an empty tail bucket) to a finite floor keeps 0 * log 0 = 0 and its gradient 0
    p_logp, q_logp = p_logp.clamp(min=floor), q_logp.clamp(min=floor)
    return (p_logp.exp() * (p_logp - q_logp)).sum(-1)                  # [B, T]


def paired_log_probs(draft_logits: torch.Tensor, target: TargetDist,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft log-probs, target log-probs) over the same outcomes: the vocabulary [B, T, V] for full
    target logits, or the K+1 collapsed categorical [B, T, K+1] for a TopK target. Computed in fp32."""
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")
    if isinstance(target, TopK):
        draft_logp = F.log_softmax(draft_logits.float(), dim=-1)        # [B, T, V]
        draft_cat = draft_topk_and_tail(draft_logp, target.ids.long())   # [B, T, K+1]
        target_cat = collapse_to_topk(target.logprobs.float())           # [B, T, K+1]
        target_cat = bound_empty_target_tail(target_cat, draft_cat)
        return temper(draft_cat, temperature), temper(target_cat, temperature)
    if target.shape != draft_logits.shape:
        raise ValueError(f"target logits {tuple(target.shape)} and draft logits {tuple(draft_logits.shape)} "
                         "differ; map both to one vocabulary first")
    draft_logp = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    target_logp = F.log_softmax(target.detach().float() / temperature, dim=-1)
    return draft_logp, target_logp


def collapse_to_topk(topk_logp: torch.Tensor) -> torch.Tensor:
    """Append the tail bucket log(1 - sum_k p_k) to K log-probs: [..., K] -> [..., K+1]."""
    covered = torch.logsumexp(topk_logp, dim=-1, keepdim=True)           # [B, T, 1], <= 0 up to rounding
    return torch.cat([topk_logp, log1mexp(covered)], dim=-1)


def draft_topk_and_tail(draft_logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] draft log-probs -> [B, T, K+1]: the K target ids, then the exact log-mass of every other id.

    The draft's full distribution is at hand, so its tail is summed over the ids outside the top-k (in log
    space) rather than taken as 1 - sum: a confident draft keeps a tiny but finite tail, where 1 - sum would
    round to an empty bucket and give the divergence an infinite (floored to 3e38) term wherever the
    target's tail has mass. The tail is -inf only when the draft truly puts nothing there (K = V)."""
    picked = draft_logp.gather(-1, ids)                                                   # [B, T, K]
    tail = draft_logp.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)       # [B, T, 1]
    return torch.cat([picked, tail], dim=-1)


def bound_empty_target_tail(target_cat: torch.Tensor, draft_cat: torch.Tensor) -> torch.Tensor:
    """A stored top-k that covers more than 1 - TAIL_EPS has an empty tail bucket (its true mass is below
    TAIL_EPS but unknown). Where the draft has tail mass, give the target the largest tail it can have,
    TAIL_EPS: the tail term stays finite (it is then an estimate, off by at most what TAIL_EPS of mass can
    contribute) instead of the floored 3e38 that would swamp every other token of the batch. With K = V the
    draft's tail is empty as well and nothing changes (the collapsed divergence is still the exact full one)."""
    empty = torch.isneginf(target_cat[..., -1:]) & torch.isfinite(draft_cat[..., -1:])
    bounded = torch.where(empty, torch.full_like(target_cat[..., -1:], math.log(TAIL_EPS)), target_cat[..., -1:])
    return torch.cat([target_cat[..., :-1], bounded], dim=-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0; -inf where 1 - exp(x) < TAIL_EPS, with finite gradients everywhere."""
    has_tail = x < math.log1p(-TAIL_EPS)
    safe = torch.where(has_tail, x, torch.full_like(x, -1.0))          # keep log(0)'s infinite grad out
    # two branches for accuracy (Maechler 2012): expm1 near 0, log1p far from it
    value = torch.where(safe > -math.log(2), torch.log(-torch.expm1(safe)), torch.log1p(-torch.exp(safe)))
    return torch.where(has_tail, value, torch.full_like(x, -math.inf))


def temper(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """Soften a categorical given as log-probs: softmax(log p / T). For the K+1 collapsed categorical this
    tempers the tail as one outcome (exact for K = V, an approximation otherwise, the same on both sides)."""
    if temperature == 1.0:
        return logp
    floor = torch.finfo(logp.dtype).min
    return F.log_softmax(logp.clamp(min=floor) / temperature, dim=-1)
