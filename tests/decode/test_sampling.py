"""Speculative sampling keeps the target's distribution exactly: chi-square tests on planted
distributions (single and multi-draft) and end to end through the engine; a deliberately wrong
rule must fail the same test."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdistill.decode.sampling as sampling_mod
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer, PromptLookupProposer
from specdistill.decode.sampling import SamplingConfig, logits_to_probs, verify_sampling
from specdistill.decode.tree import TokenTree
from tests.conftest import make_tiny_llama

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # a bad drafter: mass where p has little
Q2 = torch.tensor([0.30, 0.30, 0.10, 0.10, 0.10, 0.10])


def chi2_pvalue(samples: list[int], expected_probs: torch.Tensor) -> float:
    counts = np.bincount(samples, minlength=len(expected_probs)).astype(float)
    probs = expected_probs.double().numpy()
    expected = probs / probs.sum() * len(samples)
    keep = expected > 5  # chi-square needs enough expected mass per bin; merge the rest
    counts = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        counts, expected = counts[:-1], expected[:-1]
    return chisquare(counts, expected).pvalue


def first_emitted(qs: list[torch.Tensor | None], n: int, seed: int = 0) -> list[int]:
    """Draw children from each q (a None q is a deterministic proposal of token 0), verify, and
    return the first emitted token of each trial."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.log(P)[None].expand(1 + len(qs), -1)  # the target's p at every node (depth 1 only)
    cfg = SamplingConfig(temperature=1.0)
    out = []
    for _ in range(n):
        tree = TokenTree.root(0)
        for q in qs:
            token = 0 if q is None else int(torch.multinomial(q, 1, generator=gen))
            tree.add(token, 0, q, dedupe=False)
        verdict = verify_sampling(tree, logits, cfg, gen)
        out.append(tree.tokens[verdict.path[1]] if len(verdict.path) > 1 else verdict.bonus)
    return out


@pytest.mark.parametrize("qs", [[Q1], [Q2], [Q1, Q2], [None], [None, Q1]], ids=["q1", "q2", "multi", "onehot", "mixed"])
def test_emitted_tokens_follow_the_target(qs):
    assert chi2_pvalue(first_emitted(qs, 20000), P) > 1e-3


def test_a_wrong_rule_is_rejected(monkeypatch):
    """Resampling from p (instead of the residual max(p - q, 0)) after a rejection is biased."""
    monkeypatch.setattr(sampling_mod, "residual", lambda p, token, q: p)
    assert chi2_pvalue(first_emitted([Q1], 20000), P) < 1e-6


def exact_marginals(model, prompt, cfg, vocab):
    """P(t2) and P(t3) of the target's own sampling, by enumerating every prefix."""
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], cfg)  # [V]
        seqs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        logits = model(seqs).logits  # [V*V, T+2, V]
    p2_given_1 = logits_to_probs(logits[::vocab, -2], cfg)  # [V(a), V(b)]
    p3_given_12 = logits_to_probs(logits[:, -1], cfg).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2_given_1
    return joint12.sum(0), (joint12[..., None] * p3_given_12).sum((0, 1))


def sampled_tokens(engine, prompt, n):
    """n sampled 3-token continuations of prompt at temperature 1, seeds 0..n-1."""
    return [engine.generate(prompt, 3, SamplingConfig(1.0, seed=s)).tokens for s in range(n)]


def assert_unbiased_and_a_wrong_rule_caught(monkeypatch, engine, target, prompt, vocab, n=1500):
    """The engine's 2nd and 3rd sampled tokens follow the target's exact marginals (chi-square p > 1e-3), and
    resampling from p instead of the residual after a rejection is caught (p < 1e-6): the negative control."""
    exp2, exp3 = exact_marginals(target, prompt, SamplingConfig(temperature=1.0), vocab)
    outs = sampled_tokens(engine, prompt, n)
    assert chi2_pvalue([o[1] for o in outs], exp2) > 1e-3
    assert chi2_pvalue([o[2] for o in outs], exp3) > 1e-3
    monkeypatch.setattr(sampling_mod, "residual", lambda p, token, q: p)
    wrong = sampled_tokens(engine, prompt, n)
    assert min(chi2_pvalue([o[1] for o in wrong], exp2), chi2_pvalue([o[2] for o in wrong], exp3)) < 1e-6


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["t1", "t07_topk_topp"])
def test_engine_sampling_matches_target_distribution(cfg):
    vocab, prompt, n = 8, [1, 3, 5], 1500
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0)
    drafter = make_tiny_llama(vocab_size=vocab, seed=7, layers=1, peak=3.0)
    exp2, exp3 = exact_marginals(target, prompt, cfg, vocab)
    engine = SpeculativeEngine(target, DraftModelProposer(drafter, gamma=2))
    outs = [engine.generate(prompt, 3, SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=s)).tokens
            for s in range(n)]
    assert chi2_pvalue([o[1] for o in outs], exp2) > 1e-3
    assert chi2_pvalue([o[2] for o in outs], exp3) > 1e-3


def test_deterministic_proposals_keep_the_distribution():
    vocab, prompt = 8, [1, 3, 1, 3, 1]
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0)
    cfg = SamplingConfig(temperature=1.0)
    exp2, _ = exact_marginals(target, prompt, cfg, vocab)
    engine = SpeculativeEngine(target, PromptLookupProposer(num_tokens=3, max_ngram=2))
    outs = [engine.generate(prompt, 2, SamplingConfig(1.0, seed=s)).tokens for s in range(1500)]
    assert chi2_pvalue([o[1] for o in outs], exp2) > 1e-3


def test_same_seed_same_output(tiny_target):
    engine = SpeculativeEngine(tiny_target, DraftModelProposer(make_tiny_llama(seed=1, layers=1), 3))
    cfg = SamplingConfig(temperature=0.8, seed=11)
    assert engine.generate([1, 2, 3], 20, cfg).tokens == engine.generate([1, 2, 3], 20, cfg).tokens
