"""Several drafters merged into one token tree: the tree's shape and its cap, greedy losslessness
through the engine, and the target's distribution kept by multi-draft sampling (chi-square tests,
with deliberately wrong orderings and caps rejected by the same tests)."""

import random

import pytest
import torch

import specdistill.decode.proposers.ensemble as ensemble_mod
import specdistill.decode.sampling as sampling_mod
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer
from specdistill.decode.proposers.ensemble import EnsembleProposer, cap_chains, merge_chains
from specdistill.decode.sampling import SamplingConfig, verify_sampling
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import PROMPT, target_greedy
from tests.decode.test_sampling import Q1, Q2, P, chi2_pvalue, exact_marginals

Q3 = torch.tensor([0.10, 0.05, 0.05, 0.30, 0.30, 0.20])
Q4 = torch.tensor([0.05, 0.05, 0.30, 0.30, 0.20, 0.10])  # after Q1 the residual lives on tokens 0 and 1


# ---- the merged tree --------------------------------------------------------------------------------

def branch_of(tree, node):
    return [tree.tokens[i] for i in tree.path_to(node)[1:]]


def test_chains_merge_with_shared_prefixes_once():
    chains = [[10, 11, 12], [10, 11, 13], [20, 21], [10, 14]]
    tree = merge_chains(5, [(c, [None] * len(c)) for c in chains], max_nodes=64)
    assert len(tree) == 8  # root, 10, 11, 12, 13, 14, 20, 21
    assert sorted(tuple(branch_of(tree, n)) for n in range(1, len(tree))) == sorted(
        [(10,), (10, 11), (10, 11, 12), (10, 11, 13), (10, 14), (20,), (20, 21)])
    sources = {tuple(branch_of(tree, n)): [s for s, _ in tree.proposals[n]] for n in range(1, len(tree))}
    assert sources == {(10,): [0, 1, 3], (10, 11): [0, 1], (10, 11, 12): [0], (10, 11, 13): [1],
                       (10, 14): [3], (20,): [2], (20, 21): [2]}
    assert tree.tokens[:4] == [5, 10, 11, 12]  # member 0's chain first and contiguous
    assert tree.max_depth == 3 and all(tree.parents[i] < i for i in range(1, len(tree)))


def test_each_member_keeps_its_own_q_on_shared_nodes():
    q0, q1 = torch.full((30,), 1 / 30), torch.softmax(torch.arange(30.0), 0)
    tree = merge_chains(5, [([7, 8], [q0, q0]), ([7, 9], [q1, q1])], max_nodes=64)
    shared = tree.children(0)[0]
    assert [(s, q) for s, q in tree.proposals[shared]] == [(0, q0), (1, q1)]


def test_cap_drops_the_deepest_drafts_of_later_members_first():
    chains = [[10, 11, 12], [10, 11, 13], [20, 21], [10, 14]]
    # depth 1: 10 (new), 10 (shared), 20 (new), 10 (shared); depth 2: 11, 11 (shared), 21 -> 5 nodes, full
    assert cap_chains(chains, 5) == [2, 2, 2, 1]
    assert cap_chains(chains, 3) == [1, 1, 1, 0]  # member 3's 10 would need no node, but the tree is full
    assert cap_chains(chains, 2) == [1, 0, 0, 0]
    assert cap_chains(chains, 64) == [3, 3, 2, 2]
    tree = merge_chains(5, [(c, [None] * len(c)) for c in chains], max_nodes=5)
    assert len(tree) == 5 and sorted(tree.tokens) == [5, 10, 11, 20, 21]


def test_cap_admission_never_looks_at_the_draft_itself_or_later_ones():
    """Losslessness needs: whether member s keeps its depth-d draft depends only on drafts verified
    before it (shallower ones, and earlier members' at depth d). Change everything else: same answer."""
    rng = random.Random(0)
    for _ in range(300):
        chains = [[rng.randrange(3) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 4))]
        cap = rng.randint(2, 10)
        keep = cap_chains(chains, cap)
        tree = merge_chains(0, [(c, [None] * len(c)) for c in chains], cap)
        assert len(tree) <= cap
        for s, chain in enumerate(chains):
            for d in range(len(chain)):
                changed = [c[:d] + [rng.randrange(3) for _ in c[d:]] if i >= s else c[:d + 1] + [9] * len(c[d + 1:])
                           for i, c in enumerate(chains)]
                assert (cap_chains(changed, cap)[s] > d) == (keep[s] > d), (chains, cap, s, d)


