"""The lean Llama forward (decode.lean_decoder) and the float16-weights precision.

The lean forward must compute what transformers' decoder computes (same logits within float rounding,
same greedy tokens) for every shape the engine feeds it: chains, trees, extra rows given as embeddings,
captured layer inputs, static-shape caches. float16-weights must be exactly the model whose linear
weights are rounded to fp16, and speculation in it must equal plain decoding in it.
"""

from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, get_peft_model

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.lean_decoder import (
    DISABLE_ENV,
    SDPA_ENV,
    UNFUSED_ENV,
    FusedLayer,
    kernel_visibility,
    lean_supported,
)
from specdistill.decode.proposers.draft_model import DraftModelProposer
from specdistill.decode.proposers.prompt_lookup import PromptLookupProposer
from specdistill.decode.runner import ExtraRows, ModelRunner
from specdistill.decode.tree import attention_bias
from specdistill.models.gguf_blocks import attach_kquant_blocks
from specdistill.models.kernel_linear import Q41Linear, Q80Linear, q41_for_inference
from specdistill.models.kernels import DISABLE_ENV as NO_Q41_ENV
from specdistill.models.kernels import amx_unavailable, kquant_unavailable
from specdistill.models.kernels import unavailable as kernel_unavailable
from specdistill.models.packed_linear import (
    PackedLinear,
    PackedLinearFP16,
    float16_weights_supported,
    inference_weights,
    packed_for_inference,
    set_inference_weights,
)
from specdistill.models.quant_formats import grid_codes, q80_codes
from specdistill.models.target import PRECISIONS, cpu_has_native_bf16, resolve_precision
from tests.conftest import make_tiny_llama
from tests.models.kquant_fixtures import make_tiny_kquant_qwen2, write_gguf

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")
needs_fp16 = pytest.mark.skipif(not float16_weights_supported(), reason="no FBGEMM fp16 GEMM on this CPU")


def runner(model, lean: bool, static_shapes: bool = False) -> ModelRunner:
    old = os.environ.pop(DISABLE_ENV, None)
    if not lean:
        os.environ[DISABLE_ENV] = "1"
    try:
        built = ModelRunner(model, static_shapes=static_shapes)
    finally:
        os.environ.pop(DISABLE_ENV, None)
        if old is not None:
            os.environ[DISABLE_ENV] = old
    assert (built.lean is not None) == lean
    return built


TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                    dtype=torch.bool)  # root, two children, a grandchild under each


