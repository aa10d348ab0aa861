"""Packed inference copies: same outputs as the original, parameters shared, never stale."""

import pytest
import torch

from decode.engine import SpeculativeEngine
from models.packed_linear import DISABLE_ENV, PackedLinear, packed_for_inference
from decode.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")


def tiny_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False))


def test_packed_copy_computes_what_the_original_does():
    model = tiny_mlp()
    packed = packed_for_inference(model)
    assert packed is not model
    assert [type(m) for m in packed] == [PackedLinear, torch.nn.SiLU, PackedLinear]
    x = torch.randn(5, 3, 16)  # [B, T, D]
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), model(x), rtol=1e-5, atol=1e-5)


def test_original_is_left_untouched_and_trainable():
    model = tiny_mlp()
    packed_for_inference(model)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.SiLU, torch.nn.Linear]
    model(torch.randn(2, 16)).sum().backward()
    assert model[0].weight.grad is not None


def test_copy_is_cached_until_the_weights_change():
    model = tiny_mlp()
    first = packed_for_inference(model)
    assert packed_for_inference(model) is first
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an optimizer step: same tensor, new version
    second = packed_for_inference(model)
    assert second is not first
    x = torch.randn(4, 16)
    with torch.inference_mode():
        torch.testing.assert_close(second(x), model(x), rtol=1e-5, atol=1e-5)


def test_packed_module_refuses_to_train():
    packed = packed_for_inference(tiny_mlp())
    with pytest.raises(RuntimeError, match="inference"):
        packed(torch.randn(2, 16, requires_grad=True))


def test_environment_switch_turns_packing_off(monkeypatch):
    model = tiny_mlp()
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert packed_for_inference(model) is model


def test_runner_uses_packed_copies_and_matches_unpacked_logits(tiny_target, monkeypatch):
    tokens = [3, 17, 5, 9, 11, 2]
    packed_runner = ModelRunner(tiny_target)
    assert isinstance(packed_runner.head, PackedLinear)
    monkeypatch.setenv(DISABLE_ENV, "1")
    plain_runner = ModelRunner(tiny_target)
    assert plain_runner.head is tiny_target.get_output_embeddings()
    with torch.inference_mode():
        logits = []
        for runner in (packed_runner, plain_runner):
            runner.start(32)
            logits.append(runner.forward(tokens)[1])  # [T, V]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_greedy_decoding_is_the_same_with_and_without_packing(tiny_target, monkeypatch):
    prompt = [5, 8, 13, 21]
    packed = SpeculativeEngine(tiny_target).generate(prompt, 24).tokens
    monkeypatch.setenv(DISABLE_ENV, "1")
    plain = SpeculativeEngine(tiny_target).generate(prompt, 24).tokens
    assert packed == plain
