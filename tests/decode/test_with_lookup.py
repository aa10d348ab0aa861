"""A prompt-lookup chain added to another drafter's trees (`DIR+prompt_lookup`): the merged tree's
shape, greedy losslessness for Medusa and draft-model drafters, and the target's distribution kept
when a sampled drafter and the deterministic lookup propose at the same nodes."""

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import (
    LOOKUP_SOURCE,
    DraftModelProposer,
    PromptLookupProposer,
    Proposer,
    WithPromptLookup,
    build_proposer,
)
from specdistill.decode.proposers.medusa import MedusaProposer
from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.tree import TokenTree
from specdistill.models.drafters import load_drafter
from specdistill.models.medusa import MedusaHeads
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import target_greedy
from tests.decode.test_sampling import chi2_pvalue, exact_marginals
from tests.models.conftest import make_tiny_target

REPEATING = [1, 5, 7, 9, 11, 5, 7, 9, 3, 5, 7]  # "5 7" recurs: the lookup proposes 9 3 5 7 ...


class FixedChain(Proposer):
    max_depth = 2

    def propose(self, seq, max_depth, sampling, generator):
        return TokenTree.chain(seq[-1], [9, 8][:max_depth])


def test_lookup_chain_merges_into_the_inner_tree_with_shared_prefixes_once():
    tree = WithPromptLookup(FixedChain(), PromptLookupProposer(4), lookup_first=0).propose(REPEATING, 4,
                                                                                         SamplingConfig(), None)
    # inner: 7 -> 9 -> 8; lookup after "5 7": 9 3 5 7, sharing the 9
    assert tree.tokens == [7, 9, 8, 3, 5, 7]
    assert tree.parents == [-1, 0, 1, 1, 3, 4]
    assert [s for s, _ in tree.proposals[1]] == [0, LOOKUP_SOURCE]  # one node, both sources, inner first
    assert [s for s, _ in tree.proposals[3]] == [LOOKUP_SOURCE]
    shallow = WithPromptLookup(FixedChain(), PromptLookupProposer(4), lookup_first=0).propose(REPEATING, 1,
                                                                                            SamplingConfig(), None)
    assert shallow.max_depth == 1  # the engine's depth binds both


class CountingChain(FixedChain):
    calls = 0

    def propose(self, seq, max_depth, sampling, generator):
        self.calls += 1
        return super().propose(seq, max_depth, sampling, generator)


def test_a_long_match_is_drafted_alone_and_a_short_one_beside_the_inner_tree():
    inner = CountingChain()
    wrapped = WithPromptLookup(inner, PromptLookupProposer(4, max_ngram=3), lookup_first=2, weak_chain=1)
    alone = wrapped.propose(REPEATING, 4, SamplingConfig(), None)  # "5 7" recurs: a 2-gram match
    assert (alone.tokens, inner.calls) == ([7, 9, 3, 5, 7], 0)  # the lookup chain only; the inner drafted nothing
    no_match = [1, 4, 6, 4, 2, 8]  # the last token, 8, never occurred before
    assert wrapped.propose(no_match, 4, SamplingConfig(), None).tokens == [8, 9, 8]  # no match: the inner tree alone
    short = [1, 4, 6, 2, 4]  # the last token 4 occurred once, followed by 6 2 4: a 1-gram match
    tree = wrapped.propose(short, 4, SamplingConfig(), None)
    assert tree.tokens == [4, 9, 8, 6]  # the inner tree plus the lookup's first weak_chain=1 draft
    assert inner.calls == 2
    with pytest.raises(ValueError, match="lookup_first"):
        WithPromptLookup(inner, PromptLookupProposer(4), lookup_first=-1)


class CatchingUp(CountingChain):
    """An inner proposer whose every step reports 5 s of catching up."""

    def last_catch_up_s(self) -> float:
        return 5.0


def test_a_step_the_lookup_drafts_alone_reports_no_catch_up_of_the_inner_proposers():
    """The engine takes last_catch_up_s off the step's drafting time: a stale figure of the inner proposer's last
    step would make a lookup step's drafting cost negative (it did, stop 49)."""
    wrapped = WithPromptLookup(CatchingUp(), PromptLookupProposer(4, max_ngram=3), lookup_first=2)
    wrapped.propose([1, 4, 6, 4, 2, 8], 4, SamplingConfig(), None)  # no match: the inner drafts
    assert wrapped.last_catch_up_s() == 5.0
    wrapped.propose(REPEATING, 4, SamplingConfig(), None)  # a 2-gram match: the lookup alone
    assert wrapped.last_catch_up_s() == 0.0


