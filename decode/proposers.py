"""Proposers draft candidate continuations as a token tree rooted at the last emitted token.

A proposer never decides what is emitted; the target's verification does. A proposer that is
always wrong costs time, never correctness.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

import models.medusa  # noqa: F401  (registers the drafter kind "medusa" with models.drafters)
import models.lookahead  # noqa: F401  (registers the drafter kind "lookahead")
import models.eagle3  # noqa: F401  (registers the drafter kind "eagle3")
from decode.runner import ModelRunner, synchronized_clock
from decode.sampling import SamplingConfig, logits_to_probs, sample
from decode.tree import TokenTree
from models.packed_linear import packing_supported


Alternate = tuple[int, int, float]  # (depth in the chain, target token id, log path probability)
CATCH_UP_SPLIT = 8  # a draft model fed more tokens than this at once is resuming after steps without drafting


class Proposer(ABC):
    name: str = "proposer"
    max_depth: int = 1  # the deepest tree it drafts; the engine may ask for less

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        """A new request starts; `capacity` bounds the sequence length it will reach."""

    def last_catch_up_s(self) -> float:
        """Seconds of the last propose() spent catching up on tokens emitted while it did not draft."""
        return 0.0

    @abstractmethod
    def propose(
        self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> TokenTree:
        """Draft after `seq` (prompt + emitted tokens); the tree's root is seq[-1]."""


