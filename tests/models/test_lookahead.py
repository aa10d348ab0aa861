"""[LA] lookahead tokens: O(k x D) parameters, a seeded start at the mean token embedding, and the drafter
directory round trip with its target check."""

import pytest
import torch

from specdistill.decode.proposers import build_proposer
from specdistill.decode.proposers.lookahead import LookaheadProposer
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.lookahead import LookaheadTokens
from tests.models.conftest import make_tiny_target


def test_only_k_by_d_parameters_starting_near_the_mean_embedding():
    target = make_tiny_target(seed=0)
    table = target.model.get_input_embeddings().weight  # [V, D]
    tokens = LookaheadTokens.from_target(target.model, 4, seed=7, noise=0.1)
    assert [tuple(p.shape) for p in tokens.parameters()] == [(4, table.shape[1])]
    assert tokens().shape == (4, table.shape[1])
    spread = (tokens().detach() - table.mean(0)).abs() / table.std(0)  # [K, D] in units of the per-dim std
    assert 0 < float(spread.mean()) < 0.2 and float(spread.max()) < 0.6
    assert len({tuple(row.tolist()) for row in tokens()}) == 4  # distinct tokens
    again = LookaheadTokens.from_target(target.model, 4, seed=7, noise=0.1)
    assert torch.equal(again(), tokens())  # seeded
    assert not torch.equal(LookaheadTokens.from_target(target.model, 4, seed=8)(), tokens())
    assert tokens.embeddings.data_ptr() != table.data_ptr()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        LookaheadTokens(0, 16)


def test_save_and_load_round_trip_and_the_target_check(tmp_path):
    target = make_tiny_target(seed=0)
    tokens = LookaheadTokens.from_target(target.model, 3, seed=1, noise=1.0)
    save_drafter(tmp_path / "la", tokens, target, "lookahead", config=dict(tokens.config), extra={"chains": 3})
    drafter = load_drafter(str(tmp_path / "la"), target)
    assert drafter.kind == "lookahead" and drafter.manifest["extra"]["chains"] == 3
    assert torch.equal(drafter.model.embeddings, tokens.embeddings)
    proposer = build_proposer(drafter, target.model)  # what `python -m decode.evaluate --drafter DIR` builds
    assert isinstance(proposer, LookaheadProposer) and proposer.chains == 3 and proposer.max_depth == 3
    with pytest.raises(ValueError, match="fingerprint"):
        load_drafter(str(tmp_path / "la"), make_tiny_target(seed=5))


def test_a_target_of_another_width_is_refused(tmp_path):
    target = make_tiny_target(seed=0)
    tokens = LookaheadTokens(3, 16)  # the tiny target is 32 wide
    save_drafter(tmp_path / "la", tokens, target, "lookahead", config=dict(tokens.config))
    with pytest.raises(ValueError, match="hidden size 32"):
        load_drafter(str(tmp_path / "la"), target)


def test_a_manifest_without_sizes_is_refused(tmp_path):
    target = make_tiny_target(seed=0)
    save_drafter(tmp_path / "la", LookaheadTokens(3, 32), target, "lookahead", config={"num_tokens": 3})
    with pytest.raises(ValueError, match="lacks hidden_size"):
        load_drafter(str(tmp_path / "la"), target)
