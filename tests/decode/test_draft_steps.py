"""The EAGLE-3 drafter's whole tree as one fixed-shape step (decode.draft_steps), run eagerly on the CPU: it
drafts the dynamic, depth-by-depth path's trees, EOS nodes included, keeps decoding lossless, and is kept
across requests. The GPU
tests (tests/test_cuda.py) compare its CUDA-graph replay with this eager step."""

import pytest
import torch

from specdistill.decode.draft_steps import DISABLE_ENV, candidate_depths, draft_graphs_supported
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers.eagle3 import Eagle3Proposer
from specdistill.decode.step_graphs import DISABLE_ENV as NO_GRAPHS_ENV
from tests.conftest import make_tiny_llama
from tests.decode.test_eagle3_decode import features_of, tiny_eagle
from tests.decode.test_engine import PROMPT, target_greedy

# min_prob 0: the unfloored trees; 0.03: the floor cuts them alike in both paths (the fixed step drafts every
# depth, the dynamic path stops below the floor)
SHAPES = [dict(depth=4, topk=1, tree_nodes=4, min_prob=0), dict(depth=5, topk=3, tree_nodes=9, min_prob=0),
          dict(depth=6, topk=4, tree_nodes=16, min_prob=0), dict(depth=6, topk=4, tree_nodes=16, min_prob=0.03)]


def recorded_trees(proposer, target, prompt, n, eos=frozenset()):
    trees, original = [], proposer.draft_tree
    proposer.draft_tree = lambda *a: trees.append(original(*a)) or trees[-1]
    tokens = SpeculativeEngine(target, proposer, eos, adaptive=False).generate(prompt, n).tokens
    return tokens, [(tree.tokens, tree.parents) for tree in trees]


@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_steps_draft_the_dynamic_forwards_trees_and_stay_lossless(shape):
    target = make_tiny_llama(seed=0, layers=4, peak=4.0)
    eagle, embed = tiny_eagle(target, layers=(1, 2, 3)), target.get_input_embeddings()
    dynamic = Eagle3Proposer(eagle, embed, fixed_steps=False, **shape)
    fixed = Eagle3Proposer(eagle, embed, fixed_steps=True, **shape)
    ref_tokens, ref_trees = recorded_trees(dynamic, target, PROMPT, 40)
    tokens, trees = recorded_trees(fixed, target, PROMPT, 40)
    assert fixed.step is not None and not fixed.step.graphed
    assert tokens == ref_tokens == target_greedy(target, PROMPT, 40)
    assert trees == ref_trees and max(len(t) for t, _ in trees) > 1
    if shape["min_prob"]:  # the floor cut some trees below the budget
        assert min(len(t) for t, _ in trees) <= shape["tree_nodes"]


def test_eos_candidates_are_not_expanded_as_in_the_dynamic_forward():
    """An EOS node's children score -inf on the device: the same trees as the dynamic path, which skips it."""
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    eagle, embed = tiny_eagle(target), target.get_input_embeddings()
    ref = target_greedy(target, PROMPT, 40)
    eos = {ref[5], ref[13], ref[20]}
    shape = dict(depth=6, topk=4, tree_nodes=12, eos_token_ids=eos, min_prob=0)
    dynamic = Eagle3Proposer(eagle, embed, fixed_steps=False, **shape)
    fixed = Eagle3Proposer(eagle, embed, fixed_steps=True, **shape)
    ref_tokens, ref_trees = recorded_trees(dynamic, target, PROMPT, 40, eos)
    tokens, trees = recorded_trees(fixed, target, PROMPT, 40, eos)
    assert tokens == ref_tokens and trees == ref_trees
    with_eos = [(toks, parents) for toks, parents in trees if any(t in eos for t in toks[1:])]
    assert with_eos  # the rule was exercised: some tree holds an EOS node ...
    for toks, parents in with_eos:  # ... and nothing below it
        assert not any(toks[parents[i]] in eos for i in range(1, len(toks)) if parents[i] > 0)