def test_alternates_are_leaves_beside_their_chain_shared_once_and_ranked_by_path_probability():
    chains = [([10, 11], [None, None]), ([20, 21], [None, None])]
    alts = [[(0, 20, -1.0), (0, 30, -2.0), (1, 12, -0.5)], [(0, 31, -3.0), (1, 22, -1.5)]]
    tree = merge_chains(5, chains, max_nodes=64, alternates=alts)
    assert tree.tokens[:5] == [5, 10, 11, 20, 21]  # the chains first, as without alternates
    assert sorted(branch_of(tree, c) for c in tree.children(0)) == [[10], [20], [30], [31]]
    shared = [c for c in tree.children(0) if tree.tokens[c] == 20][0]
    assert [s for s, _ in tree.proposals[shared]] == [1, 0]  # member 0's alternate 20 shares member 1's node
    assert branch_of(tree, tree.tokens.index(12)) == [10, 12]  # a depth-1 alternate beside its chain's 11
    assert branch_of(tree, tree.tokens.index(22)) == [20, 22]
    assert all(not tree.children(tree.tokens.index(t)) for t in (30, 31, 12, 22))  # all leaves
    assert tree.tokens[5:] == [12, 22, 30, 31]  # best path probability first (20 was shared, no node)
    assert merge_chains(5, chains, max_nodes=7, alternates=alts).tokens == [5, 10, 11, 20, 21, 12, 22]
    assert merge_chains(5, chains, max_nodes=5, alternates=alts).tokens == [5, 10, 11, 20, 21]
    cut = merge_chains(5, [([10, 11, 12], [None] * 3)], max_nodes=3, alternates=[[(2, 40, 0.0), (1, 41, -1.0)]])
    assert cut.tokens == [5, 10, 11]  # 40 hangs below the cut draft 11 and 41 finds no room


def test_alternates_never_break_the_cap_the_chains_or_their_depth():
    rng = random.Random(1)
    for _ in range(300):
        chains = [[rng.randrange(4) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 3))]
        alts = [[(d, rng.randrange(6), -rng.random() * 5) for d in range(len(c)) for _ in range(rng.randint(0, 2))]
                for c in chains]
        cap = rng.randint(2, 14)
        plain = merge_chains(0, [(c, [None] * len(c)) for c in chains], cap)
        tree = merge_chains(0, [(c, [None] * len(c)) for c in chains], cap, alts)
        assert len(tree) <= max(cap, len(plain))
        assert tree.tokens[:len(plain)] == plain.tokens and tree.parents[:len(plain)] == plain.parents
        for node in range(len(plain), len(tree)):
            assert not tree.children(node)  # alternates are leaves
            path = branch_of(tree, node)
            for source, _ in tree.proposals[node]:  # one member's, or several that coincide
                assert path[:-1] == chains[source][:len(path) - 1]  # beside its own chain, at its depth
                assert (len(path) - 1, path[-1]) in {(d, t) for d, t, _ in alts[source]}


@torch.no_grad()  # as the engine calls proposers
def test_a_member_offers_its_next_most_likely_tokens_at_every_depth(tiny_target):
    drafter = make_tiny_llama(seed=1, layers=1)
    greedy = SamplingConfig()
    member = DraftModelProposer(drafter, gamma=3)
    member.begin(PROMPT, 64)
    drafts, _, others = member.draft_chain(PROMPT, 3, greedy, None, alternates=2)
    assert len(drafts) == 3 and [d for d, _, _ in others] == [0, 0, 1, 1, 2, 2]
    path = 0.0
    for depth in range(3):
        logq = torch.log_softmax(drafter(torch.tensor([PROMPT + drafts[:depth]])).logits[0, -1], -1)  # [V]
        ranked = logq.topk(3).indices.tolist()
        assert drafts[depth] == ranked[0] and [t for d, t, _ in others if d == depth] == ranked[1:]
        scores = [sc for d, _, sc in others if d == depth]
        assert scores == pytest.approx([path + float(logq[t]) for t in ranked[1:]], abs=1e-4)
        path += float(logq[ranked[0]])
    member.begin(PROMPT, 64)
    assert member.draft_chain(PROMPT, 3, greedy, None)[0] == drafts  # alternates change nothing else
    mapped = DraftModelProposer(drafter, gamma=3, vocab_map=torch.arange(drafter.config.vocab_size).flip(0),
                                target_vocab=drafter.config.vocab_size)
    mapped.begin(PROMPT, 64)
    v = drafter.config.vocab_size
    first = drafter(torch.tensor([PROMPT])).logits[0, -1].topk(3).indices.tolist()
    assert ([t for _, t, _ in mapped.draft_chain(PROMPT, 1, greedy, None, alternates=2)[2]]
            == [v - 1 - i for i in first[1:]])
    member.begin(PROMPT, 64)
    sampled = member.draft_chain(PROMPT, 3, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0), 2)
    assert sampled[2] == []  # sampling drafts no alternates (they would not be draws from q)


