"""Prompt rows for a reduced head over the target's features (EAGLE-3): the request's prompt tokens that the
drafter's head lacks, drafted with rows mapped from the target's own output head.

A reduced head only drafts its M tokens. On the real-size target an 8,192-token head misses 6.6% of HumanEval's
answer tokens and 13.6% of MT-bench's, and most of those are in the request's prompt (names, quoted words, the
earlier turns): with them the head would cover 98.5% and 92.4% (docs/results.md). The draft-model proposer extends its
head with the drafter's input embeddings (a tied head's own rows); an EAGLE-3 drafter has no rows for those tokens at
all, and its trained head is no longer the target's (cosine about 0.65 between a row and the target's after 300-900
steps, 1.6-1.7x its norm). So a prompt token's row is the target's row through the linear map that best turns the
target's rows of the M head tokens into the drafter's trained ones (ridge least squares, [D, D]), fitted once per
proposer.

Drafts only: verification decides, so output is unchanged whatever these rows score. A token's log-probability is
over the M + N tokens: the head's top-K log-probabilities (normalised over M) are moved by the mass the N rows add.
"""

from __future__ import annotations

import torch

__all__ = ["PromptRows", "fit_row_map"]

# relative to the mean diagonal of the target rows' Gram matrix: on the real-size target's 900-step drafter, rows held
# out of the fit are predicted at cosine 0.764 and 0.87 of their norm (0.763 / 0.88 at 1e-4, 0.768 / 0.81 at 0.1)
RIDGE = 1e-2


def fit_row_map(source: torch.Tensor, target: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """The [D, D] map A minimising |source A - target|^2 + r |A|^2 over rows (source, target [M, D]), r = ridge times
    the mean squared norm of source's columns (so the fit does not depend on the rows' scale)."""
    if source.shape != target.shape or source.dim() != 2:
        raise ValueError(f"fit_row_map: source and target must both be [M, D], got {tuple(source.shape)} and "
                         f"{tuple(target.shape)}")
    s, t = source.double(), target.double()
    gram = s.T @ s  # [D, D]
    gram = gram + ridge * gram.diagonal().mean() * torch.eye(s.shape[1], dtype=torch.float64)
    return torch.linalg.solve(gram, s.T @ t).float()  # [D, D]


class PromptRows:
    """Per request, rows for the prompt tokens a reduced head lacks; merges them into the head's top-K.

    head [M, D]: the drafter's trained head; vocab_map [M]: its target ids; target_head [V, D]: the target's
    output head; norm_weight [D], eps: the drafter's final RMS norm (the head reads norm(out))."""

    def __init__(self, head: torch.Tensor, vocab_map: torch.Tensor, target_head: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float):
        vocab_map = vocab_map.long().cpu()
        if head.shape[0] != vocab_map.numel() or head.shape[1] != target_head.shape[1]:
            raise ValueError(f"prompt rows: a head of {tuple(head.shape)} with {vocab_map.numel()} ids does not "
                             f"match the target's head of {tuple(target_head.shape)}")
        self.head = head.detach().float().cpu()  # [M, D]
        self.target_head = target_head.detach()  # [V, D], rows read per request
        self.map = fit_row_map(self.target_head[vocab_map].float().cpu(), self.head)  # [D, D]
        self.known = torch.zeros(target_head.shape[0], dtype=torch.bool)
        self.known[vocab_map] = True
        self.norm_weight, self.eps = norm_weight.detach().float().cpu(), float(eps)
        self.ids = torch.zeros(0, dtype=torch.long)  # [N] this request's extra target ids
        self.rows = torch.zeros(0, head.shape[1])  # [N, D]

    @property
    def active(self) -> bool:
        return self.ids.numel() > 0

    def begin(self, prompt_ids: list[int]) -> None:
        """This request's extra tokens: the prompt's ids the head lacks (within the target's vocabulary)."""
        ids = torch.tensor(sorted(set(prompt_ids)), dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.known.numel())]
        self.ids = ids[~self.known[ids]]  # [N]
        self.rows = self.target_head[self.ids].float().cpu() @ self.map  # [N, D]

    def normed(self, outs: torch.Tensor) -> torch.Tensor:
        """[n, D] drafter outputs -> what the head reads, RMS-normed [n, D] fp32."""
        x = outs.float().cpu()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight

    def logits(self, outs: torch.Tensor) -> torch.Tensor:
        """[n, D] -> the extra tokens' logits [n, N]."""
        return self.normed(outs) @ self.rows.T

    def merge_top(self, outs: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, tokens: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's top-k (values: log-probabilities over M [n, k], descending; indices: head rows [n, k];
        tokens: their target ids [n, k]) merged with the extra tokens': (log-probabilities over M + N [n, k],
        target ids [n, k]), descending. The head's normaliser comes from its best row's logit in fp32 (the head's
        own kernel may round otherwise: scores only)."""
        x = self.normed(outs)  # [n, D]
        values, indices, tokens = values.float().cpu(), indices.cpu(), tokens.cpu()
        best_logit = (self.head[indices[:, 0]] * x).sum(-1)  # [n]
        lse_head = best_logit - values[:, 0]  # [n]
        extra = x @ self.rows.T  # [n, N]
        lse = torch.logaddexp(lse_head, torch.logsumexp(extra, dim=-1))  # [n]
        head_values = values - (lse - lse_head)[:, None]  # [n, k]
        extra_top = (extra - lse[:, None]).topk(min(k, extra.shape[1]), dim=-1)
        merged = torch.cat([head_values, extra_top.values], dim=-1)  # [n, k + k']
        merged_tokens = torch.cat([tokens, self.ids[extra_top.indices]], dim=-1)
        best = merged.topk(min(k, merged.shape[1]), dim=-1)
        return best.values, merged_tokens.gather(1, best.indices)
