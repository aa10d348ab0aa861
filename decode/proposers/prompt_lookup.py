"""Prompt lookup decoding (drafter kind `prompt_lookup`): n-gram matches in the sequence itself, and
the same lookup added as one more chain to another drafter's trees (spec `DIR+prompt_lookup`)."""

from __future__ import annotations

import torch

from specdistill.decode.proposers.base import Proposer, manifest_decoding, register_proposer, register_wrapper
from specdistill.decode.tree import TokenTree

__all__ = ["PromptLookupProposer", "WithPromptLookup", "LOOKUP_SOURCE", "lookup_continuation",
           "prompt_lookup_proposer"]


class PromptLookupProposer(Proposer):
    """N-gram lookup in the sequence itself (prompt lookup decoding): find the most recent earlier
    occurrence of the last n tokens (longest n first) and propose what followed it.

    `by_length`: each length n of the matched n-gram is a drafting regime of its own ("ngram1" .. "ngramN",
    `regime`), so the engine's adaptive depth is chosen per length: on the targets' greedy answers a 3-gram's
    10-token chain is accepted 4.4-5.4 tokens deep on average, a 2-gram's 1.1-2.1 and a 1-gram's 0.5-0.8
    (docs/design/adaptive-depth.md), and one depth for all drafts the 1-gram's rows for little where a verified row
    is dear, or cuts the 3-gram's chain short. A step without a match ("ngram0") drafts nothing. False: one regime
    for every step (as before 2026-12-07)."""

    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1, by_length: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens = self.max_depth = num_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.by_length = by_length
        self.last_match: tuple = (None, (0, []))

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.last_match = (None, (0, []))

    def regime(self, seq: list[int]) -> tuple[str | None, int]:
        """("ngramN", deepest draft) for a match of N tokens (by_length), ("ngram0", 0) for none; one unnamed
        regime otherwise."""
        if not self.by_length:
            return None, self.max_depth
        n, drafts = self.full_match(seq)
        return f"ngram{n}", self.max_depth if drafts else 0

    def propose(self, seq, max_depth, sampling, generator):
        return TokenTree.chain(seq[-1], self.full_match(seq)[1][:max_depth])

    def match(self, seq: list[int], max_depth: int) -> tuple[int, list[int]]:
        """(n, drafts): the matched n-gram's length (0: none) and up to min(num_tokens, max_depth) drafts."""
        depth = min(self.num_tokens, max_depth)
        return lookup_match(seq, depth, self.max_ngram, self.min_ngram) if depth > 0 else (0, [])

    def full_match(self, seq: list[int]) -> tuple[int, list[int]]:
        """match() at full depth, computed once per step (regime() and propose() both ask; within a request seq
        only grows, so its length names the step)."""
        key = (id(seq), len(seq), seq[-1])
        if self.last_match[0] != key:
            self.last_match = (key, self.match(seq, self.num_tokens))
        return self.last_match[1]


LOOKUP_SOURCE = 1 << 20  # the lookup chain's source index: after any member of an inner ensemble