# ---- greedy through the engine ---------------------------------------------------------------------

def members(target, gamma=4, eos=frozenset()):
    """Two bad drafters around a perfect one (the target itself), so that branches disagree."""
    return [DraftModelProposer(make_tiny_llama(seed=1, layers=1), gamma, eos_token_ids=eos),
            DraftModelProposer(target, gamma, eos_token_ids=eos),
            DraftModelProposer(make_tiny_llama(seed=2, layers=2), gamma - 1, eos_token_ids=eos)]


@pytest.mark.parametrize("max_tree_nodes", [2, 4, 12])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_ensemble_is_the_targets_greedy_output(tiny_target, max_tree_nodes, adaptive):
    ref = target_greedy(tiny_target, PROMPT, 40)
    proposer = EnsembleProposer(members(tiny_target), max_tree_nodes)
    engine = SpeculativeEngine(tiny_target, proposer, adaptive=adaptive)
    gen = engine.generate(PROMPT, 40)
    assert gen.tokens == ref
    assert engine.generate([3, 1, 4], 20).tokens == target_greedy(tiny_target, [3, 1, 4], 20)  # reused
    if max_tree_nodes >= 12 and not adaptive:  # room for the perfect member's whole chain
        assert gen.stats.tau > 3.0


@pytest.mark.parametrize("max_tree_nodes", [3, 8, 20])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_ensemble_with_branches_is_the_targets_greedy_output(tiny_target, max_tree_nodes, adaptive):
    proposer = EnsembleProposer(members(tiny_target), max_tree_nodes, branches=3)
    engine = SpeculativeEngine(tiny_target, proposer, adaptive=adaptive)
    assert engine.generate(PROMPT, 40).tokens == target_greedy(tiny_target, PROMPT, 40)
    assert engine.generate([3, 1, 4], 20).tokens == target_greedy(tiny_target, [3, 1, 4], 20)


def test_branches_raise_acceptance_of_bad_members(tiny_target):
    """Two drafters that are not the target: their second choices catch some of the first misses."""
    bad = lambda: [DraftModelProposer(make_tiny_llama(seed=s, layers=1), 3) for s in (1, 2)]  # noqa: E731
    stats = {b: SpeculativeEngine(tiny_target, EnsembleProposer(bad(), 64, branches=b), adaptive=False)
             .generate(PROMPT, 60) for b in (1, 4)}
    assert stats[4].tokens == stats[1].tokens == target_greedy(tiny_target, PROMPT, 60)
    assert stats[4].stats.tau > stats[1].stats.tau  # 1.18 against 1.00 with these seeds


def test_greedy_ensemble_beats_its_members_when_they_cover_each_other(tiny_target):
    """A member that is right only where another is wrong: merged, they are accepted more often."""
    ref = target_greedy(tiny_target, PROMPT, 40)
    solo = [SpeculativeEngine(tiny_target, m, adaptive=False).generate(PROMPT, 40).stats.tau
            for m in members(tiny_target)]
    merged = SpeculativeEngine(tiny_target, EnsembleProposer(members(tiny_target), 16), adaptive=False)
    gen = merged.generate(PROMPT, 40)
    assert gen.tokens == ref and gen.stats.tau >= max(solo)


def test_eos_inside_drafts_stops_exactly(tiny_target):
    ref = target_greedy(tiny_target, PROMPT, 40)
    eos = ref[13]
    proposer = EnsembleProposer(members(tiny_target, gamma=6, eos={eos}), 16)
    gen = SpeculativeEngine(tiny_target, proposer, eos_token_ids={eos}).generate(PROMPT, 40)
    assert gen.tokens == ref[: ref.index(eos) + 1] == target_greedy(tiny_target, PROMPT, 40, eos=eos)


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_inside_drafts(tiny_target, max_new):
    proposer = EnsembleProposer(members(tiny_target, gamma=5), 16)
    gen = SpeculativeEngine(tiny_target, proposer).generate(PROMPT, max_new)
    assert gen.tokens == target_greedy(tiny_target, PROMPT, max_new) and len(gen.tokens) == max_new


