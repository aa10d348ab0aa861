"""models.q41_linear: the packing is exact on a Q4_1 (layers) or Q8_0 (head) grid, the kernels compute F.linear
over it with each row alike whatever the row count, and the engine uses them only where a matrix is exactly on
such a grid, with greedy output unchanged."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from models.q41_linear import (MAX_ROWS, NO_AMX_ENV, GreedyHead, Q8Int8Linear, Q8Int8Weight, Q41Linear, Q41Weight,
                               Q80Linear, amx_unavailable, attention_rows, avx512_available, build_kernel,
                               grid_deviation, head_for_inference, int8_inference_copy, int8_rows, pack_q8_int8,
                               pack_q41, pack_q80, q8_int8_gemm, q41_linear, q41_or_packed, q41_usable, q80_codes,
                               q80_deviation, q80_gemm, q80_inference_copy, q80_rounded, q80_usable, rms_norm_rows,
                               rope_qk, scales_are_fp16, unpack_q8_int8, unpack_q41, unpack_q80, vnni_unavailable)
from models.packed_linear import PackedLinear


def q41_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] weights that are exactly Q4_1: per group of 32, code * step + min, codes 0 and 15 both present."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15  # the group's min and max are the grid's ends, as Q4_1 writes them
    step = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()  # a GGUF stores d and m in fp16
    low = (torch.randn(n, k // 32, 1, generator=g) * 0.05).half().float()
    return (codes * step + low).reshape(n, k)


def snap_to_q41(linear: torch.nn.Linear) -> None:
    with torch.no_grad():
        linear.weight.copy_(unpack_q41(pack_q41(linear.weight)))


def test_packing_a_q41_matrix_loses_nothing():
    w = q41_matrix(24, 128)
    assert grid_deviation(w) < 1e-6
    assert torch.allclose(unpack_q41(pack_q41(w)), w, rtol=0, atol=1e-6)


def test_a_matrix_off_the_grid_shows_its_deviation_and_is_not_used():
    w = torch.randn(24, 128)
    assert grid_deviation(w) > 1e-3
    linear = torch.nn.Linear(128, 24, bias=False)
    assert not q41_usable(linear)
    assert isinstance(q41_or_packed(linear), PackedLinear)
    snap_to_q41(linear)
    assert q41_usable(linear)


def test_shapes_the_kernel_cannot_take_are_errors():
    with pytest.raises(ValueError, match="K must be"):
        pack_q41(torch.randn(4, 80))  # K not whole groups of 32
    with pytest.raises(ValueError, match="N of 2"):
        pack_q41(torch.randn(3, 64))  # N not whole blocks of the kernel's 2 outputs
    with pytest.raises(ValueError, match="form must be"):
        pack_q41(torch.randn(4, 64), "avx2")


needs_kernel = pytest.mark.skipif(shutil.which("gcc") is None or not avx512_available(),
                                  reason="the kernel needs gcc and an AVX-512 CPU")


@needs_kernel
def test_the_kernel_computes_f_linear_over_the_packed_weights(tmp_path):
    lib = build_kernel(tmp_path)
    w = q41_matrix(40, 1536, seed=1)
    q = pack_q41(w)
    x = torch.randn(40, 1536)  # several blocks of the kernel's 8 rows
    y = q41_linear(lib, x, q)
    reference = F.linear(x, w)
    assert float((y - reference).abs().max() / reference.abs().max()) < 1e-5
    for rows in (1, 5, 9, 17):  # a row is computed alike whatever the row count
        assert torch.equal(q41_linear(lib, x[:rows], q), y[:rows])
    swapped = Q41Weight(((q.packed & 15) << 4) | (q.packed >> 4), q.step, q.minimum)  # the nibbles' order mixed up
    assert float((q41_linear(lib, x, swapped) - reference).abs().max() / reference.abs().max()) > 1e-2
    with pytest.raises(ValueError, match="fp32"):
        q41_linear(lib, torch.randn(MAX_ROWS + 1, 1536), q)


@needs_kernel
def test_the_kernel_rebuilds_the_weights_exactly(tmp_path):
    """A one-hot row reads one column of W: equal to the packing's weights bit for bit only if each weight is
    rebuilt as it was dequantized (q * d rounded, then + m rounded), not one ulp off (a fused multiply-add)."""
    lib = build_kernel(tmp_path)
    w = q41_matrix(64, 256, seed=2)
    columns = torch.tensor([0, 17, 31, 32, 100, 255])
    x = torch.nn.functional.one_hot(columns, 256).float()  # [6, 256]
    q = pack_q41(w)
    assert torch.equal(q41_linear(lib, x, q), unpack_q41(q)[:, columns].T)


@needs_kernel
def test_q41_linear_sends_long_calls_to_onednn_and_matches_both_ways(tmp_path):
    linear = torch.nn.Linear(128, 48, bias=False)
    snap_to_q41(linear)
    module = Q41Linear(linear, build_kernel(tmp_path))
    for rows in (1, 3, MAX_ROWS, MAX_ROWS + 7):
        x = torch.randn(1, rows, 128)
        with torch.no_grad():
            assert torch.allclose(module(x), linear(x), rtol=1e-5, atol=1e-5)


def q80_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] weights that are exactly Q8_0: per group of 32, code * step with codes in -127..127, 127 present."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    codes[..., 0] = 127
    step = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()  # Q8_0 stores d in fp16
    return (codes * step).reshape(n, k)


def test_packing_a_q80_matrix_loses_nothing_and_other_matrices_are_not_used():
    w = q80_matrix(24, 128)
    assert q80_deviation(w) == 0
    assert torch.equal(unpack_q80(pack_q80(w)), w)
    linear = torch.nn.Linear(128, 24, bias=False)
    assert not q80_usable(linear)  # random weights: far off any 8-bit grid
    with torch.no_grad():
        linear.weight.copy_(w)
    assert q80_usable(linear)


@needs_kernel
def test_the_q80_kernel_computes_f_linear_and_reads_the_weights_exactly(tmp_path):
    lib = build_kernel(tmp_path)
    w = q80_matrix(40, 576, seed=3)
    q = pack_q80(w)
    x = torch.randn(21, 576)
    y = q80_gemm(lib, x, q)
    reference = F.linear(x, w)
    assert float((y - reference).abs().max() / reference.abs().max()) < 1e-5
    for rows in (1, 5, 9):  # a row is computed alike whatever the row count
        assert torch.equal(q80_gemm(lib, x[:rows].contiguous(), q), y[:rows])
    columns = torch.tensor([0, 15, 16, 31, 300])
    assert torch.equal(q80_gemm(lib, F.one_hot(columns, 576).float(), q), w[:, columns].T)


@needs_kernel
def test_the_head_goes_to_the_q80_kernel_only_when_it_is_exactly_q80():
    head = torch.nn.Linear(128, 64, bias=False)
    assert isinstance(head_for_inference(head), PackedLinear)
    with torch.no_grad():
        head.weight.copy_(q80_matrix(64, 128, seed=4))
    fast = head_for_inference(head)
    assert isinstance(fast, Q80Linear) and head_for_inference(head) is fast  # cached
    for rows in (1, 7, MAX_ROWS + 3):  # past MAX_ROWS: oneDNN's packed copy of the same weights
        x = torch.randn(1, rows, 128)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), head(x), rtol=1e-5, atol=1e-5)


needs_amx = pytest.mark.skipif(amx_unavailable() is not None, reason=f"the AMX form: {amx_unavailable()}")
FORMS = ["fma", pytest.param("amx", marks=needs_amx)]


KINDS = {"q41": (q41_matrix, pack_q41, unpack_q41, q41_linear), "q80": (q80_matrix, pack_q80, unpack_q80, q80_gemm)}


@needs_kernel
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["q41", "q80"])
def test_each_form_computes_f_linear_rows_alike_and_reads_the_weights_exactly(tmp_path, kind, form):
    matrix, pack, unpack, gemm = KINDS[kind]
    lib = build_kernel(tmp_path)
    w = matrix(96, 576, seed=11)
    q = pack(w, form)
    assert q.form == form and q.shape == (96, 576)
    assert torch.equal(unpack(q), unpack(pack(w, "fma")))  # the same weights in either order
    x = torch.randn(40, 576)  # past the AMX form's tiles of 16 rows
    y = gemm(lib, x, q)
    reference = F.linear(x, unpack(q))
    assert float((y - reference).abs().max() / reference.abs().max()) < 1e-5
    for rows in (1, 5, 16, 17, 33):  # a row is computed alike whatever the row count
        assert torch.equal(gemm(lib, x[:rows].contiguous(), q), y[:rows])
    columns = torch.tensor([0, 15, 16, 31, 32, 100, 575])  # one-hot rows: the packing's weights bit for bit
    assert torch.equal(gemm(lib, F.one_hot(columns, 576).float(), q), unpack(q)[:, columns].T)


@needs_kernel
@needs_amx
def test_the_amx_form_reads_its_tile_order_and_fails_when_the_order_is_wrong(tmp_path):
    lib = build_kernel(tmp_path)
    w = q41_matrix(64, 256, seed=13)
    q = pack_q41(w, "amx")
    x = torch.randn(3, 256)
    reference = F.linear(x, unpack_q41(q))
    rows_swapped = Q41Weight(((q.packed & 15) << 4) | (q.packed >> 4), q.step, q.minimum, form="amx")
    assert float((q41_linear(lib, x, rows_swapped) - reference).abs().max() / reference.abs().max()) > 1e-2
    head = q80_matrix(64, 256, seed=14)
    h = pack_q80(head, "amx")
    pairs_swapped = type(h)(h.codes.reshape(*h.codes.shape[:-1], 16, 2).flip(-1).reshape(h.codes.shape), h.step, "amx")
    assert float((q80_gemm(lib, x, pairs_swapped) - F.linear(x, head)).abs().max()) > 1e-2


@needs_amx
def test_the_amx_form_takes_whole_blocks_of_32_outputs_and_fp16_scales_and_can_be_switched_off(monkeypatch):
    assert pack_q41(q41_matrix(64, 64)).form == "amx" and pack_q80(q80_matrix(64, 64)).form == "amx"
    assert pack_q41(q41_matrix(48, 64)).form == "fma"  # 48 outputs: not whole blocks of 32
    with pytest.raises(ValueError, match="N of 32"):
        pack_q41(q41_matrix(48, 64), "amx")
    g = torch.Generator().manual_seed(15)
    codes = torch.randint(0, 16, (64, 2, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    fp32_steps = (codes * (torch.rand(64, 2, 1, generator=g) * 0.01 + 1e-3)).reshape(64, 64)  # steps not fp16
    assert pack_q41(fp32_steps).form == "fma"
    with pytest.raises(ValueError, match="not fp16 values"):
        pack_q41(fp32_steps, "amx")
    monkeypatch.setenv(NO_AMX_ENV, "1")
    assert amx_unavailable() == f"${NO_AMX_ENV} is set"
    assert pack_q41(q41_matrix(64, 64)).form == "fma"
    with pytest.raises(RuntimeError, match="cannot run here"):
        pack_q80(q80_matrix(64, 64), "amx")


@needs_kernel
def test_the_row_operations_compute_rms_norm_and_transformers_rotary_embedding(tmp_path):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    lib = build_kernel(tmp_path)
    x, w = torch.randn(2, 5, 576), torch.randn(576)
    torch.testing.assert_close(rms_norm_rows(lib, x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    assert not torch.allclose(rms_norm_rows(lib, x, w, 1.0), F.rms_norm(x, (576,), w, 1e-5), atol=1e-3)  # eps read
    qkv, cos, sin = torch.randn(5, (9 + 2 * 3) * 64), torch.randn(5, 64), torch.randn(5, 64)
    q, k = rope_qk(lib, qkv, 9, 3, 64, cos, sin)  # 9 query heads, 3 key/value heads of 64
    heads = qkv[:, :576].view(1, 5, 9, 64).transpose(1, 2)
    kv_heads = qkv[:, 576:768].view(1, 5, 3, 64).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(heads, kv_heads, cos[None], sin[None])
    assert torch.equal(q, q_ref[0]) and torch.equal(k, k_ref[0])  # the same products and sums, bit for bit


def grouped_sdpa(q, keys, values, visible, scale):
    """torch's attention of q [H, N, hd] over keys/values [Hkv, T, hd], visible [N, T] -> [N, H * hd]."""
    heads, n, hd = q.shape
    groups = heads // keys.shape[0]
    expanded = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)  # head h reads h // groups
    out = F.scaled_dot_product_attention(q, *expanded, attn_mask=visible[None].expand(heads, -1, -1), scale=scale)
    return out.transpose(0, 1).reshape(n, heads * hd)


