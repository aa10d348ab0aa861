"""The greedy head in the engine (models.kernel_linear.GreedyHead through ModelRunner.forward_greedy): greedy steps
emit what the argmax of every logit gives, and it is used only where the head is the Q8_0 kernel's FMA form."""

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import PromptLookupProposer
from specdistill.decode.runner import ModelRunner
from specdistill.models.kernel_linear import FULL_HEAD_ENV
from specdistill.models.kernels import amx_unavailable, greedy_head_unavailable
from specdistill.models.quant_formats import q80_rounded
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import PROMPT, target_greedy

needs_greedy_head = pytest.mark.skipif(greedy_head_unavailable() is not None or amx_unavailable() is None,
                                       reason="the greedy head: where it pays (AVX512-VNNI) and the head on the FMA "
                                              "form")


def q80_target():
    """A tiny target whose head is exactly Q8_0 (as the default target's tied embedding) and of the int8 kernel's
    shapes (128 outputs, K = 128)."""
    target = make_tiny_llama(seed=0, layers=2, hidden_size=128, vocab_size=128, peak=3.0)
    with torch.no_grad():
        target.lm_head.weight.copy_(q80_rounded(target.lm_head.weight))
    return target


@needs_greedy_head
def test_forward_greedy_gives_the_argmax_of_forwards_logits():
    runner = ModelRunner(q80_target())
    assert runner.greedy_head is not None
    runner.start(64)
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for tokens, depths, mask in [(PROMPT, None, None), ([5, 9, 11, 3], [0, 1, 1, 2], tree_mask)]:
        hidden, best = runner.forward_greedy(tokens, depths, mask)
        again, logits = runner.forward(tokens, depths, mask)  # the same rows after the same prefix
        assert torch.equal(best, logits.argmax(-1)) and torch.equal(hidden, again)
        if depths is None:  # the prompt stays; the tree after it is verified
            runner.cache.advance(len(tokens))


@needs_greedy_head
def test_greedy_decoding_emits_the_same_tokens_with_and_without_the_greedy_head(monkeypatch):
    target = q80_target()
    reference = target_greedy(target, PROMPT, 40)
    for proposer in (None, PromptLookupProposer()):
        fast = SpeculativeEngine(target, proposer)
        assert fast.target.greedy_head is not None
        assert fast.generate(PROMPT, 40).tokens == reference
    monkeypatch.setenv(FULL_HEAD_ENV, "1")
    full = SpeculativeEngine(target, PromptLookupProposer())
    assert full.target.greedy_head is None and full.generate(PROMPT, 40).tokens == reference


def test_no_greedy_head_where_the_head_is_not_exactly_q80():
    assert ModelRunner(make_tiny_llama(seed=0, hidden_size=128, vocab_size=128)).greedy_head is None


@needs_greedy_head
def test_batched_greedy_generation_reads_the_same_tokens_from_the_argmax_head(monkeypatch):
    from specdistill.distill.generation import ArgmaxLogits, argmax_head, generate_batch
    from specdistill.models.kernel_linear import greedy_head_for
    target = q80_target()
    prompts = [[1, 5, 9, 12], [1, 7], [1, 3, 3, 3, 8, 20]]
    fast = generate_batch(target, prompts, max_new_tokens=24, pad_id=0, eos_token_ids={2})
    monkeypatch.setenv(FULL_HEAD_ENV, "1")
    assert generate_batch(target, prompts, max_new_tokens=24, pad_id=0, eos_token_ids={2}) == fast
    monkeypatch.delenv(FULL_HEAD_ENV)
    head = target.get_output_embeddings()
    with argmax_head(target, greedy_head_for(head)):
        argmax = target.get_output_embeddings()
        assert isinstance(argmax, ArgmaxLogits)
        x = torch.randn(2, 3, 128)
        logits = argmax(x)  # [2, 3, V]: 0 at each row's argmax of the head's logits, -inf elsewhere
        assert torch.equal(logits.argmax(-1), head(x).argmax(-1))
        assert bool((logits == 0).sum(-1).eq(1).all()) and bool(torch.isinf(logits).sum(-1).eq(127).all())
        x[1, 2, 0] = float("nan")  # a row without a token: the head's own logits
        assert torch.isnan(argmax(x)).any()
    assert target.get_output_embeddings() is head  # put back
