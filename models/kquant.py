"""A GGUF's K-quant blocks (Q4_K, Q6_K) read as integer codes and scales, and packed into the layout the kernel
library's VNNI GEMMs read (models/kernels/csrc/kquant.cpp): pure torch.

A real-size target ships as a K-quant GGUF (Qwen2.5-Coder-1.5B Q4_K_M: Q4_K and Q6_K blocks of 256 weights). Its
fp32 dequantization is 7.1 GB that every token streams; its own blocks are 1.0 GB. `KQuantBlocks` is one matrix's
raw blocks as the file stores them, [N, K/256 * block bytes]; `q4k_fields`/`q6k_fields` decode them to codes and
scales; `dequantize` rebuilds the fp32 weights exactly as gguf-py does (tests compare them with
`gguf.quants.dequantize`, and models.gguf_blocks checks them against the loaded model before any kernel reads
them); `pack` lays a matrix out for the kernel.

Block formats (ggml's, 256 weights each):
- Q4_K, 144 bytes: d, dmin fp16; 12 bytes of eight 6-bit (scale, min) pairs, one per sub-block of 32; 128 bytes of
  4-bit codes (byte 32j + l: weight 64j + l low nibble, 64j + 32 + l high). w = d * sc * q - dmin * m.
- Q6_K, 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales (one per 16 weights), d fp16.
  w = d * sc * (q - 32), q in 0..63.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPER = 256  # weights per K-quant block
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q5_0": 22, "Q8_0": 34}
BLOCK_WEIGHTS = {"Q4_K": SUPER, "Q6_K": SUPER, "Q5_0": 32, "Q8_0": 32}
INT8_KINDS = ("Q5_0", "Q8_0")  # blocks of 32 that are exactly int8 codes times a step: the int8 kernel's Q8_0 form
OUTPUTS_SIDE_BY_SIDE = 16  # the kernel's output block: N must be a multiple


@dataclass
class KQuantBlocks:
    """One [N, K] matrix as a GGUF stores it: `kind` (a key of BLOCK_BYTES) and raw uint8 [N, K / block weights *
    block bytes]."""

    kind: str
    raw: torch.Tensor

    def __post_init__(self):
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"KQuantBlocks: kind must be one of {sorted(BLOCK_BYTES)}, got {self.kind!r}")
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2 or self.raw.shape[1] % BLOCK_BYTES[self.kind]:
            raise ValueError(f"KQuantBlocks: raw must be uint8 [N, K/{BLOCK_WEIGHTS[self.kind]} * "
                             f"{BLOCK_BYTES[self.kind]}], got "
                             f"{self.raw.dtype} {list(self.raw.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] // BLOCK_BYTES[self.kind] * BLOCK_WEIGHTS[self.kind]

    def blocks(self) -> torch.Tensor:  # [N, K / block weights, block bytes]
        return self.raw.reshape(self.raw.shape[0], -1, BLOCK_BYTES[self.kind])


def fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[..., bytes] -> the fp16 at byte `start` of each block, as fp32 [...]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0].float()


def q4k_fields(w: KQuantBlocks) -> dict[str, torch.Tensor]:
    """codes uint8 [N, K] (0..15), sc and m uint8 [N, K/32] (0..63), d and dmin fp32 [N, K/256]."""
    b = w.blocks()
    n, nblocks = b.shape[:2]
    scales = b[..., 4:16].reshape(n, nblocks, 3, 4)
    low, high, mixed = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)  # [N, KB, 8]
    m = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    qs = b[..., 16:].reshape(n, nblocks, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3)  # [N, KB, 4 chunks of 64, low | high, 32]
    return {"codes": codes.reshape(n, -1), "sc": sc.reshape(n, -1), "m": m.reshape(n, -1),
            "d": fp16_at(b, 0), "dmin": fp16_at(b, 2)}


def q6k_fields(w: KQuantBlocks) -> dict[str, torch.Tensor]:
    """codes uint8 [N, K] (0..63, the weight's q + 32), sc int8 [N, K/16], d fp32 [N, K/256]."""
    b = w.blocks()
    n, nblocks = b.shape[:2]
    ql = b[..., :128].reshape(n, nblocks, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, nblocks, 2, 4, 32)  # [.., half, group, l]
    qh = b[..., 128:192].reshape(n, nblocks, 2, 1, 32)
    high = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=3)  # [.., half, group, l]
    codes = (low | (high << 4)).reshape(n, -1)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return {"codes": codes, "sc": sc, "d": fp16_at(b, 208)}