def tree_visibility(rows: int, prefix: int, seed: int) -> torch.Tensor:
    """[rows, prefix + rows]: the whole prefix but a few random keys, and a random tree (each row sees itself)."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.ones(rows, prefix + rows, dtype=torch.bool)
    visible[:, :prefix] &= torch.rand(rows, prefix, generator=g) < 0.9
    visible[:, prefix:] = (torch.rand(rows, rows, generator=g) < 0.5).tril() | torch.eye(rows, dtype=torch.bool)
    return visible


@needs_kernel
@pytest.mark.parametrize("rows,prefix,hd", [(1, 300, 64), (3, 7, 64), (14, 40, 32), (MAX_ROWS, 129, 64)])
def test_the_attention_kernel_computes_grouped_attention_over_what_each_row_sees(tmp_path, rows, prefix, hd):
    lib = build_kernel(tmp_path)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(9, rows, hd, generator=g)
    buffer = torch.randn(2, 3, prefix + rows + 20, hd, generator=g)  # a cache with room past the rows
    keys, values = buffer[0, :, :prefix + rows], buffer[1, :, :prefix + rows]  # views, rows hd apart
    visible = tree_visibility(rows, prefix, seed=rows)
    got = attention_rows(lib, q, keys, values, visible, hd ** -0.5)
    torch.testing.assert_close(got, grouped_sdpa(q, keys, values, visible, hd ** -0.5), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_attention_kernel_computes_each_row_alike_and_never_reads_what_a_row_cannot_see(tmp_path):
    lib = build_kernel(tmp_path)
    g = torch.Generator().manual_seed(3)
    rows, prefix, hd = 6, 50, 64
    q, keys, values = torch.randn(9, rows, hd, generator=g), torch.randn(3, prefix + rows, hd, generator=g), \
        torch.randn(3, prefix + rows, hd, generator=g)
    visible = tree_visibility(rows, prefix, seed=4)
    visible[:, 16:32] = False  # a whole block of 16 keys hidden from every row
    together = attention_rows(lib, q, keys, values, visible, 0.125)
    for i in range(rows):  # bit for bit the same alone as beside the other rows
        alone = attention_rows(lib, q[:, i:i + 1].contiguous(), keys, values, visible[i:i + 1], 0.125)
        assert torch.equal(alone[0], together[i])
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    hidden = ~visible.any(0)  # keys no row sees: NaN there changes nothing
    poisoned_keys[:, hidden], poisoned_values[:, hidden] = float("nan"), float("nan")
    assert hidden.sum() >= 16
    assert torch.equal(attention_rows(lib, q, poisoned_keys, poisoned_values, visible, 0.125), together)
    assert not torch.equal(attention_rows(lib, q, keys, values, visible, 0.25), together)  # the scale is read


@needs_kernel
def test_the_attention_kernel_refuses_tensors_it_does_not_read(tmp_path):
    lib = build_kernel(tmp_path)
    q, kv, visible = torch.randn(9, 2, 64), torch.randn(3, 10, 64), torch.ones(2, 10, dtype=torch.bool)
    attention_rows(lib, q, kv, kv, visible, 0.125)
    for bad in [dict(q=torch.randn(9, 2, 72)), dict(q=torch.randn(2, 9, 64).transpose(0, 1)),
                dict(keys=torch.randn(3, 64, 10).transpose(1, 2)), dict(keys=torch.randn(4, 10, 64)),
                dict(visible=torch.ones(2, 10)), dict(visible=torch.ones(2, 9, dtype=torch.bool)),
                dict(q=torch.randn(9, 2, 64).double())]:
        args = dict(q=q, keys=kv, values=kv, visible=visible) | bad
        with pytest.raises(ValueError, match="attention_rows"):
            attention_rows(lib, args["q"], args["keys"], args["values"], args["visible"], 0.125)


def test_a_drafters_weights_round_to_q8_0_with_fp16_steps_and_a_largest_code_of_127():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 96)  # groups of very different scales
    w[5, 32:64] = 0  # a group of zeros stays zeros
    rounded = q80_rounded(w)
    codes, step = q80_codes(rounded)  # read back as pack_q80 reads it
    assert torch.equal((codes * step[..., None]).reshape(w.shape), rounded) and scales_are_fp16(codes, step)
    nonzero = step > 0
    assert torch.all(codes.abs().amax(-1)[nonzero] == 127) and not nonzero[5, 1]
    assert torch.all((rounded - w).abs().reshape(64, 3, 32) <= step[..., None] / 2 * (1 + 1e-6))


@needs_kernel
def test_q8_0_drafting_copies_compute_f_linear_over_the_rounded_weights():
    linear = torch.nn.Linear(96, 64, bias=False)
    copy_ = q80_inference_copy(linear)
    assert isinstance(copy_, Q80Linear) and copy_.codes.form == ("fma" if amx_unavailable() else "amx")
    x = torch.randn(1, 5, 96)
    with torch.no_grad():
        torch.testing.assert_close(copy_(x), F.linear(x, q80_rounded(linear.weight)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias-free"):
        q80_inference_copy(torch.nn.Linear(96, 64))


def test_the_int8_layout_holds_the_q8_0_grid_exactly_and_takes_whole_blocks_of_32_outputs():
    w = q80_rounded(torch.randn(64, 96))
    packed = pack_q8_int8(w)
    assert torch.equal(unpack_q8_int8(packed), w)
    codes, _ = q80_codes(w)  # the bias takes back the unsigned offset: -128 times each group's code sum
    assert torch.equal(packed.bias.permute(0, 2, 1).reshape(64, 3), (-128 * codes.sum(-1)).int())
    for shape in [(48, 96), (64, 80)]:
        with pytest.raises(ValueError, match="N of 32"):
            pack_q8_int8(torch.randn(*shape))


needs_vnni = pytest.mark.skipif(vnni_unavailable() is not None, reason=f"the int8 kernel: {vnni_unavailable()}")


def int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What q8_int8_gemm stands for, in float64: each group's dot of x's int8 codes with w's Q8_0 codes, times both
    steps, summed over the groups (x [R, K], w [N, K] on the Q8_0 grid)."""
    xc, xs = int8_rows(x)  # [R, G, 32], [R, G]
    wc, ws = q80_codes(w)  # [N, G, 32], [N, G]
    dots = torch.einsum("rgk,ngk->rng", xc.double(), wc.double())
    return (dots * ws.double()[None] * xs.double()[:, None]).sum(-1)