class DraftModelProposer(Proposer):
    """A small causal LM that drafts a chain of `gamma` tokens autoregressively.

    Its cache holds `cached` = the tokens it has processed. After verification the sequence is the
    old one plus the accepted drafts plus the bonus token, so the cache is valid up to the longest
    common prefix with the new sequence: roll back to it (a length move) and feed the rest.

    After steps without drafting (the adaptive depth chose plain decoding) the rest is long: every
    token emitted meanwhile. Feeding it is a one-off cost of resuming, not a cost of the depth being
    drafted, so beyond CATCH_UP_SPLIT tokens it runs as its own forward, timed (`last_catch_up_s`),
    and the engine leaves it out of what the adaptive depth learns drafting costs. Charged to the
    probe that resumes, it made a 4-layer drafter's one-token probe cost a third of a target forward
    after 64 idle steps, and kept a drafter that pays when drafting steadily from ever starting.
    """

    name = "draft_model"

    def __init__(self, model: torch.nn.Module, gamma: int = 5, vocab_map: torch.Tensor | None = None,
                 eos_token_ids: set[int] = frozenset(), target_vocab: int | None = None,
                 prompt_vocab: bool = False):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if prompt_vocab and vocab_map is None:
            raise ValueError("prompt_vocab extends a reduced draft head; this drafter has the full vocabulary")
        self.runner = ModelRunner(model)
        self.gamma = self.max_depth = gamma
        self.base_map = None if vocab_map is None else vocab_map.to(self.runner.device)
        self.vocab_map = self.base_map  # [M (+ N)] this request's head index -> target id
        self.eos_token_ids = set(eos_token_ids)
        # a reduced head's probabilities are scattered into the target's vocabulary for sampling
        self.target_vocab = target_vocab or (None if vocab_map is None else int(vocab_map.max()) + 1)
        self.prompt_vocab = prompt_vocab
        self.extra_rows: torch.Tensor | None = None  # [N, D] head rows of this request's prompt-only tokens
        self.cached: list[int] = []
        self.catch_up_s = 0.0  # of the last draft_chain

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.runner.start(capacity + self.gamma + 1)
        self.cached = []
        if self.prompt_vocab:
            self.extend_head_by_prompt(prompt_ids)

    def extend_head_by_prompt(self, prompt_ids: list[int]) -> None:
        """Make this request's prompt tokens draftable: the reduced head gets, for this request only, a
        row for every prompt token it lacks (answers copy names and objects from their question: 90% of
        the GSM8K answer tokens an 8k head lacks are in the prompt). A row is the drafter's input
        embedding of the token, which is the head row itself in a tied-embedding model (every SmolLM2
        truncated drafter), so such a token scores as the drafter's own untrained full head would.
        Lossless like any draft: verification decides."""
        known = set(self.base_map.tolist())
        extra = sorted({t for t in prompt_ids if t not in known})
        if not extra:
            self.vocab_map, self.extra_rows = self.base_map, None
            return
        ids = torch.tensor(extra, dtype=torch.long, device=self.runner.device)  # [N]
        embed = self.runner.model.get_input_embeddings().weight  # [V, D]
        self.extra_rows = embed.detach()[ids].float()  # [N, D]
        self.vocab_map = torch.cat([self.base_map, ids])  # [M + N]

    def propose(self, seq, max_depth, sampling, generator):
        drafts, probs, _ = self.draft_chain(seq, max_depth, sampling, generator)
        return TokenTree.chain(seq[-1], drafts, probs)

    def draft_chain(self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator,
                    alternates: int = 0) -> tuple[list[int], list[torch.Tensor | None], list[Alternate]]:
        """(drafts, q per draft, alternates): the chain after `seq`, and in greedy mode, at every
        depth d of the chain, the next `alternates` most likely tokens after the chain's own there,
        as (d, target id, log path probability: the chain's log q up to d plus the alternate's),
        best first within a depth. They cost no extra forward (the chain computed those logits), and
        a tree builder ranks them by path probability to spend its node budget where this drafter
        itself expects acceptance (as EAGLE-2 does). Sampling drafts no alternates: a deterministic
        top-k is not a draw from q, which the multi-draft rule needs."""
        depth = min(self.gamma, max_depth)
        self.catch_up_s = 0.0
        if depth <= 0:
            return [], [], []
        keep = min(common_prefix_len(self.cached, seq), len(seq) - 1)
        self.runner.cache.truncate(keep)
        behind = seq[keep:]
        if len(behind) > CATCH_UP_SPLIT:
            self.catch_up_s = self._catch_up(behind[:-1])
            behind = behind[-1:]
        logits = self._feed(behind)
        branching = alternates > 0 and sampling.greedy
        drafts, probs, others, path_logq = [], [], [], 0.0
        for i in range(depth):
            token, q = self._choose(logits, sampling, generator)
            if branching:
                path_logq = self._add_alternates(others, i, logits, alternates, path_logq)
            drafts.append(token)
            probs.append(q)
            if i == depth - 1 or token in self.eos_token_ids:
                break
            logits = self._feed([token])
        self.cached = seq + drafts[:-1]
        return drafts, probs, others

    def _add_alternates(self, out: list[Alternate], depth: int, logits: torch.Tensor, n: int,
                        path_logq: float) -> float:
        """Append the 2nd..(n+1)-th most likely tokens of [V_draft] `logits` at `depth`, scored by
        path_logq + their log q; return the path's log q through the chain's own (top-1) token."""
        logq = torch.log_softmax(logits.float(), dim=-1)  # [V_draft]
        top = logq.topk(min(n + 1, logq.shape[-1]))  # the chain's argmax first (ties: topk's order)
        ids = top.indices if self.vocab_map is None else self.vocab_map[top.indices]
        for token, lq in zip(ids[1:].tolist(), top.values[1:].tolist()):
            out.append((depth, int(token), path_logq + lq))
        return path_logq + float(top.values[0])

    def last_catch_up_s(self) -> float:
        return self.catch_up_s

    def _catch_up(self, tokens: list[int]) -> float:
        """Feed `tokens` into the cache without computing logits; the seconds it took."""
        start = synchronized_clock(self.runner.device)
        self.runner.forward(tokens, logits_rows=slice(0, 0))
        self.runner.cache.advance(len(tokens))
        return synchronized_clock(self.runner.device) - start

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        hidden, logits = self.runner.forward(tokens, logits_rows=slice(-1, None))
        self.runner.cache.advance(len(tokens))
        if self.extra_rows is None:
            return logits[0]  # [V_draft]
        extra = self.extra_rows @ hidden[-1].float()  # [N]
        return torch.cat([logits[0], extra])  # [V_draft + N]

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[int, torch.Tensor | None]:
        if sampling.greedy:
            idx = int(logits.argmax())
            return (idx if self.vocab_map is None else int(self.vocab_map[idx])), None
        q = logits_to_probs(logits.cpu(), sampling)  # [V_draft]
        if self.vocab_map is not None:
            q = q.new_zeros(self.target_vocab).scatter_(0, self.vocab_map.cpu(), q)  # [V]
        return sample(q, generator), q


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
    the inner proposer's drafts at each node, which the multi-draft rule (decode.ensemble) allows: a
    draft only has to be independent of the sampled values decided before it, and these depend on
    the context alone. Self-drafting proposers (Medusa) keep reading the target's hidden states
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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def build_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(), **kw) -> Proposer:
    """The proposer for a loaded drafter (models.drafters.Drafter), checked against the target;
    with the drafter's `with_lookup` (spec `...+prompt_lookup`), its trees gain a prompt-lookup chain."""
    proposer = drafter_proposer(drafter, target_model, gamma, eos_token_ids, **kw)
    if getattr(drafter, "with_lookup", False):
        return WithPromptLookup(proposer, prompt_lookup_proposer(gamma, kw))
    return proposer


def prompt_lookup_proposer(gamma: int, kw: dict) -> PromptLookupProposer:
    """Prompt lookup drafting up to 2 x gamma tokens unless kw sets num_tokens / max_ngram."""
    return PromptLookupProposer(num_tokens=kw.get("num_tokens", max(gamma, 1) * 2), max_ngram=kw.get("max_ngram", 3))


