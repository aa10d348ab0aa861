"""Identity, limit, masking and normalization properties of the distillation losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.distill.losses import (
    LOSS_KINDS,
    TopK,
    count_tokens,
    cross_entropy_loss,
    distill_loss,
    forward_kl,
    jsd,
    reverse_kl,
    token_normalized,
    total_variation,
)

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def random_logits(*shape, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def full_topk(logits: torch.Tensor, k: int) -> TopK:
    values, ids = F.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return TopK(ids, values)


def loss(kind, draft, target, mask=None, **kw):
    labels = target.argmax(-1) if isinstance(target, torch.Tensor) else None
    return distill_loss(kind, draft, target=target, labels=labels, mask=mask, **kw)


# ---- identities -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_zero_when_equal_and_positive_otherwise(kind, temperature):
    draft, other = random_logits(2, 5, 11, seed=1), random_logits(2, 5, 11, seed=2)
    same = distill_loss(kind, draft, target=draft.clone(), temperature=temperature)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    assert distill_loss(kind, draft, target=other, temperature=temperature).item() > 1e-3


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_topk_tail_gives_zero_when_draft_equals_target(kind, k, temperature):
    draft = random_logits(2, 4, 9, seed=3).requires_grad_(True)
    value = distill_loss(kind, draft, target=full_topk(draft.detach(), k), temperature=temperature)
    value.backward()
    assert value.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(draft.grad).all()


def test_hand_computed_values_on_three_tokens():
    p, q = [0.7, 0.2, 0.1], [0.2, 0.5, 0.3]           # target, draft
    target, draft = torch.tensor([p]).log()[None], torch.tensor([q]).log()[None]   # [1, 1, 3]
    fkl = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.5) + 0.1 * math.log(0.1 / 0.3)
    rkl = 0.2 * math.log(0.2 / 0.7) + 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.1)
    m = [0.45, 0.35, 0.2]                                # beta * p + (1 - beta) * q at beta = 0.5
    kl_pm = sum(a * math.log(a / b) for a, b in zip(p, m))
    kl_qm = sum(a * math.log(a / b) for a, b in zip(q, m))
    assert forward_kl(draft, target).item() == pytest.approx(fkl, rel=1e-5)
    assert reverse_kl(draft, target).item() == pytest.approx(rkl, rel=1e-5)
    assert jsd(draft, target, beta=0.5).item() == pytest.approx((0.5 * kl_pm + 0.5 * kl_qm) / 0.25, rel=1e-5)
    assert total_variation(draft, target).item() == pytest.approx(0.5, rel=1e-5)
    assert cross_entropy_loss(draft, torch.tensor([[1]])).item() == pytest.approx(-math.log(0.5), rel=1e-5)


def test_cross_entropy_matches_torch_with_ignored_labels():
    draft = random_logits(3, 6, 10, seed=4)
    labels = torch.randint(0, 10, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.rand(3, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    expected = F.cross_entropy(draft.reshape(-1, 10), labels.masked_fill(~mask, -100).reshape(-1))
    assert (cross_entropy_loss(draft, labels.masked_fill(~mask, -100), mask).item()
            == pytest.approx(expected.item(), rel=1e-5))


# ---- JSD convention -----------------------------------------------------------------------------

def test_jsd_endpoints_are_forward_and_reverse_kl_and_continuous():
    # moderate logits: the approach to the limit is slower where log(p / q) exceeds log(1 / beta)
    draft, target = random_logits(2, 5, 7, seed=5, scale=1.0), random_logits(2, 5, 7, seed=6, scale=1.0)
    fkl, rkl = forward_kl(draft, target).item(), reverse_kl(draft, target).item()
    assert jsd(draft, target, beta=0.0).item() == pytest.approx(fkl, rel=1e-6)
    assert jsd(draft, target, beta=1.0).item() == pytest.approx(rkl, rel=1e-6)
    assert jsd(draft, target, beta=1e-4).item() == pytest.approx(fkl, rel=1e-2)
    assert jsd(draft, target, beta=1 - 1e-4).item() == pytest.approx(rkl, rel=1e-2)
    with pytest.raises(ValueError, match="beta"):
        jsd(draft, target, beta=1.5)


def test_jsd_is_rescaled_gkd():
    """beta * (1 - beta) * jsd is GKD's / TRL's generalized JSD; at beta = 0.5 that is the classic JSD."""
    draft, target = random_logits(1, 3, 5, seed=7), random_logits(1, 3, 5, seed=8)
    p, q = F.softmax(target, -1), F.softmax(draft, -1)
    m = 0.5 * (p + q)
    classic = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    assert (0.25 * jsd(draft, target, beta=0.5)).item() == pytest.approx(classic.mean().item(), rel=1e-5)


# ---- total variation ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_tvd_is_in_unit_interval(seed):
    for scale in (0.1, 3.0, 30.0):
        draft, target = (random_logits(4, 6, 13, seed=seed, scale=scale),
                         random_logits(4, 6, 13, seed=seed + 50, scale=scale))
        per_token = total_variation(draft, target, reduction="none")
        assert (per_token >= 0).all() and (per_token <= 1).all()
        topk = total_variation(draft, full_topk(target, 4), reduction="none")
        assert (topk >= 0).all() and (topk <= 1).all()


def test_tvd_is_one_for_disjoint_supports():
    draft = torch.tensor([[[100.0, -100.0, -100.0, -100.0]]])
    target = torch.tensor([[[-100.0, -100.0, 100.0, 100.0]]])
    assert total_variation(draft, target).item() == pytest.approx(1.0, abs=1e-6)
    assert total_variation(draft, full_topk(target, 2)).item() == pytest.approx(1.0, abs=1e-6)


# ---- masking and normalization ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("as_topk", [False, True])
def test_masked_positions_do_not_count(kind, as_topk):
    draft, target = random_logits(2, 6, 8, seed=9), random_logits(2, 6, 8, seed=10)
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    draft2, target2 = draft.clone(), target.clone()
    draft2[~mask] = random_logits(int((~mask).sum()), 8, seed=11, scale=10.0)
    target2[~mask] = random_logits(int((~mask).sum()), 8, seed=12, scale=10.0)
    wrap = (lambda t: full_topk(t, 3)) if as_topk else (lambda t: t)
    labels, labels2 = target.argmax(-1), target2.argmax(-1).masked_fill(~mask, -100)
    a = distill_loss(kind, draft, target=wrap(target), labels=labels, mask=mask, beta=0.3)
    leaf = draft2.clone().requires_grad_(True)
    b = distill_loss(kind, leaf, target=wrap(target2), labels=labels2, mask=mask, beta=0.3)
    b.backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert (leaf.grad[~mask] == 0).all()


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_token_normalization_across_micro_batches_equals_concatenated_batch(kind):
    """Micro-batches of different lengths and token counts: window mean == one batch holding both."""
    vocab = 7
    draft_a, target_a = random_logits(2, 4, vocab, seed=13), random_logits(2, 4, vocab, seed=14)
    draft_b, target_b = random_logits(3, 7, vocab, seed=15), random_logits(3, 7, vocab, seed=16)
    mask_a = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    mask_b = torch.ones(3, 7, dtype=torch.bool)
    mask_b[0, 5:] = False

    def pad(t, width):  # right-pad the time dimension with zeros
        return F.pad(t, (0, 0, 0, width - t.shape[1])) if t.dim() == 3 else F.pad(t, (0, width - t.shape[1]))

    draft = torch.cat([pad(draft_a, 7), draft_b]).requires_grad_(True)
    target, mask = torch.cat([pad(target_a, 7), target_b]), torch.cat([pad(mask_a, 7), mask_b])
    whole = loss(kind, draft, target, mask, beta=0.4)
    whole.backward()

    parts = [(draft_a.clone().requires_grad_(True), target_a, mask_a),
             (draft_b.clone().requires_grad_(True), target_b, mask_b)]
    sums = [(loss(kind, d, t, m, beta=0.4, reduction="sum"), count_tokens(m)) for d, t, m in parts]
    assert token_normalized(sums).item() == pytest.approx(whole.item(), rel=1e-5)
    n_window = sum(count_tokens(m) for _, _, m in parts)
    accumulated = 0.0
    for d, t, m in parts:   # gradient accumulation: each micro-batch divided by the window's count
        part = loss(kind, d, t, m, beta=0.4, normalizer=n_window)
        part.backward()
        accumulated += part.item()
    assert accumulated == pytest.approx(whole.item(), rel=1e-5)
    grads = torch.cat([pad(parts[0][0].grad, 7), parts[1][0].grad])
    assert torch.allclose(grads, draft.grad, atol=1e-7)
    assert whole.item() != pytest.approx(0.5 * (loss(kind, draft_a, target_a, mask_a, beta=0.4).item()
                                                + loss(kind, draft_b, target_b, mask_b, beta=0.4).item()), rel=1e-3)


# ---- top-k targets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_with_k_equal_vocab_matches_full(kind, temperature):
    draft, target = random_logits(2, 5, 10, seed=17), random_logits(2, 5, 10, seed=18)
    mask = torch.rand(2, 5, generator=torch.Generator().manual_seed(2)) > 0.2
    full = distill_loss(kind, draft, target=target, mask=mask, temperature=temperature, beta=0.3)
    topk = distill_loss(kind, draft, target=full_topk(target, 10), mask=mask, temperature=temperature, beta=0.3)
    assert topk.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_topk_collapse_is_a_lower_bound_of_the_full_divergence(kind):
    draft, target = random_logits(3, 5, 12, seed=19), random_logits(3, 5, 12, seed=20)
    full = distill_loss(kind, draft, target=target, reduction="none", beta=0.3)
    for k in (1, 4, 8):
        topk = distill_loss(kind, draft, target=full_topk(target, k), reduction="none", beta=0.3)
        assert (topk <= full + 1e-5).all()


def test_topk_gradients_are_finite_when_the_tail_is_empty():
    """A target point mass (tail exactly 0) and a draft near one: no NaN from log(0)."""
    draft = torch.tensor([[[30.0, -30.0, -30.0]]], requires_grad=True)
    target = TopK(torch.tensor([[[0]]]), torch.tensor([[[0.0]]]))
    for kind in DIVERGENCES:
        draft.grad = None
        value = distill_loss(kind, draft, target=target, beta=0.5)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(draft.grad).all()


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_a_confident_draft_against_a_target_with_tail_mass_stays_bounded(kind):
    """The draft puts all but ~1e-13 of its mass on the target's top-2 while the target keeps 2% outside:
    1 - sum would round the draft's tail to an empty bucket and give a ~1e36 loss (seen in online training).
    The exact tail keeps it finite and still below the full divergence."""
    target = torch.tensor([[[4.0, 3.0, 0.1, 0.0, -0.2, -0.5]]])            # ~2% outside the top-2
    draft = torch.tensor([[[20.0, 19.0, -10.0, -10.0, -10.0, -10.0]]], requires_grad=True)
    full = distill_loss(kind, draft, target=target, beta=0.3)
    topk = distill_loss(kind, draft, target=full_topk(target, 2), beta=0.3)
    topk.backward()
    assert torch.isfinite(topk) and torch.isfinite(draft.grad).all()
    assert 0.0 < topk.item() <= full.item() + 1e-5


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_a_target_tail_below_eps_with_draft_tail_mass_stays_bounded(kind):
    """The reverse case: the target's stored top-k covers all but <1e-6 (an empty tail bucket) while the
    draft spreads mass outside it. Reverse KL and JSD would take log(0) of the target's tail."""
    target = torch.tensor([[[20.0, 19.0, -10.0, -10.0, -10.0, -10.0]]])
    draft = torch.tensor([[[1.0, 0.5, 0.3, 0.2, 0.1, 0.0]]], requires_grad=True)
    value = distill_loss(kind, draft, target=full_topk(target, 2), beta=0.3)
    value.backward()
    assert torch.isfinite(value) and value.item() < 100 and torch.isfinite(draft.grad).all()


