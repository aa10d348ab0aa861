"""Medusa heads: distinct layers, identity start, and the drafter directory round trip."""

import pytest
import torch

from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.medusa import MedusaHeads
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_target


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


def test_sequential_heads_add_one_fuse_layer_each_and_start_as_medusa():
    k, n, h, v = 3, 1, 16, 40
    heads = MedusaHeads(k, n, h, v, sequential=True)
    count = sum(p.numel() for p in heads.parameters())
    assert count == k * n * (h * h + h) + k * v * h + k * (2 * h * h + h)  # + a [2h -> h] fuse per head
    target = make_tiny_llama(seed=3)
    sequential = MedusaHeads.from_target(target, num_heads=3, num_layers=1, sequential=True)
    plain = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    hidden = torch.randn(5, target.config.hidden_size)
    tokens = target.get_input_embeddings()(torch.randint(0, 10, (3, 5)))  # [K, N, D]
    with torch.no_grad():
        torch.testing.assert_close(sequential(hidden, tokens), plain(hidden), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="token_embeddings"):
        sequential(hidden)


def test_sequential_head_k_reads_the_state_of_head_k_minus_1():
    target = make_tiny_llama(seed=3)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1, sequential=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        hidden = torch.randn(4, target.config.hidden_size)  # [N, D]
        tokens = torch.randn(3, 4, target.config.hidden_size)  # [K, N, D]
        states = heads.states(hidden, tokens)  # [K, N, D]
        manual = hidden
        for k, head in enumerate(heads.heads):
            manual = head.blocks(manual + head.fuse(torch.cat([manual, tokens[k]], -1)))
            torch.testing.assert_close(states[k], manual)
        changed = tokens.clone()
        changed[1] += 1.0  # the token before head 2's: heads 2 and 3 change, head 1 does not
        after = heads.states(hidden, changed)
    assert torch.equal(after[0], states[0])
    assert not torch.allclose(after[1], states[1]) and not torch.allclose(after[2], states[2])


def test_sequential_round_trip_keeps_the_kind_of_head(tmp_path):
    target = make_tiny_target(seed=0)
    heads = MedusaHeads.from_target(target.model, num_heads=2, num_layers=1, sequential=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_drafter(tmp_path / "m", heads, target, "medusa", config=dict(heads.config), extra={"tree": [[0]]})
    loaded = load_drafter(str(tmp_path / "m"), target).model
    assert loaded.sequential
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def prefix_heads(target_model, seed=0, scale=0.2):
    heads = MedusaHeads.from_target(target_model, num_heads=2, num_layers=1, sequential=True, prefix_layer=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.prefix.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return heads


def test_prefix_layer_starts_as_the_identity():
    target = make_tiny_llama(seed=3)
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1, sequential=True, prefix_layer=True)
    hidden = torch.randn(2, 7, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(heads.source(hidden), hidden, rtol=0, atol=0)
    assert heads.config["prefix"]["num_heads"] == target.config.num_attention_heads


def test_prefix_layer_extended_piece_by_piece_is_one_causal_pass():
    """Decoding feeds the prefix layer a few accepted rows at a time through its KV cache: the outputs
    must be those of one causal pass over the whole sequence, and no row may see a later one."""
    from specdistill.models.medusa import PrefixCache

    target = make_tiny_llama(seed=3)
    heads = prefix_heads(target)
    hidden = torch.randn(10, target.config.hidden_size)  # [T, D]
    with torch.no_grad():
        whole = heads.source(hidden[None])[0]  # [T, D]
        cache = PrefixCache(heads.prefix, 12, hidden.device, hidden.dtype)
        pieces = [heads.prefix.extend(hidden[a:b], cache) for a, b in ((0, 3), (3, 4), (4, 8), (8, 10))]
        changed = hidden.clone()
        changed[6:] += 1.0
        after = heads.source(changed[None])[0]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole, hidden)  # the layer does something
    torch.testing.assert_close(after[:6], whole[:6], rtol=0, atol=0)  # causal
    assert not torch.allclose(after[6:], whole[6:])
    with pytest.raises(RuntimeError, match="prefix cache full"):
        with torch.no_grad():
            heads.prefix.extend(hidden[:3], cache)


def test_prefix_round_trip_keeps_the_layer(tmp_path):
    target = make_tiny_target(seed=0)
    heads = prefix_heads(target.model)
    save_drafter(tmp_path / "m", heads, target, "medusa", config=dict(heads.config), extra={"tree": [[0]]})
    loaded = load_drafter(str(tmp_path / "m"), target).model
    assert loaded.prefix is not None and loaded.config["prefix"] == heads.config["prefix"]
    assert heads.state_dict().keys() == loaded.state_dict().keys()
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