def test_bad_ensembles_are_refused(tiny_target):
    with pytest.raises(ValueError, match="at least one member"):
        EnsembleProposer([], 8)
    with pytest.raises(ValueError, match="max_tree_nodes"):
        EnsembleProposer(members(tiny_target), 1)
    with pytest.raises(ValueError, match="branches"):
        EnsembleProposer(members(tiny_target), 8, branches=0)
    assert EnsembleProposer(members(tiny_target, gamma=4), 8).max_depth == 4


# ---- sampling: planted distributions ---------------------------------------------------------------

def first_emitted(qs: list[torch.Tensor], n: int, max_nodes: int = 64, seed: int = 0) -> list[int]:
    """Each source samples a one-token chain from its q; the chains merge (and are capped); the target's
    p is P everywhere; return the first emitted token of each trial."""
    gen = torch.Generator().manual_seed(seed)
    cfg = SamplingConfig(temperature=1.0)
    out = []
    for _ in range(n):
        chains = [([int(torch.multinomial(q, 1, generator=gen))], [q]) for q in qs]
        tree = merge_chains(0, chains, max_nodes)
        logits = torch.log(P)[None].expand(len(tree), -1)
        verdict = verify_sampling(tree, logits, cfg, gen)
        out.append(tree.tokens[verdict.path[1]] if len(verdict.path) > 1 else verdict.bonus)
    return out


@pytest.mark.parametrize("qs,max_nodes", [([Q1, Q2, Q3], 64), ([Q1, Q1, Q2], 64), ([Q1, Q4, Q2], 3)],
                         ids=["three", "twins", "capped"])
def test_merged_drafts_keep_the_target_distribution(qs, max_nodes):
    assert chi2_pvalue(first_emitted(qs, 20000, max_nodes), P) > 1e-3


def test_ordering_drafts_by_their_tokens_is_rejected(monkeypatch):
    """Trying the drafts in token order (instead of source order) selects them by their values."""
    def by_token(tree, node):
        found = [(s, c, q) for c in tree.children(node) for s, q in tree.proposals[c]]
        return sorted(found, key=lambda item: (tree.tokens[item[1]], item[0]))

    monkeypatch.setattr(sampling_mod, "proposals_in_source_order", by_token)
    assert chi2_pvalue(first_emitted([Q1, Q2, Q3], 20000), P) < 1e-6


def test_admitting_drafts_because_they_share_a_node_is_rejected(monkeypatch):
    """A cap that lets a draft in for free when it coincides with a node already there decides on
    the draft's own value: a later member is then present when its draft equals one already rejected,
    so it is rejected for sure, and the residual wrongly loses its q. Planted so that this matters:
    after Q1 and Q4 the residual is spread over tokens 0 and 1, where Q2 has mass."""
    def free_sharing(chains, max_nodes):
        nodes, keep = {()}, [0] * len(chains)
        for s, chain in enumerate(chains):
            if chain and (len(nodes) < max_nodes or (chain[0],) in nodes):
                nodes.add((chain[0],))
                keep[s] = 1
        return keep

    # the real cap passes this very setting: test_merged_drafts_keep_the_target_distribution[capped]
    monkeypatch.setattr(ensemble_mod, "cap_chains", free_sharing)
    assert chi2_pvalue(first_emitted([Q1, Q4, Q2], 20000, max_nodes=3), P) < 1e-6


# ---- sampling through the engine --------------------------------------------------------------------

def test_engine_ensemble_sampling_matches_target_distribution():
    vocab, prompt, n = 8, [1, 3, 5], 1500
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0)
    drafters = [make_tiny_llama(vocab_size=vocab, seed=s, layers=1, peak=3.0) for s in (7, 8, 9)]
    cfg = SamplingConfig(temperature=0.9, top_k=6)
    exp2, exp3 = exact_marginals(target, prompt, cfg, vocab)
    proposer = EnsembleProposer([DraftModelProposer(d, gamma=2) for d in drafters], max_tree_nodes=5)
    engine = SpeculativeEngine(target, proposer)
    outs = [engine.generate(prompt, 3, SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=s)).tokens
            for s in range(n)]
    assert chi2_pvalue([o[1] for o in outs], exp2) > 1e-3
    assert chi2_pvalue([o[2] for o in outs], exp3) > 1e-3
