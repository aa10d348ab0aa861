"""Tree verification equals sequential decoding of each branch; KV rollback equals a fresh prefill."""

import gc
import weakref

import pytest
import torch

from specdistill.decode.kv_cache import SpecCache
from specdistill.decode.runner import ModelRunner
from specdistill.decode.tree import TokenTree

PREFIX = [1, 8, 3, 12, 5]


def hand_made_tree() -> TokenTree:
    """root 5 -> {10 -> {11, 12 -> 13}, 20 -> 21, 30}: several branches of different depths."""
    tree = TokenTree.root(PREFIX[-1])
    a = tree.add(10, 0)
    tree.add(11, a)
    b = tree.add(12, a)
    tree.add(13, b)
    c = tree.add(20, 0)
    tree.add(21, c)
    tree.add(30, 0)
    return tree


def full_logits(model, tokens):
    return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


def prefilled_runner(model, prefix):
    runner = ModelRunner(model)
    runner.start(64)
    runner.forward(prefix)
    runner.cache.advance(len(prefix))
    return runner


@torch.no_grad()
def test_tree_forward_equals_each_branch_decoded_sequentially(tiny_target):
    tree = hand_made_tree()
    runner = prefilled_runner(tiny_target, PREFIX[:-1])
    _, logits = runner.forward(tree.tokens, tree.depths, tree.ancestor_mask())  # [N, V]
    for node in range(len(tree)):
        branch = [tree.tokens[i] for i in tree.path_to(node)]
        ref = full_logits(tiny_target, PREFIX[:-1] + branch)[-1]
        torch.testing.assert_close(logits[node], ref, atol=1e-4, rtol=1e-4)


def test_dedupe_and_shapes():
    tree = hand_made_tree()
    assert tree.add(10, 0) == 1  # an identical child is shared, not duplicated
    assert len(tree) == 8 and tree.max_depth == 3
    mask = tree.ancestor_mask()
    assert mask[4].tolist() == [True, True, False, True, True, False, False, False]
    assert mask.diagonal().all() and not mask.triu(1).any()


@torch.no_grad()
def test_commit_of_a_non_contiguous_path_equals_fresh_prefill(tiny_target):
    tree = hand_made_tree()
    runner = prefilled_runner(tiny_target, PREFIX[:-1])
    runner.forward(tree.tokens, tree.depths, tree.ancestor_mask())
    path = tree.path_to(4)  # nodes 0, 1, 3, 4: not contiguous after node 1
    runner.cache.commit_path(path)
    accepted = PREFIX[:-1] + [tree.tokens[i] for i in path]
    fresh = prefilled_runner(tiny_target, accepted)
    assert runner.cache.length == fresh.cache.length == len(accepted)
    for got, ref in zip(runner.cache.layers, fresh.cache.layers):
        n = len(accepted)
        torch.testing.assert_close(got.keys[:, :, :n], ref.keys[:, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values[:, :, :n], ref.values[:, :, :n], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rollback_then_continue_equals_fresh(tiny_target):
    runner = prefilled_runner(tiny_target, PREFIX)
    runner.forward([40, 41, 42])  # drafts that get rejected
    runner.cache.truncate(len(PREFIX))  # rollback moves the length only
    _, logits = runner.forward([7])
    ref = full_logits(tiny_target, PREFIX + [7])[-1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-4)


def test_a_dropped_cache_frees_its_buffers_without_the_cycle_collector():
    """Its layers reach it weakly: no reference cycle keeps dead KV buffers until a full collection (a teacher-data
    job builds one cache a batch of sequences)."""
    cache = SpecCache(num_layers=3, max_len=16)
    states = torch.randn(1, 2, 4, 8)  # [B, H, L, D]
    [layer.update(states, states) for layer in cache.layers]  # the buffers allocated (no name left holding one)
    assert cache.length == 0 and cache.layers[2].get_max_length() == 16
    buffer, gone = weakref.ref(cache.stacked[0]), weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert gone() is None and buffer() is None  # freed by reference counting alone
    finally:
        gc.enable()
    orphan = SpecCache(num_layers=1, max_len=4).layers[0]  # a layer kept past its cache says so
    with pytest.raises(RuntimeError, match="no longer exists"):
        orphan.get_seq_length()
