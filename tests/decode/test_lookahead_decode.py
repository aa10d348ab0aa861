"""[LA] lookahead decoding is lossless and drafts from the right rows: greedy output is the target's own,
[LA] rows change neither the verified logits nor the committed KV, sampling follows the target."""

import pytest
import torch

from specdistill.decode.adaptive import DraftLengthController
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers.lookahead import LookaheadProposer
from specdistill.decode.runner import ModelRunner
from specdistill.decode.tree import TokenTree
from specdistill.models.lookahead import LookaheadTokens
from tests.conftest import make_tiny_llama
from tests.decode.test_self_draft import chi2_pvalue, exact_marginals, sample_second_and_third, target_greedy

PROMPTS = ([1, 5, 7, 9, 11, 5, 7], [1, 3, 4], [1, 9, 9, 9, 12, 10])


def random_tokens(target, k=3, seed=0, noise=1.0) -> LookaheadTokens:
    return LookaheadTokens.from_target(target, k, seed=seed, noise=noise).eval()


def constant_target(vocab=16, token=5):
    """A target whose greedy output is `token` forever: every [LA] draft of it is accepted."""
    target = make_tiny_llama(seed=0, vocab_size=vocab)
    with torch.no_grad():
        target.lm_head.weight.zero_()
        target.lm_head.weight[token] = 1.0
        target.model.norm.weight.fill_(1.0)
    return target


@torch.no_grad()
def reference_drafts(target, tokens: LookaheadTokens, context: list[int]) -> list[int]:
    """PaSS by the book: one plain causal forward of context + [LA_1..LA_k]; the argmax at LA_j."""
    embeds = torch.cat([target.get_input_embeddings()(torch.tensor([context])), tokens()[None]], dim=1)
    logits = target(inputs_embeds=embeds).logits[0, len(context):]  # [K, V]
    return logits.argmax(-1).tolist()


class RecordingProposer(LookaheadProposer):
    """Remembers each tree's context, its drafts and the chain shift they were read with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shift, self.log = 0, []

    def nearest_owner(self, node):
        owner, self.shift = super().nearest_owner(node)
        return owner, self.shift

    def propose(self, seq, max_depth, sampling, generator):
        self.log.append((list(seq), list(self.drafts), self.shift))
        return super().propose(seq, max_depth, sampling, generator)


@pytest.mark.parametrize("chains,branches", [(1, 1), (2, 1), (4, 1), (2, 2), (3, 3)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_is_the_targets_output(chains, branches, adaptive):
    target = make_tiny_llama(seed=2, vocab_size=16, peak=3.0)  # peaked, small vocabulary: drafts often right
    proposer = LookaheadProposer(random_tokens(target), target, chains=chains, branches=branches)
    engine = SpeculativeEngine(target, proposer, adaptive=adaptive)
    accepted = 0
    for prompt in PROMPTS:
        gen = engine.generate(prompt, 30)
        assert gen.tokens == target_greedy(target, prompt, 30)
        accepted += gen.stats.accepted
    assert accepted > 0  # accepted drafts (and the chains under them) were exercised


@pytest.mark.parametrize("max_new", [1, 2, 7, 33])
def test_eos_and_max_new_tokens_cut_exactly(max_new):
    target = make_tiny_llama(seed=2, peak=3.0, vocab_size=16)  # EOS (2) comes up often
    engine = SpeculativeEngine(target, LookaheadProposer(random_tokens(target, k=4), target, chains=2),
                               eos_token_ids={2}, adaptive=False)
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_new).tokens == target_greedy(target, prompt, max_new, eos=2)


def test_every_draft_of_a_constant_target_is_accepted():
    target = constant_target()
    engine = SpeculativeEngine(target, LookaheadProposer(random_tokens(target, k=3), target, chains=4),
                               adaptive=False)
    gen = engine.generate(PROMPTS[0], 30)
    assert gen.tokens == target_greedy(target, PROMPTS[0], 30)
    assert gen.tokens[1:] == [5] * 29  # the first token comes from the prompt's state, then always 5
    assert gen.stats.alpha > 0.9 and gen.stats.target_forwards <= 10  # k drafts + the bonus per forward


@pytest.mark.parametrize("chains", [1, 4])
def test_drafts_are_the_la_outputs_after_the_last_accepted_token(chains):
    """Each tree (root = the bonus token) is drafted from [LA] rows placed right after the last accepted
    token, as a plain forward of context + [LA] would give; with a chain only under the root, from the
    root's rows shifted by how far the accepted path went below it."""
    target = make_tiny_llama(seed=2, vocab_size=16, peak=3.0)
    tokens = random_tokens(target, k=3)
    proposer = RecordingProposer(tokens, target, chains=chains)
    SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPTS[0], 24)
    assert len(proposer.log) >= 5
    shifted = 0
    for seq, drafts, shift in proposer.log:
        context = seq[:len(seq) - 1 - shift]  # up to the chain's owner (root excluded: it is the bonus)
        assert drafts == reference_drafts(target, tokens, context)[shift:]
        shifted += shift > 0
    assert (shifted > 0) == (chains == 1)  # chains under every node never need the shift


