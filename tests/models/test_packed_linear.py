"""Packed inference copies: same outputs as the original, parameters shared, never stale."""

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer
from specdistill.decode.runner import ModelRunner
from specdistill.models import packed_linear
from specdistill.models.packed_linear import DISABLE_ENV, GEMM_PAD_ENV, PackedLinear, gemm_padding, packed_for_inference
from tests.conftest import make_tiny_llama

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


# ---- small calls padded to the rows oneDNN computes fastest -----------------------------------------

@pytest.mark.parametrize("shape", [(16,), (1, 16), (2, 16), (1, 2, 16), (3, 16), (1, 5, 16), (2, 3, 16)])
def test_padded_calls_keep_their_rows_shape_and_values(shape, monkeypatch):
    """Rows below B computed as T keep their own rows: the shape asked for, F.linear's values, and the same
    values as the unpadded call up to rounding; calls of B rows or more are not padded at all."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 24)
    padded, plain = PackedLinear(linear, padding=(3, 6)), PackedLinear(linear, padding=(0, 0))
    x = torch.randn(shape)
    with torch.inference_mode():
        out = padded(x)
        assert out.shape == (*shape[:-1], 24) and out.is_contiguous()
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)
    rows = x.numel() // 16
    calls = []  # what the kernel was given: T rows when padded, the call's own otherwise
    original = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda inp, *a: calls.append(inp.numel() // 16) or original(inp, *a))
    with torch.inference_mode():
        padded(x)
    assert calls == [6 if rows < 3 else rows]


@pytest.mark.parametrize("value, expected", [("off", (0, 0)), ("2:4", (2, 4)), (" 3:6 ", (3, 6)), ("1:1", (1, 1))])
def test_padding_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(GEMM_PAD_ENV, value)
    assert gemm_padding() == expected


@pytest.mark.parametrize("value", ["6", "4:2", "0:3", "a:b", "3:"])
def test_a_bad_padding_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(GEMM_PAD_ENV, value)
    with pytest.raises(ValueError, match=GEMM_PAD_ENV):
        gemm_padding()


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_no_padding_by_default_below_avx512(monkeypatch, capability):
    monkeypatch.delenv(GEMM_PAD_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(packed_linear, "gemm_row_timings", lambda: pytest.fail("timed where nothing is padded"))
    assert gemm_padding() == (0, 0)


def fake_timings(one_padded: float, two_padded: float) -> dict[tuple[int, int], float]:
    """Timings where 1 and 2 rows take 1.0 s as themselves and the given seconds computed as six."""
    return {(1, 1): 1.0, (1, 6): one_padded, (2, 2): 1.0, (2, 6): two_padded}


@pytest.mark.parametrize("one_padded, two_padded, expected", [
    (0.80, 0.85, (3, 6)),   # both faster padded (the AMD Zen 4 host's forward)
    (0.90, 1.10, (2, 6)),   # only one row
    (1.15, 1.12, (0, 0)),   # neither (the Intel Xeon host's)
    (0.97, 0.97, (0, 0)),   # faster by less than PAD_MIN_GAIN: noise, not a reason
    (1.10, 0.80, (0, 0)),   # two rows alone cannot be padded without one
])
def test_avx512_padding_follows_the_measured_gain(monkeypatch, one_padded, two_padded, expected):
    monkeypatch.delenv(GEMM_PAD_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(packed_linear, "gemm_row_timings", lambda: fake_timings(one_padded, two_padded))
    packed_linear.measured_gemm_padding.cache_clear()
    try:
        assert gemm_padding() == expected
    finally:
        packed_linear.measured_gemm_padding.cache_clear()


def test_gemm_row_timings_time_every_variant():
    rng_before = torch.get_rng_state()
    timings = packed_linear.gemm_row_timings(megabytes=2, reps=2)
    assert set(timings) == {(1, 1), (1, 6), (2, 2), (2, 6)}
    assert all(t > 0 for t in timings.values())
    assert torch.equal(torch.get_rng_state(), rng_before)  # timing draws nothing: seeded runs stay as they were
    one, two = packed_linear.padding_gains(timings)
    assert one == pytest.approx(1 - timings[(1, 6)] / timings[(1, 1)])
    assert two == pytest.approx(1 - timings[(2, 6)] / timings[(2, 2)])


def test_a_new_padding_packs_a_new_copy(monkeypatch):
    model = tiny_mlp()
    monkeypatch.setenv(GEMM_PAD_ENV, "off")
    first = packed_for_inference(model)
    monkeypatch.setenv(GEMM_PAD_ENV, "2:5")
    second = packed_for_inference(model)
    assert second is not first and (second[0].pad_below, second[0].pad_to) == (2, 5)
    assert (first[0].pad_below, first[0].pad_to) == (0, 0)


@pytest.mark.parametrize("pad", ["off", "3:6", "9:12"])  # 9:12: every verification of this test padded too
def test_greedy_decoding_is_the_targets_under_any_padding(tiny_target, monkeypatch, pad):
    """Plain and speculative decoding (a 1-layer draft model, 4 drafts: verifications of 1-5 rows) with the
    engine's packed copies padded give the unpacked target's greedy tokens."""
    prompt = [5, 8, 13, 21]
    monkeypatch.setenv(DISABLE_ENV, "1")
    reference = SpeculativeEngine(tiny_target).generate(prompt, 24).tokens
    monkeypatch.delenv(DISABLE_ENV)
    monkeypatch.setenv(GEMM_PAD_ENV, pad)
    assert (ModelRunner(tiny_target).head.pad_below, ModelRunner(tiny_target).head.pad_to) == gemm_padding()
    drafter = DraftModelProposer(make_tiny_llama(seed=1, layers=1), gamma=4)
    for proposer in (None, drafter):
        assert SpeculativeEngine(tiny_target, proposer).generate(prompt, 24).tokens == reference
