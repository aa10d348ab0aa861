"""The weight formats the CPU kernels read (models.kernels), packed from and unpacked to fp32 matrices: pure torch.

- Q4_1 (`Q41Weight`): per group of 32 weights q * d + m, q in 0..15; the default target's layer matrices are exactly
  this (its GGUF's blocks: `grid_deviation` is 0), 53 MB of codes where fp32 is 425 MB.
- Q8_0 (`Q80Weight`): per group of 32 weights q * d, q in -127..127; the default target's tied head.
- Q8_0 in the int8 kernel's layout (`Q8Int8Weight`): for drafters (rows rounded to int8) and the greedy head.

Each of the first two in one of two forms: "fma" (AVX-512 FMAs over weights rebuilt exactly) and "amx" (AMX-BF16
tiles: the codes in the tile unit's pair order, steps and minima fp16, as a GGUF stores them). A matrix is packed in
one form and every call over it uses that form, so a row's numbers never depend on how many rows are computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdistill.models.kernels import amx_unavailable

GROUP = 32
GRID_TOLERANCE = 1e-6  # a matrix within this of its grid (relative to its largest weight) is Q4_1 up to rounding
OUTPUT_BLOCK = 2  # the FMA form's outputs computed together
AMX_OUTPUT_BLOCK = 32  # the AMX form's: two tiles of 16 outputs
INT8_OUTPUT_BLOCK = 32  # the int8 kernel computes two blocks of 16 outputs together


class Q41Weight:
    """One [N, K] matrix as Q4_1 in one of the kernel's forms: packed uint8 codes two a byte, step d and minimum
    m. "fma" (AVX-512): packed [N, K/2], d and m [N, K/32] fp32. "amx" (AMX-BF16 tiles): packed [N/16, K/32, 8,
    32] in the tile unit's pair order, d and m [N/16, K/32, 16] fp16 (models/kernels/csrc/gemm_amx.cpp)."""

    def __init__(self, packed: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor, form: str = "fma"):
        self.packed, self.step, self.minimum, self.form = packed, step, minimum, form

    @property
    def shape(self) -> tuple[int, int]:
        if self.form == "amx":
            return self.packed.shape[0] * 16, self.packed.shape[1] * GROUP
        return self.packed.shape[0], self.packed.shape[1] * 2


def grid_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes [N, K/32, 32] in 0..15 as float, step [N, K/32], min [N, K/32]): each group's 4-bit grid
    from its min and max, the one Q4_1 quantizes on."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15)
    return codes, step, low


def grid_deviation(weight: torch.Tensor) -> float:
    """max |w - its 4-bit grid value| / max |w|: 0 when the matrix is exactly Q4_1."""
    codes, step, low = grid_codes(weight)
    rebuilt = (codes * step[..., None] + low[..., None]).reshape(weight.shape)
    return float((rebuilt - weight).abs().max() / weight.abs().max().clamp(min=1e-30))