@needs_vnni
def test_the_int8_kernel_computes_the_q8_0_dot_of_int8_rows_each_row_alike(tmp_path):
    lib = build_kernel(tmp_path)
    w = q80_rounded(torch.randn(96, 1152) * torch.logspace(-2, 0, 1152))
    packed = pack_q8_int8(w)
    x = torch.randn(13, 1152) * 3  # more rows than the kernel's blocks of 4
    x[2, 64:96] = 0  # a group of zeros: step 0
    y = q8_int8_gemm(lib, x, packed)
    reference = int8_reference(x, w)
    assert float((y.double() - reference).abs().max() / reference.abs().max()) < 1e-6
    assert float((y - F.linear(x, w)).abs().max() / F.linear(x, w).abs().max()) < 2e-2  # x's rounding, no more
    for rows in (1, 4, 5, 9):
        assert torch.equal(q8_int8_gemm(lib, x[:rows].contiguous(), packed), y[:rows])
    scrambled = Q8Int8Weight(packed.codes.flip(-1).contiguous(), packed.step, packed.bias)  # k order mixed up
    assert float((q8_int8_gemm(lib, x, scrambled) - y).abs().max() / y.abs().max()) > 1e-2
    unbiased = Q8Int8Weight(packed.codes, packed.step, torch.zeros_like(packed.bias))  # the offset left in
    assert float((q8_int8_gemm(lib, x, unbiased) - y).abs().max() / y.abs().max()) > 1e-1


