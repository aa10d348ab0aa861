"""decode.lean_eagle3: the CPU drafting rows compute what Eagle3Drafter's own rows, fuse and logits compute."""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.lean_decoder import UNFUSED_ENV
from specdistill.decode.lean_eagle3 import DISABLE_ENV, LeanEagle3, lean_eagle3
from specdistill.decode.proposers.eagle3 import Eagle3Proposer
from specdistill.models.eagle3 import DraftCache
from specdistill.models.kernels import int8_unavailable
from specdistill.models.kernels import unavailable as kernel_unavailable
from specdistill.models.packed_linear import float16_weights_supported, packed_for_inference
from tests.conftest import make_tiny_llama
from tests.decode.test_eagle3_decode import tiny_eagle


def drafter_with_gqa(hidden: int = 32):
    """A tiny drafter (4 query heads over 2 key/value heads, as the tiny target) with every weight and norm
    moved off its start, so a swapped or skipped norm would show. hidden 128: head_dim 32, where the kernel
    library's RMSNorm and RoPE take the rows (decode.lean_decoder.row_ops_library)."""
    target = make_tiny_llama(seed=0, layers=3, hidden_size=hidden)
    drafter = tiny_eagle(target, layers=(0, 1, 2))
    assert drafter.config["num_attention_heads"] // drafter.config["num_key_value_heads"] == 2
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for param in drafter.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return target, drafter


def run_rows(net, drafter, calls, start_position):
    """`calls` [(rows, commit)] against one cache, each row seeing a random part of the cached rows and its own
    earlier rows (a tree's sparse mask). Returns every call's outputs and logits."""
    cache = DraftCache(drafter, 64, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(1)
    d = drafter.config["hidden_size"]
    outs = []
    for n, commit in calls:
        embeds, states = torch.randn(n, d, generator=generator), torch.randn(n, d, generator=generator)
        positions = torch.arange(start_position, start_position + n)
        visible = torch.rand(n, cache.used + n, generator=generator) < 0.7
        visible[:, cache.used:] = torch.eye(n, dtype=torch.bool) | visible[:, cache.used:].tril()
        out = net.rows(embeds, states, positions, cache, visible)
        outs += [out, net.logits(out)]
        if commit:
            cache.commit()
        start_position += n
    return outs


@pytest.mark.parametrize("hidden", [32, 128])
@pytest.mark.parametrize("start_position", [0, 1500])  # 1500: past the rotary table's first size
def test_lean_rows_logits_and_fuse_equal_the_drafters(start_position, hidden):
    _, drafter = drafter_with_gqa(hidden)
    lean = lean_eagle3(drafter, "float32")
    assert isinstance(lean, LeanEagle3)
    assert (lean.native is not None) == (hidden == 128 and kernel_unavailable() is None)
    calls = [(5, True), (3, False), (2, False)]
    with torch.no_grad():
        for got, want in zip(run_rows(lean, drafter, calls, start_position), run_rows(drafter, drafter, calls,
                                                                                       start_position)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        features = torch.randn(4, drafter.fc.in_features)
        torch.testing.assert_close(lean.fuse(features), drafter.fuse(features), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not float16_weights_supported(), reason="no FBGEMM fp16 GEMM on this CPU")
def test_fp16_lean_rows_equal_the_fp16_packed_drafters():
    _, drafter = drafter_with_gqa()
    calls = [(4, True), (3, False)]
    with torch.no_grad():
        got = run_rows(lean_eagle3(drafter, "float16"), drafter, calls, 7)
        want = run_rows(packed_for_inference(drafter, "float16"), drafter, calls, 7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_the_switch_and_an_unpackable_drafter_fall_back_to_the_drafters_own_rows(monkeypatch):
    _, drafter = drafter_with_gqa()
    assert lean_eagle3(drafter.to(torch.bfloat16), "float32") is None  # not fp32: no packing
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert lean_eagle3(drafter.float(), "float32") is None


def test_the_proposer_drafts_with_lean_rows_depth_by_depth_only():
    target = make_tiny_llama(seed=0, layers=3)
    drafter = tiny_eagle(target, layers=(0, 1, 2))
    embed = target.get_input_embeddings()
    assert isinstance(Eagle3Proposer(drafter, embed, fixed_steps=False).net, LeanEagle3)
    assert not isinstance(Eagle3Proposer(drafter, embed, fixed_steps=True).net, LeanEagle3)


def int8_calls(net, drafter, start_position):
    """run_rows' calls on `net`, each output followed by its top-3 (log-probabilities, indices); and the cache."""
    cache = DraftCache(drafter, 64, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(1)
    outs, position = [], start_position
    for n, commit in [(5, True), (3, False), (2, False)]:
        embeds, states = torch.randn(n, 128, generator=generator), torch.randn(n, 128, generator=generator)
        visible = torch.rand(n, cache.used + n, generator=generator) < 0.7
        visible[:, cache.used:] = torch.eye(n, dtype=torch.bool) | visible[:, cache.used:].tril()
        out = net.rows(embeds, states, torch.arange(position, position + n), cache, visible)
        outs += [out, *net.top(out, 3)]
        position += n
        if commit:
            cache.commit()
    return outs, cache


@pytest.mark.skipif(int8_unavailable() is not None, reason=f"the int8 kernel: {int8_unavailable()}")
@pytest.mark.parametrize("start_position", [0, 1500])
def test_fused_int8_rows_and_top_k_compute_what_the_lean_python_computes(start_position, monkeypatch):
    _, drafter = drafter_with_gqa(128)
    fused = lean_eagle3(drafter, "int8")
    assert fused.fused is not None
    monkeypatch.setenv(UNFUSED_ENV, "1")
    python = lean_eagle3(drafter, "int8")  # the same int8 matrices, every operation through LeanEagle3's Python
    assert python.fused is None
    with torch.no_grad():
        (got, got_cache), (want, want_cache) = int8_calls(fused, drafter, start_position), int8_calls(
            python, drafter, start_position)
    for a, b in zip(got, want):
        if a.dtype == torch.int64:
            assert torch.equal(a, b)  # the same top-3 draft indices, most probable first
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # SiLU from the library's exp: a few ulps
    assert got_cache.used == want_cache.used == 10
    for a, b in ((got_cache.keys, want_cache.keys), (got_cache.values, want_cache.values)):
        assert torch.equal(a[:, :10], b[:, :10])  # the rows' keys and values come before SiLU: the same bits
