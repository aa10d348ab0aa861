"""Token trees: the unit of verification. A chain of drafts is a tree with one branch.

Node 0 is the root: the last emitted token, which the target has not processed yet. Every other
node is a drafted token whose parent is the context it was drafted after. The target verifies the
whole tree in one forward, each node attending to the committed prefix and to its own ancestors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

# min_prob, the path-probability floor of greedy EAGLE-3 and DFlash trees, tuned for EAGLE-3: 0.05 on the 2-core
# CPU, where rows past the first few cost 1.5 ms each (about 0.06 of a token's time at 40 tokens/s), measured
# against 0.03, 0.07 and 0.1 (docs/journal.md, "A probability floor for EAGLE-3 trees"); off on CUDA, where it could
# save nothing: the fixed-shape step drafts every depth anyway, and 48 rows verify for about one forward (not
# measured there).
DEFAULT_MIN_PROB = {"cpu": 0.05, "cuda": 0.0}


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    # Who proposed each node: (source, q) pairs, one per proposer (drafter) that drafted this
    # token here, where q is the [V] distribution over the target's vocabulary it was sampled
    # from, or None for a deterministic proposal (greedy drafts, n-gram lookup). Several sources
    # share a node when their drafts coincide; sampling verification tries them in source order.
    proposals: list[list[tuple[int, torch.Tensor | None]]] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls(tokens=[token], parents=[-1], proposals=[[]], depths=[0])

    @classmethod
    def chain(cls, root: int, drafts: list[int], probs: list[torch.Tensor | None] | None = None) -> "TokenTree":
        tree = cls.root(root)
        parent = 0
        for i, token in enumerate(drafts):
            parent = tree.add(token, parent, probs[i] if probs else None, dedupe=False)
        return tree

    def add_chain(self, drafts: list[int], probs: list[torch.Tensor | None] | None = None,
                  source: int = 0) -> list[int]:
        """Merge one proposer's chain under the root, sharing prefixes with what is there; return
        the chain's nodes, one per draft."""
        nodes, parent = [], 0
        for i, token in enumerate(drafts):
            parent = self.add(token, parent, probs[i] if probs else None, source=source)
            nodes.append(parent)
        return nodes

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, probs: torch.Tensor | None = None, dedupe: bool = True,
            source: int = 0) -> int:
        """Append `token` under `parent` as proposed by `source`; with `dedupe`, an identical child
        is shared (the proposal is recorded on it) instead of duplicated."""
        if dedupe:
            for child in self.children(parent):
                if self.tokens[child] == token:
                    self.proposals[child].append((source, probs))
                    return child
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.proposals.append([(source, probs)])
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.parents)) if self.parents[i] == node]

    def path_to(self, node: int) -> list[int]:
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        if self.is_chain():
            return torch.ones(n, n, dtype=torch.bool, device=device).tril()
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # parents precede children, so the parent's row is complete
            mask[i] |= mask[self.parents[i]]
        return mask.to(device)


def attention_bias(
    prefix_len: int, ancestors: torch.Tensor, total_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """The 4D additive mask for a tree forward: [1, 1, N, total_len].

    Each node sees the committed prefix [0, prefix_len) and its own ancestors written at
    [prefix_len, prefix_len + N); everything else (other branches, stale entries past the tree
    when the cache has static shapes) gets the dtype's most negative value.
    """
    n = ancestors.shape[0]
    bias = torch.full((n, total_len), torch.finfo(dtype).min, dtype=dtype, device=ancestors.device)
    bias[:, :prefix_len] = 0
    bias[:, prefix_len : prefix_len + n].masked_fill_(ancestors, 0)
    return bias[None, None]


def select_tree(root: int, tokens: list[int], parents: list[int], scores: list[float], depths: list[int],
                tree_nodes: int, min_score: float = float("-inf"),
                step_seconds: Callable[[int], float] | None = None) -> TokenTree:
    """The `tree_nodes` most probable candidates whose log path probability is at least `min_score` (ties:
    shallower first; -inf never), parents before children. A child is never more probable than its parent,
    so the set is closed under ancestors, and so is every prefix of it in that order. With `step_seconds`
    (n -> seconds of the step with a tree of n nodes, root included), the prefix that maximises the expected
    tokens a second (`priced_size`)."""
    order = np.lexsort((np.asarray(depths), -np.asarray(scores, dtype=np.float64)))
    kept, chosen = [], set()  # by descending score, and as a set
    for i in order.tolist():
        if len(kept) >= tree_nodes or scores[i] == float("-inf") or scores[i] < min_score:  # sorted: none after
            break
        if parents[i] < 0 or parents[i] in chosen:
            kept.append(i)
            chosen.add(i)
    if step_seconds is not None:
        kept = kept[:priced_size([math.exp(scores[i]) for i in kept], step_seconds)]
        chosen = set(kept)
    tree, node_of = TokenTree.root(root), {-1: 0}
    for i in sorted(chosen, key=lambda i: (depths[i], -scores[i])):
        node_of[i] = tree.add(tokens[i], node_of[parents[i]], None, dedupe=False)
    return tree


def priced_size(probs: list[float], step_seconds: Callable[[int], float]) -> int:
    """How many of the nodes (in this order; each one's parent before it) a tree keeps: the k in [0, len(probs)]
    that maximises (1 + probs[0] + ... + probs[k - 1]) / step_seconds(k + 1), the step's expected tokens a second.
    A node's path probability under a trained drafter is the chance the target accepts it (the drafter is
    calibrated: module docstring), and a greedy step emits one token more than it accepts, so the numerator is
    the step's expected tokens; step_seconds prices the drafting done and the verification of k nodes and the
    root. Ties: the smaller tree."""
    best, best_rate, expected = 0, 1.0 / step_seconds(1), 1.0
    for k, p in enumerate(probs, start=1):
        expected += p
        rate = expected / step_seconds(k + 1)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