def test_short_chains_draft_what_a_full_chain_drafts_first():
    """The engine asks for chains one deeper than the step drafted; LA_j sees only LA_1..LA_j of its
    chain, so a chain of d rows drafts exactly the first d drafts of a full one, at d rows' cost."""
    target = make_tiny_llama(seed=2, vocab_size=16, peak=3.0)
    tokens = random_tokens(target, k=3)
    tree = TokenTree.chain(13, [7, 9])
    drafts = {}
    for depth in (1, 2, None):
        proposer = LookaheadProposer(tokens, target, chains=2)
        extra = proposer.verification_rows(tree, depth)
        assert extra.embeds.shape[0] == 2 * (depth or 3)  # chains x rows per chain
        with torch.no_grad():
            runner = ModelRunner(target)
            runner.start(64)
            runner.forward(PROMPTS[0])
            runner.cache.advance(len(PROMPTS[0]))
            hidden, _ = runner.forward(tree.tokens, tree.depths, tree.ancestor_mask(), extra=extra)
        proposer.observe_rows(target.lm_head(hidden[len(tree):]), 0)  # the root was the last accepted node
        drafts[depth] = proposer.drafts
    assert len(drafts[None]) == 3
    assert drafts[1] == drafts[None][:1] and drafts[2] == drafts[None][:2]


def test_la_rows_change_neither_verified_logits_nor_committed_kv():
    target = make_tiny_llama(seed=3)
    prompt, tree = [1, 5, 7, 9, 11], TokenTree.root(13)
    for token, parent in [(20, 0), (21, 0), (30, 1), (31, 2), (40, 3)]:  # two branches
        tree.add(token, parent, dedupe=False)
    proposer = LookaheadProposer(random_tokens(target, k=3), target, chains=6)
    results = []
    with torch.no_grad():
        for extra in (None, proposer.verification_rows(tree)):
            runner = ModelRunner(target)
            runner.start(64)
            runner.forward(prompt)
            runner.cache.advance(len(prompt))
            hidden, logits = runner.forward(tree.tokens, tree.depths, tree.ancestor_mask(),
                                            logits_rows=slice(0, len(tree)), extra=extra)
            runner.cache.commit_path([0, 2, 4])  # root, 21, 31
            results.append((logits, [layer.keys[:, :, :runner.cache.length].clone() for layer in runner.cache.layers],
                            hidden.shape[0]))
        plain = target(torch.tensor([prompt + [13, 21, 31]]), use_cache=True)
    (logits_a, kv_a, rows_a), (logits_b, kv_b, rows_b) = results
    assert rows_b == rows_a + 6 * 3  # an [LA] chain under every node was really fed
    torch.testing.assert_close(logits_b, logits_a, rtol=0, atol=1e-5)
    for layer, (a, b) in enumerate(zip(kv_a, kv_b)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        torch.testing.assert_close(b, plain.past_key_values.layers[layer].keys, rtol=0, atol=1e-5)


def test_bad_lookahead_inputs_are_refused():
    target = make_tiny_llama(seed=0)
    with pytest.raises(ValueError, match="hidden size"):
        LookaheadProposer(LookaheadTokens(3, 16), target)
    with pytest.raises(ValueError, match="chains"):
        LookaheadProposer(random_tokens(target), target, chains=0)
    with pytest.raises(ValueError, match="branches"):
        LookaheadProposer(random_tokens(target), target, branches=0)


def test_branches_put_the_first_rows_runners_up_beside_the_first_draft():
    """With branches b the tree holds the chain of top-1 drafts and, as siblings of the first draft, the
    first [LA] row's next b - 1 tokens in rank order; the chain's nodes come first, so they get the chains."""
    target = make_tiny_llama(seed=2, vocab_size=16, peak=3.0)
    proposer = LookaheadProposer(random_tokens(target, k=3), target, chains=2, branches=3)
    proposer.begin([1, 5, 7], 64)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))  # one chain's LA_1..LA_3
    proposer.owner_row, proposer.active, proposer.parents, proposer.depths = {0: 0}, 3, [-1], [0]
    proposer.observe_rows(logits, 0)
    tree = proposer.propose([1, 5, 7], 3, None, None)
    ranked = logits[0].argsort(descending=True).tolist()
    assert tree.tokens == [7] + logits.argmax(-1).tolist() + ranked[1:3]
    assert tree.parents == [-1, 0, 1, 2, 0, 0]
    assert proposer.propose([1, 5, 7], 0, None, None).tokens == [7]  # depth 0: no drafts, no siblings
    rows = proposer.verification_rows(tree, 1)
    assert rows.mask[:, :len(tree)].any(0).tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("branches", [1, 2])
