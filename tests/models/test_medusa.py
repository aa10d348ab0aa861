"""Medusa heads: distinct layers, identity start, and the drafter directory round trip."""

import pytest
import torch

from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_target
from models.drafters import load_drafter, save_drafter
from models.medusa import MedusaHeads


def test_layers_do_not_share_weights():
    k, n, h, v = 3, 2, 16, 40
    heads = MedusaHeads(k, n, h, v)
    count = sum(p.numel() for p in heads.parameters())
    assert count == k * n * (h * h + h) + k * v * h  # shared blocks would count once
    blocks = [block.linear.weight for head in heads.heads for block in head.blocks]
    assert len({w.data_ptr() for w in blocks}) == k * n


def test_identity_init_reproduces_the_targets_head():
    target = make_tiny_llama(seed=3)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11]])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # [T, D] after the final norm
        medusa = heads(hidden)  # [K, T, V]
    # head 1 at t is supposed to predict t + 2; from the identity it gives the target's own
    # distribution for t + 1, i.e. the target's head at the same position, unshifted
    for k in range(3):
        torch.testing.assert_close(medusa[k], out.logits[0], rtol=0, atol=1e-5)
    assert heads.heads[0].proj.weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, not a view


def test_save_and_load_round_trip(tmp_path):
    target = make_tiny_target(seed=0)
    heads = MedusaHeads.from_target(target.model, num_heads=2, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tree = [[0], [1], [0, 0]]
    save_drafter(tmp_path / "m", heads, target, "medusa", config=dict(heads.config), extra={"tree": tree})
    drafter = load_drafter(str(tmp_path / "m"), target)
    assert drafter.kind == "medusa" and drafter.manifest["extra"]["tree"] == tree
    for (name, a), (_, b) in zip(heads.state_dict().items(), drafter.model.state_dict().items()):
        assert torch.equal(a, b), name
    other = make_tiny_target(seed=5)
    with pytest.raises(ValueError, match="fingerprint"):
        load_drafter(str(tmp_path / "m"), other)
