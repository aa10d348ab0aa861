"""The engine is lossless: greedy output is the target's own, for every proposer and edge case."""

from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer, PromptLookupProposer, build_proposer, lookup_continuation
from specdistill.decode.sampling import SamplingConfig
from tests.conftest import make_tiny_llama

PROMPT = [1, 5, 7, 9, 11, 5, 7]


def target_greedy(model, prompt, n, eos=None):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class AlwaysWrongProposer(PromptLookupProposer):
    """Drafts the token the target is known not to emit (its argmax + 1), four deep."""

    def __init__(self, target):
        super().__init__(by_length=False)  # one regime: its chain does not depend on matches
        self.target = target

    def propose(self, seq, max_depth, sampling, generator):
        from specdistill.decode.tree import TokenTree
        nxt = int(self.target(torch.tensor([seq])).logits[0, -1].argmax())
        wrong = (nxt + 1) % self.target.config.vocab_size
        return TokenTree.chain(seq[-1], [wrong, wrong, wrong][:max_depth])


def proposers(target):
    drafter = make_tiny_llama(seed=1, layers=1)
    return {
        "baseline": None,
        "bad_drafter": DraftModelProposer(drafter, gamma=4),
        "perfect_drafter": DraftModelProposer(target, gamma=4),
        "prompt_lookup": PromptLookupProposer(num_tokens=6),
        "always_wrong": AlwaysWrongProposer(target),
    }


@pytest.mark.parametrize("name", ["baseline", "bad_drafter", "perfect_drafter", "prompt_lookup", "always_wrong"])
def test_greedy_output_is_the_targets(tiny_target, name):
    ref = target_greedy(tiny_target, PROMPT, 40)
    proposer = proposers(tiny_target)[name]
    gen = SpeculativeEngine(tiny_target, proposer, adaptive=False).generate(PROMPT, 40)
    assert gen.tokens == ref
    assert gen.stats.new_tokens == 40
    # the adaptive draft length (timing-driven) changes speed, never the output
    assert SpeculativeEngine(tiny_target, proposers(tiny_target)[name]).generate(PROMPT, 40).tokens == ref
    if name == "perfect_drafter":
        assert gen.stats.alpha == 1.0 and gen.stats.tau > 3.0
    if name in ("always_wrong", "baseline"):
        assert gen.stats.tau == 1.0


def test_eos_inside_a_draft_stops_exactly(tiny_target):
    ref = target_greedy(tiny_target, PROMPT, 40)
    eos = ref[13]
    expected = ref[: ref.index(eos) + 1]
    gen = SpeculativeEngine(tiny_target, DraftModelProposer(tiny_target, gamma=6, eos_token_ids={eos}),
                            eos_token_ids={eos}).generate(PROMPT, 40)
    assert gen.tokens == expected
    assert gen.tokens == target_greedy(tiny_target, PROMPT, 40, eos=eos)


@pytest.mark.parametrize("max_new", [1, 2, 7, 11])
def test_max_new_tokens_inside_a_draft(tiny_target, max_new):
    ref = target_greedy(tiny_target, PROMPT, max_new)
    gen = SpeculativeEngine(tiny_target, DraftModelProposer(tiny_target, gamma=5)).generate(PROMPT, max_new)
    assert gen.tokens == ref and len(gen.tokens) == max_new


def test_repeated_requests_reuse_the_engine(tiny_target):
    engine = SpeculativeEngine(tiny_target, DraftModelProposer(make_tiny_llama(seed=1, layers=1), gamma=3))
    for prompt in ([1, 2, 3], PROMPT, [4] * 30, [9]):
        assert engine.generate(prompt, 12).tokens == target_greedy(tiny_target, prompt, 12)


def test_reduced_vocab_drafter_is_lossless(tiny_target):
    """A drafter whose head covers only some target tokens, mapped back through vocab_map."""
    drafter = make_tiny_llama(seed=3, layers=1)  # embeds all 64 target tokens ...
    drafter.lm_head = torch.nn.Linear(32, 16, bias=False)  # ... but its head scores only 16
    vocab_map = torch.arange(0, 64, 4)  # draft id i -> target id 4i
    proposer = DraftModelProposer(drafter, gamma=3, vocab_map=vocab_map, target_vocab=64)
    gen = SpeculativeEngine(tiny_target, proposer).generate(PROMPT, 30)
    assert gen.tokens == target_greedy(tiny_target, PROMPT, 30)
    sampled = SpeculativeEngine(tiny_target, proposer).generate(PROMPT, 10, SamplingConfig(temperature=1.0))
    assert len(sampled.tokens) == 10


def test_stats_add_up(tiny_target):
    gen = SpeculativeEngine(tiny_target, DraftModelProposer(make_tiny_llama(seed=1, layers=1), 4)).generate(PROMPT, 30)
    s = gen.stats
    assert s.new_tokens == 30
    assert s.accepted + s.target_forwards >= s.new_tokens  # every forward emits a bonus token
    assert s.drafted == sum(s.drafted_per_position)
    assert s.accepted == sum(s.accepted_per_position)
    assert s.tau == pytest.approx(s.new_tokens / s.target_forwards)
    assert s.draft_time_s > 0 and s.verify_time_s > 0 and s.total_time_s >= s.draft_time_s + s.verify_time_s


