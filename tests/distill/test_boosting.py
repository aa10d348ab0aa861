"""Boosting weights rise exactly where earlier drafters missed, are uniform when all covered, and are
normalised to mean 1 over the loss positions; coverage counts per drafter and together."""

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.distill.batching import collate
from specdistill.distill.boosting import (
    boost_weights,
    collate_weighted,
    coverage_report,
    covers,
    teacher_forced_coverage,
    weighted_token_ce,
)
from tests.conftest import make_tiny_llama


def logits_ranking(*orders: list[int], vocab: int = 6) -> torch.Tensor:
    """[N, V] logits whose descending order at row i starts with orders[i]."""
    rows = []
    for order in orders:
        row = torch.zeros(vocab)
        for rank, token in enumerate(order):
            row[token] = 10.0 - rank
        rows.append(row)
    return torch.stack(rows)


def test_top1_and_topm_coverage():
    logits = logits_ranking([3, 1, 4], [0, 5, 2], [2, 3, 1])  # [3, V]
    labels = torch.tensor([3, 5, 1])
    assert covers(logits, labels, "top1").tolist() == [True, False, False]
    assert covers(logits, labels, "topm", m=2).tolist() == [True, True, False]
    assert covers(logits, labels, "topm", m=3).tolist() == [True, True, True]


def test_coverage_through_a_reduced_head():
    vocab_map = torch.tensor([10, 20, 30])  # draft index i -> target id
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    assert covers(logits, torch.tensor([20, 20]), vocab_map=vocab_map).tolist() == [True, False]
    assert covers(logits, torch.tensor([30, 30]), "topm", 2, vocab_map).tolist() == [True, True]


def test_bad_rule_and_scheme_are_refused():
    with pytest.raises(ValueError, match="top3"):
        covers(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), "top3")
    with pytest.raises(ValueError, match="m >= 1"):
        covers(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), "topm", 0)
    with pytest.raises(ValueError, match="adaboost"):
        boost_weights(torch.ones(1, 3, dtype=torch.bool), 1.0, "adaboost")
    with pytest.raises(ValueError, match="strength"):
        boost_weights(torch.ones(1, 3, dtype=torch.bool), -1.0)


def test_linear_weights_rise_exactly_where_all_earlier_drafters_missed():
    covered = torch.tensor([[1, 0, 0, 1, 0],
                            [1, 1, 0, 0, 0]], dtype=torch.bool)  # [K=2, N=5]; positions 2 and 4 missed by both
    w = boost_weights(covered, strength=2.0)
    missed_by_all = torch.tensor([False, False, True, False, True])
    assert torch.all(w[missed_by_all] > w[~missed_by_all].max())
    assert torch.allclose(w[~missed_by_all], w[0].expand(3)) and w[2] == w[4]
    raw = torch.tensor([1, 1, 3, 1, 3], dtype=torch.float)  # 1 + strength * (1 - covered_by_any)
    torch.testing.assert_close(w, raw * 5 / raw.sum())
    assert w.mean().item() == pytest.approx(1.0) and w.sum().item() == pytest.approx(5.0)


def test_exp_weights_count_the_misses():
    covered = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)  # misses: 0, 1, 2
    w = boost_weights(covered, strength=0.5, scheme="exp")
    raw = torch.tensor([1.0, math.exp(0.5), math.exp(1.0)])
    torch.testing.assert_close(w, raw * 3 / raw.sum())
    assert w[0] < w[1] < w[2]
    huge = boost_weights(covered, strength=1000.0, scheme="exp")  # no overflow: all mass on the worst position
    assert torch.isfinite(huge).all() and huge.tolist() == pytest.approx([0.0, 0.0, 3.0])


