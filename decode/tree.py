"""Token trees: the unit of verification. A chain of drafts is a tree with one branch.

Node 0 is the root: the last emitted token, which the target has not processed yet. Every other
node is a drafted token whose parent is the context it was drafted after. The target verifies the
whole tree in one forward, each node attending to the committed prefix and to its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
