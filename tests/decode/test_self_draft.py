"""Medusa decoding is lossless: greedy output is the target's own, sampled output follows its distribution."""

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers.medusa import (
    MedusaProposer,
    check_tree,
    choose_tree,
    expected_accept_length,
    tree_from_ranks,
)
from specdistill.decode.sampling import SamplingConfig
from specdistill.models.medusa import MedusaHeads
from tests.conftest import make_tiny_llama
from tests.decode.test_sampling import chi2_pvalue

PROMPT = [1, 5, 7, 9, 11, 5, 7]
BRANCHY = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [2, 0], [0, 1, 0]]


def target_greedy(model, prompt, n, eos=None):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_heads(target, k=3, seed=0, scale=0.5, sequential=False, prefix=False):
    heads = MedusaHeads.from_target(target, num_heads=k, num_layers=1, sequential=sequential, prefix_layer=prefix)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return heads.eval()


class RecordingProposer(MedusaProposer):
    """Checks the offsets: remembers, for each tree, the hidden state its proposals came from and the
    sequence it was drafted after."""

    def __init__(self, heads, tree, vocab_map=None):
        super().__init__(heads, tree, vocab_map)
        self.last_state, self.drafted_from, self.proposed = None, [], []

    def head_choices(self, hidden):
        self.last_state = hidden.clone()
        return super().head_choices(hidden)

    def propose(self, seq, max_depth, sampling, generator):
        self.drafted_from.append((list(seq), self.last_state))
        tree = super().propose(seq, max_depth, sampling, generator)
        self.proposed += tree.tokens[1:]
        return tree


def medusa_proposer(target, heads, tree=None, vocab_map=None):
    return MedusaProposer(heads, tree, vocab_map=vocab_map, embed=target.get_input_embeddings())