def test_candidates_come_in_depth_order_with_their_parents():
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    fixed = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=4, topk=3, tree_nodes=8,
                           fixed_steps=True)
    fixed.begin(PROMPT, 64)
    with torch.no_grad():
        fixed.observe_prefill(features_of(target, PROMPT, fixed.feature_layers))
        out = fixed.feed_context(PROMPT)
    tokens, parents, scores = fixed.step.run(out, 4, fixed.position - 1)
    depths = candidate_depths(3, 4)
    assert len(tokens) == len(parents) == len(scores) == len(depths) == 3 + 3 * 9
    for i, parent in enumerate(parents):
        if depths[i] == 1:
            assert parent == -1
        else:
            assert depths[parent] == depths[i] - 1 and scores[i] <= scores[parent] + 1e-6
    with pytest.raises(ValueError, match="depth 5 outside 1..4"):
        fixed.step.run(out, 5, fixed.position - 1)


def test_the_step_is_kept_across_requests_and_rebuilt_for_a_longer_one():
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    fixed = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=4, topk=2, tree_nodes=6,
                           fixed_steps=True)
    engine = SpeculativeEngine(target, fixed, adaptive=False)
    engine.generate(PROMPT, 20)
    step = fixed.step
    for n in (10, 20):
        assert engine.generate(PROMPT, n).tokens == target_greedy(target, PROMPT, n)
        assert fixed.step is step  # the same buffers: a recorded graph would be replayed, not recorded again
        assert fixed.context_step.cache is step.cache
    long_prompt = PROMPT * 12
    assert engine.generate(long_prompt, 30).tokens == target_greedy(target, long_prompt, 30)
    assert fixed.step is not step and fixed.step.cache is fixed.cache  # a larger cache: a new step over it


def test_fixed_steps_with_prompt_lookup_first_stay_lossless_through_catch_ups():
    """Lookup-only steps skip the drafter; its next step feeds the skipped positions (more than the context
    step's 8 rows: the bulk eagerly, the last row in the step)."""
    from specdistill.decode.proposers import PromptLookupProposer, WithPromptLookup

    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    prompt = PROMPT * 3  # repeats: lookup matches
    ref = target_greedy(target, prompt, 60)
    inner = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=4, topk=2, tree_nodes=6,
                           fixed_steps=True)
    fed = []
    original = inner.context_rows
    inner.context_rows = lambda tokens, *a: fed.append(len(tokens)) or original(tokens, *a)
    wrapped = WithPromptLookup(inner, PromptLookupProposer(num_tokens=10), lookup_first=1)
    assert SpeculativeEngine(target, wrapped, adaptive=False).generate(prompt, 60).tokens == ref
    assert any(n > 8 for n in fed) and any(n <= 8 for n in fed)


def test_draft_graphs_only_on_cuda_and_switched_off_by_either_variable(monkeypatch):
    assert not draft_graphs_supported(torch.device("cpu"))
    assert draft_graphs_supported(torch.device("cuda"))
    for name in (DISABLE_ENV, NO_GRAPHS_ENV):
        monkeypatch.setenv(name, "1")
        assert not draft_graphs_supported(torch.device("cuda"))
        monkeypatch.delenv(name)
    target = make_tiny_llama(seed=0, layers=2)
    assert Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings()).step is None  # CPU default: dynamic


def test_a_step_past_its_buffers_is_an_error_naming_them():
    target = make_tiny_llama(seed=0, layers=2)
    fixed = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=3, topk=2, tree_nodes=4,
                           fixed_steps=True)
    fixed.begin(PROMPT, 16)
    fixed.cache.used = fixed.cache.length = fixed.cache.keys.shape[1] - 1
    with pytest.raises(RuntimeError, match="draft step past its buffers"):
        fixed.step.run(torch.zeros(fixed.step.root.shape), 2, 3)


def test_a_draft_vocabulary_smaller_than_top_k_is_an_error_naming_both():
    target = make_tiny_llama(seed=0, layers=2)
    fixed = Eagle3Proposer(tiny_eagle(target, vocab=[3, 4, 5]), target.get_input_embeddings(), depth=3, topk=4,
                           tree_nodes=4, fixed_steps=True)
    with pytest.raises(ValueError, match="top-4 expansions need at least 4 draft tokens, the drafter has 3"):
        fixed.begin(PROMPT, 16)