def test_sampling_follows_the_targets_distribution(branches):
    vocab = 8
    target = make_tiny_llama(seed=4, vocab_size=vocab, hidden_size=16, layers=1, peak=6.0)
    engine = SpeculativeEngine(target, LookaheadProposer(random_tokens(target, k=2), target, chains=2,
                                                         branches=branches), adaptive=False)
    prompt = [1, 5, 7]
    second, third, accepted = sample_second_and_third(engine, prompt, 2000)
    p2, p3 = exact_marginals(target, prompt, vocab)
    assert accepted > 100  # the drafts were really used, not all rejected
    assert chi2_pvalue(second, p2) > 1e-3
    assert chi2_pvalue(third, p3) > 1e-3
    # the test has power: the same draws do not pass for the distribution at another temperature
    with torch.no_grad():
        sharper = torch.softmax(2.0 * torch.log(p3.float()), -1).double()
    assert chi2_pvalue(third, sharper) < 1e-3


class ScriptedController(DraftLengthController):
    """Decodes plainly but for a one-token probe every `every` steps; learns nothing (no timing)."""

    def __init__(self, every: int):
        super().__init__(max_depth=3)
        self.every, self.calls = every, 0

    def choose(self, limit: int) -> int:
        self.calls += 1
        return 1 if limit > 0 and self.calls % self.every == 0 else 0

    def observe(self, *args) -> None:
        pass


def test_a_controller_settled_at_plain_decoding_feeds_la_rows_only_before_its_probes():
    """Where the adaptive depth decodes plainly, a forward carries [LA] rows only when the next step will
    draft (a probe): the other forwards are plain ones, and the probes still draft from the rows."""
    target = make_tiny_llama(seed=2, vocab_size=16, peak=3.0)
    engine = SpeculativeEngine(target, LookaheadProposer(random_tokens(target), target, chains=2))
    engine.controllers[None] = engine.controller = ScriptedController(every=4)
    with_rows, drafted = [], []
    forward, greedy, propose = engine.target.forward, engine.target.forward_greedy, engine.proposer.propose

    def spy_forward(*args, extra=None, **kwargs):
        with_rows.append(extra is not None)
        return forward(*args, extra=extra, **kwargs)

    def spy_propose(seq, max_depth, *args):
        tree = propose(seq, max_depth, *args)
        drafted.append(tree.max_depth)
        return tree

    def spy_greedy(*args, **kwargs):
        with_rows.append(False)
        return greedy(*args, **kwargs)

    engine.target.forward, engine.target.forward_greedy = spy_forward, spy_greedy
    engine.proposer.propose = spy_propose
    gen = engine.generate(PROMPTS[0], 30)
    assert gen.tokens == target_greedy(target, PROMPTS[0], 30)
    # the prefill's chain, then rows only in the forward before each probe, and every probe drafted from them
    assert with_rows[0] and sum(with_rows[1:]) == len(drafted) >= 5 and drafted == [1] * len(drafted)
    assert len(with_rows) == gen.stats.target_forwards and sum(with_rows) <= 1 + len(with_rows) // 4
