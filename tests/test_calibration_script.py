"""scripts/eagle3_calibration.py: which verified nodes were accepted, their path probabilities, and the
reliability table; and on a tiny drafter, every verified node is recorded once."""

from __future__ import annotations

import math

import pytest

from decode.engine import SpeculativeEngine
from decode.proposers.eagle3 import Candidate, Eagle3Proposer
from decode.tree import TokenTree
from scripts.eagle3_calibration import candidate_scores, node_records, record_generation, reliability
from tests.conftest import make_tiny_llama
from tests.decode.test_eagle3_decode import tiny_eagle
from tests.decode.test_engine import PROMPT


def small_tree() -> tuple[TokenTree, dict]:
    """root 1 -> a=10 (0.6) -> c=12 (0.6 x 0.5); root -> b=11 (0.3)."""
    candidates = [Candidate(10, -1, 1, math.log(0.6)), Candidate(11, -1, 1, math.log(0.3)),
                  Candidate(12, 0, 2, math.log(0.3))]
    tree = TokenTree.root(1)
    a = tree.add(10, 0, None, dedupe=False)
    tree.add(11, 0, None, dedupe=False)
    tree.add(12, a, None, dedupe=False)
    return tree, candidate_scores(candidates)


def test_nodes_on_the_accepted_path_and_only_they_count_as_accepted():
    tree, scores = small_tree()
    assert sorted(node_records(tree, scores, [10, 12, 99])) == [(1, pytest.approx(0.3), False),
                                                              (1, pytest.approx(0.6), True),
                                                              (2, pytest.approx(0.3), True)]
    assert [a for _, _, a in node_records(tree, scores, [11, 99])] == [False, True, False]
    assert not any(a for _, _, a in node_records(tree, scores, [42]))  # nothing accepted, the bonus only


def test_reliability_bins_count_every_node_once_and_average_within_the_bin():
    records = [(1, p, a) for p, a in [(0.05, False), (0.08, True), (0.55, True), (0.51, False), (0.99, True),
                                      (1.0, True)]]
    table = reliability(records)
    assert sum(row["nodes"] for row in table) == len(records)
    assert [(row["low"], row["nodes"], row["accepted"]) for row in table] == [(0.0, 2, 0.5), (0.5, 2, 0.5),
                                                                              (0.9, 2, 1.0)]
    assert all(row["low"] <= row["mean_probability"] <= row["high"] for row in table)


def test_a_generation_records_each_verified_node_with_the_engines_acceptance():
    target = make_tiny_llama(seed=0, layers=2, peak=4.0)
    proposer = Eagle3Proposer(tiny_eagle(target), target.get_input_embeddings(), depth=3, topk=2, tree_nodes=5,
                              min_prob=0)
    engine = SpeculativeEngine(target, proposer, adaptive=False)
    records, generation = record_generation(engine, proposer, PROMPT, 40)
    stats = generation.stats
    accepted_by_depth = [sum(a for d, _, a in records if d == k + 1) for k in range(3)]
    depths = len(stats.accepted_per_position)
    assert accepted_by_depth[:depths] == stats.accepted_per_position  # the engine's own count, position by position
    assert not any(accepted_by_depth[depths:]) and sum(accepted_by_depth) > 0
    assert sum(d == 1 for d, _, _ in records) == 2 * stats.drafted_per_position[0]  # top-2 under every step's root
    assert all(0 < p <= 1 for _, p, _ in records)
    assert proposer.draft_tree.__func__ is Eagle3Proposer.draft_tree  # the recording wrapper is gone
