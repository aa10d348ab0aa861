"""Prompt lookup's drafting regimes: one adaptive depth per matched n-gram length (`by_length`), a step without a
match drafting nothing, the option read from kw or the drafter's manifest, and the output still the target's."""

import pytest

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import PromptLookupProposer, WithPromptLookup, build_proposer
from specdistill.decode.proposers.prompt_lookup import prompt_lookup_proposer
from specdistill.decode.sampling import SamplingConfig
from specdistill.models.drafters import load_drafter, save_drafter
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import target_greedy
from tests.models.conftest import make_tiny_target

REPEATING = [1, 5, 7, 9, 11, 5, 7, 9, 3, 5, 7]  # "5 7" recurs, "3 5 7" does not: a 2-gram match, 9 3 5 7 ...


def test_each_match_length_is_a_regime_and_no_match_drafts_nothing():
    lookup = PromptLookupProposer(6)
    assert lookup.regime(REPEATING) == ("ngram2", 6)
    assert lookup.regime(REPEATING + [9]) == ("ngram3", 6)  # "5 7 9" occurred
    assert lookup.regime([1, 2, 3, 4]) == ("ngram0", 0)  # nothing recurs
    assert lookup.regime([1, 2, 3, 3]) == ("ngram1", 6)  # "3" at the end: its continuation is the last 3
    assert lookup.propose([1, 2, 3, 4], 6, SamplingConfig(), None).tokens == [4]  # the root alone
    assert lookup.propose(REPEATING, 6, SamplingConfig(), None).tokens == [7, 9, 3, 5, 7]
    assert PromptLookupProposer(6, by_length=False).regime(REPEATING) == (None, 6)


def test_the_match_is_computed_once_per_step_and_anew_for_each_request():
    lookup = PromptLookupProposer(4)
    seq = [1, 5, 7, 9, 5, 7]
    assert lookup.regime(seq) == ("ngram2", 4)
    lookup.last_match = (lookup.last_match[0], (2, [42]))  # what a second computation would not give
    assert lookup.propose(seq, 4, SamplingConfig(), None).tokens == [7, 42]  # the step's cached match
    lookup.begin(seq, 64)  # a new request forgets it
    assert lookup.propose(seq, 4, SamplingConfig(), None).tokens == [7, 9, 5, 7]


@pytest.mark.parametrize("by_length", [True, False])
def test_greedy_output_is_the_targets_with_a_controller_per_length(by_length):
    target = make_tiny_llama(seed=0)
    engine = SpeculativeEngine(target, PromptLookupProposer(6, by_length=by_length), adaptive=True)
    assert engine.generate(REPEATING, 60).tokens == target_greedy(target, REPEATING, 60)
    names = set(engine.controllers) - {None}  # None: the default, unused with regimes
    if not by_length:
        assert names == set()
        return
    assert names and all(n in {"ngram0", "ngram1", "ngram2", "ngram3"} for n in names)
    if "ngram0" in names:  # a step without a match never drafts, probes included
        assert engine.controllers["ngram0"].max_depth == 0 and not engine.controllers["ngram0"].nodes_at


def test_the_option_comes_from_kw_or_the_manifest_and_a_bad_value_is_named(tmp_path):
    target = make_tiny_target(seed=0)
    assert load_drafter("prompt_lookup", target) and prompt_lookup_proposer(5, {}).by_length
    save_drafter(tmp_path / "one", None, target, "prompt_lookup", config={},
                 extra={"decoding": {"lookup_by_length": False}})
    drafter = load_drafter(tmp_path / "one", target)
    assert not build_proposer(drafter, target.model).by_length
    assert build_proposer(drafter, target.model, lookup_by_length=True).by_length  # kw over the manifest
    hybrid = build_proposer(load_drafter("truncated:1+prompt_lookup", target), target.model, lookup_by_length=False)
    assert isinstance(hybrid, WithPromptLookup) and not hybrid.lookup.by_length
    with pytest.raises(ValueError, match="lookup_by_length"):
        prompt_lookup_proposer(5, {"lookup_by_length": "no"})
