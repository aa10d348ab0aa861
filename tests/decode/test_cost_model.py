"""The speculative step's cost model: hand-computed values, and the properties its answers must have."""

import math

import pytest

from specdistill.decode.cost_model import (
    acceptance_needed,
    best_depth,
    expected_tokens,
    interpolate,
    report_costs,
    speedup,
    step_cost,
)

FLAT = [1.0] * 10  # verification costs one forward whatever its rows (a GPU's regime)


def test_expected_tokens_and_cost_by_hand():
    cumulative = [0.5, 0.25, 0.1]
    assert expected_tokens(cumulative, 0) == 1.0
    assert expected_tokens(cumulative, 3) == pytest.approx(1.85)
    assert step_cost(2, 0.1, [1.0, 1.02, 1.05]) == pytest.approx(0.2 + 1.05)
    assert speedup(cumulative, 2, 0.1, [1.0, 1.02, 1.05]) == pytest.approx(1.75 / 1.25)


def test_plain_decoding_is_the_unit_and_useless_drafts_never_pay():
    costs = [1.0, 1.01, 1.03, 1.06]
    assert best_depth([0.0, 0.0, 0.0], 0.05, costs) == (0, 1.0)
    for depth in range(4):
        assert speedup([0.0] * 3, depth, 0.0, costs) <= 1.0


def test_better_drafters_draft_deeper_and_pay_more():
    costs = interpolate({1: 1.0, 4: 1.05, 8: 1.3}, 9)
    results = [best_depth([a ** k for k in range(1, 9)], 0.1, costs) for a in (0.2, 0.5, 0.8, 0.95)]
    depths, gains = zip(*results)
    assert list(depths) == sorted(depths) and depths[-1] > depths[0]
    assert list(gains) == sorted(gains) and gains[-1] > 2


def test_acceptance_needed_with_a_free_drafter_and_flat_verification():
    # 1 + a + ... + a^8 = 1.5 has its root just above 1/3 (a / (1 - a) = 0.5 at infinite depth)
    a = acceptance_needed(1.5, 0.0, FLAT, max_depth=8)
    assert 1 + sum(a ** k for k in range(1, 9)) == pytest.approx(1.5, abs=1e-3)
    assert a == pytest.approx(1 / 3, abs=2e-3)


def test_acceptance_needed_grows_with_the_goal_and_the_drafting_cost():
    costs = interpolate({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.3}, 9)
    by_goal = [acceptance_needed(g, 0.1, costs, 8) for g in (1.1, 1.3, 1.5, 2.0)]
    assert by_goal == sorted(by_goal)
    by_cost = [acceptance_needed(1.5, c, costs, 8) for c in (0.0, 0.05, 0.15, 0.3)]
    assert by_cost == sorted(by_cost) and by_cost[0] < by_cost[-1]
    # the answer is the least acceptance that reaches the goal
    a = by_cost[2]
    assert best_depth([a ** k for k in range(1, 9)], 0.15, costs)[1] >= 1.5
    assert best_depth([(a - 0.01) ** k for k in range(1, 9)], 0.15, costs)[1] < 1.5


def test_unreachable_when_drafting_costs_a_forward():
    assert acceptance_needed(1.5, 1.0, FLAT, 8) is None  # (1 + d) / (d + 1) = 1 even if all is accepted


def test_interpolate_between_and_past_the_measured_rows():
    costs = interpolate({1: 1.0, 3: 1.2, 5: 1.6}, 7)
    assert costs == pytest.approx([1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0])
    with pytest.raises(ValueError, match="1 row"):
        interpolate({2: 1.1, 4: 1.2}, 4)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="P_2"):
        expected_tokens([0.3, 0.5], 2)  # accepting two drafts cannot be likelier than accepting one
    with pytest.raises(ValueError, match="depth 3"):
        expected_tokens([0.3, 0.1], 3)
    with pytest.raises(ValueError, match="rows"):
        step_cost(4, 0.1, [1.0, 1.1])


def test_report_costs_from_an_evaluation_entry():
    baseline = {"wall_s": 20.0, "target_forwards": 1000}  # 20 ms a forward
    entry = {"tau": 1.3, "alpha": 0.25, "target_forwards": 1000, "draft_time_s": 3.6, "speedup": 1.1,
             "acceptance_per_position": [0.3, 0.35, 0.1]}
    costs = report_costs(entry, baseline)
    # 300 accepted of 1,200 drafted; 3 ms a drafted token = 0.15 of a forward
    assert costs["drafted_per_step"] == pytest.approx(1.2)
    assert costs["draft_cost"] == pytest.approx(0.15)
    assert costs["cumulative"] == [0.3, 0.3, 0.1]  # the running minimum: nested events
    no_drafts = report_costs({**entry, "tau": 1.0, "alpha": 0.0, "acceptance_per_position": []}, baseline)
    assert math.isnan(no_drafts["draft_cost"]) and no_drafts["cumulative"] == []