class WithPromptLookup(Proposer):
    """Another proposer's tree plus a prompt-lookup chain from its root (drafter spec `DIR+prompt_lookup`).

    The two draft different things: a trained drafter guesses what the target writes, n-gram lookup
    finds what it copies (names, code, quoted text), and the lookup costs no model call, only the
    verification rows of its drafts. How much a lookup chain is worth depends on the length n of the
    n-gram it matched: on the target's greedy answers (MT-bench and held-out Arena-Hard first turns,
    docs/journal.md "Prompt lookup first") a 3-gram match's 10-token chain was accepted 4.5-5.8 tokens deep
    on average, a 2-gram's 1.6-2.7, a 1-gram's 0.6-1.1, where the EAGLE-3 tree's whole step gets about
    0.65 for half a target forward of drafting. So a match of at least `lookup_first` tokens is drafted
    alone: the inner proposer skips the step (a draft model or EAGLE-3 feeds the skipped positions with
    its next step's context rows, in one forward). A shorter match adds at most `weak_chain` tokens to
    the inner tree (its rows cost verification time for little; all of the chain by default).
    `lookup_first=0` never drafts the chain alone. The chain merges into the tree with shared prefixes once, as
    source LOOKUP_SOURCE: greedy verification is lossless whatever the tree, and in sampling the
    lookup drafts are deterministic functions of the sequence (q one-hot, proposal None), tried after
    the inner proposer's drafts at each node, which the multi-draft rule (decode.proposers.ensemble)
    allows: a draft only has to be independent of the sampled values decided before it, and these
    depend on the context alone. Self-drafting proposers (Medusa) keep reading the target's hidden states
    through this wrapper; [LA] proposers add rows of their own to each forward and are refused."""

    name = "with_prompt_lookup"

    def __init__(self, inner: Proposer, lookup: PromptLookupProposer, lookup_first: int = 2,
                 weak_chain: int | None = None):
        if inner.adds_rows:
            raise ValueError("+prompt_lookup cannot wrap a lookahead ([LA]) drafter: its rows follow the tree's nodes")
        if lookup_first < 0 or (weak_chain is not None and weak_chain < 0):
            raise ValueError(f"lookup_first and weak_chain must be >= 0, got {lookup_first}, {weak_chain}")
        self.inner, self.lookup = inner, lookup
        self.name = f"{inner.name}+prompt_lookup"  # as the drafter spec names the composition (reports, errors)
        self.lookup_first = lookup_first
        self.weak_chain = lookup.num_tokens if weak_chain is None else weak_chain
        self.self_drafting = inner.self_drafting
        self.feature_layers = inner.feature_layers  # EAGLE-3 reads these target layers
        self.max_depth = max(inner.max_depth, lookup.max_depth)
        self.verify_seconds = None  # the engine's price of verification (price_verification)
        self.inner_drafted = False  # whether the last propose() called the inner proposer

    def weight_format(self) -> str | None:
        return self.inner.weight_format()  # the lookup has no weights

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.lookup.begin(prompt_ids, capacity)
        self.inner.begin(prompt_ids, capacity)

    def last_catch_up_s(self) -> float:
        # the inner proposer's catch-up belongs to this step only if it drafted in it (else it is a stale figure
        # of an earlier step, which the engine would take off this step's drafting time)
        return self.inner.last_catch_up_s() if self.inner_drafted else 0.0

    def price_verification(self, seconds) -> None:
        self.verify_seconds = seconds

    def observe_prefill(self, hidden: torch.Tensor) -> None:
        self.inner.observe_prefill(hidden)

    def observe_verification(self, hidden: torch.Tensor, verdict) -> None:
        self.inner.observe_verification(hidden, verdict)

    def regime(self, seq: list[int]) -> tuple[str | None, int]:
        """(name, deepest draft) of this step's drafting, for the engine's adaptive depth: "lookup" (the
        chain alone; "lookupN" for a match of N tokens where the lookup's by_length is set) or "inner" (the inner
        tree and a weak chain); one regime when lookup_first is 0."""
        if not self.lookup_first:
            return None, self.max_depth
        found = self.lookup.full_match(seq)
        if self.drafts_alone(found):
            return f"lookup{found[0]}" if self.lookup.by_length else "lookup", self.lookup.max_depth
        return "inner", max(self.inner.max_depth, min(self.weak_chain, self.lookup.max_depth))

    def drafts_alone(self, match: tuple[int, list[int]]) -> bool:
        return bool(self.lookup_first and match[0] >= self.lookup_first and match[1])

    def propose(self, seq, max_depth, sampling, generator):
        found = self.lookup.full_match(seq)
        drafts = found[1][:max_depth]
        self.inner_drafted = not self.drafts_alone(found)
        if not self.inner_drafted:  # the inner proposer drafts nothing this step
            tree = TokenTree.root(seq[-1])
            tree.add_chain(drafts, None, source=LOOKUP_SOURCE)
            return tree
        chain = drafts[:self.weak_chain]
        price, extra = self.verify_seconds, len(chain)  # the inner tree is priced with the chain's rows beside it
        self.inner.price_verification(None if price is None else (lambda n: price(n + extra)))
        tree = self.inner.propose(seq, min(max_depth, self.inner.max_depth), sampling, generator)
        tree.add_chain(chain, None, source=LOOKUP_SOURCE)  # shares the inner tree's nodes
        return tree


def lookup_continuation(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's last n tokens."""
    return lookup_match(seq, k, max_ngram, min_ngram)[1]


def lookup_match(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """(n, up to k tokens that followed the latest earlier occurrence of seq's last n tokens), the longest
    n in [min_ngram, max_ngram] that occurs; (0, []) when none does."""
    n_seq = len(seq)
    for n in range(min(max_ngram, n_seq - 1), min_ngram - 1, -1):
        pattern = seq[n_seq - n:]
        for start in range(n_seq - n - 1, -1, -1):  # latest match first, excluding the suffix itself
            if seq[start:start + n] == pattern:
                return n, seq[start + n:start + n + k]
    return 0, []


def prompt_lookup_proposer(gamma: int, kw: dict, drafter=None) -> PromptLookupProposer:
    """Prompt lookup drafting up to 2 x gamma tokens unless kw sets num_tokens / max_ngram; a depth per matched
    length (PromptLookupProposer.by_length) unless kw's lookup_by_length, else the drafter manifest's
    extra.decoding.lookup_by_length, is false."""
    by_length = kw.get("lookup_by_length")
    if by_length is None:
        by_length = manifest_decoding(drafter).get("lookup_by_length", True)
    if not isinstance(by_length, bool):
        raise ValueError(f"lookup_by_length: must be true or false, got {by_length!r}")
    return PromptLookupProposer(num_tokens=kw.get("num_tokens", max(gamma, 1) * 2), max_ngram=kw.get("max_ngram", 3),
                                by_length=by_length)


def build_prompt_lookup_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                                 **kw) -> PromptLookupProposer:
    return prompt_lookup_proposer(gamma, kw, drafter)


def add_prompt_lookup(inner: Proposer, drafter, target_model, gamma: int = 5,
                      eos_token_ids: set[int] = frozenset(), **kw) -> WithPromptLookup:
    """`inner` with a prompt-lookup chain added to its trees (a drafter whose `with_lookup` is set);
    kw lookup_first / lookup_weak_chain set WithPromptLookup's lookup_first / weak_chain, lookup_by_length (or the
    drafter manifest's) whether the chain's steps take a depth per matched length."""
    return WithPromptLookup(inner, prompt_lookup_proposer(gamma, kw, drafter), lookup_first=kw.get("lookup_first", 2),
                            weak_chain=kw.get("lookup_weak_chain"))


register_proposer("prompt_lookup", build_prompt_lookup_proposer)
register_wrapper("with_lookup", add_prompt_lookup)