def shape_supported(weight: torch.Tensor) -> bool:
    """[N, K] with K whole groups and N whole output blocks of the kernel's FMA form (every form's minimum)."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.shape[0] % OUTPUT_BLOCK == 0


def scales_are_fp16(codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor | None = None) -> bool:
    """Whether the weights come out the same with the steps (and minima) rounded to fp16, as the AMX form stores
    them: a GGUF stores them as fp16, so every matrix of the default target does (codes [N, G, 32], step and low
    [N, G])."""
    def rebuilt(d, m):
        return codes * d[..., None] + (0 if m is None else m[..., None])
    half = (lambda t: None if t is None else t.half().float())  # noqa: E731
    return torch.equal(rebuilt(half(step), half(low)), rebuilt(step, low))


def _check_shape(caller: str, weight: torch.Tensor, form: str) -> None:
    block = AMX_OUTPUT_BLOCK if form == "amx" else OUTPUT_BLOCK
    if not shape_supported(weight) or weight.shape[0] % block:
        raise ValueError(f"{caller}: K must be a multiple of {GROUP} and N of {block} ({form} form), "
                         f"got {list(weight.shape)}")


def _choose_form(caller: str, weight: torch.Tensor, form: str | None, fp16_scales: Callable[[], bool]) -> str:
    """form, or where None: "amx" where this process may use the AMX form (`amx_unavailable`), N is whole blocks
    of 32 outputs and the scales are fp16 values, else "fma". An error names what keeps an asked form out."""
    if form is None:
        usable = weight.shape[0] % AMX_OUTPUT_BLOCK == 0 and amx_unavailable() is None
        form = "amx" if usable and fp16_scales() else "fma"
    if form not in ("fma", "amx"):
        raise ValueError(f"{caller}: form must be 'fma' or 'amx', got {form!r}")
    if form == "amx" and (why := amx_unavailable()) is not None:  # also asks Linux for the tiles, once
        raise RuntimeError(f"{caller}: the AMX form cannot run here: {why}")
    _check_shape(caller, weight, form)
    if form == "amx" and not fp16_scales():
        raise ValueError(f"{caller}: the AMX form stores steps and minima as fp16, and this matrix's are not fp16 "
                         f"values")
    return form


def by_block(per_group: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [N/16, G, 16]: a group's steps (or minima) for a block of 16 outputs side by side."""
    n, groups = per_group.shape
    return per_group.reshape(n // 16, 16, groups).permute(0, 2, 1).contiguous()


def from_blocks(blocked: torch.Tensor) -> torch.Tensor:
    """by_block's inverse: [N/16, G, 16] -> [N, G]."""
    return blocked.permute(0, 2, 1).reshape(-1, blocked.shape[1])


def pack_q41(weight: torch.Tensor, form: str | None = None) -> Q41Weight:
    """[N, K] fp32 -> Q41Weight in `form` (default: AMX where it may run, see `_choose_form`). FMA form: byte j of
    group g holds code j (low nibble) and code j + 16 (high nibble); AMX form: the tile unit's order, fp16 steps
    and minima (models/kernels/csrc/gemm_amx.cpp)."""
    _check_shape("pack_q41", weight, "fma")  # every form's minimum, before the grid is read
    n, k = weight.shape
    codes, step, low = grid_codes(weight.detach().float())
    form = _choose_form("pack_q41", weight, form, lambda: scales_are_fp16(codes, step, low))
    codes = codes.to(torch.uint8)  # [N, G, 32]
    if form == "fma":
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        return Q41Weight(packed, step.contiguous(), low.contiguous())
    groups = k // GROUP
    pairs = codes.reshape(n // 16, 16, groups, 8, 2, 2)  # [block, n, g, p, row 2p or 2p + 1, pair element]
    pairs = pairs.permute(0, 2, 3, 4, 1, 5).reshape(n // 16, groups, 8, 2, 32)  # [block, g, p, row parity, 32]
    packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).contiguous()  # [N/16, G, 8, 32]
    return Q41Weight(packed, by_block(step).half(), by_block(low).half(), form="amx")


def unpack_q41(w: Q41Weight) -> torch.Tensor:
    """Q41Weight -> the [N, K] fp32 matrix it stands for (the packing's inverse, for checks)."""
    n, k = w.shape
    if w.form == "amx":
        rows = torch.stack([w.packed & 15, w.packed >> 4], dim=3)  # [N/16, G, 8, 2, 32]
        codes = rows.reshape(n // 16, k // GROUP, 8, 2, 16, 2).permute(0, 4, 1, 2, 3, 5)  # [blk, n, g, p, par, 2]
        codes = codes.reshape(n, k // GROUP, GROUP).float()
        step, minimum = from_blocks(w.step).float(), from_blocks(w.minimum).float()
    else:
        bytes_ = w.packed.reshape(n, k // GROUP, 16)
        codes = torch.cat([bytes_ & 15, bytes_ >> 4], dim=-1).float()  # [N, G, 32]
        step, minimum = w.step, w.minimum
    return (codes * step[..., None] + minimum[..., None]).reshape(n, k)


class Q80Weight:
    """One [N, K] matrix as Q8_0 (w = q * d) in one of the kernel's forms. "fma": int8 codes [N, K], step d
    [N, K/32] fp32. "amx": codes [N/16, K/32, 16, 32] in the tile unit's pair order, d [N/16, K/32, 16] fp16."""

    def __init__(self, codes: torch.Tensor, step: torch.Tensor, form: str = "fma"):
        self.codes, self.step, self.form = codes, step, form

    @property
    def shape(self) -> tuple[int, int]:
        if self.form == "amx":
            return self.codes.shape[0] * 16, self.codes.shape[1] * GROUP
        return tuple(self.codes.shape)


def q80_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes [N, K/32, 32] in -127..127 as float, step [N, K/32]): each group's grid as Q8_0 writes it,
    d = max |w| / 127 (a group of zeros: d = 0)."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    step = groups.abs().amax(-1) / 127
    codes = torch.round(groups / step.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    return codes, step


def q80_deviation(weight: torch.Tensor) -> float:
    """max |w - its 8-bit grid value| / max |w|: 0 when the matrix is exactly Q8_0."""
    codes, step = q80_codes(weight)
    rebuilt = (codes * step[..., None]).reshape(weight.shape)
    return float((rebuilt - weight).abs().max() / weight.abs().max().clamp(min=1e-30))


def pack_q80(weight: torch.Tensor, form: str | None = None) -> Q80Weight:
    """[N, K] fp32 -> Q80Weight (int8 codes, one step per group of 32) in `form` (default: AMX where it may run,
    see `_choose_form`; its steps fp16)."""
    _check_shape("pack_q80", weight, "fma")
    codes, step = q80_codes(weight.detach().float())
    form = _choose_form("pack_q80", weight, form, lambda: scales_are_fp16(codes, step))
    codes = codes.to(torch.int8)  # [N, G, 32]
    if form == "fma":
        return Q80Weight(codes.reshape(weight.shape).contiguous(), step.contiguous())
    n, groups = weight.shape[0], weight.shape[1] // GROUP
    pairs = codes.reshape(n // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)  # [block, g, row kk, n, pair element]
    return Q80Weight(pairs.reshape(n // 16, groups, 16, 32).contiguous(), by_block(step).half(), form="amx")


def unpack_q80(w: Q80Weight) -> torch.Tensor:
    """Q80Weight -> the [N, K] fp32 matrix it stands for."""
    n, k = w.shape
    if w.form == "amx":
        codes = w.codes.reshape(n // 16, k // GROUP, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k // GROUP, GROUP)
        step = from_blocks(w.step).float()
    else:
        codes, step = w.codes.reshape(n, k // GROUP, GROUP), w.step
    return (codes.float() * step[..., None]).reshape(n, k)


def q80_rounded(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> the nearest Q8_0 matrix whose steps are fp16 values (the AMX form's), each group's step
    rounded up to an fp16 value so its largest weight's code is exactly 127 (`pack_q80` then reads the same step
    back). For drafters: their weights are not on any grid, and drafting in Q8_0 changes only which tokens are
    proposed, never the output (the target verifies)."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    largest = groups.abs().amax(-1)  # [N, G]
    step = (largest / 127).half()
    step = torch.where(step.float() * 127 < largest, torch.nextafter(step, torch.full_like(step, float("inf"))), step)
    step = step.float()[..., None]
    codes = torch.where(step > 0, torch.round(groups / step.clamp(min=torch.finfo(torch.float32).tiny)), 0.0)
    return (codes.clamp(-127, 127) * step).reshape(n, k)


class Q8Int8Weight:
    """One [N, K] matrix as Q8_0 (w = q * d) laid out for the int8 dot products of the library's `Int8Matrix`: codes
    [N/16, K/32, 8, 16, 4] int8 (16 outputs side by side, four consecutive k each), steps d [N/16, K/32, 16] fp32,
    bias [N/16, K/32, 16] int32 = -128 * each group's code sum (the unsigned offset of x's codes, taken back)."""

    def __init__(self, codes: torch.Tensor, step: torch.Tensor, bias: torch.Tensor):
        self.codes, self.step, self.bias = codes, step, bias

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * 16, self.codes.shape[1] * GROUP


def pack_q8_int8(weight: torch.Tensor) -> Q8Int8Weight:
    """[N, K] fp32 (N % 32 == 0, K % 32 == 0) -> its Q8_0 grid (`q80_codes`) in the int8 kernel's layout."""
    check_int8_shape("pack_q8_int8", weight)
    return int8_layout(*q80_codes(weight.detach().float()))


def check_int8_shape(caller: str, weight: torch.Tensor) -> None:
    n, k = weight.shape
    if k % GROUP or n % INT8_OUTPUT_BLOCK:
        raise ValueError(f"{caller}: K must be a multiple of {GROUP} and N of {INT8_OUTPUT_BLOCK}, "
                         f"got {list(weight.shape)}")


def int8_layout(codes: torch.Tensor, step: torch.Tensor) -> Q8Int8Weight:
    """A Q8_0 grid (codes [N, G, 32] as float, step [N, G]: `q80_codes`) in the int8 kernel's layout."""
    n, groups = step.shape
    codes = codes.to(torch.int8).reshape(n // 16, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    bias = (-128 * codes.to(torch.int32).sum(dim=(2, 4))).to(torch.int32).contiguous()  # [N/16, G, 16]
    return Q8Int8Weight(codes, by_block(step), bias)


def unpack_q8_int8(w: Q8Int8Weight) -> torch.Tensor:
    """Q8Int8Weight -> the [N, K] fp32 matrix it stands for."""
    n, k = w.shape
    codes = w.codes.permute(0, 3, 1, 2, 4).reshape(n, k // GROUP, GROUP).float()
    return (codes * from_blocks(w.step)[..., None]).reshape(n, k)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [R, K] -> (codes [R, K/32, 32] in -127..127 as float, step [R, K/32]): the rounding of x that
    the int8 kernel makes (step max |x| / 127 per group; x times 127 / max, rounded to nearest even)."""
    r, k = x.shape
    groups = x.reshape(r, k // GROUP, GROUP)
    top = groups.abs().amax(-1)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    return torch.round(groups * inverse[..., None]), top / 127.0

