"""Prompt lookup decoding (drafter kind `prompt_lookup`): n-gram matches in the sequence itself, and
the same lookup added as one more chain to another drafter's trees (spec `DIR+prompt_lookup`)."""

from __future__ import annotations

import torch

from decode.proposers.base import Proposer, register_proposer, register_wrapper
from decode.tree import TokenTree

__all__ = ["PromptLookupProposer", "WithPromptLookup", "LOOKUP_SOURCE", "lookup_continuation",
           "prompt_lookup_proposer"]


class PromptLookupProposer(Proposer):
    """N-gram lookup in the sequence itself (prompt lookup decoding): find the most recent earlier
    occurrence of the last n tokens (longest n first) and propose what followed it."""

    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens = self.max_depth = num_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seq, max_depth, sampling, generator):
        depth = min(self.num_tokens, max_depth)
        drafts = lookup_continuation(seq, depth, self.max_ngram, self.min_ngram) if depth > 0 else []
        return TokenTree.chain(seq[-1], drafts)


LOOKUP_SOURCE = 1 << 20  # the lookup chain's source index: after any member of an inner ensemble


class WithPromptLookup(Proposer):
    """Another proposer's tree plus a prompt-lookup chain from its root (drafter spec `DIR+prompt_lookup`).

    The two draft different things: a trained drafter guesses what the target writes, n-gram lookup
    finds what it copies (names, code, quoted text), and the lookup costs no model call, only the
    verification rows of its drafts. The chain merges into the tree with shared prefixes once, as
    source LOOKUP_SOURCE: greedy verification is lossless whatever the tree, and in sampling the
    lookup drafts are deterministic functions of the sequence (q one-hot, proposal None), tried after
    the inner proposer's drafts at each node, which the multi-draft rule (decode.proposers.ensemble)
    allows: a draft only has to be independent of the sampled values decided before it, and these
    depend on the context alone. Self-drafting proposers (Medusa) keep reading the target's hidden states
    through this wrapper; [LA] proposers add rows of their own to each forward and are refused."""

    name = "with_prompt_lookup"

    def __init__(self, inner: Proposer, lookup: PromptLookupProposer):
        if hasattr(inner, "verification_rows"):
            raise ValueError("+prompt_lookup cannot wrap a lookahead ([LA]) drafter: its rows follow the tree's nodes")
        self.inner, self.lookup = inner, lookup
        self.self_drafting = bool(getattr(inner, "self_drafting", False))
        self.feature_layers = getattr(inner, "feature_layers", None)  # EAGLE-3 reads these target layers
        self.max_depth = max(inner.max_depth, lookup.max_depth)

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.inner.begin(prompt_ids, capacity)

    def last_catch_up_s(self) -> float:
        return self.inner.last_catch_up_s()

    def observe_prefill(self, hidden: torch.Tensor) -> None:
        self.inner.observe_prefill(hidden)

    def observe_verification(self, hidden: torch.Tensor, verdict) -> None:
        self.inner.observe_verification(hidden, verdict)

    def propose(self, seq, max_depth, sampling, generator):
        tree = self.inner.propose(seq, min(max_depth, self.inner.max_depth), sampling, generator)
        chain = self.lookup.propose(seq, max_depth, sampling, generator)
        tree.add_chain(chain.tokens[1:], None, source=LOOKUP_SOURCE)  # shares the nodes the inner tree already has
        return tree


def lookup_continuation(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's last n tokens."""
    n_seq = len(seq)
    for n in range(min(max_ngram, n_seq - 1), min_ngram - 1, -1):
        pattern = seq[n_seq - n:]
        for start in range(n_seq - n - 1, -1, -1):  # latest match first, excluding the suffix itself
            if seq[start:start + n] == pattern:
                return seq[start + n:start + n + k]
    return []


def prompt_lookup_proposer(gamma: int, kw: dict) -> PromptLookupProposer:
    """Prompt lookup drafting up to 2 x gamma tokens unless kw sets num_tokens / max_ngram."""
    return PromptLookupProposer(num_tokens=kw.get("num_tokens", max(gamma, 1) * 2), max_ngram=kw.get("max_ngram", 3))


def build_prompt_lookup_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                                 **kw) -> PromptLookupProposer:
    return prompt_lookup_proposer(gamma, kw)


def add_prompt_lookup(inner: Proposer, drafter, target_model, gamma: int = 5,
                      eos_token_ids: set[int] = frozenset(), **kw) -> WithPromptLookup:
    """`inner` with a prompt-lookup chain added to its trees (a drafter whose `with_lookup` is set)."""
    return WithPromptLookup(inner, prompt_lookup_proposer(gamma, kw))


register_proposer("prompt_lookup", build_prompt_lookup_proposer)
register_wrapper("with_lookup", add_prompt_lookup)