@needs_vnni
def test_int8_drafting_copies_round_weights_to_q8_0_and_send_long_calls_to_onednn():
    linear = torch.nn.Linear(96, 64, bias=False)
    copy_ = int8_inference_copy(linear)
    assert isinstance(copy_, Q8Int8Linear) and torch.equal(unpack_q8_int8(copy_.codes), q80_rounded(linear.weight))
    x = torch.randn(1, 5, 96)
    with torch.no_grad():
        assert torch.equal(copy_(x)[0], q8_int8_gemm(copy_.lib, x[0], copy_.codes))
        assert torch.equal(copy_.rows(x), copy_(x))
        long = torch.randn(MAX_ROWS + 3, 96)
        torch.testing.assert_close(copy_(long), F.linear(long, q80_rounded(linear.weight)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias-free"):
        int8_inference_copy(torch.nn.Linear(96, 64))
    with pytest.raises(ValueError, match="N of 32"):
        int8_inference_copy(torch.nn.Linear(96, 48, bias=False))


@needs_vnni
def test_the_greedy_head_gives_exactly_the_argmax_of_the_q80_logits_ties_to_the_first(tmp_path):
    g = torch.Generator().manual_seed(3)
    weight = q80_rounded(torch.randn(256, 192, generator=g) * 0.05)
    weight[200] = weight[17]  # an exact tie: the first of the two must win, as torch.argmax
    weight[90] = weight[17] * (1 - 2 ** -10)  # near ties below it, inside the int8 pass's error
    weight[91] = weight[17] * (1 - 2 ** -9)
    weight = q80_rounded(weight)
    head = torch.nn.Linear(192, 256, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    lib = build_kernel(tmp_path)
    fma, greedy = Q80Linear(head, lib), GreedyHead(head.weight, lib)
    assert fma.codes.form == "fma" or amx_unavailable() is None
    x = torch.randn(40, 192, generator=g) * torch.logspace(-2, 1, 192)  # groups of very different steps
    x[3, :64] = 0  # whole groups of zeros: step 0
    x[5] = weight[17] * 40  # a row that points at the tied outputs
    with torch.no_grad():
        want = fma(x[None])[0].argmax(-1)
    tokens, candidates = greedy.tokens(x)
    assert torch.equal(tokens, want) and tokens[5] == 17
    assert bool((candidates >= 1).all()) and candidates[5] >= 4  # 17 and its near ties had to be computed
    for rows in (1, 7):  # alike whatever the number of rows
        assert torch.equal(greedy.tokens(x[:rows])[0], want[:rows])
    x[6, 0] = float("nan")
    assert greedy.tokens(x)[0][6] == -1  # no candidate: the runner takes every logit then
