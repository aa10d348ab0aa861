"""A draft model trained from a K-quant sibling drafts on Q8_0 blocks of its trained weights (manifest `weights`):
the rounding is gguf-py's, the loaded model is exactly its blocks, the kernels run them, and decoding stays
plain decoding's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.models import kernels
from specdistill.models.drafters import MANIFEST, load_drafter, save_drafter
from specdistill.models.gguf_blocks import ATTRIBUTE, attach_kquant_blocks, attach_q8_0_blocks
from specdistill.models.kquant import dequantize
from specdistill.models.target import target_from_model
from specdistill.train.distill_steps import saved_weights
from tests.models.kquant_fixtures import make_tiny_kquant_qwen2, write_gguf

PROMPTS = ([1, 5, 9, 3, 17, 22, 40, 5, 9, 3], [1, 30, 31, 32, 30, 31])


def float_qwen2(seed: int):
    """A tiny Qwen2 (hidden 256, untied head, q/k/v biases) with plain fp32 weights: nothing attached."""
    model, _ = make_tiny_kquant_qwen2(seed=seed)
    with torch.no_grad():
        for linear in model.modules():
            if isinstance(linear, torch.nn.Linear):
                linear.weight.add_(0.01 * torch.randn_like(linear.weight))  # off any grid
    return model


def test_each_linear_becomes_exactly_its_q8_0_blocks():
    model = float_qwen2(seed=5)
    before = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    odd = torch.nn.Linear(40, 64)  # K not whole blocks of 32: left as it is
    model.add_module("odd", odd)
    odd_weight = odd.weight.detach().clone()

    assert attach_q8_0_blocks(model) == len(before) == 2 * 7 + 1  # every layer matrix and the head
    modules = dict(model.named_modules())
    for name, original in before.items():
        linear = modules[name]
        (blocks,) = getattr(linear, ATTRIBUTE)
        assert blocks.kind == "Q8_0" and blocks.shape == tuple(original.shape)
        assert torch.equal(linear.weight, dequantize(blocks))  # the model is its blocks
        reference = gguf_dequantize(blocks.raw.numpy(), GGMLQuantizationType.Q8_0)
        assert np.array_equal(linear.weight.detach().numpy(), reference)  # gguf-py reads the same weights
        step = original.abs().reshape(original.shape[0], -1, 32).amax(-1, keepdim=True) / 127
        error = (linear.weight - original).abs().reshape(original.shape[0], -1, 32)
        # the nearest code of its group's step, the step itself stored in fp16 (relative error up to 2^-11)
        assert bool((error <= step * (0.5 + 127 / 2048) + 1e-7).all())
    assert not hasattr(odd, ATTRIBUTE) and torch.equal(odd.weight, odd_weight)


def tiny_kquant_target(tmp_path):
    model, tensors = make_tiny_kquant_qwen2(seed=4)
    attach_kquant_blocks(model, write_gguf(tmp_path / "tiny.gguf", "qwen2", tensors))
    return target_from_model(model, None, "tiny-kquant-qwen2")


def test_a_q8_0_draft_model_loads_on_its_blocks_and_decodes_plain_decodings_output(tmp_path):
    target = tiny_kquant_target(tmp_path)
    path = save_drafter(tmp_path / "drafter", float_qwen2(seed=5), target, "draft_model", config={},
                        weights="q8_0")
    assert json.loads((path / MANIFEST).read_text())["weights"] == "q8_0"
    drafter = load_drafter(path, target)
    attached = [getattr(m, ATTRIBUTE) for m in drafter.model.modules() if hasattr(m, ATTRIBUTE)]
    assert len(attached) == 15 and all(b.kind == "Q8_0" for (b,) in attached)

    eos = target.eos_token_ids
    plain = SpeculativeEngine(target.model, None, eos)
    proposer = build_proposer(drafter, target.model, gamma=4, eos_token_ids=eos, drafter_weights="auto")
    engine = SpeculativeEngine(target.model, proposer, eos, adaptive=False)
    for prompt in PROMPTS:
        generation = engine.generate(prompt, 32)
        assert generation.tokens == plain.generate(prompt, 32).tokens
        assert generation.stats.drafted > 0
    expected = "Q8_0" if kernels.kquant_unavailable() is None else "float32"  # on the K-quant kernels where they run
    assert proposer.weight_format() == expected


def test_saved_without_weights_the_model_loads_as_saved(tmp_path):
    target = tiny_kquant_target(tmp_path)
    model = float_qwen2(seed=6)
    drafter = load_drafter(save_drafter(tmp_path / "d", model, target, "draft_model", config={}), target)
    assert not any(hasattr(m, ATTRIBUTE) for m in drafter.model.modules())
    assert torch.equal(drafter.model.lm_head.weight, model.lm_head.weight)


def test_bad_weights_are_errors_naming_them(tmp_path):
    target = tiny_kquant_target(tmp_path)
    with pytest.raises(ValueError, match="weights 'q4_0'"):
        save_drafter(tmp_path / "a", float_qwen2(seed=5), target, "draft_model", config={}, weights="q4_0")
    assert not (tmp_path / "a").exists()
    path = save_drafter(tmp_path / "b", float_qwen2(seed=5), target, "draft_model", config={}, weights="q8_0")
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "weights": "int3"}))
    with pytest.raises(ValueError, match="`weights` must be one of q8_0 or absent, got 'int3'"):
        load_drafter(path, target)


def test_a_drafter_trained_from_a_named_real_target_is_saved_for_q8_0():
    assert saved_weights(SimpleNamespace(drafter="qwen2.5-coder-0.5b")) == "q8_0"
    assert saved_weights(SimpleNamespace(drafter="truncated:2")) is None