def test_prompt_lookup_finds_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    assert lookup_continuation(seq, 3, max_ngram=3, min_ngram=1) == [4, 5, 7]
    assert lookup_continuation([1, 2, 3], 3, 3, 1) == []


def test_bad_requests_are_refused(tiny_target):
    engine = SpeculativeEngine(tiny_target, None)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([1, 2], 0)
    with pytest.raises(ValueError, match="gamma"):
        DraftModelProposer(tiny_target, gamma=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)


def test_mismatched_vocabulary_is_refused(tiny_target):
    drafter = SimpleNamespace(kind="draft_model", model=make_tiny_llama(vocab_size=50), vocab_map=None)
    with pytest.raises(ValueError, match=r"vocabulary \(50 tokens\).*\(64\)"):
        build_proposer(drafter, tiny_target)
    unknown = SimpleNamespace(kind="crystal_ball", model=None, vocab_map=None)
    with pytest.raises(ValueError, match="crystal_ball"):
        build_proposer(unknown, tiny_target)


def test_gemv_friendly_head_changes_layout_not_values(tiny_target, monkeypatch):
    """The unpacked path (packing off or unavailable); packed drafters are left as they are."""
    from specdistill.decode.proposers import use_gemv_friendly_head
    from specdistill.models.packed_linear import DISABLE_ENV

    monkeypatch.setenv(DISABLE_ENV, "1")

    drafter = make_tiny_llama(seed=4, layers=1)
    ids = torch.tensor([PROMPT])
    before = drafter(ids).logits
    use_gemv_friendly_head(drafter)
    weight = drafter.get_output_embeddings().weight
    assert weight.t().is_contiguous() and not weight.is_contiguous()
    torch.testing.assert_close(drafter(ids).logits, before, rtol=1e-5, atol=1e-5)
    proposer = build_proposer(SimpleNamespace(kind="draft_model", model=drafter, vocab_map=None, manifest={}),
                              tiny_target, 4)
    gen = SpeculativeEngine(tiny_target, proposer).generate(PROMPT, 30)
    assert gen.tokens == target_greedy(tiny_target, PROMPT, 30)


def test_a_resuming_drafter_catches_up_in_a_forward_of_its_own(tiny_target):
    """After steps without drafting, the tokens emitted meanwhile are fed as a separate, timed forward;
    the chain drafted after it is the one a drafter fed everything at once drafts."""
    # its CATCH_UP_SPLIT is the one drafting reads
    import specdistill.decode.proposers.draft_model as draft_model_module

    drafter = make_tiny_llama(seed=1, layers=1)
    seq = PROMPT + target_greedy(tiny_target, PROMPT, 30)
    split, whole = DraftModelProposer(drafter, gamma=3), DraftModelProposer(drafter, gamma=3)
    torch.set_grad_enabled(False)  # as the engine drafts (inference mode); restored below
    try:
        check_catch_up(split, whole, seq, draft_model_module)
    finally:
        torch.set_grad_enabled(True)


def check_catch_up(split, whole, seq, draft_model_module):
    for proposer in (split, whole):
        proposer.begin(PROMPT, 64)
        proposer.propose(PROMPT, 3, SamplingConfig(), None)  # caches the prompt
    chain = split.propose(seq, 3, SamplingConfig(), None)  # 30 tokens behind: more than CATCH_UP_SPLIT
    assert len(seq) - len(PROMPT) > draft_model_module.CATCH_UP_SPLIT and split.last_catch_up_s() > 0
    old = draft_model_module.CATCH_UP_SPLIT
    draft_model_module.CATCH_UP_SPLIT = 10 ** 9  # as before the split: everything in one forward
    try:
        assert whole.propose(seq, 3, SamplingConfig(), None).tokens == chain.tokens
    finally:
        draft_model_module.CATCH_UP_SPLIT = old
    assert whole.last_catch_up_s() == 0.0
    split.propose(seq + chain.tokens[1:2], 3, SamplingConfig(), None)  # steady drafting: a token or two behind
    assert split.last_catch_up_s() == 0.0


class CatchingUpProposer(PromptLookupProposer):
    """Drafts a fixed chain at no cost but `catch_up` seconds per draft, all of it catching up."""

    def __init__(self, catch_up: float):
        super().__init__(num_tokens=3, by_length=False)  # one regime: its chain does not depend on matches
        self.catch_up = catch_up

    def propose(self, seq, max_depth, sampling, generator):
        import time

        from specdistill.decode.tree import TokenTree

        time.sleep(self.catch_up)
        return TokenTree.chain(seq[-1], [3, 3, 3][:max_depth])

    def last_catch_up_s(self):
        return self.catch_up


def test_the_adaptive_depth_does_not_learn_catch_up_as_drafting_cost(tiny_target):
    engine = SpeculativeEngine(tiny_target, CatchingUpProposer(0.05))
    gen = engine.generate(PROMPT, 12)
    assert gen.stats.draft_time_s >= 0.05  # the time was spent and is reported
    controller = engine.controller
    # but not charged to any depth (what remains is sleep's overshoot; charged, each would be >= 0.05)
    assert controller.draft_at and max(controller.draft_at.values()) < 0.025
