"""scripts/prompt_lookup_study.py: its engine policy is the engine's lookup, and its replay counts what greedy
verification would accept."""

import random

import pytest

from decode.proposers.prompt_lookup import lookup_match
from scripts.prompt_lookup_study import (POLICIES, NgramIndex, Policy, accepted_and_rows, main, proposals, replay,
                                         within_nodes)


def test_the_engine_policy_proposes_what_the_engine_looks_up():
    rng = random.Random(0)
    engine = POLICIES[0]
    for _ in range(30):
        seq = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]  # a small vocabulary: many matches
        index = NgramIndex(seq, engine.max_ngram)
        for end in range(1, len(seq) + 1):
            n, drafts = lookup_match(seq[:end], engine.num_tokens, engine.max_ngram, engine.min_ngram)
            assert proposals(index, end, engine) == (n, [drafts] if drafts else [])


def test_accepted_is_the_longest_proposed_prefix_and_rows_count_shared_prefixes_once():
    assert accepted_and_rows([[1, 2, 3], [1, 2, 4, 5]], [1, 2, 4, 6]) == (3, 5)
    assert accepted_and_rows([], [1]) == (0, 0)
    assert within_nodes([[1, 2, 3], [1, 2, 4], [7, 8]], 4) == [[1, 2, 3], [1, 2, 4]]
    assert within_nodes([[1, 2, 3, 4, 5]], 3) == [[1, 2, 3]]


def test_replay_of_an_answer_that_repeats_its_prompt():
    prompt = [5, 6, 7, 8, 9, 10, 11]
    answer = [5, 6, 7, 8, 9, 10, 11, 12]  # a copy of the prompt, then a new token
    one_chain = replay([(prompt, answer)], Policy("engine", num_tokens=10))
    # step 1: no earlier 11 -> emits 5; step 2: "5" matched -> 6..11 accepted (6 tokens) + 12 = 7 tokens
    assert one_chain["steps"] == 2 and one_chain["tau"] == 4.0
    plain = replay([(prompt, answer)], Policy("none", min_ngram=3, max_ngram=3, num_tokens=1))
    assert plain["tau"] >= 1.0 and plain["rows_per_step"] >= 1.0


def test_a_directory_without_teacher_data_is_an_error_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path)])
    assert exit_.value.code == 2
    assert f"argument teacher_data: no teacher data in {tmp_path}" in capsys.readouterr().err
