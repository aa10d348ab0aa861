"""DFlash drafters: config checks that name the field, the paper's layer choice, the block's attention reads
only the context before it and its own block, and the drafter directory round-trips."""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.proposers import build_proposer  # registers the proposer kinds (and the drafter kinds)
from specdistill.models.dflash import MAX_BLOCK_SIZE, DFlashDrafter, default_target_layers, dflash_config
from specdistill.models.drafters import load_drafter, save_drafter
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_target


def features_of(model, ids: list[int], layers: list[int]) -> torch.Tensor:
    """[T, K x D]: the inputs of `layers` at every position (hidden_states[i] is layer i's input)."""
    out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def test_the_default_layers_are_the_papers_spread_as_layer_inputs():
    # z-lab's build_target_layer_ids(30, 3) = [1, 14, 27] (layer outputs) -> inputs [2, 15, 28]
    assert default_target_layers(30, 3) == [2, 15, 28]
    assert default_target_layers(30, 1) == [16]
    layers = default_target_layers(36, 5)
    assert layers == sorted(layers) and layers[0] == 2 and layers[-1] == 34


@pytest.mark.parametrize("kw, field", [(dict(block_size=0), "dflash.block_size"),
                                       (dict(block_size=1), "dflash.block_size"),
                                       (dict(block_size=MAX_BLOCK_SIZE + 1), "dflash.block_size"),
                                       (dict(num_layers=0), "dflash.layers"),
                                       (dict(target_layers=[0, 1]), "dflash.target_layers"),
                                       (dict(target_layers=[1, 3]), "dflash.target_layers")])
def test_bad_configs_are_errors_naming_the_field(kw, field):
    target = make_tiny_llama(layers=3)
    with pytest.raises(ValueError, match=field):
        dflash_config(target, 0, **{"num_layers": 1, "block_size": 4, **kw})


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block_only():
    target = make_tiny_llama(seed=0, layers=3)
    drafter = DFlashDrafter.for_target(target, None, num_layers=2, block_size=4, target_layers=[1, 2], seed=1).eval()
    ids = [1, 5, 7, 9, 11, 5, 7, 13, 17, 19]
    with torch.no_grad():
        feats = features_of(target, ids, drafter.target_layers)[None]  # [1, T, 2D]
        first = target.get_input_embeddings()(torch.tensor([[ids[3], ids[6]]]))  # [1, 2, D]
        anchors = torch.tensor([[3, 6]])
        out = drafter.blocks(feats, first, anchors)  # [1, 2, 4, D]
        changed = feats.clone()
        changed[:, 3:] += 1.0  # positions >= the first anchor: context of the second block only
        first_changed = first.clone()
        first_changed[:, 1] += 1.0  # the second block's verified token
        out2 = drafter.blocks(changed, first_changed, anchors)
    torch.testing.assert_close(out[0, 0], out2[0, 0])
    assert (out[0, 1] - out2[0, 1]).abs().max() > 1e-3
    alone = drafter.blocks(feats, first[:, :1], anchors[:, :1])  # a block does not see another block
    torch.testing.assert_close(out[0, 0], alone[0, 0], atol=1e-5, rtol=1e-4)


def test_the_drafter_directory_round_trips_and_refuses_another_target(tmp_path):
    target = make_tiny_target(seed=0, layers=3)
    vocab = torch.arange(4, 40)
    drafter = DFlashDrafter.for_target(target.model, vocab, num_layers=2, block_size=5, target_layers=[1, 2],
                                       seed=2, init="target_layers")
    with torch.no_grad():
        drafter.mask_embedding.add_(0.5)
    path = save_drafter(tmp_path / "dflash", drafter, target, "dflash", config={**drafter.config},
                        extra={"decoding": {"depth": 3, "topk": 2}})
    loaded = load_drafter(path, target)
    assert loaded.kind == "dflash" and torch.equal(loaded.vocab_map, vocab)
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name
    proposer = build_proposer(loaded, target.model)
    assert (proposer.max_depth, proposer.topk, proposer.feature_layers) == (3, 2, [1, 2])
    with pytest.raises(ValueError, match="fingerprint"):
        load_drafter(path, make_tiny_target(seed=1, layers=3))


def test_target_layers_init_starts_the_first_layer_as_the_targets():
    """init target_layers: fc passes the deepest feature through and layer 0's projections are the target's."""
    target = make_tiny_llama(seed=0, layers=3)
    drafter = DFlashDrafter.for_target(target, None, num_layers=1, block_size=4, target_layers=[1, 2],
                                       init="target_layers")
    d = target.config.hidden_size
    torch.testing.assert_close(drafter.fc.weight[:, d:], torch.eye(d))
    assert not drafter.fc.weight[:, :d].any()
    torch.testing.assert_close(drafter.layers[0].self_attn.k_proj.weight,
                               target.model.layers[2].self_attn.k_proj.weight)
    with pytest.raises(ValueError, match="dflash.init"):
        DFlashDrafter.for_target(target, None, init="nonsense")
