"""EAGLE-3 decoding: lossless with chains and dynamic trees, and the training unroll is what decoding computes."""

from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.adaptive import DraftLengthController
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import PromptLookupProposer, WithPromptLookup
from specdistill.decode.proposers.eagle3 import (
    DEFAULT_MIN_PROB,
    Candidate,
    Eagle3Proposer,
    build_eagle3_proposer,
    eagle3_drafting_weights,
)
from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.tree import priced_size
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.kernel_linear import Q8Int8Linear, Q80Linear
from specdistill.models.kernels import amx_unavailable, int8_unavailable
from specdistill.models.kernels import unavailable as kernel_unavailable
from specdistill.models.packed_linear import drafting_weights
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import PROMPT, target_greedy


def root_paths(tree) -> list[tuple[int, ...]]:
    """Each node's tokens from below the root down to it (the root's own: ())."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tree.tokens)):
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    return paths


def candidate_scores(candidates) -> dict[tuple[int, ...], float]:
    """The proposer's drafted candidates (Candidate) by token path -> log path probability."""
    paths: list[tuple[int, ...]] = []
    for c in candidates:
        paths.append((paths[c.parent] if c.parent >= 0 else ()) + (c.token,))
    return {path: c.score for path, c in zip(paths, candidates)}


def tiny_eagle(target, vocab=None, layers=(0, 1, 1), seed=3):
    vocab_map = None if vocab is None else torch.tensor(vocab)
    return Eagle3Drafter.for_target(target, vocab_map, list(layers), seed=seed).eval()


def features_of(target, ids: list[int], layers) -> torch.Tensor:
    """[T, 3D]: the inputs of `layers` at every position (hidden_states[i] is layer i's input)."""
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize("shape", [dict(depth=1, topk=1, tree_nodes=1), dict(depth=4, topk=1, tree_nodes=4),
                                   dict(depth=5, topk=3, tree_nodes=9), dict(depth=6, topk=4, tree_nodes=16),
                                   dict(depth=6, topk=4, tree_nodes=16, min_prob=0.03)])
def test_greedy_output_is_the_targets(shape):
    target = make_tiny_llama(seed=0, layers=4, peak=4.0)
    ref = target_greedy(target, PROMPT, 40)
    proposer = Eagle3Proposer(tiny_eagle(target, layers=(1, 2, 3)), target.get_input_embeddings(), **shape)
    for adaptive in (False, True):
        gen = SpeculativeEngine(target, proposer, adaptive=adaptive).generate(PROMPT, 40)
        assert gen.tokens == ref
    assert gen.stats.new_tokens == 40


def test_a_wider_mlp_than_the_targets_is_lossless_and_exports():
    """eagle3_intermediate_size: the drafter's MLP at three times the target's width decodes the target's
    greedy output and its export carries the width vLLM builds the layer with."""
    target = make_tiny_llama(seed=0, layers=4, peak=4.0)
    wide = 3 * target.config.intermediate_size
    drafter = Eagle3Drafter.for_target(target, None, [1, 2, 3], seed=3, init="target_layer",
                                       intermediate_size=wide).eval()
    assert drafter.midlayer.mlp.down_proj.weight.shape[1] == wide
    proposer = Eagle3Proposer(drafter, target.get_input_embeddings(), depth=5, topk=3, tree_nodes=9)
    assert SpeculativeEngine(target, proposer).generate(PROMPT, 30).tokens == target_greedy(target, PROMPT, 30)


def test_trees_are_closed_and_within_budget():
    target = make_tiny_llama(seed=0, layers=2)
    proposer = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=5, topk=3, tree_nodes=7,
                              min_prob=0)
    engine = SpeculativeEngine(target, proposer, adaptive=False)
    sizes = []
    original = proposer.draft_tree

    def recording(root, out, depth):
        tree = original(root, out, depth)
        sizes.append((len(tree), tree.max_depth))
        assert all(p < i for i, p in enumerate(tree.parents) if i)  # parents before children
        return tree

    proposer.draft_tree = recording
    engine.generate(PROMPT, 20)
    assert sizes and all(n == 8 for n, _ in sizes) and max(d for _, d in sizes) > 1