def int8_fields(w: KQuantBlocks) -> dict[str, torch.Tensor]:
    """Q8_0 or Q5_0 -> codes int8 [N, K] (Q5_0: its 5-bit q - 16), d fp32 [N, K/32]: w = d * code."""
    b = w.blocks()
    n = b.shape[0]
    if w.kind == "Q8_0":
        codes = b[..., 2:].contiguous().view(torch.int8)
    else:
        high = b[..., 2:6].contiguous().view(torch.int32)  # bit i: the 5th bit of weight i
        high = (high >> torch.arange(32, dtype=torch.int32)) & 1  # [N, KB, 32]
        low = torch.cat([b[..., 6:22] & 0x0F, b[..., 6:22] >> 4], dim=-1).to(torch.int32)
        codes = (low | (high << 4)).to(torch.int8) - 16
    return {"codes": codes.reshape(n, -1), "d": fp16_at(b, 0)}


def dequantize(w: KQuantBlocks) -> torch.Tensor:
    """The fp32 [N, K] weights, computed as gguf-py's dequantization computes them (the same roundings)."""
    n, k = w.shape
    if w.kind in INT8_KINDS:
        f = int8_fields(w)
        return (f["d"][..., None] * f["codes"].reshape(n, -1, 32).float()).reshape(n, k)
    if w.kind == "Q4_K":
        f = q4k_fields(w)
        scale = (f["d"][..., None] * f["sc"].reshape(n, -1, 8).float()).reshape(n, -1, 1)
        minimum = (f["dmin"][..., None] * f["m"].reshape(n, -1, 8).float()).reshape(n, -1, 1)
        return (scale * f["codes"].reshape(n, -1, 32).float() - minimum).reshape(n, k)
    f = q6k_fields(w)
    scale = (f["d"][..., None] * f["sc"].reshape(n, -1, 16).float()).reshape(n, -1, 1)
    return (scale * (f["codes"].reshape(n, -1, 16).float() - 32)).reshape(n, k)