def forwards(run: ModelRunner, feature_layers=()) -> list[torch.Tensor]:
    """Prefill, a tree verification, a chain after committing a path: every output the engine reads."""
    run.feature_layers = list(feature_layers)
    run.start(64)
    out = []
    _, logits = run.forward([5, 9, 3, 17, 22, 40])
    out += [logits] + ([run.features] if feature_layers else [])
    run.cache.advance(6)
    _, logits = run.forward([7, 11, 12, 30, 31], depths=[0, 1, 1, 2, 2], ancestors=TREE)
    out += [logits] + ([run.features] if feature_layers else [])
    run.cache.commit_path([0, 2, 4])
    hidden, logits = run.forward([8, 13], logits_rows=slice(1, 2))
    return out + [hidden, logits]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_lean_forward_computes_what_transformers_does(static_shapes):
    model = make_tiny_llama(layers=3, seed=4)
    with torch.inference_mode():
        lean = forwards(runner(model, True, static_shapes), feature_layers=[0, 1, 2])
        reference = forwards(runner(model, False, static_shapes), feature_layers=[0, 1, 2])
    assert len(lean) == len(reference) == 6
    for a, b in zip(lean, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lean_forward_with_extra_rows_given_as_embeddings():
    model = make_tiny_llama(layers=2, seed=5)
    extra = ExtraRows(embeds=torch.randn(2, 32), depths=[1, 2],
                      mask=torch.tensor([[1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 1]], dtype=torch.bool))
    outs = []
    for lean in (True, False):
        run = runner(model, lean)
        run.start(32)
        with torch.inference_mode():
            run.forward([3, 4, 5])
            run.cache.advance(3)
            outs.append(run.forward([6, 7, 8, 9], extra=extra))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def tiny_pair(architecture: str):
    """(target, drafter) of one architecture: Llama with peaked heads, or Qwen2 with its biases."""
    if architecture == "qwen2":
        return make_tiny_qwen2(seed=0), make_tiny_qwen2(seed=1)
    return make_tiny_llama(layers=2, seed=0, peak=4.0), make_tiny_llama(layers=1, seed=1, peak=4.0)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_greedy_speculation_with_the_lean_forward_equals_transformers_generate(architecture):
    target, drafter = tiny_pair(architecture)
    prompt = [1, 5, 9, 14, 5, 9]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    for proposer in (None, DraftModelProposer(drafter, gamma=4), PromptLookupProposer(num_tokens=3)):
        engine = SpeculativeEngine(target, proposer)
        assert engine.target.lean is not None
        assert engine.generate(prompt, 24).tokens == expected


def test_lean_forward_is_rebuilt_when_the_weights_change():
    model = make_tiny_llama(layers=1, seed=6)
    first = runner(model, True)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    second, reference = runner(model, True), runner(model, False)
    assert second.lean is not first.lean
    with torch.inference_mode():
        for run in (second, reference):
            run.start(8)
        torch.testing.assert_close(second.forward([1, 2, 3])[1], reference.forward([1, 2, 3])[1])


def q41_llama(seed: int) -> torch.nn.Module:
    """A tiny Llama whose layer matrices are exactly Q4_1 (as the default target's are), its head not."""
    model = make_tiny_llama(hidden_size=128, layers=2, seed=seed, peak=4.0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                module.weight.copy_(q41_with_fp16_scales(module.weight))
    return model


def q41_with_fp16_scales(weight: torch.Tensor) -> torch.Tensor:
    """The nearest Q4_1 matrix whose steps and minima are fp16 values, as a GGUF stores them."""
    codes, step, low = grid_codes(weight)
    return (codes * step.half().float()[..., None] + low.half().float()[..., None]).reshape(weight.shape)


def q41_runner(model, on: bool) -> ModelRunner:
    old = os.environ.pop(NO_Q41_ENV, None)
    if not on:
        os.environ[NO_Q41_ENV] = "1"
    try:
        return runner(model, True)
    finally:
        os.environ.pop(NO_Q41_ENV, None)
        if old is not None:
            os.environ[NO_Q41_ENV] = old


def assert_greedy_output_is_the_same_without_the_kernels_and_with_speculation(model) -> None:
    prompt = [5, 9, 3, 17, 22, 40, 5, 9, 3]
    plain = SpeculativeEngine(model, None, eos_token_ids={2}).generate(prompt, 40).tokens
    os.environ[NO_Q41_ENV] = "1"
    try:
        assert SpeculativeEngine(model, None, eos_token_ids={2}).generate(prompt, 40).tokens == plain
    finally:
        os.environ.pop(NO_Q41_ENV)
    proposer = PromptLookupProposer(num_tokens=4)
    assert SpeculativeEngine(model, proposer, eos_token_ids={2}, adaptive=False).generate(prompt, 40).tokens == plain


FUSED_CALL = FusedLayer.__call__


def sdpa_runner(model, static_shapes: bool) -> ModelRunner:
    os.environ[SDPA_ENV] = "1"
    try:
        return runner(model, True, static_shapes)
    finally:
        os.environ.pop(SDPA_ENV)


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the kernel library: {kernel_unavailable()}")
@pytest.mark.parametrize("static_shapes", [False, True])
def test_the_librarys_attention_computes_what_sdpa_does_and_speculation_stays_plain_decoding(static_shapes):
    model = make_tiny_llama(hidden_size=128, layers=2, seed=9)  # head_dim 32: the kernel library's rows
    on, off = runner(model, True, static_shapes), sdpa_runner(model, static_shapes)
    assert on.lean.kernel_attention and not off.lean.kernel_attention
    with torch.inference_mode():
        for a, b in zip(forwards(on), forwards(off)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    prompt = [5, 9, 3, 17, 22, 40, 5, 9, 3]
    plain = SpeculativeEngine(model, None, eos_token_ids={2}).generate(prompt, 40).tokens
    assert SpeculativeEngine(model, PromptLookupProposer(num_tokens=4), eos_token_ids={2},
                             adaptive=False).generate(prompt, 40).tokens == plain


def test_only_the_engines_masks_over_few_rows_go_to_the_librarys_attention():
    ancestors = torch.ones(3, 3, dtype=torch.bool).tril()
    mask = attention_bias(5, ancestors, 12, torch.float32)  # [1, 1, 3, 12]: 5 committed, 3 rows, 4 stale
    visible = kernel_visibility(mask)
    assert torch.equal(visible, mask[0, 0] == 0) and visible[:, :5].all() and not visible[:, 8:].any()
    assert kernel_visibility(mask * 0.5) is None  # another kind of additive mask: torch's SDPA reads it
    long = attention_bias(0, torch.ones(65, 65, dtype=torch.bool).tril(), 65, torch.float32)
    assert kernel_visibility(long) is None  # past MAX_ROWS: a prefill, for SDPA's blocking


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the Q4_1 kernel: {kernel_unavailable()}")
def test_the_q41_kernel_computes_what_onednn_does_and_speculation_stays_plain_decoding():
    model = q41_llama(seed=8)
    on, off = q41_runner(model, True), q41_runner(model, False)
    kinds = {type(m) for layer in on.lean.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    assert kinds == {Q41Linear}
    forms = {m.codes.form for layer in on.lean.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    assert forms == ({"fma"} if amx_unavailable() else {"amx"})  # every matrix here is whole blocks of 32 outputs
    assert not any(isinstance(layer.qkv, Q41Linear) for layer in off.lean.layers)
    with torch.inference_mode():
        for a, b in zip(forwards(on), forwards(off)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert_greedy_output_is_the_same_without_the_kernels_and_with_speculation(model)


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the Q4_1 kernel: {kernel_unavailable()}")
@pytest.mark.skipif(amx_unavailable() is None, reason="the AMX form runs here: its layers keep LeanLayer's Python")
@pytest.mark.parametrize("static_shapes", [False, True])
def test_fused_layers_compute_the_same_bits_as_the_lean_layers_python(static_shapes, monkeypatch):
    calls = []
    monkeypatch.setattr(FusedLayer, "__call__", lambda self, *a: calls.append(1) or FUSED_CALL(self, *a))
    model = q41_llama(seed=11)
    fused = runner(model, True, static_shapes)
    os.environ[UNFUSED_ENV] = "1"
    try:
        python = runner(model, True, static_shapes)
    finally:
        os.environ.pop(UNFUSED_ENV)
    assert all(layer.fused is not None for layer in fused.lean.layers)
    assert all(layer.fused is None for layer in python.lean.layers)
    with torch.inference_mode():
        for a, b in zip(forwards(fused, feature_layers=(0, 1)), forwards(python, feature_layers=(0, 1))):
            assert torch.equal(a, b)  # logits, EAGLE-3's features, prefill, tree and chain alike
        assert len(calls) >= 2 * len(fused.lean.layers)  # the tree and the chain ran fused (the prefill set up)
        for run in (fused, python):  # the keys and values written, as the Python path writes them
            run.start(64)
            run.forward([5, 9, 3, 17])
        end = 4
        for layer_a, layer_b in zip(fused.cache.layers, python.cache.layers):
            assert torch.equal(layer_a.keys[:, :, :end], layer_b.keys[:, :, :end])
            assert torch.equal(layer_a.values[:, :, :end], layer_b.values[:, :, :end])
    assert_greedy_output_is_the_same_without_the_kernels_and_with_speculation(model)


@pytest.mark.skipif(kquant_unavailable() is not None, reason=f"the K-quant kernels: {kquant_unavailable()}")
@pytest.mark.parametrize("int8_parts", [False, True])
def test_fused_kquant_layers_compute_the_same_bits_as_the_lean_layers_python(int8_parts, tmp_path, monkeypatch):
    """A real-size target's layers (a GGUF's Q4_K/Q6_K blocks, and Q8_0/Q5_0 parts as the 0.5B's file has, q/k/v
    biases) run in the library's two calls a layer, and give LeanLayer's Python's bits: logits, features, caches."""
    calls = []
    monkeypatch.setattr(FusedLayer, "__call__", lambda self, *a: calls.append(1) or FUSED_CALL(self, *a))
    model, tensors = make_tiny_kquant_qwen2(seed=5, int8_parts=int8_parts)
    attach_kquant_blocks(model, write_gguf(tmp_path / "tiny.gguf", "qwen2", tensors))
    fused = runner(model, True)
    monkeypatch.setenv(UNFUSED_ENV, "1")
    python = runner(model, True)
    layers = fused.lean.layers
    assert all(layer.fused is not None for layer in layers) and all(layer.fused is None for layer in python.lean.layers)
    kinds = "+".join(m.describe() for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert ("Q8_0" in kinds and "Q5_0" in kinds) == int8_parts and "Q6_K" in kinds
    with torch.inference_mode():
        for a, b in zip(forwards(fused, feature_layers=(0, 1)), forwards(python, feature_layers=(0, 1))):
            assert torch.equal(a, b)  # logits, EAGLE-3's features, prefill, tree and chain alike
        assert len(calls) >= 2 * len(layers)
        for run in (fused, python):
            run.start(64)
            run.forward([5, 9, 3, 17])
        for layer_a, layer_b in zip(fused.cache.layers, python.cache.layers):
            assert torch.equal(layer_a.keys[:, :, :4], layer_b.keys[:, :, :4])
            assert torch.equal(layer_a.values[:, :, :4], layer_b.values[:, :, :4])


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the Q4_1 kernel: {kernel_unavailable()}")
def test_batched_teacher_generation_runs_the_q41_matrices_on_the_kernel_and_writes_the_same_tokens():
    from specdistill.distill.generation import generate_batch
    model = q41_llama(seed=9)
    copy_ = q41_for_inference(model)
    projections = [module.get_submodule(name) for module in copy_.model.layers
                   for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert all(isinstance(m, Q41Linear) for m in projections)
    assert not isinstance(copy_.lm_head, Q41Linear)  # not on its grid
    assert q41_for_inference(model) is copy_  # cached while the weights are unchanged
    prompts = [[5, 9, 3, 17], [22, 40], [7, 7, 7, 7, 7, 8]]
    on = generate_batch(model, prompts, max_new_tokens=24, pad_id=0, eos_token_ids={2})
    os.environ[NO_Q41_ENV] = "1"
    try:
        assert q41_for_inference(model) is not copy_
        assert generate_batch(model, prompts, max_new_tokens=24, pad_id=0, eos_token_ids={2}) == on
    finally:
        os.environ.pop(NO_Q41_ENV)


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the Q4_1 kernel: {kernel_unavailable()}")
def test_a_q80_head_runs_on_its_kernel_and_greedy_output_does_not_change():
    model = q41_llama(seed=10)
    head = model.get_output_embeddings()
    with torch.no_grad():
        codes, step = q80_codes(head.weight)  # the default target's tied head is exactly Q8_0, its steps fp16
        head.weight.copy_((codes * step.half().float()[..., None]).reshape(head.weight.shape))
    fast = q41_runner(model, True).head
    assert isinstance(fast, Q80Linear) and fast.codes.form == ("fma" if amx_unavailable() else "amx")
    assert not isinstance(q41_runner(model, False).head, Q80Linear)
    assert_greedy_output_is_the_same_without_the_kernels_and_with_speculation(model)


def make_tiny_qwen2(seed: int = 0, sliding: bool = False):
    """A seeded random Qwen2 (attention biases made non-zero, an untied head, grouped-query attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, use_sliding_window=sliding, sliding_window=16, max_window_layers=0,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("static_shapes", [False, True])
def test_lean_forward_computes_what_transformers_does_for_qwen2_with_its_biases(static_shapes):
    model = make_tiny_qwen2(seed=3)
    assert lean_supported(model) is None
    with torch.inference_mode():
        lean = forwards(runner(model, True, static_shapes))
        reference = forwards(runner(model, False, static_shapes))
    for a, b in zip(lean, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    unbiased = make_tiny_qwen2(seed=3)
    with torch.no_grad():
        unbiased.model.layers[0].self_attn.k_proj.bias.zero_()
    with torch.inference_mode():
        assert not torch.allclose(forwards(runner(unbiased, True, static_shapes))[0], lean[0])  # the biases are read


def test_lean_forward_declines_what_it_does_not_compute():
    assert "sliding-window" in lean_supported(make_tiny_qwen2(sliding=True))
    model = make_tiny_llama(layers=1)
    assert lean_supported(model) is None
    adapted = get_peft_model(make_tiny_llama(layers=1), LoraConfig(r=2, target_modules=["q_proj"]))
    assert "q_proj" in lean_supported(adapted.base_model.model)
    bf16 = make_tiny_llama(layers=1).to(torch.bfloat16)
    assert "fp32" in lean_supported(bf16)
    other = make_tiny_llama(layers=1)
    other.config.hidden_act = "gelu"
    assert "activation" in lean_supported(other)


@needs_fp16
def test_fp16_packed_linear_is_the_linear_with_fp16_rounded_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    rounded = torch.nn.Linear(24, 40)
    with torch.no_grad():
        rounded.weight.copy_(linear.weight.half().float())
        rounded.bias.copy_(linear.bias)
    packed = packed_for_inference(linear, "float16")
    assert isinstance(packed, PackedLinearFP16)
    for rows in (1, 3, 16):
        x = torch.randn(1, rows, 24)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), rounded(x), rtol=1e-5, atol=1e-5)
            assert not torch.equal(packed(x), linear(x))  # a different model from the fp32 one


@needs_fp16
def test_speculation_in_float16_weights_equals_plain_decoding_in_float16_weights():
    target, drafter = make_tiny_llama(layers=2, seed=0, peak=4.0), make_tiny_llama(layers=1, seed=1, peak=4.0)
    set_inference_weights(target, "float16")
    assert inference_weights(target) == "float16"
    prompt = [1, 5, 9, 14, 5, 9, 14]
    plain = SpeculativeEngine(target, None)
    assert isinstance(plain.target.head, PackedLinearFP16)
    expected = plain.generate(prompt, 30).tokens
    for proposer in (DraftModelProposer(drafter, gamma=4), PromptLookupProposer(num_tokens=3)):
        for adaptive in (True, False):
            assert SpeculativeEngine(target, proposer, adaptive=adaptive).generate(prompt, 30).tokens == expected


def test_precision_names_resolve_and_bad_ones_name_the_choices():
    assert resolve_precision("float32", "cpu") == (torch.float32, "float32")
    if cpu_has_native_bf16():
        assert resolve_precision("bfloat16", "cpu") == (torch.bfloat16, "float32")
    else:
        with pytest.raises(ValueError, match="token for token"):
            resolve_precision("bfloat16", "cpu")
    assert resolve_precision(torch.bfloat16, "cpu") == (torch.bfloat16, "float32")  # as a torch dtype: as asked
    assert resolve_precision(None, "cpu") == (torch.float32, "float32")
    assert resolve_precision("auto", "cuda")[0] == torch.bfloat16
    with pytest.raises(ValueError, match="float16-weights"):
        resolve_precision("fp8", "cpu")
    with pytest.raises(ValueError, match="CPU precision"):
        resolve_precision("float16-weights", "cuda")
    with pytest.raises(ValueError, match="choose one of float32, float16"):
        set_inference_weights(make_tiny_llama(layers=1), "int8")
    assert set(PRECISIONS) == {"float32", "bfloat16", "float16-weights", "auto"}


def test_evaluate_rejects_a_bad_dtype_naming_the_choices(capsys):
    from specdistill.decode.evaluate import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--drafter", "prompt_lookup", "--questions", __file__, "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert "--dtype" in err and "float16-weights" in err and "auto" in err


@needs_fp16
@pytest.mark.parametrize("target_weights", ["float32", "float16"])
def test_drafters_draft_in_float16_weights_whatever_the_target_computes_in(target_weights):
    from specdistill.decode.proposers import build_proposer
    from specdistill.decode.proposers.medusa import MedusaProposer
    from specdistill.models.drafters import Drafter
    from specdistill.models.eagle3 import Eagle3Drafter
    from specdistill.models.medusa import MedusaHeads

    target = make_tiny_llama(layers=2, seed=0)
    set_inference_weights(target, target_weights)
    draft = Drafter(kind="draft_model", model=make_tiny_llama(layers=1, seed=1), vocab_map=None, manifest={}, path=None)
    proposer = build_proposer(draft, target)
    assert inference_weights(draft.model) == "float16"
    assert isinstance(proposer.runner.head, PackedLinearFP16)
    eagle = Eagle3Drafter.for_target(target, torch.arange(64), [0, 1, 1]).float().eval()
    eagle_drafter = Drafter(kind="eagle3", model=eagle, vocab_map=eagle.vocab_map, manifest={}, path=None)
    net = build_proposer(eagle_drafter, target).net
    auto = Q80Linear if kernel_unavailable() is None else PackedLinearFP16  # EAGLE-3: Q8_0 where the kernels run
    assert isinstance(net.lm_head, auto) and isinstance(net.fc, auto)
    net = build_proposer(eagle_drafter, target, drafter_weights="float16").net
    assert isinstance(net.lm_head, PackedLinearFP16) and isinstance(net.fc, PackedLinearFP16)
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1).eval()
    medusa = build_proposer(Drafter(kind="medusa", model=heads, vocab_map=None, manifest={}, path=None), target)
    assert isinstance(medusa, MedusaProposer) and all(isinstance(p, PackedLinearFP16) for p in medusa.projections)
    # asked for the drafter as trained: fp32 packing, for every kind
    assert isinstance(build_proposer(eagle_drafter, target, drafter_weights="float32").net.lm_head, PackedLinear)
    build_proposer(draft, target, drafter_weights="float32")
    assert inference_weights(draft.model) == "float32"


def test_drafter_weights_bad_value_names_the_choices():
    from specdistill.models.packed_linear import drafting_weights

    model = make_tiny_llama(layers=1, seed=0)
    with pytest.raises(ValueError, match="choose one of auto, float32, float16"):
        drafting_weights(model, "half")
    assert drafting_weights(model.to(torch.bfloat16), "auto") == "float32"  # unpackable: as it is


@needs_fp16
def test_speculation_with_float16_drafters_still_equals_plain_decoding():
    from specdistill.decode.proposers import build_proposer
    from specdistill.models.drafters import Drafter
    from specdistill.models.eagle3 import Eagle3Drafter

    target = make_tiny_llama(layers=2, seed=0)
    eagle = Eagle3Drafter.for_target(target, torch.arange(64), [0, 1, 1]).float().eval()
    drafter = Drafter(kind="eagle3", model=eagle, vocab_map=eagle.vocab_map, manifest={}, path=None)
    prompt = [1, 5, 9, 14, 3, 7]
    plain = SpeculativeEngine(target, None, eos_token_ids={2}).generate(prompt, 40).tokens
    for weights in ("float16", "float32"):
        proposer = build_proposer(drafter, target, eos_token_ids={2}, drafter_weights=weights)
        engine = SpeculativeEngine(target, proposer, eos_token_ids={2}, adaptive=False)
        assert engine.generate(prompt, 40).tokens == plain


def test_serve_takes_a_precision_and_rejects_a_bad_one_naming_the_choices(capsys, tmp_path):
    from specdistill.decode.serve import parse_args

    assert parse_args(["--log-dir", str(tmp_path), "--dtype", "float16-weights"]).dtype == "float16-weights"
    assert parse_args(["--log-dir", str(tmp_path)]).dtype is None  # the device's default
    with pytest.raises(SystemExit):
        parse_args(["--log-dir", str(tmp_path), "--dtype", "half"])
    err = capsys.readouterr().err
    assert "--dtype" in err and "float16-weights" in err


@needs_fp16
def test_an_evaluation_in_float16_weights_names_it_and_skips_the_fp32_peers(tmp_path):
    from specdistill.decode.evaluate import EvalConfig, run_evaluation
    from specdistill.decode.questions import load_questions
    from specdistill.models.drafters import load_drafter
    from specdistill.models.target import target_from_model
    from tests.decode.test_evaluate import MT_BENCH_LINES, VOCAB, make_chat_tokenizer, write_lines

    target = target_from_model(make_tiny_llama(vocab_size=VOCAB, layers=2, seed=0), make_chat_tokenizer(), "tiny")
    set_inference_weights(target.model, "float16")
    assert target.precision == "float16-weights"
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    drafters = {"truncated:1": load_drafter("truncated:1", target)}
    config = EvalConfig(drafters=tuple(drafters), questions=str(tmp_path / "q.jsonl"), max_new_tokens=10, warmup=0,
                        peers="hf")
    result = run_evaluation(target, drafters, questions, config, progress=False)
    assert result.config["precision"] == "float16-weights"
    assert {"hf_generate", "hf_assisted", "hf_prompt_lookup"} <= set(result.skipped)
    assert all("fp32 model" in reason for reason in result.skipped.values())
    assert result.summary["speculative"]["mismatches"] == 0 and result.summary["speculative"]["turns"] == 4


@pytest.mark.parametrize("library_reason,fbgemm,expected", [
    (None, True, "float32"),  # the kernel library's 4-bit forms (AVX-512 or its AVX2 build)
    ("this CPU has neither avx512f nor avx2 with fma and f16c", True, "float16"),
    ("no C++ compiler (c++ or g++) on PATH", False, "float32"),
])
def test_auto_precision_on_a_cpu_without_bf16_is_the_kernel_library_where_it_runs(monkeypatch, library_reason,
                                                                                    fbgemm, expected):
    from specdistill.models import kernels, target

    monkeypatch.setattr(target, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(target, "float16_weights_supported", lambda: fbgemm)
    monkeypatch.setattr(kernels, "unavailable", lambda: library_reason)
    assert resolve_precision("auto", "cpu") == (torch.float32, expected)