def test_the_floor_keeps_exactly_the_nodes_at_or_above_it():
    """With a path-probability floor (and a node budget that does not bind), the tree is the unfloored
    tree's nodes whose path probability reaches the floor, and drafting stops expanding below it."""
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    proposer = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=4, topk=3, tree_nodes=64,
                              min_prob=0)
    original, checked = proposer.draft_tree, []

    def both(root, out, depth):
        proposer.min_score = float("-inf")
        full = original(root, out, depth)
        scores = candidate_scores(proposer.candidates)
        floor = sorted(scores.values())[len(scores) // 2]  # the median candidate's: some nodes in, some out
        proposer.cache.drop_uncommitted()
        proposer.min_score = floor
        floored = original(root, out, depth)
        assert set(root_paths(full)[1:]) == set(scores)  # the budget did not bind
        assert set(root_paths(floored)[1:]) == {p for p, s in scores.items() if s >= floor}
        parents = {c.parent for c in proposer.candidates if c.parent >= 0}
        assert all(proposer.candidates[p].score >= floor for p in parents)  # nothing below it was expanded
        checked.append((len(floored), len(full)))
        return floored

    proposer.draft_tree = both
    engine = SpeculativeEngine(target, proposer, adaptive=False)
    assert engine.generate(PROMPT, 24).tokens == target_greedy(target, PROMPT, 24)
    assert checked and all(n < m for n, m in checked)


def test_priced_size_maximises_expected_tokens_a_second():
    probs = [0.9, 0.5, 0.1]
    # rows at 0.2 of a step each: 1 / 1, 1.9 / 1.2, 2.4 / 1.4 (best), 2.5 / 1.6
    assert priced_size(probs, lambda n: 1 + 0.2 * (n - 1)) == 2
    assert priced_size(probs, lambda n: 1.0) == 3  # free rows: every node earns something
    assert priced_size(probs, lambda n: float(n)) == 0  # a row as dear as a step: no node pays
    assert priced_size([], lambda n: 1.0) == 0
    sizes = [priced_size(probs, lambda n, c=c: 1 + c * (n - 1)) for c in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0)]
    assert sizes == sorted(sizes, reverse=True)  # dearer rows never keep a larger tree


def priced_trees(monkeypatch, row_cost: float) -> tuple[list[int], list[int]]:
    """Greedy tokens and tree sizes with verification priced at 1 + row_cost per extra row (the engine's
    controller's prediction replaced; its depth choice is unchanged)."""
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    proposer = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=4, topk=3, tree_nodes=9,
                              min_prob=0)
    monkeypatch.setattr(DraftLengthController, "predicted_verify_cost", lambda self, n: 1.0 + row_cost * (n - 1))
    monkeypatch.setattr(DraftLengthController, "choose", lambda self, limit: min(limit, self.max_depth))
    sizes, original = [], proposer.draft_tree
    proposer.draft_tree = lambda *a: sizes.append(len(tree := original(*a))) or tree
    tokens = SpeculativeEngine(target, proposer).generate(PROMPT, 30).tokens
    return tokens, sizes


def test_priced_trees_follow_the_price_of_a_row_and_stay_lossless(monkeypatch):
    ref = target_greedy(make_tiny_llama(seed=0, layers=2, peak=4.0), PROMPT, 30)
    free_tokens, free = priced_trees(monkeypatch, 0.0)
    dear_tokens, dear = priced_trees(monkeypatch, 10.0)
    mid_tokens, mid = priced_trees(monkeypatch, 0.3)
    assert free_tokens == dear_tokens == mid_tokens == ref
    assert set(free) == {10} and set(dear[1:]) == {1}  # every node kept / none pays (the first step is unpriced)
    assert sum(dear) <= sum(mid) <= sum(free)


def test_priced_false_keeps_the_full_tree():
    target = make_tiny_llama(seed=0, layers=2)
    proposer = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), priced=False)
    proposer.price_verification(lambda n: float(n))
    assert proposer.verify_seconds is None


def test_with_prompt_lookup_prices_the_inner_tree_beside_its_chain():
    """The inner proposer's price of n nodes is the engine's price of n + the chain's rows."""
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    inner = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=3, topk=2, tree_nodes=6)
    lookup = PromptLookupProposer(num_tokens=4)
    wrapped = WithPromptLookup(inner, lookup, lookup_first=0)
    seen = []
    original = inner.price_verification
    inner.price_verification = lambda seconds: seen.append(seconds) or original(seconds)
    wrapped.price_verification(lambda n: 100.0 * n)
    seq = PROMPT + PROMPT[:3]  # PROMPT's first tokens again: the lookup matches and drafts a chain
    chain = lookup.match(seq, lookup.num_tokens)[1][:3]  # as deep as the step drafts
    assert len(chain) == 3
    inner.begin(seq, 64)
    inner.observe_prefill(torch.zeros(len(seq), inner.drafter.fc.in_features))
    wrapped.propose(seq, 3, SamplingConfig(), None)
    assert seen[-1](1) == 100.0 * (1 + 3)


