"""The K-quant GEMMs on AMX-INT8 tiles (models/kernels/csrc/kquant_amx.cpp): for every row count, and at the
extremes of the rebuilt weights' byte planes, the tiles compute bit for bit what the VNNI loop computes; KQuantLinear
takes them where the process may, and a bad tile_rows is an error naming it."""

from __future__ import annotations

import pytest
import torch

from specdistill.models import kernels
from specdistill.models.kernel_linear import KQuantLinear, kquant_matrix
from specdistill.models.kquant import KQuantBlocks
from tests.models.kquant_fixtures import random_blocks

needs_tiles = pytest.mark.skipif(kernels.amx_int8_unavailable() is not None,
                                 reason=f"the K-quant tiles: {kernels.amx_int8_unavailable()}")
needs_kquant = pytest.mark.skipif(kernels.kquant_unavailable() is not None,
                                reason=f"the K-quant kernels: {kernels.kquant_unavailable()}")
# Byte ranges of one block (gguf): Q4_K d, dmin (0:4), 12 bytes of 6-bit scales and mins, 128 of codes;
# Q6_K 128 low nibbles, 64 bytes of top bits, 16 int8 scales (192:208), d (208:210).
Q4K_SCALES, Q4K_CODES = (4, 16), (16, 144)
Q6K_CODES, Q6K_SCALES = (0, 192), (192, 208)


def with_bytes(blocks: KQuantBlocks, fields: dict[tuple[int, int], int]) -> KQuantBlocks:
    """`blocks` with byte ranges [start, stop) of every block set to one value each."""
    per = {"Q4_K": 144, "Q6_K": 210}[blocks.kind]
    raw = blocks.raw.clone().view(blocks.raw.shape[0], -1, per)
    for (start, stop), value in fields.items():
        raw[..., start:stop] = value
    return KQuantBlocks(blocks.kind, raw.reshape(blocks.raw.shape[0], -1))


def both_ways(matrix, x: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the VNNI loop's y, y with tiles from `tile_rows` rows on) for x [R, K]."""
    lib = kernels.library()
    rows = lib.quantize_rows_q8k(x)
    loop, tiles = torch.empty(x.shape[0], matrix.N), torch.empty(x.shape[0], matrix.N)
    matrix.gemm_into(*rows, loop, 0)
    matrix.gemm_into(*rows, tiles, 0, tile_rows=tile_rows)
    return loop, tiles


@needs_tiles
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_tiles_compute_the_vnni_loops_numbers_at_every_row_count(kind):
    matrix = kquant_matrix(kernels.library(), random_blocks(kind, 48, 768, seed=7))
    x = torch.randn(70, 768) * 4
    for rows in range(1, 71):  # sixteens on the tiles, pairs of them and a single one, the rest on the loop
        loop, tiles = both_ways(matrix, x[:rows].contiguous(), 16)
        assert torch.equal(loop, tiles), rows


@needs_tiles
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_tiles_cross_the_passes_as_the_loop_does(kind):
    matrix = kquant_matrix(kernels.library(), random_blocks(kind, 32, 768, seed=5))
    x = torch.randn(1403, 768)  # passes of 672 tiled rows at K = 768: two whole, one of 48, 11 rows on the loop
    loop, tiles = both_ways(matrix, x, 16)
    assert torch.equal(loop, tiles)


@needs_tiles
@pytest.mark.parametrize("kind, fields", [
    ("Q4_K", {Q4K_SCALES: 0xFF, Q4K_CODES: 0xFF}),  # sc = m = 63, q = 15: w' = 945, the high plane's 3
    ("Q6_K", {Q6K_CODES: 0x00, Q6K_SCALES: 0x80}),  # sc = -128, q = 0: w' = 4096, the high plane's 16
    ("Q6_K", {Q6K_CODES: 0x00, Q6K_SCALES: 0x7F}),  # sc = 127, q = 0: w' = -4064, the high plane's -16
    ("Q6_K", {Q6K_CODES: 0xFF, Q6K_SCALES: 0x80}),  # sc = -128, q = 63: w' = -3968
])
def test_tiles_hold_the_extremes_of_the_rebuilt_weights(kind, fields):
    matrix = kquant_matrix(kernels.library(), with_bytes(random_blocks(kind, 32, 512, seed=3), fields))
    signs = torch.where(torch.rand(48, 512, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0)
    for x in (torch.full((48, 512), 3.0), -torch.full((48, 512), 3.0), 3.0 * signs):  # x's codes all +-127
        loop, tiles = both_ways(matrix, x, 16)
        assert torch.equal(loop, tiles)
        assert loop.abs().max() > 0


@needs_tiles
def test_a_projection_takes_the_tiles_where_the_process_may(monkeypatch):
    blocks = random_blocks("Q4_K", 32, 512, seed=2)
    linear = KQuantLinear([blocks, random_blocks("Q6_K", 16, 512, seed=4)], torch.randn(48), kernels.library())
    assert linear.matrix.tile_rows == kernels.KQUANT_TILE_ROWS
    monkeypatch.setenv(kernels.NO_AMX_ENV, "1")
    on_the_loop = KQuantLinear([blocks, random_blocks("Q6_K", 16, 512, seed=4)], torch.randn(48), kernels.library())
    assert on_the_loop.matrix.tile_rows == 0
    x = torch.randn(37, 512)
    on_the_loop.bias.copy_(linear.bias)
    with torch.inference_mode():
        assert torch.equal(linear(x), on_the_loop(x))


@needs_kquant
def test_a_tile_row_count_below_one_tile_is_refused():
    lib = kernels.library()
    matrix = kquant_matrix(lib, random_blocks("Q4_K", 16, 256))
    with pytest.raises(ValueError, match="Q4KMatrix.gemm_into: tile_rows must be 0 or at least 16, got 8"):
        matrix.gemm_into(*lib.quantize_rows_q8k(torch.randn(2, 256)), torch.empty(2, 16), 0, tile_rows=8)
    with pytest.raises(ValueError, match="KQuantProjection: tile_rows must be 0 or at least 16, got -1"):
        lib.KQuantProjection([matrix], None, tile_rows=-1)


@pytest.mark.skipif(kernels.flavour()[0] != "avx2" or kernels.unavailable() is not None,
                    reason="the library's AVX2 flavour is not this process's")
def test_the_avx2_build_refuses_tiles_naming_why():
    lib = kernels.library()
    matrix = kquant_matrix(lib, random_blocks("Q4_K", 16, 256))
    with pytest.raises(RuntimeError, match="Q4KMatrix.gemm_into: the library's AVX2 build has no AMX forms"):
        matrix.gemm_into(*lib.quantize_rows_q8k(torch.randn(16, 256)), torch.empty(16, 16), 0, tile_rows=16)
    assert kernels.amx_int8_unavailable() == kernels.amx_unavailable() == "the library's AVX2 flavour has no AMX forms"