@pytest.mark.parametrize("scheme", ["linear", "exp"])
def test_uniform_when_everything_is_covered_or_nothing_came_before(scheme):
    assert boost_weights(torch.ones(3, 7, dtype=torch.bool), 4.0, scheme).tolist() == [1.0] * 7
    assert boost_weights(torch.zeros(3, 7, dtype=torch.bool), 4.0, scheme).tolist() == [1.0] * 7  # all missed alike
    assert boost_weights(torch.zeros(0, 7, dtype=torch.bool), 4.0, scheme).tolist() == [1.0] * 7
    assert boost_weights(torch.tensor([[True, False]]), 0.0, scheme).tolist() == [1.0, 1.0]


def test_normalised_over_the_mask_and_zero_outside():
    covered = torch.tensor([[[1, 0, 1, 0], [0, 0, 1, 1]]], dtype=torch.bool)  # [K=1, B=2, T=4]
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    w = boost_weights(covered, 1.0, mask=mask)
    assert (w[~mask] == 0).all()
    assert w[mask].mean().item() == pytest.approx(1.0) and w.sum().item() == pytest.approx(6.0)
    assert w[0, 1] == pytest.approx(2 * w[0, 0].item())  # a miss weighs 1 + strength = 2 covered positions


def test_coverage_report_per_drafter_and_cumulative():
    covered = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    report = coverage_report(covered)
    assert report["per_drafter"] == pytest.approx([0.25, 0.25, 0.75])
    assert report["cumulative"] == pytest.approx([0.25, 0.5, 0.75])
    assert report["positions"] == 4


def test_weighted_ce_is_plain_ce_with_unit_weights_and_scales_per_position():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    plain = F.cross_entropy(logits[mask], labels[mask], reduction="sum")
    torch.testing.assert_close(weighted_token_ce(logits, labels, mask, torch.ones(2, 5)), plain)
    weights = torch.ones(2, 5)
    weights[0, 2] = 3.0
    weights[1, 4] = 100.0  # masked out: no effect
    extra = 2.0 * F.cross_entropy(logits[0, 2:3], labels[0, 2:3], reduction="sum")
    torch.testing.assert_close(weighted_token_ce(logits, labels, mask, weights), plain + extra)


RECORDS = [{"prompt_ids": [1, 5, 6], "response_ids": [7, 8, 9, 2]},
           {"prompt_ids": [1, 9], "response_ids": [10, 11]},
           {"prompt_ids": [1, 3, 4, 5, 6, 7], "response_ids": [12, 13, 14, 15, 16]}]


def test_weights_land_on_the_response_positions_as_collate_places_labels():
    records = [dict(r, weights=[float(i + 1) for i in range(len(r["response_ids"]))]) for r in RECORDS[:2]]
    batch, weights = collate_weighted(records, pad_id=0, max_len=16)
    for row in range(2):
        assert weights[row][batch.loss_mask[row]].tolist() == records[row]["weights"]
        assert (weights[row][~batch.loss_mask[row]] == 0).all()
    _, unit = collate_weighted(RECORDS[:2], pad_id=0, max_len=16)  # no weights: 1 on the loss positions
    assert torch.equal(unit, batch.loss_mask.float())
    with pytest.raises(ValueError, match="record 0: 1 weights for 4"):
        collate_weighted([dict(RECORDS[0], weights=[1.0])], 0, 16)


def test_teacher_forced_coverage_aligns_with_the_fitted_responses():
    torch.manual_seed(0)
    model = make_tiny_llama(vocab_size=20, seed=4, layers=1)
    max_len = 8  # record 2 (11 tokens) is cut: 5 response tokens kept, as in training
    got = teacher_forced_coverage(model, RECORDS, "top1", 1, None, pad_id=0, max_len=max_len, batch_size=2)
    assert [len(r) for r in got] == [4, 2, 5]
    batch = collate(RECORDS, 0, max_len)
    with torch.no_grad():
        argmax = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.argmax(-1)
    for row, hits in enumerate(got):
        expected = (argmax[row] == batch.labels[row])[batch.loss_mask[row]].tolist()
        assert hits == expected
    everything = teacher_forced_coverage(model, RECORDS, "topm", 20, None, 0, max_len)
    assert all(all(r) for r in everything)