def sides(t: torch.Tensor, per_block: int) -> torch.Tensor:
    """[N, KB * per_block] -> [N/16, KB, per_block, 16]: a block's values for 16 outputs side by side."""
    n = t.shape[0]
    return t.reshape(n // 16, 16, -1, per_block).permute(0, 2, 3, 1).contiguous()


def nibble_layout(codes: torch.Tensor, block: int = SUPER) -> torch.Tensor:
    """codes uint8 [N, K] (4 bits) -> [N/16, K/block, block/32, 4, 64]: byte 4o + i of pair p of sub-block s holds
    output o's codes at k = 32s + 8p + i (low nibble) and 32s + 8p + 4 + i (high). block: 256 for the K-quants, 32
    for Q5_0's groups."""
    n, k = codes.shape
    c = codes.reshape(n // 16, 16, k // 32, 4, 2, 4)  # [nb, o, sub-block, p, nibble, i]
    c = c.permute(0, 2, 3, 4, 1, 5)  # [nb, sub-block, p, nibble, o, i]
    return (c[..., 0, :, :] | (c[..., 1, :, :] << 4)).reshape(n // 16, k // block, block // 32, 4, 64).contiguous()


def min_pairs(m: torch.Tensor) -> torch.Tensor:
    """[N/16, KB, 8, 16] -> [N/16, KB, 4, 16, 2]: sub-blocks 2j and 2j + 1 side by side per output (vpdpwssd)."""
    nb, kb = m.shape[:2]
    return m.reshape(nb, kb, 4, 2, 16).transpose(3, 4).contiguous()


def high_layout(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (6 bits) -> their top 2 bits [N/16, K/256, 8, 2, 64]: byte 4o + i of vector h of
    sub-block s holds those of chunk t = 4h + u (k = 32s + 4t + i) at bits 2u."""
    n, k = codes.shape
    c = (codes >> 4).reshape(n // 16, 16, k // SUPER, 8, 2, 4, 4)  # [nb, o, kb, s, h, u, i]
    c = c.permute(0, 2, 3, 4, 5, 1, 6)  # [nb, kb, s, h, u, o, i]
    packed = c[..., 0, :, :] | (c[..., 1, :, :] << 2) | (c[..., 2, :, :] << 4) | (c[..., 3, :, :] << 6)
    return packed.reshape(n // 16, k // SUPER, 8, 2, 64).contiguous()


def q8_0_steps(w: KQuantBlocks) -> torch.Tensor:
    """A Q5_0 / Q8_0 matrix's fp16 steps as the kernel reads them: [N/16, K/32, 16]."""
    return sides(w.blocks()[..., 0:2].contiguous().view(torch.float16)[..., 0], 1)[:, :, 0].contiguous()


def q50_layout(w: KQuantBlocks) -> dict[str, torch.Tensor]:
    """Q5_0 -> low uint8 [N/16, K/32, 4, 64] (byte 4o + i of vector p: output o's q at k = 8p + i in the low nibble,
    8p + 4 + i in the high), high uint8 [N/16, K/32, 64] (byte 4o + i: the 5th bit of q at k = 4t + i at bit t), d
    fp16 [N/16, K/32, 16], the file's steps; q = code + 16 in 0..31."""
    n, k = w.shape
    q = (int8_fields(w)["codes"].to(torch.int16) + 16).to(torch.uint8)  # [N, K]
    low = nibble_layout(q & 0x0F, block=32)[:, :, 0]  # [N/16, K/32, 4, 64]
    fifth = (q >> 4).reshape(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [nb, g, t, o, i]
    high = torch.zeros_like(fifth[:, :, 0])
    for t in range(8):
        high |= fifth[:, :, t] << t
    return {"low": low, "high": high.reshape(n // 16, k // 32, 64).contiguous(), "d": q8_0_steps(w)}


def q80_layout(w: KQuantBlocks) -> dict[str, torch.Tensor]:
    """Q8_0 -> codes uint8 [N/16, K/32, 8, 64] (byte 4o + i of vector t: output o's q = code + 128 at k = 4t + i), d
    fp16 [N/16, K/32, 16], the file's steps."""
    n, k = w.shape
    q = (int8_fields(w)["codes"].to(torch.int16) + 128).to(torch.uint8)  # [N, K]
    codes = q.reshape(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [nb, g, t, o, i]
    return {"codes": codes.reshape(n // 16, k // 32, 8, 64).contiguous(), "d": q8_0_steps(w)}


def check_packable(w: KQuantBlocks, caller: str) -> None:
    n, _ = w.shape
    if n % OUTPUTS_SIDE_BY_SIDE:
        raise ValueError(f"{caller}: N must be a multiple of {OUTPUTS_SIDE_BY_SIDE}, got {list(w.shape)}")


def pack(w: KQuantBlocks) -> dict[str, torch.Tensor]:
    """The kernel's tensors for one matrix: Q4_K -> codes, sc, m, d, dmin; Q6_K -> low, high, sc, d; Q5_0 -> low,
    high, d; Q8_0 -> codes, d (models/kernels/csrc/kquant.cpp has the layouts)."""
    check_packable(w, "kquant.pack")
    if w.kind in INT8_KINDS:
        return q50_layout(w) if w.kind == "Q5_0" else q80_layout(w)
    if w.kind == "Q4_K":
        f = q4k_fields(w)
        return {"codes": nibble_layout(f["codes"]), "sc": sides(f["sc"], 8), "m": min_pairs(sides(f["m"], 8)),
                "d": sides(f["d"], 1)[:, :, 0], "dmin": sides(f["dmin"], 1)[:, :, 0]}
    f = q6k_fields(w)
    return {"low": nibble_layout(f["codes"] & 0x0F), "high": high_layout(f["codes"]), "sc": sides(f["sc"], 16),
            "d": sides(f["d"], 1)[:, :, 0]}


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 [R, K] -> (q int8 [R, K], d [R, K/256], sums int32 [R, K/16]) as the kernel rounds rows (for tests)."""
    r, k = x.shape
    blocks = x.reshape(r, k // SUPER, SUPER)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8).reshape(r, k)
    sums = q.reshape(r, k // 16, 16).sum(-1, dtype=torch.int32)
    return q, amax / 127.0, sums


def gemm_reference(x: torch.Tensor, w: KQuantBlocks) -> torch.Tensor:
    """What the kernel computes, in float64 (its integer sums are exact): x rounded as the kernel rounds it, times
    the matrix's integer codes and scales; [R, K] -> [R, N] (for tests)."""
    q, dx, _ = quantize_rows_reference(x)
    r, k = x.shape
    n = w.shape[0]
    xq = q.double().reshape(r, 1, k // SUPER, SUPER)
    if w.kind == "Q4_K":
        f = q4k_fields(w)
        codes = f["codes"].double().reshape(1, n, k // SUPER, 8, 32)
        dots = (codes * xq.reshape(r, 1, k // SUPER, 8, 32)).sum(-1)  # [R, N, KB, 8]
        xsum = xq.reshape(r, 1, k // SUPER, 8, 32).sum(-1)
        sc, m = f["sc"].double().reshape(1, n, -1, 8), f["m"].double().reshape(1, n, -1, 8)
        per_block = f["d"].double() * (dots * sc).sum(-1) - f["dmin"].double() * (xsum * m).sum(-1)
    else:
        f = q6k_fields(w)
        codes = f["codes"].double().reshape(1, n, k // SUPER, 16, 16) - 32
        dots = (codes * xq.reshape(r, 1, k // SUPER, 16, 16)).sum(-1)  # [R, N, KB, 16]
        per_block = f["d"].double() * (dots * f["sc"].double().reshape(1, n, -1, 16)).sum(-1)
    return (per_block * dx.double()[:, None, :]).sum(-1)