@pytest.mark.parametrize("min_prob", [-0.1, 1.0, 2.0])
def test_a_floor_outside_zero_to_one_is_an_error(min_prob):
    target = make_tiny_llama(seed=0, layers=2)
    with pytest.raises(ValueError, match="min_prob"):
        Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), min_prob=min_prob)


def test_the_floor_comes_from_the_caller_else_the_manifest_else_the_device():
    target = make_tiny_llama(seed=0, layers=2)
    eagle = tiny_eagle(target)

    def floor(manifest_floor, **kw):
        decoding = {} if manifest_floor is None else {"min_prob": manifest_floor}
        drafter = SimpleNamespace(model=eagle, manifest={"extra": {"decoding": decoding}})
        return build_eagle3_proposer(drafter, target, **kw).min_prob

    assert floor(None) == DEFAULT_MIN_PROB["cpu"] > 0
    assert floor(0.2) == 0.2
    assert floor(0.2, eagle3_min_prob=0.0) == 0.0  # an explicit 0 switches the floor off
    assert floor(0.0) == 0.0


def test_eos_and_max_new_tokens_inside_a_draft():
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    ref = target_greedy(target, PROMPT, 40)
    eos = ref[13]
    proposer = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=6, topk=4,
                              tree_nodes=12, eos_token_ids={eos})
    gen = SpeculativeEngine(target, proposer, {eos}, adaptive=False).generate(PROMPT, 40)
    assert gen.tokens == ref[:ref.index(eos) + 1]
    for max_new in (1, 2, 7):
        assert SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPT, max_new).tokens == ref[:max_new]


@pytest.mark.parametrize("lookup_first", [0, 1, 2])
def test_with_prompt_lookup_stays_lossless(lookup_first):
    """Also when lookup-only steps skip the drafter: it feeds the skipped positions at its next step."""
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    ref = target_greedy(target, PROMPT, 40)
    inner = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=4, topk=2, tree_nodes=6)
    drafted = []
    original = inner.propose
    inner.propose = lambda seq, *a: drafted.append(len(seq)) or original(seq, *a)
    wrapped = WithPromptLookup(inner, PromptLookupProposer(num_tokens=6), lookup_first=lookup_first)
    engine = SpeculativeEngine(target, wrapped, adaptive=False)
    steps = []
    engine_propose = wrapped.propose
    wrapped.propose = lambda seq, *a: steps.append(len(seq)) or engine_propose(seq, *a)
    assert engine.generate(PROMPT, 40).tokens == ref
    if lookup_first == 1:
        assert 0 < len(drafted) < len(steps)  # some steps were the lookup's alone


def test_reduced_vocabulary_drafts_only_its_tokens():
    target = make_tiny_llama(seed=0, layers=2)
    vocab = list(range(2, 40))
    proposer = Eagle3Proposer(tiny_eagle(target, vocab), target.get_input_embeddings(), depth=3, topk=3, tree_nodes=8)
    engine = SpeculativeEngine(target, proposer, adaptive=False)
    trees = []
    original = proposer.draft_tree
    proposer.draft_tree = lambda *a: trees.append(original(*a)) or trees[-1]
    assert engine.generate(PROMPT, 12).tokens == target_greedy(target, PROMPT, 12)
    assert all(2 <= t < 40 for tree in trees for t in tree.tokens[1:])


def test_unroll_step_j_is_what_decoding_computes():
    """Training's step j at row t equals the proposer's depth-j row over the same context and tokens."""
    target = make_tiny_llama(seed=0, layers=3)
    drafter = tiny_eagle(target, layers=(0, 1, 2))
    ids = [1, 5, 7, 9, 11, 5, 7, 13, 17, 19, 23, 29]
    feats = features_of(target, ids, drafter.target_layers)  # [T, 3D]
    steps, t_len = 4, len(ids)
    embed = target.get_input_embeddings()
    padded = torch.tensor(ids + [0] * steps)
    embeds = [embed(padded[1 + j:1 + j + t_len])[None] for j in range(steps)]  # step j: e(x_{t+1+j})
    with torch.no_grad():
        outputs = drafter.unroll(embeds, feats[None])  # steps x [1, T, D]
    for t in (3, 6):
        proposer = Eagle3Proposer(drafter, embed, depth=steps, topk=1, tree_nodes=steps)
        proposer.begin(ids, 64)
        with torch.no_grad():
            out = proposer.context_rows(ids[1:t + 2], feats[:t + 1])[-1]  # rows 0..t, last one = step 0 at t
            torch.testing.assert_close(out, outputs[0][0, t], atol=1e-5, rtol=1e-4)
            proposer.candidates, parent = [], -1
            for d in range(1, steps):  # depth d: the token x_{t+1+d}, drafted as if accepted
                node = Candidate(ids[t + 1 + d], parent, d, 0.0)
                proposer.candidates.append(node)
                parent = len(proposer.candidates) - 1
                out = proposer.expand([node], out[None], t)[0]
                torch.testing.assert_close(out, outputs[d][0, t], atol=1e-5, rtol=1e-4)