# ---- errors -----------------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    draft = random_logits(1, 2, 5)
    with pytest.raises(ValueError, match="'kl'"):
        distill_loss("kl", draft, target=draft)
    with pytest.raises(ValueError, match="labels"):
        distill_loss("ce", draft, target=draft)
    with pytest.raises(ValueError, match="temperature"):
        distill_loss("ce", draft, labels=torch.zeros(1, 2, dtype=torch.long), temperature=2.0)
    with pytest.raises(ValueError, match="differ"):
        distill_loss("fkl", draft, target=random_logits(1, 2, 6))
    with pytest.raises(ValueError, match="reduction"):
        distill_loss("fkl", draft, target=draft, reduction="avg")
    with pytest.raises(ValueError, match="mask shape"):
        distill_loss("fkl", draft, target=draft, mask=torch.ones(1, 3, dtype=torch.bool))


def test_outcomes_without_mass_on_either_side_keep_gradients_finite():
    """A top-k slot with -inf on both sides (an id outside a reduced head) must not poison the gradient."""
    from specdistill.distill.losses import TopK, distill_loss

    logits = torch.randn(1, 2, 5, requires_grad=True)
    with_absent = torch.cat([logits, torch.full((1, 2, 1), float("-inf"))], -1)
    target = TopK(torch.tensor([[[0, 5], [1, 2]]]), torch.tensor([[[-0.1, float("-inf")], [-0.5, -1.2]]]))
    for kind in ("fkl", "rkl", "jsd", "tvd"):
        logits.grad = None
        distill_loss(kind, with_absent, target=target, beta=0.5).backward()
        assert torch.isfinite(logits.grad).all(), kind
