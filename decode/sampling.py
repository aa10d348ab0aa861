"""Sampling settings, logits -> probabilities, and the lossless acceptance rules.

Verification walks the token tree from the root. At a node the target gives its distribution p;
the node's children are the drafts proposed for the next token.

Greedy: accept the child whose token is argmax p; stop when none is; the bonus token is argmax p
at the last accepted node. The output is the target's own greedy output, token for token.

Sampling (Leviathan et al. 2023; Chen et al. 2023; for several children SpecInfer's multi-step
speculative sampling): try the children in order; a child x drawn from q is accepted with
probability min(1, p(x) / q(x)); on rejection the target's distribution becomes the residual
norm(max(p - q, 0)) and the next child is tried against it. If every child is rejected the bonus
token is drawn from the last residual. Each step leaves the emitted token distributed exactly as p,
so the output distribution is the target's. A deterministic proposal is q = one-hot(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.decode.tree import TokenTree


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after temperature, top-k and top-p (fp32)."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= cfg.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes from the root (node 0) down
    bonus: int  # the token the target emits after the accepted path


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """target_logits: [N, V], row i = the target's next-token logits after node i's branch."""
    return verify_greedy_tokens(tree, target_logits.argmax(-1).tolist())


def verify_greedy_tokens(tree: TokenTree, best: list[int]) -> Verdict:
    """best [N]: the target's most probable next token after node i's branch (the argmax of its logits)."""
    node = 0
    path = [0]
    while True:
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == best[node]), None)
        if nxt is None:
            return Verdict(path, best[node])
        node = nxt
        path.append(node)


def verify_sampling(
    tree: TokenTree, target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> Verdict:
    """Lossless multi-draft speculative sampling over the tree (see module docstring)."""
    probs = logits_to_probs(target_logits, cfg).cpu()  # [N, V]; sampling runs on the CPU generator
    node, path = 0, [0]
    while True:
        p = probs[node]
        accepted = None
        for _, child, q in proposals_in_source_order(tree, node):
            p, ok = try_accept(p, tree.tokens[child], q, generator)
            if ok:
                accepted = child
                break
        if accepted is None:
            return Verdict(path, sample(p, generator))
        node = accepted
        path.append(node)


def proposals_in_source_order(tree: TokenTree, node: int) -> list[tuple[int, int, torch.Tensor | None]]:
    """(source, child, q) of every draft under `node`, ordered by source (then insertion). The order
    must not depend on the sampled tokens themselves, or the rejection chain would be biased."""
    found = [(source, child, q) for child in tree.children(node) for source, q in tree.proposals[child]]
    return sorted(found, key=lambda item: item[0])


def try_accept(
    p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, bool]:
    """One draft against the current target distribution p [V]: (distribution to go on with, accepted)."""
    q_x = 1.0 if q is None else float(q[token])
    p_x = float(p[token])
    u = float(torch.rand((), generator=generator))
    if q_x > 0 and u * q_x < p_x:  # u < p(x) / q(x), without dividing
        return p, True
    return residual(p, token, q), False


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(p - q, 0)); q None means one-hot at `token`."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min_(0.0)
    total = r.sum()
    if total <= 0:  # p <= q everywhere can only happen when p == q; then any draft is accepted
        return p
    return r / total
