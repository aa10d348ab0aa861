"""Linear layers on the CPU kernel library (models.kernels) over the weight formats of models.quant_formats, and the
choice, matrix by matrix, of what computes each of the engine's linears.

Where they run: `q41_or_packed` gives a `Q41Linear` for a bias-free fp32 matrix exactly on its Q4_1 grid (the default
target's layers: its GGUF's own 4-bit groups) when the library runs; calls of at most MAX_ROWS rows go to the kernel,
longer ones (prefill) to oneDNN's packed GEMM over the same weights. The head (`head_for_inference`): a `Q80Linear`
where it is exactly Q8_0 (the default target's tied embedding): 113 MB of fp32 become 28 MB of codes, a one-row head
about 1.9x faster. Greedy steps read `GreedyHead` where it pays (AVX512-VNNI): an int8 pass with a rigorous bound,
then the few candidates it cannot rule out computed as `q80_gemm` computes them, so exactly the full logits'
argmax, the head 1.65-2.2x cheaper. Drafters (their numbers only choose proposals, the target verifies): Q8_0
copies (`q80_inference_copy`) or int8 rows (`int8_inference_copy`). Anything else keeps models.packed_linear.
docs/design/exact-kernels.md has the measurements behind each choice.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable

import torch

from specdistill.models import kernels
from specdistill.models.gguf_blocks import ATTRIBUTE as KQUANT_ATTRIBUTE
from specdistill.models.huge_pages import huge_pages_unavailable, in_huge_pages
from specdistill.models.kernels import (
    KQUANT_TILE_ROWS,
    MAX_ROWS,
    amx_int8_unavailable,
    amx_unavailable,
    greedy_head_unavailable,
    int8_unavailable,
    kquant_unavailable,
)
from specdistill.models.kquant import OUTPUTS_SIDE_BY_SIDE, KQuantBlocks
from specdistill.models.kquant import pack as kquant_pack
from specdistill.models.packed_linear import (
    PackedLinear,
    cached_copy,
    clone_with_packed_linears,
    packed_for_inference,
    packing_supported,
    weights_signature,
)
from specdistill.models.quant_formats import (
    GRID_TOLERANCE,
    GROUP,
    INT8_OUTPUT_BLOCK,
    OUTPUT_BLOCK,
    Q8Int8Weight,
    Q41Weight,
    Q80Weight,
    by_block,
    check_int8_shape,
    grid_deviation,
    int8_layout,
    pack_q8_int8,
    pack_q41,
    pack_q80,
    q80_codes,
    q80_deviation,
    q80_rounded,
    shape_supported,
)

log = logging.getLogger("specdistill.kernels")
_copies: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]]" = weakref.WeakKeyDictionary()
_head_checks: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, bool]]" = weakref.WeakKeyDictionary()

GREEDY_SLACK = 0.52  # q8_argmax's bound per unit of dx * d * sum |codes|: 0.5 for x's rounding, 0.02 for fp32 sums
FULL_HEAD_ENV = "SPECDISTILL_FULL_HEAD"  # greedy steps compute every logit (comparisons, escape hatch)


class KernelLinear(torch.nn.Module):
    """y = x W^T for a bias-free fp32 W exactly on a grid the library reads: up to MAX_ROWS rows through the kernel
    (`gemm`, bound by `bind` to the packed weights), more (prefill) through oneDNN's packed GEMM of the same weights.
    Inference only. Subclasses name the format."""

    pack: Callable[[torch.Tensor], object]  # [N, K] fp32 -> the kernel's format

    def __init__(self, linear: torch.nn.Linear, lib):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.codes = fields_in_huge_pages(self.pack(linear.weight.detach()))
        self.gemm = self.bind(lib, self.codes)  # x [R, K] contiguous fp32 -> [R, N], checked by the library
        self.prefill = PackedLinear(linear)

    @staticmethod
    def bind(lib, codes) -> Callable[[torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__} is for inference; train the original module")
        rows = x.numel() // self.in_features
        if not 1 <= rows <= MAX_ROWS or x.dtype != torch.float32:
            return self.prefill(x)
        return self.gemm(x.reshape(rows, self.in_features).contiguous()).view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for the lean forwards' hot path, without nn.Module's dispatch: x fp32 [1, N, in] -> [1, N, out]."""
        n = x.shape[1]
        if n > MAX_ROWS:
            return self.prefill(x)
        return self.gemm(x.reshape(n, self.in_features).contiguous()).view(1, n, -1)