KINDS = {"medusa": {}, "sequential": {"sequential": True}, "prefix": {"sequential": True, "prefix": True}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [None, BRANCHY], ids=["chain", "branchy"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_is_the_targets_output(tiny_target, tree, adaptive, kind):
    ref = target_greedy(tiny_target, PROMPT, 60)
    proposer = medusa_proposer(tiny_target, random_heads(tiny_target, **KINDS[kind]), tree)
    gen = SpeculativeEngine(tiny_target, proposer, adaptive=adaptive).generate(PROMPT, 60)
    assert gen.tokens == ref


def test_prefix_layer_reads_every_accepted_position_once_in_order(tiny_target):
    """Before each proposal, the heads' s_0 is the prefix layer's output at the last processed position
    of one causal pass over the target's states for the whole sequence so far (prompt and accepted
    tokens; the root, the last emitted token, is not processed yet)."""
    heads = random_heads(tiny_target, sequential=True, prefix=True)
    seen = []

    class Recording(MedusaProposer):
        def propose(self, seq, max_depth, sampling, generator):
            seen.append((list(seq), self.hidden.clone()))
            return super().propose(seq, max_depth, sampling, generator)

    proposer = Recording(heads, BRANCHY, embed=tiny_target.get_input_embeddings())
    SpeculativeEngine(tiny_target, proposer, adaptive=False).generate(PROMPT, 30)
    assert len(seen) > 3
    with torch.no_grad():
        for seq, state in seen:
            out = tiny_target(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True)
            expected = heads.source(out.hidden_states[-1])[0, -1]  # [D]
            torch.testing.assert_close(state, expected, rtol=1e-4, atol=1e-4)


def test_sequential_tree_nodes_are_each_heads_choices_given_the_path_above(tiny_target):
    """A node at rank path (r_1, ..., r_d) is head d's r_d-th choice, head d reading the state head d-1
    computed for the node's parent and the parent's token (the root: the last emitted token)."""
    heads = random_heads(tiny_target, sequential=True)
    proposer = medusa_proposer(tiny_target, heads, BRANCHY)
    hidden = torch.randn(tiny_target.config.hidden_size)
    proposer.observe_prefill(hidden[None])  # [1, D]: a one-token prompt's states
    tree = proposer.propose(PROMPT, 3, SamplingConfig(), None)
    embed = tiny_target.get_input_embeddings()
    with torch.no_grad():
        for i, path in enumerate(check_tree(BRANCHY, 3)):
            state, token = hidden, PROMPT[-1]
            for depth, rank in enumerate(path):
                head = heads.heads[depth]
                state = head.state(state, embed(torch.tensor(token)))
                token = int(head.proj(state).topk(rank + 1).indices[rank])
            assert tree.tokens[i + 1] == token, path
    assert proposer.propose(PROMPT, 1, SamplingConfig(), None).max_depth == 1


def test_sequential_heads_need_the_targets_embedding(tiny_target):
    with pytest.raises(ValueError, match="embedding"):
        MedusaProposer(random_heads(tiny_target, sequential=True), BRANCHY)


@pytest.mark.parametrize("max_new", [1, 2, 7, 33])
def test_eos_and_max_new_tokens_cut_exactly(max_new):
    target = make_tiny_llama(seed=2, peak=3.0, vocab_size=16)  # small vocabulary: EOS (2) comes up often
    heads = MedusaHeads.from_target(target, num_heads=4)  # identity heads: often right at depth 1
    for prompt in ([1, 3, 4], [1, 9, 9, 9], [1, 5, 7, 11, 13]):
        ref = target_greedy(target, prompt, max_new, eos=2)
        gen = SpeculativeEngine(target, MedusaProposer(heads, BRANCHY[:7]), eos_token_ids={2},
                                adaptive=False).generate(prompt, max_new)
        assert gen.tokens == ref


def test_a_perfect_head_is_accepted_at_the_right_offset():
    """Heads that copy the target's head predict token t+1 from h_t: that is the bonus (root), never the
    root's child, so a tree of their proposals is accepted only where the sequence repeats a token.
    Shifting by one is what head 1 must learn; here we plant it: a target whose greedy path repeats
    one token forever accepts every identity-head draft."""
    target = make_tiny_llama(seed=0, vocab_size=16)
    with torch.no_grad():  # a target that always emits token 5: logits = bias-free head on a constant
        target.lm_head.weight.zero_()
        target.lm_head.weight[5] = 1.0
        target.model.norm.weight.fill_(1.0)
    heads = MedusaHeads.from_target(target, num_heads=3)
    gen = SpeculativeEngine(target, MedusaProposer(heads), adaptive=False).generate(PROMPT, 30)
    assert gen.tokens == target_greedy(target, PROMPT, 30)
    assert gen.stats.alpha > 0.8  # (nearly) every draft accepted: each step emits 3 drafts + the bonus


def test_proposals_come_from_the_last_accepted_node(tiny_target):
    """Each tree (root = the last emitted token, the bonus) is drafted from the target's hidden state of
    the token before the root: the state the bonus was predicted from. No extra target forward."""
    proposer = RecordingProposer(random_heads(tiny_target), BRANCHY)
    gen = SpeculativeEngine(tiny_target, proposer, adaptive=False).generate(PROMPT, 20)
    with torch.no_grad():
        out = tiny_target(input_ids=torch.tensor([PROMPT + gen.tokens]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0]  # [T, D]
    # a tree per verification (not the last: 1 token left)
    assert len(proposer.drafted_from) >= gen.stats.target_forwards - 2
    for seq, state in proposer.drafted_from:
        torch.testing.assert_close(state, hidden[len(seq) - 2], rtol=1e-4, atol=1e-4)


def test_candidate_vocabulary_keeps_greedy_lossless_and_proposals_inside_it(tiny_target):
    vocab_map = torch.arange(0, tiny_target.config.vocab_size, 3)  # every third token may be proposed
    proposer = RecordingProposer(random_heads(tiny_target), BRANCHY, vocab_map=vocab_map)
    gen = SpeculativeEngine(tiny_target, proposer, adaptive=False).generate(PROMPT, 40)
    assert gen.tokens == target_greedy(tiny_target, PROMPT, 40)
    allowed = set(vocab_map.tolist())
    assert proposer.proposed and all(t in allowed for t in proposer.proposed)


def test_candidate_vocabulary_ranks_as_the_full_head_does_on_its_rows(tiny_target):
    """Restricting the projection to vocab_map's rows gives the full head's ranking of those tokens."""
    heads = random_heads(tiny_target)
    vocab_map = torch.tensor([3, 4, 8, 15, 16, 23, 42])
    hidden = torch.randn(tiny_target.config.hidden_size)
    restricted = MedusaProposer(heads, BRANCHY, vocab_map=vocab_map).head_choices(hidden)  # [K, ranks]
    with torch.no_grad():
        full = heads(hidden)[:, vocab_map]  # [K, M]
    expected = vocab_map[full.topk(restricted.shape[1], dim=-1).indices]
    assert torch.equal(restricted, expected)


def test_tree_from_ranks_places_head_choices_by_depth():
    topk = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])  # [K, ranks]
    tree = tree_from_ranks(99, check_tree(BRANCHY, 3), topk, max_depth=3)
    assert tree.tokens[0] == 99
    tokens = {tuple(p): tree.tokens[i + 1] for i, p in enumerate(check_tree(BRANCHY, 3))}
    assert tokens[(0,)] == 10 and tokens[(2,)] == 12 and tokens[(1, 0)] == 20 and tokens[(0, 0, 1)] == 31
    for i, path in enumerate(check_tree(BRANCHY, 3)):
        assert tree.depths[i + 1] == len(path)
    assert tree_from_ranks(99, BRANCHY, topk, max_depth=1).max_depth == 1


def test_choose_tree_maximises_expected_length():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.05]]
    tree = choose_tree(acc, 6)
    check_tree(tree, 3)  # a valid tree
    assert tree[:2] == [[0], [0, 0]]  # 0.6, then 0.24
    # no other valid 6-node tree does better: brute force over candidate nodes
    import itertools
    nodes = [list(p) for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    best = 0.0
    for combo in itertools.combinations(range(len(nodes)), 6):
        paths = [nodes[i] for i in combo]
        try:
            check_tree(paths, 3)
        except ValueError:
            continue
        best = max(best, expected_accept_length(paths, acc))
    assert expected_accept_length(tree, acc) == pytest.approx(best)


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent"):
        check_tree([[0, 0]], 3)
    with pytest.raises(ValueError, match="depth"):
        check_tree([[0], [0, 0], [0, 0, 0]], 2)


def sample_second_and_third(engine, prompt, draws: int):
    """The 2nd and 3rd tokens of `draws` seeded 3-token generations at temperature 1, and the drafts
    accepted over all of them."""
    second, third, accepted = [], [], 0
    for seed in range(draws):
        gen = engine.generate(prompt, 3, SamplingConfig(temperature=1.0, seed=seed))
        second.append(gen.tokens[1])
        third.append(gen.tokens[2])
        accepted += gen.stats.accepted
    return second, third, accepted


def exact_marginals(target, prompt, vocab):
    """The target's exact distributions of the 2nd and 3rd sampled tokens (temperature 1)."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [V]
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        p2_given = torch.softmax(target(seqs).logits[:, -1].double(), -1)  # [V, V]
        pairs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3_given = torch.softmax(target(pairs).logits[:, -1].double(), -1).view(vocab, vocab, vocab)
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return p2, p3


@pytest.mark.parametrize("sequential", [False, True], ids=["medusa", "sequential"])
def test_sampling_follows_the_targets_distribution(sequential):
    vocab = 12
    target = make_tiny_llama(seed=4, vocab_size=vocab, peak=2.0)
    # identity: plausible but shifted drafts
    heads = MedusaHeads.from_target(target, num_heads=2, sequential=sequential)
    if sequential:  # the tokens above move the choices
        with torch.no_grad():
            for head in heads.heads:
                head.fuse.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    proposer = medusa_proposer(target, heads, [[0], [1], [2], [0, 0], [1, 0]])
    engine = SpeculativeEngine(target, proposer, adaptive=False)
    prompt = [1, 5, 7]
    second, third, accepted = sample_second_and_third(engine, prompt, 800)
    p2, p3 = exact_marginals(target, prompt, vocab)
    assert accepted > 150  # the drafts were really used, not all rejected
    assert chi2_pvalue(second, p2) > 1e-3
    assert chi2_pvalue(third, p3) > 1e-3
