"""scripts/bench_q41_gemm.py: its packing is exact on a Q4_1 grid, and its kernel computes F.linear over it."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from scripts.bench_q41_gemm import (Q41Weight, avx512_available, build_kernel, grid_deviation, pack_q41, q41_linear,
                                    unpack_q41)


def q41_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] weights that are exactly Q4_1: per group of 32, code * step + min, codes 0 and 15 both present."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15  # the group's min and max are on the grid's ends, as Q4_1 writes them
    step = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    low = torch.randn(n, k // 32, 1, generator=g) * 0.05
    return (codes * step + low).reshape(n, k)


def test_packing_a_q41_matrix_loses_nothing():
    w = q41_matrix(24, 128)
    assert grid_deviation(w) < 1e-6
    assert torch.allclose(unpack_q41(pack_q41(w)), w, rtol=0, atol=1e-6)


def test_a_matrix_off_the_grid_shows_its_deviation():
    w = torch.randn(24, 128)
    assert grid_deviation(w) > 1e-3
    assert (unpack_q41(pack_q41(w)) - w).abs().max() > 1e-3


def test_shapes_the_kernel_cannot_take_are_errors():
    with pytest.raises(ValueError, match="K must be"):
        pack_q41(torch.randn(4, 96))


needs_kernel = pytest.mark.skipif(shutil.which("gcc") is None or not avx512_available(),
                                  reason="the kernel needs gcc and an AVX-512 CPU")


@needs_kernel
def test_the_kernel_computes_f_linear_over_the_packed_weights(tmp_path):
    lib = build_kernel(tmp_path)
    w = q41_matrix(40, 1536, seed=1)
    q = pack_q41(w)
    x = torch.randn(5, 1536)
    y = q41_linear(lib, x, q)
    reference = F.linear(x, w)
    assert float((y - reference).abs().max() / reference.abs().max()) < 1e-5
    assert torch.equal(q41_linear(lib, x[:1], q), y[:1])  # a row is computed alike whatever the row count
    swapped = Q41Weight(((q.packed & 15) << 4) | (q.packed >> 4), q.step, q.minimum)  # the nibbles' order mixed up
    assert float((q41_linear(lib, x, swapped) - reference).abs().max() / reference.abs().max()) > 1e-2
    with pytest.raises(ValueError, match="fp32"):
        q41_linear(lib, torch.randn(17, 1536), q)
