"""models.kquant, the library's K-quant GEMMs (models/kernels/csrc/kquant.cpp), KQuantLinear and models.gguf_blocks:
blocks decode to gguf-py's weights, the kernels compute what their integer arithmetic says and each row alike
whatever the rows beside it, a fused matrix of mixed formats equals its parts, and a GGUF's blocks are attached
only to the linears they are exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdistill.models import kernels
from specdistill.models.gguf_blocks import ATTRIBUTE, attach_kquant_blocks, llama_row_order, module_name
from specdistill.models.kernel_linear import KQuantLinear, kquant_matrix
from specdistill.models.kquant import KQuantBlocks, dequantize, gemm_reference, pack, quantize_rows_reference
from tests.models.kquant_fixtures import make_tiny_kquant_qwen2, random_blocks, write_gguf

needs_kquant = pytest.mark.skipif(kernels.kquant_unavailable() is not None,
                                reason=f"the K-quant kernels: {kernels.kquant_unavailable()}")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_blocks_decode_to_gguf_pys_weights(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    blocks = random_blocks(kind, 48, 512, seed=1)
    reference = gguf_dequantize(blocks.raw.numpy(), GGMLQuantizationType[kind])
    assert torch.equal(dequantize(blocks), torch.from_numpy(np.ascontiguousarray(reference)).reshape(48, 512))


def test_blocks_refuse_a_bad_kind_or_a_ragged_row():
    with pytest.raises(ValueError, match="kind must be one of"):
        KQuantBlocks("Q5_K", torch.zeros(16, 176, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"raw must be uint8 \[N, K/256 \* 144\]"):
        KQuantBlocks("Q4_K", torch.zeros(16, 150, dtype=torch.uint8))
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        pack(random_blocks("Q4_K", 8, 256))


def test_rows_are_rounded_to_int8_per_block_of_256():
    x = torch.randn(3, 512) * torch.tensor([1.0, 100.0, 0.01])[:, None]
    x[2, 256:] = 0  # an all-zero block: step 0, codes 0
    q, d, sums = quantize_rows_reference(x)
    assert q.abs().max() == 127 and d[2, 1] == 0 and torch.all(q[2, 256:] == 0)
    rebuilt = q.float().reshape(3, 2, 256) * d[..., None]
    assert torch.all((rebuilt.reshape(3, 512) - x).abs() <= d.repeat_interleave(256, 1) / 2 + 1e-6)
    assert torch.equal(sums, q.reshape(3, 32, 16).sum(-1, dtype=torch.int32))


@needs_kquant
def test_the_librarys_rounding_is_the_reference_rounding():
    x = torch.randn(5, 768) * 3
    for ours, reference in zip(kernels.library().quantize_rows_q8k(x), quantize_rows_reference(x)):
        assert torch.equal(ours, reference)


@needs_kquant
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kernel_computes_its_integer_arithmetic_and_each_row_alike(kind):
    lib = kernels.library()
    blocks = random_blocks(kind, 48, 768, seed=2)
    matrix = kquant_matrix(lib, blocks)
    x = torch.randn(19, 768)  # 19 rows: two groups of 8 and one of 3
    y = torch.full((19, 48 + 32), float("nan"))
    matrix.gemm_into(*lib.quantize_rows_q8k(x), y, 16)
    assert torch.isnan(y[:, :16]).all() and torch.isnan(y[:, 64:]).all()  # only its columns written
    reference = gemm_reference(x, blocks)
    assert float((y[:, 16:64].double() - reference).abs().max() / reference.abs().max()) < 1e-5
    for count in range(1, 19):  # alone, and in calls of every group size and of several groups, at other offsets
        rows = range(count % 3, count % 3 + count)
        part = x[rows.start:rows.stop].contiguous()
        out = torch.empty(len(rows), 48)
        matrix.gemm_into(*lib.quantize_rows_q8k(part), out, 0)
        assert torch.equal(out, y[rows.start:rows.stop, 16:64])
    dense = x @ dequantize(blocks).T  # the rounding of x is the only approximation
    assert float((y[:, 16:64] - dense).abs().max() / dense.abs().max()) < 0.03


@needs_kquant
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_call_of_more_rows_than_one_pass_computes_each_row_as_alone(kind):
    lib = kernels.library()
    matrix = kquant_matrix(lib, random_blocks(kind, 32, 768, seed=5))
    x = torch.randn(1403, 768)  # K = 768: passes of 680 rows (512 KiB of int8 rows), so three passes, one of 43
    whole = torch.empty(1403, 32)
    matrix.gemm_into(*lib.quantize_rows_q8k(x), whole, 0)
    for start in range(0, 1403, 61):  # groups of 61 rows, across the passes' edges
        part = torch.empty(min(61, 1403 - start), 32)
        matrix.gemm_into(*lib.quantize_rows_q8k(x[start:start + 61].contiguous()), part, 0)
        assert torch.equal(part, whole[start:start + 61]), start


@needs_kquant
def test_kernel_boundary_names_what_is_wrong():
    lib = kernels.library()
    matrix = kquant_matrix(lib, random_blocks("Q4_K", 16, 256))
    q, d, sums = lib.quantize_rows_q8k(torch.randn(2, 256))
    with pytest.raises(ValueError, match=r"Q4KMatrix.gemm_into: y must be \[2, >= column \+ 16\]"):
        matrix.gemm_into(q, d, sums, torch.empty(2, 16), 8)
    with pytest.raises(TypeError, match="Q4KMatrix.gemm_into: q must be Char"):
        matrix.gemm_into(q.float(), d, sums, torch.empty(2, 16), 0)
    with pytest.raises(ValueError, match="quantize_rows_q8k: x must be .* K a multiple of 256"):
        lib.quantize_rows_q8k(torch.randn(2, 300))
    packed = pack(random_blocks("Q6_K", 16, 256))
    packed["sc"] = packed["sc"][:, :, :8].contiguous()
    with pytest.raises(ValueError, match="Q6KMatrix: sc must have shape"):
        lib.Q6KMatrix(**packed)


@needs_kquant
def test_a_fused_matrix_of_mixed_formats_equals_its_parts_with_its_bias():
    lib = kernels.library()
    parts = [random_blocks("Q4_K", 32, 512, seed=3), random_blocks("Q6_K", 16, 512, seed=4),
             random_blocks("Q4_K", 16, 512, seed=5)]
    bias = torch.randn(64)
    fused = KQuantLinear(parts, bias, lib)
    x = torch.randn(1, 6, 512)
    with torch.inference_mode():
        y = fused(x)
        alone = torch.cat([KQuantLinear([p], None, lib)(x) for p in parts], dim=-1) + bias
    assert y.shape == (1, 6, 64) and torch.equal(y, alone) and torch.equal(fused.rows(x), y)
    assert fused(torch.randn(0, 512)).shape == (0, 64)  # no rows, as nn.Linear (a catch-up asking for no logits)
    with pytest.raises(ValueError, match="segments of different K"):
        KQuantLinear([parts[0], random_blocks("Q4_K", 16, 256)], None, lib)


def test_the_q5_0_layout_holds_every_code_and_step_where_the_kernel_reads_it():
    from specdistill.models.kquant import int8_fields, q50_layout

    blocks = random_blocks("Q5_0", 32, 96, seed=12)
    packed = q50_layout(blocks)
    codes = int8_fields(blocks)["codes"] + 16  # q in 0..31 [N, K]
    assert {k: list(v.shape) for k, v in packed.items()} == {"low": [2, 3, 4, 64], "high": [2, 3, 64],
                                                             "d": [2, 3, 16]}
    for n, k in [(0, 0), (5, 7), (17, 40), (31, 95), (16, 36)]:
        nb, o, g, j = n // 16, n % 16, k // 32, k % 32
        p, nibble, i = j // 8, (j % 8) // 4, j % 4
        byte = int(packed["low"][nb, g, p, 4 * o + i])
        t = j // 4  # chunk of 4 k
        fifth = (int(packed["high"][nb, g, 4 * o + i]) >> t) & 1
        assert ((byte >> (4 * nibble)) & 0x0F) | (fifth << 4) == int(codes[n, k]), (n, k)
        assert float(packed["d"][nb, g, o]) == float(int8_fields(blocks)["d"][n, g])


def test_the_q8_0_layout_holds_every_code_offset_to_unsigned_where_the_kernel_reads_it():
    from specdistill.models.kquant import int8_fields, q80_layout

    blocks = random_blocks("Q8_0", 32, 96, seed=14)
    packed = q80_layout(blocks)
    codes = int8_fields(blocks)["codes"]
    assert list(packed["codes"].shape) == [2, 3, 8, 64] and list(packed["d"].shape) == [2, 3, 16]
    for n, k in [(0, 0), (5, 7), (17, 40), (31, 95)]:
        nb, o, g, j = n // 16, n % 16, k // 32, k % 32
        assert int(packed["codes"][nb, g, j // 4, 4 * o + j % 4]) == int(codes[n, k]) + 128, (n, k)


@needs_kquant
@pytest.mark.parametrize("kind", ["Q5_0", "Q8_0"])
def test_blocks_of_32_compute_what_the_int8_kernel_computes_bit_for_bit_each_row_alike(kind):
    """Q50Matrix / Q80Matrix read the file's codes (5.5 / 8.5 bits a weight) where Int8Matrix reads them as int8
    with an fp32 step and an int32 offset per 32 (10 bits): the same integer dots, the same fp32 operations in the
    same order, so the same numbers; any row count, each row as alone."""
    from specdistill.models.kquant import INT8_KINDS, int8_fields
    from specdistill.models.quant_formats import int8_layout

    lib = kernels.library()
    blocks = random_blocks(kind, 64, 768, seed=13)
    native = kquant_matrix(lib, blocks)
    f = int8_fields(blocks)
    w = int8_layout(f["codes"].reshape(64, 24, 32), f["d"])
    assert kind in INT8_KINDS and type(native).__name__ == {"Q5_0": "Q50Matrix", "Q8_0": "Q80Matrix"}[kind]
    x = torch.randn(11, 768, generator=torch.Generator().manual_seed(3)) * 2
    x[4, 64:96] = 0  # a group of zeros: step 0
    y = native.gemm(x)
    assert torch.equal(y, lib.Int8Matrix(w.codes, w.step, w.bias).gemm(x))
    for rows in (range(0, 1), range(2, 5), range(3, 11)):
        assert torch.equal(native.gemm(x[rows.start:rows.stop].contiguous()), y[rows.start:rows.stop])
    forty_eight = kquant_matrix(lib, KQuantBlocks(kind, blocks.raw[:48].contiguous()))  # N a multiple of 16 only
    assert torch.equal(forty_eight.gemm(x), y[:, :48])
    dense = x @ dequantize(blocks).T
    assert float((y - dense).abs().max() / dense.abs().max()) < 0.03


@needs_kquant
def test_blocks_of_32_refuse_a_layout_of_another_shape():
    lib = kernels.library()
    packed = pack(random_blocks("Q5_0", 16, 64))
    with pytest.raises(ValueError, match=r"Q50Matrix: high must have shape"):
        lib.Q50Matrix(packed["low"], packed["high"][:, :1].contiguous(), packed["d"])
    with pytest.raises(TypeError, match="Q80Matrix: d must be Half"):
        lib.Q80Matrix(pack(random_blocks("Q8_0", 16, 64))["codes"], packed["d"].float())


@needs_kquant
def test_q5_0_and_q8_0_segments_run_over_exactly_their_codes():
    """A small model's Q5_0 / Q8_0 matrices (the 0.5B draft model's) beside a K-quant one: each segment computes
    x rounded per group of 32 (the int8 kernel's rounding) times exactly the file's codes and steps, more than
    MAX_ROWS rows at once, each row alike alone."""
    from specdistill.models.kernels import MAX_ROWS
    from specdistill.models.kquant import int8_fields
    from specdistill.models.quant_formats import int8_rows

    lib = kernels.library()
    parts = [random_blocks("Q5_0", 32, 512, seed=6), random_blocks("Q8_0", 64, 512, seed=7),
             random_blocks("Q4_K", 16, 512, seed=8)]
    fused = KQuantLinear(parts, None, lib)
    x = torch.randn(MAX_ROWS + 3, 512, generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        y = fused(x)
    xq, dx = int8_rows(x)  # [R, G, 32], [R, G]
    for part, start in zip(parts[:2], (0, 32)):
        f = int8_fields(part)
        codes = f["codes"].double().reshape(part.shape[0], -1, 32)  # [N, G, 32]
        dots = torch.einsum("rgk,ngk->rng", xq.double(), codes)  # exact integer sums
        expected = (dots * dx.double()[:, None, :] * f["d"].double()[None]).sum(-1)
        got = y[:, start:start + part.shape[0]].double()
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
    with torch.inference_mode():
        assert torch.equal(fused(x[5:6])[0], y[5])
        assert torch.equal(fused(x[MAX_ROWS:])[1], y[MAX_ROWS + 1])



@needs_kquant
def test_a_projection_refuses_what_is_not_a_matrix_of_its_k_or_a_bias_of_its_width():
    lib = kernels.library()
    q4k = kquant_matrix(lib, random_blocks("Q4_K", 16, 512, seed=1))
    with pytest.raises(TypeError, match="a part must be a Q4KMatrix, Q6KMatrix, Q50Matrix or Q80Matrix"):
        lib.KQuantProjection([q4k, object()], None)
    with pytest.raises(ValueError, match="KQuantProjection: parts over different K: 512 and 256"):
        lib.KQuantProjection([q4k, kquant_matrix(lib, random_blocks("Q6_K", 16, 256, seed=2))], None)
    with pytest.raises(ValueError, match=r"KQuantProjection: bias must have shape \[16\]"):
        lib.KQuantProjection([q4k], torch.zeros(32))
    with pytest.raises(ValueError, match=r"KQuantProjection.gemm: x must be \[R >= 1, 512\]"):
        lib.KQuantProjection([q4k], None).gemm(torch.zeros(2, 256))


def test_llama_cpp_names_map_to_transformers_modules():
    assert module_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj"
    assert module_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj"
    assert module_name("output.weight") == "lm_head"
    assert module_name("token_embd.weight") is None and module_name("blk.0.attn_norm.weight") is None


def test_llama_row_order_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows, heads = 48, 3
    file_rows = torch.randn(rows, 4)
    expected = torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(file_rows.numpy(), heads, heads))
    assert torch.equal(file_rows[llama_row_order(rows, heads)], expected)


def test_a_gguf_is_attached_to_exactly_the_linears_it_is(tmp_path):
    model, tensors = make_tiny_kquant_qwen2(seed=1, layers=2)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3  # one weight off its block: not attached
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", tensors)
    counts = attach_kquant_blocks(model, path)
    assert counts == {"attached": len(tensors) - 1, "differing": 1, "unmatched": 0}
    assert not hasattr(model.model.layers[1].mlp.up_proj, ATTRIBUTE)
    head = getattr(model.lm_head, ATTRIBUTE)
    assert head[0].kind == "Q6_K" and torch.equal(head[0].raw, tensors["output.weight"].raw)


def test_the_source_gguf_is_read_from_a_conversions_marker_only_where_it_is_a_path(tmp_path):
    from specdistill.models.gguf_blocks import gguf_source

    for info, expected in (({"gguf": "/data/model.gguf"}, "/data/model.gguf"), ({"source": "/x/y.gguf"}, "/x/y.gguf"),
                           ({"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}, None), ({"name": "hf"}, None)):
        (tmp_path / "COMPLETE.json").write_text(__import__("json").dumps(info))
        assert gguf_source(tmp_path) == (None if expected is None else __import__("pathlib").Path(expected))
    assert gguf_source(tmp_path / "absent") is None


def test_a_file_without_k_quants_or_not_a_gguf_attaches_nothing(tmp_path):
    model, tensors = make_tiny_kquant_qwen2(seed=2, layers=1)
    q8_only = {"output.weight": random_blocks("Q8_0", 64, 256)}  # a Q4_1/Q8_0 file keeps its exact kernels
    none = {"attached": 0, "differing": 0, "unmatched": 0}
    assert attach_kquant_blocks(model, write_gguf(tmp_path / "q8.gguf", "qwen2", q8_only)) == none
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    assert attach_kquant_blocks(model, tmp_path / "bad.gguf") == none
    assert not any(hasattr(m, ATTRIBUTE) for m in model.modules())


@needs_kquant
@pytest.mark.parametrize("code,sign", [(127, 1.0), (127, -1.0), (-128, 1.0), (-128, -1.0)])
def test_blocks_of_32_at_the_extremes_of_their_codes_compute_exact_integer_dots(code, sign):
    """Q8_0's unsigned bytes reach 255 and x's int8 codes +-127, where a pair of products leaves int16 (the AVX2
    build's vpmaddubsw would saturate there: csrc/avx2_isa.h splits the byte); the integer dot must be exact."""
    blocks = random_blocks("Q8_0", 32, 256, seed=21)
    raw = blocks.raw.clone().view(32, -1, 34)
    raw[..., 2:34] = code & 0xFF  # every weight's code; each block keeps its own fp16 step
    blocks = KQuantBlocks("Q8_0", raw.reshape(32, -1))
    x = torch.full((3, 256), sign)  # rounded to +-127 in every group
    y = kquant_matrix(kernels.library(), blocks).gemm(x)
    dense = x.double() @ dequantize(blocks).double().T
    assert float((y.double() - dense).abs().max() / dense.abs().max()) < 1e-6