def test_sampling_keeps_the_targets_distribution_and_a_wrong_rule_fails(monkeypatch):
    """Sampled drafts go in with their q; a drafter confidently wrong (q near one-hot) must not bias the
    output, and resampling from p instead of the residual after a rejection must show up as bias."""
    from tests.decode.test_sampling import assert_unbiased_and_a_wrong_rule_caught

    vocab, prompt = 8, [1, 3, 5]
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0)
    drafter = tiny_eagle(target, layers=(0, 1, 1), seed=5)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(20.0)  # a peaked q, far from the target's p
    engine = SpeculativeEngine(target, Eagle3Proposer(drafter, target.get_input_embeddings(), depth=2))
    assert_unbiased_and_a_wrong_rule_caught(monkeypatch, engine, target, prompt, vocab)


needs_library = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the kernel: {kernel_unavailable()}")


@needs_library
def test_q8_0_drafting_weights_stay_lossless_and_auto_picks_them_where_the_kernel_runs():
    target = make_tiny_llama(seed=0, layers=4, peak=4.0, hidden_size=128)  # head_dim 32: every matrix on the kernel
    drafter = tiny_eagle(target, layers=(1, 2, 3))
    ref = target_greedy(target, PROMPT, 40)
    proposer = Eagle3Proposer(drafter, target.get_input_embeddings(), depth=5, topk=3, tree_nodes=9, weights="q8_0")
    assert isinstance(proposer.net.qkv, Q80Linear) and isinstance(proposer.net.lm_head, Q80Linear)
    assert proposer.net.qkv.codes.form == ("amx" if amx_unavailable() is None else "fma")
    for adaptive in (False, True):
        assert SpeculativeEngine(target, proposer, adaptive=adaptive).generate(PROMPT, 40).tokens == ref
    auto = ("int8" if int8_unavailable() is None else "q8_0" if kernel_unavailable() is None
            else drafting_weights(drafter, "auto"))
    assert eagle3_drafting_weights(drafter, "auto", None) == auto
    assert eagle3_drafting_weights(drafter, "float32", None) == "float32"
    odd = tiny_eagle(make_tiny_llama(seed=0, layers=2, hidden_size=48))  # K = 48: not whole groups of 32
    assert eagle3_drafting_weights(odd, "auto", None) == drafting_weights(odd, "auto")  # auto never fails on a shape
    with pytest.raises(ValueError, match="lean drafting rows"):
        eagle3_drafting_weights(drafter, "q8_0", True)  # fixed-shape steps keep the drafter's own modules
    with pytest.raises(ValueError, match="only EAGLE-3"):
        drafting_weights(target, "q8_0")


@pytest.mark.skipif(int8_unavailable() is not None, reason=f"the int8 kernel: {int8_unavailable()}")
def test_int8_drafting_weights_stay_lossless_and_draft_nearly_what_q8_0_drafts():
    target = make_tiny_llama(seed=0, layers=4, peak=4.0, hidden_size=128)
    drafter = tiny_eagle(target, layers=(1, 2, 3))
    ref = target_greedy(target, PROMPT, 40)
    proposer = Eagle3Proposer(drafter, target.get_input_embeddings(), depth=5, topk=3, tree_nodes=9, weights="int8")
    assert isinstance(proposer.net.qkv, Q8Int8Linear) and isinstance(proposer.net.lm_head, Q8Int8Linear)
    for adaptive in (False, True):
        assert SpeculativeEngine(target, proposer, adaptive=adaptive).generate(PROMPT, 40).tokens == ref
    q80 = Eagle3Proposer(drafter, target.get_input_embeddings(), weights="q8_0").net
    out = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    int8_logits, q80_logits = proposer.net.logits(out), q80.logits(out)
    assert float((int8_logits - q80_logits).abs().max() / q80_logits.abs().max()) < 2e-2  # x's rounding alone
    assert torch.equal(int8_logits.argmax(-1), q80_logits.argmax(-1))
    assert eagle3_drafting_weights(drafter, "int8", None) == "int8"
    with pytest.raises(ValueError, match="lean drafting rows"):
        eagle3_drafting_weights(drafter, "int8", True)
    with pytest.raises(ValueError, match="only EAGLE-3"):
        drafting_weights(target, "int8")
