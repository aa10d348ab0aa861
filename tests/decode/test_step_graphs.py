"""Fixed-shape steps (decode.step_graphs), run eagerly on the CPU: the path a GPU replays as CUDA graphs.

A step pads a forward of n rows to its bucket, writes keys and values at explicit cache slots and attends
over the whole cache; its outputs must be what the dynamic-shape forward gives for every n, and speculation
through it must equal plain decoding. tests/test_cuda.py checks the recorded graphs against these steps on a
GPU.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers.draft_model import DraftModelProposer
from specdistill.decode.proposers.eagle3 import Eagle3Proposer
from specdistill.decode.proposers.prompt_lookup import PromptLookupProposer
from specdistill.decode.runner import ModelRunner
from specdistill.decode.step_graphs import BUCKETS, StaticStep, bucket_for
from specdistill.decode.tree import TokenTree, attention_bias
from specdistill.models.eagle3 import Eagle3Drafter
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import PROMPT

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")


def test_bucket_is_the_smallest_that_holds_the_rows():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 33, 64)] == [1, 2, 4, 4, 8, 16, 64, 64]
    assert bucket_for(BUCKETS[-1] + 1) is None


def random_tree(n: int, seed: int) -> TokenTree:
    """A tree of n nodes, each under a random earlier node."""
    gen = torch.Generator().manual_seed(seed)
    tree = TokenTree.root(int(torch.randint(64, (1,), generator=gen)))
    while len(tree) < n:
        parent = int(torch.randint(len(tree), (1,), generator=gen))
        tree.add(int(torch.randint(64, (1,), generator=gen)), parent, dedupe=False)
    return tree


def run_tree(run: ModelRunner, prompt: list[int], tree: TokenTree, feature_layers=(0, 1)):
    """Prefill, then verify `tree`; (prefill logits, tree logits, tree features, hidden)."""
    run.feature_layers = list(feature_layers)
    run.start(len(prompt) + len(tree) + 8)
    _, first = run.forward(prompt)
    run.cache.advance(len(prompt))
    hidden, logits = run.forward(tree.tokens, depths=tree.depths, ancestors=tree.ancestor_mask())
    return first, logits, run.features, hidden


@pytest.mark.parametrize("nodes", [1, 3, 5, 8, 13, 40])
def test_a_padded_step_gives_the_dynamic_forwards_outputs(nodes):
    model = make_tiny_llama(layers=3, seed=4)
    prompt = [3 + i % 60 for i in range(70)]  # past the largest bucket: the prefill runs eagerly
    tree = random_tree(nodes, seed=nodes)
    with torch.inference_mode():
        fixed = ModelRunner(model, static_shapes=True, fixed_steps=True)
        assert fixed.steps is not None and not fixed.steps.graphed
        got = run_tree(fixed, prompt, tree)
        expected = run_tree(ModelRunner(model, static_shapes=False), prompt, tree)
    assert set(fixed.steps.steps) == {(bucket_for(nodes), (0, 1))}  # the tree ran as a step; the prompt did not
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_committed_paths_and_padding_leave_the_cache_as_the_dynamic_forward_does():
    """After a tree, a committed path and a chain, the next forward sees the same context: padding rows
    wrote only past the tree."""
    model = make_tiny_llama(layers=2, seed=7)
    tree = random_tree(11, seed=3)
    outs = []
    for run in (ModelRunner(model, static_shapes=True, fixed_steps=True), ModelRunner(model)):
        with torch.inference_mode():
            run_tree(run, [4, 8, 15, 16, 23, 42], tree, feature_layers=())
            run.cache.commit_path([0, 2, 5])
            run.forward([9, 10, 11])
            run.cache.advance(3)
            outs.append(run.forward([12])[1])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def eagle3_proposer(target):
    eagle = Eagle3Drafter.for_target(target, None, [0, 1, 2], seed=3).eval()
    return Eagle3Proposer(eagle, target.get_input_embeddings(), depth=5, topk=3, tree_nodes=12)


@pytest.mark.parametrize("kind", ["draft_model", "prompt_lookup", "eagle3"])
def test_speculation_through_fixed_steps_equals_plain_decoding(kind):
    target = make_tiny_llama(layers=3, seed=0, peak=4.0)
    proposer = {"draft_model": lambda: DraftModelProposer(make_tiny_llama(layers=1, seed=1, peak=4.0), gamma=5),
                "prompt_lookup": lambda: PromptLookupProposer(num_tokens=4),
                "eagle3": lambda: eagle3_proposer(target)}[kind]()
    plain = SpeculativeEngine(target, None).generate(PROMPT, 40).tokens
    for adaptive in (False, True):
        engine = SpeculativeEngine(target, proposer, static_shapes=True, fixed_steps=True, adaptive=adaptive)
        assert engine.target.steps is not None
        assert engine.generate(PROMPT, 40).tokens == plain
        assert engine.generate(PROMPT, 40).tokens == plain  # a second request on the same steps
        assert engine.target.steps.steps, "no verification ran as a fixed-shape step"


def test_a_longer_request_reallocates_the_cache_and_drops_the_steps():
    model = make_tiny_llama(layers=1, seed=2)
    run = ModelRunner(model, static_shapes=True, fixed_steps=True)
    with torch.inference_mode():
        run.start(16)
        run.forward([1, 2, 3])
        first_cache = run.cache
        assert run.steps.steps
        run.start(run.cache.max_len + 1)
    assert run.cache is not first_cache and run.cache.max_len >= first_cache.max_len + 1
    assert not run.steps.steps and run.steps.cache is run.cache


def test_fixed_steps_are_off_by_default_on_the_cpu():
    model = make_tiny_llama(layers=1)
    assert ModelRunner(model).steps is None
    assert ModelRunner(model, static_shapes=True).steps is None  # eager steps only when asked for


def test_the_steps_mask_is_the_trees_attention_bias():
    model = make_tiny_llama(layers=1, seed=3)
    run = ModelRunner(model, static_shapes=True, fixed_steps=True)
    run.start(40)
    tree = random_tree(6, seed=11)
    step = StaticStep(run.lean, run.head, run.cache, 8, (), torch.device("cpu"), torch.float32, graphed=False)
    step.load(tree.tokens, tree.depths, tree.ancestor_mask(), prefix=9)
    mask = step.attention_mask(step.ints[16:])  # [1, 1, 8, T]
    expected = attention_bias(9, tree.ancestor_mask(), run.cache.max_len, torch.float32)  # [1, 1, 6, T]
    assert torch.equal(mask[:, :, :6], expected)
    for row in (6, 7):  # padding: the prefix and itself
        allowed = (mask[0, 0, row] == 0).nonzero().flatten().tolist()
        assert allowed == [*range(9), 9 + row]


def test_one_shape_runs_every_forward_as_the_same_step_and_stays_exact():
    target = make_tiny_llama(layers=2, seed=0, peak=4.0)
    kw = {"static_shapes": True, "fixed_steps": True, "one_shape": True, "max_tree_nodes": 16}
    plain = SpeculativeEngine(target, None, **kw)
    expected = plain.generate(PROMPT, 40).tokens
    assert set(plain.target.steps.steps) == {(16, ())}  # plain decoding's one-row steps too
    engine = SpeculativeEngine(target, DraftModelProposer(make_tiny_llama(layers=1, seed=1, peak=4.0), gamma=5), **kw)
    assert engine.generate(PROMPT, 40).tokens == expected
    assert set(engine.target.steps.steps) == {(16, ())}


def test_the_layers_share_one_stacked_buffer_and_a_path_moves_in_one_copy():
    model = make_tiny_llama(layers=3, seed=5)
    run = ModelRunner(model)
    with torch.inference_mode():
        run.start(32)
        run.forward([1, 2, 3, 4, 5, 6])
    keys, values = run.cache.stacked
    assert run.cache.uniform and keys.shape[0] == 3
    for index, layer in enumerate(run.cache.layers):
        assert layer.keys.data_ptr() == keys[index].data_ptr()
    before = keys[:, :, :, [1, 3, 5]].clone()
    with torch.inference_mode():
        run.cache.commit_path([1, 3, 5])
    assert torch.equal(keys[:, :, :, :3], before)  # every layer's accepted entries, moved down


def test_layers_of_different_shapes_get_their_own_buffers():
    from specdistill.decode.kv_cache import SpecCache
    cache = SpecCache(2, 16)
    k0, k1 = torch.randn(1, 2, 4, 8), torch.randn(1, 3, 4, 8)  # [B, H, N, D]: layer 1 has more heads
    cache.layers[0].update(k0, k0)
    cache.layers[1].update(k1, k1)
    assert not cache.uniform
    cache.commit_path([2, 0])
    assert torch.equal(cache.layers[1].keys[:, :, :2], k1[:, :, [2, 0]])
    assert torch.equal(cache.layers[0].keys[:, :, :2], k0[:, :, [2, 0]])
