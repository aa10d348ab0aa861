"""Grouped-query attention without repeating K/V gives transformers' sdpa attention, row for row."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdistill.decode.attention import GROUPED_SDPA, grouped_mask_argument, grouped_query_sdpa, use_grouped_query_sdpa
from specdistill.decode.runner import ModelRunner
from specdistill.decode.tree import TokenTree, attention_bias
from tests.conftest import make_tiny_llama


class Groups(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def tree_mask(prefix: int, n: int, dtype=torch.float32) -> torch.Tensor:
    tree = TokenTree.root(1)
    for i in range(n - 1):
        tree.add(2 + i, i // 2, dedupe=False)  # a branchy tree: every node but the root has a sibling or two
    return attention_bias(prefix, tree.ancestor_mask(), prefix + n, dtype)  # [1, 1, n, prefix + n]


@pytest.mark.parametrize("groups,n", [(3, 5), (2, 2), (3, 9), (1, 4)])
def test_folded_query_rows_attend_as_repeated_kv_does(groups, n):
    gen = torch.Generator().manual_seed(groups * 10 + n)
    kv_heads, d, prefix = 3, 16, 11
    query = torch.randn(1, kv_heads * groups, n, d, generator=gen)
    key, value = (torch.randn(1, kv_heads, prefix + n, d, generator=gen) for _ in range(2))
    mask = tree_mask(prefix, n)
    ours, _ = grouped_query_sdpa(Groups(groups), query, key, value, mask, scaling=d ** -0.5)
    ref, _ = sdpa_attention_forward(Groups(groups), query, key, value, mask, scaling=d ** -0.5)
    assert ours.shape == ref.shape == (1, n, kv_heads * groups, d)
    assert torch.allclose(ours, ref, atol=1e-5)
    # the tree mask matters: a row may not see its siblings, so dropping the mask changes the output
    unmasked, _ = grouped_query_sdpa(Groups(groups), query, key, value, torch.zeros_like(mask), scaling=d ** -0.5)
    assert not torch.allclose(unmasked, ref, atol=1e-3)


def test_the_runner_switches_a_grouped_target_and_its_tree_logits_stay_the_same():
    """ModelRunner runs the target through grouped_query_sdpa; the verification logits of a branchy tree
    equal those of transformers' sdpa on the same model (tiny Llama: 4 query heads over 2 K/V heads)."""
    torch.manual_seed(0)
    model = make_tiny_llama(seed=7)
    prompt, tree = [1, 5, 7, 9, 11, 3], TokenTree.root(13)
    for token, parent in [(20, 0), (21, 0), (30, 1), (31, 2), (40, 3)]:
        tree.add(token, parent, dedupe=False)
    assert model.config._attn_implementation == "sdpa"
    ModelRunner(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    logits = {}
    for impl in ("sdpa", GROUPED_SDPA):
        runner = ModelRunner(model)
        model.config._attn_implementation = impl  # force each in turn
        with torch.no_grad():
            runner.start(64)
            runner.forward(prompt)
            runner.cache.advance(len(prompt))
            logits[impl] = runner.forward(tree.tokens, tree.depths, tree.ancestor_mask())[1]
    assert torch.allclose(logits["sdpa"], logits[GROUPED_SDPA], atol=1e-5)


def test_a_model_not_on_sdpa_is_left_alone():
    model = make_tiny_llama(seed=1)
    model.config._attn_implementation = "eager"
    use_grouped_query_sdpa(model)
    assert model.config._attn_implementation == "eager"


def test_padding_masks_still_apply_after_the_switch():
    """transformers builds no mask at all for an attention name it has no mask function for; the switch
    registers sdpa's, so a left-padded batch gives the unpadded row's logits either way."""
    model = make_tiny_llama(seed=2)
    ids = torch.tensor([[0, 0, 5, 7, 9], [3, 4, 5, 7, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(ids[:1, 2:]).logits[0, -1]
        use_grouped_query_sdpa(model)
        padded = model(ids, attention_mask=mask).logits[0, -1]
    assert model.config._attn_implementation == GROUPED_SDPA
    assert torch.allclose(alone, padded, atol=1e-4)


def test_a_mask_tiled_by_the_caller_is_used_and_gives_the_same_attention():
    """grouped_mask_argument tiles once per forward what each layer would tile: the same result; and the
    given tiled mask is the one applied (a different one changes the output), unless its shape does not fit."""
    gen = torch.Generator().manual_seed(3)
    groups, kv_heads, d, prefix, n = 3, 2, 16, 9, 5
    query = torch.randn(1, kv_heads * groups, n, d, generator=gen)
    key, value = (torch.randn(1, kv_heads, prefix + n, d, generator=gen) for _ in range(2))
    mask = tree_mask(prefix, n)
    model = make_tiny_llama(seed=1)  # 4 query heads over 2 K/V heads
    ModelRunner(model)
    (name, tiled), = grouped_mask_argument(model, mask).items()
    assert tiled.shape == (1, 1, 2 * n, prefix + n)
    tiled = mask.repeat(1, 1, groups, 1)
    plain, _ = grouped_query_sdpa(Groups(groups), query, key, value, mask, scaling=d ** -0.5)
    given, _ = grouped_query_sdpa(Groups(groups), query, key, value, mask, scaling=d ** -0.5, **{name: tiled})
    assert torch.equal(given, plain)
    wrong, _ = grouped_query_sdpa(Groups(groups), query, key, value, mask, scaling=d ** -0.5,
                                  **{name: torch.zeros_like(tiled)})
    assert not torch.allclose(wrong, plain, atol=1e-3)
    misfit, _ = grouped_query_sdpa(Groups(groups), query, key, value, mask, scaling=d ** -0.5,
                                   **{name: torch.zeros_like(mask)})
    assert torch.equal(misfit, plain)
    assert grouped_mask_argument(model, mask[:, :, :1]) == {}  # one row: transformers folds it itself