class Q41Linear(KernelLinear):
    """A KernelLinear over Q4_1 (the default target's layer matrices). `matrix`: the library's Q41Matrix of the FMA
    form (what FusedLayer hands the library), None in the AMX form."""

    pack = staticmethod(pack_q41)
    matrix = None

    def bind(self, lib, w: Q41Weight):
        if w.form == "amx":
            return lambda x: lib.q41_amx(x, w.packed, w.step, w.minimum)
        self.matrix = lib.Q41Matrix(w.packed, w.step, w.minimum)
        return self.matrix.gemm


class Q80Linear(KernelLinear):
    """A KernelLinear over Q8_0 (the default target's tied head)."""

    pack = staticmethod(pack_q80)

    @staticmethod
    def bind(lib, w: Q80Weight):
        if w.form == "amx":
            return lambda x: lib.q80_amx(x, w.codes, w.step)
        return lambda x: lib.q80_gemm(x, w.codes, w.step)


class Q8Int8Linear(KernelLinear):
    """A KernelLinear over Q8_0 weights with int8 activations: for drafters, whose numbers decide only which tokens
    are proposed. `matrix`: the library's Int8Matrix (what FusedRows hands the library)."""

    pack = staticmethod(pack_q8_int8)
    matrix = None

    def bind(self, lib, w: Q8Int8Weight):
        self.matrix = lib.Int8Matrix(w.codes, w.step, w.bias)
        return self.matrix.gemm