def random_medusa(target, **kind):
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1, **kind)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    return MedusaProposer(heads.eval(), [[0], [1], [0, 0], [0, 0, 0]], embed=target.get_input_embeddings())


@pytest.mark.parametrize("inner", ["sequential", "prefix", "draft_model"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_lookup_is_the_targets_output(tiny_target, inner, adaptive):
    if inner == "draft_model":
        proposer = DraftModelProposer(make_tiny_llama(seed=1, layers=1), gamma=3)
    else:
        proposer = random_medusa(tiny_target, sequential=True, prefix_layer=inner == "prefix")
    wrapped = WithPromptLookup(proposer, PromptLookupProposer(6))
    looked_up = []
    original = wrapped.propose

    def recording(seq, max_depth, sampling, generator):
        tree = original(seq, max_depth, sampling, generator)
        looked_up.append(sum(any(s == LOOKUP_SOURCE for s, _ in p) for p in tree.proposals))
        return tree

    wrapped.propose = recording
    gen = SpeculativeEngine(tiny_target, wrapped, adaptive=adaptive).generate(REPEATING, 60)
    assert gen.tokens == target_greedy(tiny_target, REPEATING, 60)
    assert sum(looked_up) > 0  # the lookup chain was really in the trees


@pytest.mark.parametrize("lookup_first", [0, 2])
def test_sampled_drafts_and_lookup_drafts_keep_the_target_distribution(lookup_first):
    """A drafter sampling from its q and the lookup's one-hot drafts share nodes; the multi-draft rule
    tries the drafter's first. The 2nd and 3rd emitted tokens must follow the target's sampling."""
    vocab, prompt, n = 8, [1, 3, 1, 3, 1], 1500
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0)
    drafter = make_tiny_llama(vocab_size=vocab, seed=7, layers=1, peak=3.0)
    cfg = SamplingConfig(temperature=0.9, top_k=6)
    exp2, exp3 = exact_marginals(target, prompt, cfg, vocab)
    engine = SpeculativeEngine(target, WithPromptLookup(DraftModelProposer(drafter, gamma=2), PromptLookupProposer(3),
                                                        lookup_first=lookup_first))
    outs = [engine.generate(prompt, 3, SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=s)).tokens
            for s in range(n)]
    assert chi2_pvalue([o[1] for o in outs], exp2) > 1e-3
    assert chi2_pvalue([o[2] for o in outs], exp3) > 1e-3


def test_spec_suffix_adds_the_lookup_and_bad_specs_are_named():
    target = make_tiny_target(seed=0)
    drafter = load_drafter("truncated:1+prompt_lookup", target)
    assert drafter.kind == "draft_model" and drafter.with_lookup
    assert isinstance(build_proposer(drafter, target.model), WithPromptLookup)
    assert not isinstance(build_proposer(load_drafter("truncated:1", target), target.model), WithPromptLookup)
    for bad in ("prompt_lookup+prompt_lookup", "+prompt_lookup", "truncated:1+prompt_lookup+prompt_lookup"):
        with pytest.raises(ValueError, match=r"\+prompt_lookup"):
            load_drafter(bad, target)


def test_the_adaptive_depth_learns_lookup_steps_and_inner_steps_apart(tiny_target):
    """Long-match steps (the lookup chain alone, no drafting cost) and inner-tree steps get a controller each."""
    inner = DraftModelProposer(make_tiny_llama(seed=1, layers=1), gamma=3)
    wrapped = WithPromptLookup(inner, PromptLookupProposer(6), lookup_first=2)
    engine = SpeculativeEngine(tiny_target, wrapped, adaptive=True)
    assert engine.generate(REPEATING, 60).tokens == target_greedy(tiny_target, REPEATING, 60)
    names = set(engine.controllers) - {None}  # None: the default, unused with regimes
    assert "inner" in names and "lookup2" in names and names <= {"inner", "lookup2", "lookup3"}
    lookup, tree = engine.controllers["lookup2"], engine.controllers["inner"]
    assert lookup.max_depth == 6 and tree.max_depth == 6  # the inner regime: max(gamma 3, the weak chain's 6)
    assert lookup.verify_cost and tree.verify_cost  # both regimes drafted and were measured
    assert wrapped.regime(REPEATING) == ("lookup2", 6)  # "5 7" recurs, "3 5 7" does not
    one = WithPromptLookup(inner, PromptLookupProposer(6, by_length=False), lookup_first=2)
    assert one.regime(REPEATING) == ("lookup", 6)  # every long match's steps in one regime
    union = WithPromptLookup(inner, PromptLookupProposer(6), lookup_first=0)
    assert union.regime(REPEATING) == (None, union.max_depth)
