"""A reduced draft head extended, per request, by the prompt's own tokens: exact scores, reset per request,
lossless, and it drafts the copied tokens a fixed reduced head never can."""

import copy
from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer, build_proposer
from specdistill.decode.sampling import SamplingConfig
from specdistill.models.draft_models import reduce_head
from tests.conftest import make_tiny_llama

PROMPT = list(range(1, 48, 2))  # 24 distinct odd tokens


@pytest.fixture(scope="module")
def tied_target():
    return make_tiny_llama(seed=5, layers=2, tie=True).eval()


def reduced_copy(model, vocab_map: torch.Tensor):
    return reduce_head(copy.deepcopy(model), vocab_map).eval()


def without(tokens) -> torch.Tensor:
    """Every target id (of 64) except `tokens`."""
    drop = set(tokens)
    return torch.tensor([t for t in range(64) if t not in drop])


def greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_prompt_rows_score_as_the_tied_full_head(tied_target):
    base = without(PROMPT[:10])
    proposer = DraftModelProposer(reduced_copy(tied_target, base), gamma=3, vocab_map=base, target_vocab=64,
                                  prompt_vocab=True)
    proposer.begin(PROMPT, 64)
    assert proposer.vocab_map.tolist() == base.tolist() + PROMPT[:10]  # only what the head lacked, once
    with torch.no_grad():
        logits = proposer._feed(PROMPT)  # [M + N]
        full = tied_target(torch.tensor([PROMPT])).logits[0, -1]  # [V]
    assert torch.allclose(logits, full[proposer.vocab_map], atol=1e-4)


def test_the_extension_is_per_request(tied_target):
    base = without(PROMPT)
    proposer = DraftModelProposer(reduced_copy(tied_target, base), gamma=3, vocab_map=base, target_vocab=64,
                                  prompt_vocab=True)
    proposer.begin(PROMPT, 64)
    assert len(proposer.vocab_map) == 64
    proposer.begin([2, 4, 6], 64)  # all in the base head: nothing added, nothing left from the last request
    assert proposer.vocab_map.tolist() == base.tolist() and proposer.extra_rows is None


def test_copied_tokens_are_drafted_and_the_output_stays_the_targets(tied_target):
    """The drafter is the target itself with every prompt token cut from its head: with the prompt's
    rows back it is the target again (alpha 1); without them it cannot draft what the target copies."""
    ref = greedy(tied_target, PROMPT, 30)
    assert set(ref) & set(PROMPT), "the case needs a target that copies from its prompt"
    base = without(PROMPT)
    drafter = reduced_copy(tied_target, base)
    stats = {}
    for on in (False, True):
        proposer = DraftModelProposer(drafter, gamma=4, vocab_map=base, target_vocab=64, prompt_vocab=on)
        gen = SpeculativeEngine(tied_target, proposer, adaptive=False).generate(PROMPT, 30)
        assert gen.tokens == ref
        stats[on] = gen.stats
        sampled = SpeculativeEngine(tied_target, proposer).generate(PROMPT, 12, SamplingConfig(temperature=1.0))
        assert len(sampled.tokens) == 12
    assert stats[True].alpha == 1.0
    assert stats[False].alpha < 1.0


def test_sampling_q_covers_the_head_and_the_prompt_only(tied_target):
    base = without(PROMPT)
    proposer = DraftModelProposer(reduced_copy(tied_target, base), gamma=2, vocab_map=base, target_vocab=64,
                                  prompt_vocab=True)
    proposer.begin([2, 3, 5], 16)
    with torch.no_grad():
        logits = proposer._feed([2, 3, 5])
    _, q = proposer._choose(logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert q.shape == (64,) and torch.isclose(q.sum(), torch.tensor(1.0))
    allowed = set(base.tolist()) | {3, 5}
    assert all(float(q[t]) == 0.0 for t in range(64) if t not in allowed)
    assert float(q[3]) > 0 and float(q[5]) > 0


def test_prompt_vocab_follows_the_manifest_and_needs_a_reduced_head(tied_target):
    base = without(PROMPT)
    drafter = SimpleNamespace(kind="draft_model", model=reduced_copy(tied_target, base), vocab_map=base,
                              manifest={"extra": {"prompt_vocab": True}})
    assert build_proposer(drafter, tied_target, 3).prompt_vocab is True
    assert build_proposer(drafter, tied_target, 3, prompt_vocab=False).prompt_vocab is False
    drafter.manifest = {}
    assert build_proposer(drafter, tied_target, 3).prompt_vocab is False
    with pytest.raises(ValueError, match="prompt_vocab"):
        DraftModelProposer(tied_target, gamma=3, prompt_vocab=True)
