"""scripts/eagle3_teacher_forced.py's copy statistics: a 2-gram lookup's hits on the answer positions, and the
drafter's first-step hits where the lookup is right."""

from __future__ import annotations

from scripts.eagle3_teacher_forced import copy_stats, lookup_hits


def test_lookup_hits_name_the_token_that_followed_the_latest_earlier_2gram():
    prompt = [5, 6, 7, 8, 5, 6]
    answer = [9, 7, 8, 5]  # rows predict seq[t + 2] for t from len(prompt) - 2: 9 (after 5 6: 7, wrong), 7, 8, 5
    hits = lookup_hits(prompt, answer)
    assert len(hits) == len(answer)
    assert hits[0] is False           # "5 6" was followed by 7 before, the answer says 9
    assert hits[1] is None            # "6 9" never occurred earlier: no draft
    assert hits[2] is None            # "9 7" neither
    assert hits[3] is True            # "7 8" was followed by 5


def test_copy_stats_count_the_drafter_only_where_the_lookup_is_right():
    stats = copy_stats([True, False, True, False], [True, True, None, False])
    assert stats["positions"] == 4
    assert stats["lookup_right"] == 0.5
    assert stats["drafter_right_where_lookup_right"] == 0.5
    assert stats["drafter_right"] == 0.5