def drafter_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(), **kw) -> Proposer:
    if drafter.kind == "prompt_lookup":
        return prompt_lookup_proposer(gamma, kw)
    if drafter.kind == "draft_model":
        check_vocab(drafter.model, target_model, drafter.vocab_map)
        use_gemv_friendly_head(drafter.model)
        prompt_vocab = kw.get("prompt_vocab")
        if prompt_vocab is None:  # default: what the drafter's manifest asks for
            prompt_vocab = bool((drafter.manifest.get("extra") or {}).get("prompt_vocab", False))
        return DraftModelProposer(drafter.model, gamma, drafter.vocab_map, eos_token_ids,
                                  target_vocab=vocab_size(target_model),
                                  prompt_vocab=prompt_vocab and drafter.vocab_map is not None)
    if drafter.kind == "ensemble":
        from decode.ensemble import build_ensemble_proposer  # ensemble builds on this module

        for member in drafter.members:
            use_gemv_friendly_head(member.model)
        return build_ensemble_proposer(drafter.members, target_model, gamma, eos_token_ids,
                                       drafter.manifest.get("max_tree_nodes", 16),
                                       drafter.manifest.get("branches", 1))
    if drafter.kind == "medusa":
        from decode.self_draft import MedusaProposer  # self_draft builds on this module

        check_medusa_vocab(drafter.model, target_model)
        return MedusaProposer(drafter.model, tree=(drafter.manifest.get("extra") or {}).get("tree"),
                              vocab_map=drafter.vocab_map, embed=target_model.get_input_embeddings())
    if drafter.kind == "lookahead":
        from decode.lookahead import LookaheadProposer, decoding_options  # lookahead builds on this module

        return LookaheadProposer(drafter.model, target_model, **decoding_options(drafter.manifest))
    if drafter.kind == "eagle3":
        from decode.eagle3 import Eagle3Proposer  # eagle3 builds on this module

        options = (drafter.manifest.get("extra") or {}).get("decoding") or {}
        return Eagle3Proposer(drafter.model, target_model.get_input_embeddings(),
                              depth=kw.get("eagle3_depth") or options.get("depth"),
                              topk=kw.get("eagle3_topk") or options.get("topk"),
                              tree_nodes=kw.get("eagle3_tree_nodes") or options.get("tree_nodes"),
                              eos_token_ids=eos_token_ids)
    raise ValueError(f"no proposer for drafter kind {drafter.kind!r} "
                     "(known: draft_model, prompt_lookup, ensemble, medusa, lookahead, eagle3)")


def check_medusa_vocab(heads, target_model) -> None:
    v_heads, v_target = heads.config["vocab_size"], vocab_size(target_model)
    if v_heads != v_target:
        raise ValueError(f"Medusa heads predict {v_heads} tokens but the target's vocabulary has {v_target}")


def use_gemv_friendly_head(model: torch.nn.Module) -> None:
    """Store a CPU drafter's [V, D] head column-major (same values, transposed memory layout).

    A drafter runs its head on one row at a time; the CPU BLAS here computes x @ W.T about twice as
    fast when W.T is contiguous (measured: 4.4 ms against 8.6 ms for the 49k x 576 head), and the
    head is most of a small drafter's step. Not needed where fp32 weights are packed for oneDNN
    (models.packed_linear), which is faster still. Only for inference-time drafters: a model being trained
    keeps its layout (optimizers and DDP hold views of it)."""
    head = model.get_output_embeddings()
    if head is None or head.weight.device.type != "cpu" or head.weight.dim() != 2:
        return
    if packing_supported(model):  # the runner reads a packed copy; the layout of this one does not matter
        return
    with torch.no_grad():
        head.weight.data = head.weight.data.t().contiguous().t()


def vocab_size(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().weight.shape[0]


def check_vocab(draft_model, target_model, vocab_map: torch.Tensor | None) -> None:
    """A drafter must speak the target's vocabulary: same head size, or a map into it."""
    v_target, v_draft = vocab_size(target_model), vocab_size(draft_model)
    if vocab_map is None and v_draft != v_target:
        raise ValueError(f"drafter vocabulary ({v_draft} tokens) does not match the target's ({v_target}); "
                         "train the drafter on this target or give a vocab_map")
    if vocab_map is not None:
        if vocab_map.numel() != v_draft:
            raise ValueError(f"vocab_map has {vocab_map.numel()} entries but the drafter head has {v_draft}")
        if int(vocab_map.max()) >= v_target or int(vocab_map.min()) < 0:
            raise ValueError(f"vocab_map points outside the target's vocabulary of {v_target} tokens")