class KQuantLinear(torch.nn.Module):
    """y = x W^T (+ b) over a GGUF's own blocks (models.kquant: Q4_K and Q6_K, and a small model's Q5_0 and Q8_0) on
    the library's VNNI GEMMs, llama.cpp's arithmetic: each row of x rounded to int8 once per kind of rounding its
    parts read (per block of 256 for the K-quants, per 32 for Q5_0 and Q8_0), then every segment of the matrix
    (a fused projection's parts, each in its own format) writes its columns of one output, in one call into the
    library (its KQuantProjection, which decode.lean_decoder's fused layers also take). Every row count, prefill
    included, runs here, each row computed alike whatever the rows beside it; calls of KQUANT_TILE_ROWS rows or more
    run their Q4_K/Q6_K parts on AMX-INT8 tiles where this process may (`amx_int8_unavailable`), the same numbers.
    Inference only."""

    def __init__(self, segments: list[KQuantBlocks], bias: torch.Tensor | None, lib):
        super().__init__()
        self.in_features = segments[0].shape[1]
        if any(s.shape[1] != self.in_features for s in segments):
            raise ValueError(f"KQuantLinear: segments of different K: {[list(s.shape) for s in segments]}")
        self.out_features = sum(s.shape[0] for s in segments)
        self.kinds = [s.kind for s in segments]
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        tile_rows = KQUANT_TILE_ROWS if amx_int8_unavailable() is None else 0
        self.matrix = lib.KQuantProjection([kquant_matrix(lib, s) for s in segments], self.bias, tile_rows=tile_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("KQuantLinear is for inference; train the original module")
        rows = x.numel() // self.in_features
        if rows == 0:  # as nn.Linear: no rows in, none out (a draft model's catch-up asks its head for no logits)
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y = self.matrix.gemm(x.reshape(rows, self.in_features).float().contiguous())
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for the lean forwards' hot path: x fp32 [1, N, in] -> [1, N, out]."""
        return self.matrix.gemm(x.reshape(-1, self.in_features).contiguous()).view(1, x.shape[1], -1)

    def describe(self) -> str:
        return "KQuantLinear (" + "+".join(self.kinds) + ")"


def fields_in_huge_pages(weight):
    """A packed weight (Q41Weight, Q80Weight, Q8Int8Weight) with each of its tensors moved into 2 MiB pages: the
    kernels stream them every token (models.huge_pages)."""
    for name, value in vars(weight).items():
        if isinstance(value, torch.Tensor):
            setattr(weight, name, in_huge_pages(value))
    return weight


def kquant_matrix(lib, blocks: KQuantBlocks):
    """The library's matrix over a GGUF's `blocks` (models.kquant.pack): Q4KMatrix, Q6KMatrix, Q50Matrix or
    Q80Matrix."""
    packed = {name: in_huge_pages(t) for name, t in kquant_pack(blocks).items()}  # streamed every token
    return {"Q4_K": lib.Q4KMatrix, "Q6_K": lib.Q6KMatrix, "Q5_0": lib.Q50Matrix, "Q8_0": lib.Q80Matrix}[blocks.kind](
        **packed)


def kquant_segments(linear: torch.nn.Module) -> list[KQuantBlocks] | None:
    """The K-quant blocks a linear was found to be exactly (models.gguf_blocks), in output order, or None."""
    return getattr(linear, KQUANT_ATTRIBUTE, None)


def kquant_usable(linear: torch.nn.Module) -> bool:
    """A CPU fp32 linear with K-quant blocks attached, on a CPU whose library runs the K-quant GEMMs
    (kernels.kquant_unavailable)."""
    segments = kquant_segments(linear)
    return (segments is not None and kquant_unavailable() is None and linear.weight.dtype == torch.float32
            and linear.weight.device.type == "cpu"
            and all(s.shape[0] % OUTPUTS_SIDE_BY_SIDE == 0 for s in segments))


def kquant_linear(linear: torch.nn.Module) -> KQuantLinear:
    return KQuantLinear(kquant_segments(linear), linear.bias, kernels.library())


def q80_usable(linear: torch.nn.Module) -> bool:
    """A bias-free fp32 CPU nn.Linear of a shape the kernel takes, exactly on its Q8_0 grid up to float rounding."""
    w = getattr(linear, "weight", None)
    return (isinstance(linear, torch.nn.Linear) and linear.bias is None and w.dtype == torch.float32
            and w.device.type == "cpu" and shape_supported(w) and q80_deviation(w.detach()) <= GRID_TOLERANCE)


def head_for_inference(head: torch.nn.Module) -> torch.nn.Module:
    """The target's output head for the engine: on the Q8_0 kernel where it is exactly Q8_0 (the default
    target's tied embedding) and the library runs, else models.packed_linear's packed copy. Logged once per head;
    the grid check (a pass over every weight) and the copy are cached until the weights change."""
    if kquant_usable(head):  # a K-quant GGUF's own head (a real-size target's untied Q6_K output)
        return cached_copy(_copies, head, ("kquant", amx_int8_unavailable(), huge_pages_unavailable(),
                                           weights_signature(head)),
                           lambda: kquant_linear(head))
    usable = cached_copy(_head_checks, head, weights_signature(head), lambda: q80_usable(head))
    if not usable or kernels.unavailable() is not None:
        return packed_for_inference(head)

    def build():
        fast = Q80Linear(head, kernels.library())
        log.info("fp32 head: the Q8_0 kernel (%d x %d, its %s form)", head.out_features, head.in_features,
                 fast.codes.form)
        return fast
    return cached_copy(_copies, head, ("q80", amx_unavailable(), huge_pages_unavailable(), weights_signature(head)),
                       build)


def q80_rounded_linear(linear: torch.nn.Linear) -> torch.nn.Linear:
    """A frozen bias-free copy of `linear` with its weights rounded to Q8_0 (`q80_rounded`); the linear is
    untouched."""
    rounded = torch.nn.Linear(linear.in_features, linear.out_features, bias=False)
    with torch.no_grad():
        rounded.weight.copy_(q80_rounded(linear.weight))
    return rounded.requires_grad_(False)


def q80_inference_copy(linear: torch.nn.Linear) -> torch.nn.Module:
    """A bias-free fp32 CPU nn.Linear's weights rounded to Q8_0 (`q80_rounded`), on the Q8_0 kernel (its AMX form
    where it runs); prefill-sized calls through oneDNN over the same rounded weights. The linear is untouched.
    ValueError naming what is missing where the library or the shape does not allow it."""
    if (why := kernels.unavailable()) is not None:
        raise ValueError(f"Q8_0 drafting weights need the kernel library: {why}")
    if linear.bias is not None or not shape_supported(linear.weight):
        raise ValueError(f"Q8_0 drafting weights: a bias-free matrix with K a multiple of {GROUP} and N of "
                         f"{OUTPUT_BLOCK}, got {list(linear.weight.shape)} (bias: {linear.bias is not None})")
    return Q80Linear(q80_rounded_linear(linear), kernels.library())


def int8_shapes_supported(linear: torch.nn.Module) -> bool:
    """A linear of a shape the int8 kernel takes: K whole groups of 32, N whole pairs of 16-output blocks."""
    w = getattr(linear, "weight", None)
    return w is not None and w.dim() == 2 and w.shape[1] % GROUP == 0 and w.shape[0] % INT8_OUTPUT_BLOCK == 0


def int8_inference_copy(linear: torch.nn.Linear) -> torch.nn.Module:
    """As `q80_inference_copy`, on the int8 kernel (`Q8Int8Linear`): the weights rounded to Q8_0, decode-time rows
    rounded to int8 per group of 32. ValueError naming what is missing where the CPU or the shape does not allow
    it."""
    if (why := int8_unavailable()) is not None:
        raise ValueError(f"int8 drafting weights need the kernel library's int8 kernels: {why}")
    if linear.bias is not None or not int8_shapes_supported(linear):
        raise ValueError(f"int8 drafting weights: a bias-free matrix with K a multiple of {GROUP} and N of "
                         f"{INT8_OUTPUT_BLOCK}, got {list(linear.weight.shape)} (bias: {linear.bias is not None})")
    return Q8Int8Linear(q80_rounded_linear(linear), kernels.library())


def int8_unsupported(module: torch.nn.Module) -> str | None:
    """None when every nn.Linear of `module` can run on the int8 kernel (`int8_inference_copy`), else why not: what
    the CPU lacks, or the first matrix that cannot (a bias, a shape)."""
    if (why := int8_unavailable()) is not None:
        return why
    if not packing_supported(module):
        return "an fp32 module on the CPU is needed (with oneDNN packing not switched off)"
    for name, m in module.named_modules():
        if type(m) is torch.nn.Linear and (m.bias is not None or not int8_shapes_supported(m)):
            return (f"{name} is {list(m.weight.shape)}{' with a bias' if m.bias is not None else ''}; the int8 kernel "
                    f"takes bias-free matrices with K a multiple of {GROUP} and N of {INT8_OUTPUT_BLOCK}")
    return None


def int8_for_inference(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` (its other parameters shared) with every nn.Linear on the int8 kernel
    (`int8_inference_copy`: the weights rounded to Q8_0, decode-time rows rounded to int8 per group of 32; calls of
    more than MAX_ROWS rows through oneDNN over the same rounded weights). For drafters, whose numbers decide only
    which tokens are proposed. Cached until the weights change. ValueError saying why where `int8_unsupported` does."""
    if (why := int8_unsupported(module)) is not None:
        raise ValueError(f"int8 drafting weights: {why}")
    return cached_copy(_copies, module, ("int8", huge_pages_unavailable(), weights_signature(module)),
                       lambda: clone_with_packed_linears(module, int8_inference_copy))


class GreedyHead:
    """The target's next tokens under greedy decoding from its Q8_0 head (the default target's tied embedding, on
    the FMA form), exactly torch.argmax of `q80_gemm`'s logits, at the int8 kernel's cost: an int8 pass over every
    output with a bound on its distance from the exact logit, then the exact logits (the same operations in the same
    order as q80_gemm) of the few outputs the bound cannot rule out (`q8_argmax`, csrc/int8.cpp). On a 2-core Zen 4
    the head's 49152 x 576 over one row costs 1.5 ms instead of 2.7, over four 1.6 instead of 3.3."""

    def __init__(self, weight: torch.Tensor, lib):
        self.lib = lib
        check_int8_shape("GreedyHead", weight)
        codes, step = q80_codes(weight.detach().float())  # [N, G, 32], [N, G]: the FMA form's own grid
        self.codes = fields_in_huge_pages(int8_layout(codes, step))
        self.matrix = lib.Int8Matrix(self.codes.codes, self.codes.step, self.codes.bias)
        slack = (GREEDY_SLACK * step.double() * codes.abs().sum(-1).double()).float()
        slack = torch.nextafter(slack, torch.full_like(slack, float("inf")))  # rounded up: never below the bound
        self.slack = in_huge_pages(by_block(slack))  # [N/16, G, 16]

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 [R, K] (1 <= R <= MAX_ROWS) -> (each row's argmax [R] int64, -1 for a row with no candidate (NaN);
        how many outputs each row computed exactly [R] int32)."""
        return self.lib.q8_argmax(x.contiguous(), self.matrix, self.slack)


def greedy_head_for(head: torch.nn.Module) -> GreedyHead | None:
    """The greedy head of a target whose inference head (`head_for_inference`) is the Q8_0 kernel's FMA form, where
    it pays (`kernels.greedy_head_unavailable`: AVX512-VNNI) and N is whole blocks of 32; else None (greedy steps
    take the argmax of the full logits). $SPECDISTILL_FULL_HEAD keeps the full logits. Cached until the weights
    change."""
    if os.environ.get(FULL_HEAD_ENV, "") not in ("", "0"):
        return None
    fast = head_for_inference(head)
    if not isinstance(fast, Q80Linear) or fast.codes.form != "fma" or not int8_shapes_supported(head):
        return None
    if (why := greedy_head_unavailable()) is not None:
        if int8_unavailable() is not None:  # a missing kernel costs; where it only does not pay (AVX2) nothing is lost
            kernels.warn_fallback("the greedy head", why, "greedy steps compute every logit: the head 1.65-2.2x "
                                  "costlier, plain decoding about 1.13x slower")
        return None
    return cached_copy(_copies, fast, ("greedy", huge_pages_unavailable(), weights_signature(head)),
                       lambda: GreedyHead(head.weight, kernels.library()))


def q41_usable(linear: torch.nn.Linear) -> bool:
    """A bias-free fp32 CPU matrix of a shape the kernel takes, on its Q4_1 grid up to float rounding (the
    default target's layers: exactly)."""
    w = linear.weight
    return (linear.bias is None and w.dtype == torch.float32 and w.device.type == "cpu" and shape_supported(w)
            and grid_deviation(w.detach()) <= GRID_TOLERANCE)


def q41_or_packed(linear: torch.nn.Module) -> torch.nn.Module:
    """KQuantLinear where a K-quant GGUF's blocks are attached (`kquant_usable`), Q41Linear where `q41_usable` and
    the library runs, else PackedLinear (oneDNN)."""
    if kquant_usable(linear):
        return kquant_linear(linear)
    if kernels.unavailable() is None and q41_usable(linear):
        return Q41Linear(linear, kernels.library())
    return PackedLinear(linear)


def q41_for_inference(module: torch.nn.Module) -> torch.nn.Module:
    """models.packed_linear.packed_for_inference(module) with its exactly-Q4_1 matrices (and an exactly-Q8_0
    head) on the kernels: for batched generation by the target (distill.generation), whose decode steps are one row
    per sequence. The same weights, so the same greedy tokens up to fp32 summation order. Cached until the weights
    change."""
    if kernels.unavailable() is not None or not packing_supported(module):
        return packed_for_inference(module)
    return cached_copy(_copies, module, ("q41", amx_unavailable(), huge_pages_unavailable(), weights_signature(module)),
                       lambda: clone_with_packed_linears(module, _on_a_kernel_or_packed))


def _on_a_kernel_or_packed(linear: torch.nn.Linear) -> torch.nn.Module:
    """KQuantLinear, else Q41Linear, else Q80Linear (a head), else PackedLinear; each grid checked once."""
    if kquant_usable(linear):
        return kquant_linear(linear)
    if kernels.unavailable() is None:
        if q41_usable(linear):
            return Q41Linear(linear, kernels.library())
        if q80_usable(linear):
            return Q80Linear(linear, kernels.library())
    return PackedLinear(linear)
