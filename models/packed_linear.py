"""Inference copies of a model whose fp32 CPU linear layers use oneDNN's pre-packed weights.

Why: at batch size 1 a forward over a few tokens streams every weight from memory once, so it
should cost about what a one-token forward costs. The default CPU path (MKL through F.linear) does
not: it re-packs each weight on every call, and measured on this project's 2-core machine the
linear layers of the default target (30 layers + the 49k-token head) took 47 ms for 1 row and
71-94 ms for 2-16 rows. With the weights packed once for oneDNN they took 20 ms for 1 row and 23-30
ms for 2-16 rows (docs/journal.md, "Packed weights on CPU"). That makes plain decoding about twice as fast and
verifying a draft of k tokens nearly free: both halves of a speculative step's cost change.

The copy shares every parameter with the original (only the packed weights are new memory), so the
original keeps training, saving and serving as before. A packed copy is stale once its weights
change: `packed_for_inference` caches copies by the weights' identity and version counter, so a
model trained since it was packed is packed again.

Numerics: packed and unpacked results differ by float rounding (max 2e-6 on these matrices), the
same order as F.linear's own differences between one row and several; greedy outputs are checked
token for token against the target in the tests and benchmarks as before.

fp16 weights (`weights="float16"`, the `float16-weights` precision of models.target): the same idea
with half the bytes. FBGEMM's fp16 GEMM keeps each weight matrix in fp16 (packed once), reads fp32
activations and accumulates in fp32, with AVX2 + F16C kernels: on the 2-core AVX2 host it ran the
default target's linear layers 1.6-2x faster than the oneDNN fp32 packing at 1-16 rows
(`benchmarks/engine.py`). It computes x @ fp16(W)^T exactly up to fp32 accumulation order, i.e.
a target whose linear weights are rounded to fp16: a different model from the fp32 one (greedy
outputs can diverge after some tokens), so speculative decoding in this precision is lossless with
respect to plain decoding in this precision, and every report names it.

Drafters draft in fp16 weights wherever FBGEMM's fp16 GEMM runs (`drafting_weights`), whatever the
target computes in: a drafter's rounding can change which tokens it proposes, never which ones the
target accepts (the target verifies every draft in its own precision). A drafter's step streams its
weights like the target's does, so this halves its cost: EAGLE-3 drafting 16.5 s -> 10.3 s on 8
MT-bench answers at depth 6 with the same trees (tau 1.806 both; docs/journal.md, "Drafters draft in
fp16 weights").
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import statistics
import time
import weakref

import torch
from torch.nn import functional as F

from specdistill.models.gguf_blocks import ATTRIBUTE as GGUF_BLOCKS

__all__ = ["DRAFTING_WEIGHTS", "GEMM_PAD_ENV", "PackedLinear", "PackedLinearFP16", "WEIGHT_FORMATS", "cached_copy",
           "check_weight_format", "drafting_weights", "float16_weights_supported", "gemm_padding",
           "gemm_padding_source", "inference_weights", "measured_gemm_padding", "packed_class", "packed_for_inference",
           "packing_supported", "set_inference_weights", "weights_signature"]

WEIGHT_FORMATS = ("float32", "float16")
# the attribute of a model that says in which format its inference copies hold linear weights
WEIGHTS_ATTR = "specdistill_inference_weights"

# env switch for side-by-side measurements (docs/journal.md, "Packed weights on CPU") and as an escape hatch
DISABLE_ENV = "SPECDISTILL_NO_PACKING"

log = logging.getLogger("specdistill.packed_linear")

_cache: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]]" = weakref.WeakKeyDictionary()


# oneDNN's fp32 GEMM on AVX-512 (brgemm, six rows to a register block) computed one or two rows slower than six on
# the 2-core AMD EPYC (Zen 4): the default target's whole forward took 31.0 / 37.1 ms for 1 / 2 new rows against
# 29.4 / 30.9 with its GEMMs padded to 6 rows (zeros), and 29-31 ms for 3-6 rows, where padding cost more (about
# 1 ms of pads and slices a forward) than it saved (docs/journal.md "One or two rows computed as six"). On a 2-core
# Intel Xeon with AVX-512 and AMX the same kernel is fastest at one row and padding made plain decoding 0.86x
# (docs/journal.md "GEMM padding measured, not assumed"); on AVX2 one row is the cheapest. So a call of fewer than B
# rows computes T rows and keeps its own where this machine measures that faster: on AVX-512, one short timing per
# process (measured_gemm_padding) chooses (B, T) among (3, 6), (2, 6) and none; elsewhere none.
# $SPECDISTILL_GEMM_PAD sets it ("B:T", or "off"); `benchmarks/forward_rows.py` measures a whole forward.
GEMM_PAD_ENV = "SPECDISTILL_GEMM_PAD"
PAD_TO = 6
# padding must save at least this share of a call's time to be chosen: the pads and slices cost about 1 ms a
# forward that the timing's GEMMs do not show, and a decision should not flip on noise
PAD_MIN_GAIN = 0.05


def gemm_padding() -> tuple[int, int]:
    """(B, T): an fp32 packed GEMM call of fewer than B rows computes T rows; (0, 0): never padded.
    $SPECDISTILL_GEMM_PAD ("B:T" or "off"), else on AVX-512 what this machine measures (measured_gemm_padding),
    else (0, 0)."""
    value = os.environ.get(GEMM_PAD_ENV, "").strip().lower()
    if value == "off":
        return 0, 0
    if value:
        below, _, to = value.partition(":")
        if not (below.isdigit() and to.isdigit() and 1 <= int(below) <= int(to)):
            raise ValueError(f"${GEMM_PAD_ENV}: 'B:T' (calls of fewer than B rows compute T, 1 <= B <= T) "
                             f"or 'off', got {value!r}")
        return int(below), int(to)
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return 0, 0
    return measured_gemm_padding()


def gemm_padding_source() -> str:
    """Where `gemm_padding`'s choice comes from, for reports (decode.runtime_facts): "$SPECDISTILL_GEMM_PAD",
    "measured" (on AVX-512, timed once per process) or "none off AVX-512"."""
    if os.environ.get(GEMM_PAD_ENV, "").strip():
        return f"${GEMM_PAD_ENV}"
    return "measured" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "none off AVX-512"


@functools.cache
def measured_gemm_padding() -> tuple[int, int]:
    """(3, 6) where one and two rows computed as six are both faster by PAD_MIN_GAIN, (2, 6) where only one row
    is, else (0, 0): timed once per process on this machine's threads (about 0.2 s)."""
    one, two = padding_gains(gemm_row_timings())
    choice = (3, PAD_TO) if one >= PAD_MIN_GAIN and two >= PAD_MIN_GAIN else (2, PAD_TO) if one >= PAD_MIN_GAIN \
        else (0, 0)
    log.info("fp32 GEMM padding: %s (padding to %d rows saves %.0f%% at 1 row, %.0f%% at 2)",
             "off" if choice == (0, 0) else "%d:%d" % choice, PAD_TO, 100 * one, 100 * two)
    return choice


def padding_gains(timings: dict[tuple[int, int], float]) -> tuple[float, float]:
    """The share of time padding to PAD_TO saves at 1 and 2 rows, from {(rows, computed rows): seconds}."""
    return tuple(1.0 - timings[(rows, PAD_TO)] / timings[(rows, rows)] for rows in (1, 2))


def gemm_row_timings(megabytes: int = 64, reps: int = 5) -> dict[tuple[int, int], float]:
    """{(rows, computed rows): median seconds} of packed fp32 GEMMs over `megabytes` of weights shaped like a
    small LLM's layers (more than any core's L2, so the weights stream as in a forward), for 1 and 2 rows, each
    computed as itself and as PAD_TO; the variants interleaved rep by rep."""
    shapes = [(1536, 576), (576, 1536), (960, 576), (576, 576)]  # [out, in]: the default target's MLP, QKV, o
    weights, size = [], 0
    while size < megabytes * 2 ** 20:
        for out_features, in_features in shapes:
            weight = torch.full((out_features, in_features), 0.01)  # values do not change the time; no RNG drawn
            weights.append((torch.ops.mkldnn._reorder_linear_weight(weight), in_features))
            size += weight.numel() * weight.element_size()
    variants = [(1, 1), (1, PAD_TO), (2, 2), (2, PAD_TO)]
    samples: dict[tuple[int, int], list[float]] = {v: [] for v in variants}
    with torch.inference_mode():
        inputs = {v: {i: torch.full((v[1], i), 0.01) for _, i in shapes} for v in variants}
        for _ in range(reps + 1):  # the first round warms the kernels and is dropped
            for variant in variants:
                start = time.perf_counter()
                for weight, in_features in weights:
                    torch.ops.mkldnn._linear_pointwise(inputs[variant][in_features], weight, None, "none", [], "")
                samples[variant].append(time.perf_counter() - start)
    return {v: statistics.median(times[1:]) for v, times in samples.items()}


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. Inference only (no autograd). A call of fewer
    rows than `padding`'s B computes T (zeros after its own), where oneDNN's kernel is faster (gemm_padding)."""

    def __init__(self, linear: torch.nn.Linear, padding: tuple[int, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.pad_below, self.pad_to = gemm_padding() if padding is None else padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("PackedLinear is for inference; train the original module")
        rows = x.numel() // self.in_features
        if 0 < rows < self.pad_below:
            padded = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, self.pad_to - rows))  # [T, in]
            out = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")
            return out[:rows].view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedLinearFP16(torch.nn.Module):
    """y = x fp16(W)^T + b: W held in fp16 in FBGEMM's packed layout; x, y and accumulation in fp32."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            bias = None if linear.bias is None else linear.bias.detach().float()
            self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float().contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("PackedLinearFP16 is for inference; train the original module")
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


def check_weight_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"inference weights {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")


def set_inference_weights(model: torch.nn.Module, weights: str) -> None:
    """Make the engine's inference copies of `model` hold linear weights in `weights` format
    (see WEIGHT_FORMATS); the model's own parameters are unchanged."""
    check_weight_format(weights)
    if weights == "float16" and not float16_weights_supported():
        raise ValueError("float16 inference weights need FBGEMM's fp16 GEMM (an x86 CPU with AVX2 and F16C); "
                         "this CPU or torch build has none")
    setattr(model, WEIGHTS_ATTR, weights)


def inference_weights(model: torch.nn.Module) -> str:
    """The format set by set_inference_weights; "float32" (the parameters' own values) by default."""
    return getattr(model, WEIGHTS_ATTR, "float32")


@functools.cache
def float16_weights_supported() -> bool:
    """FBGEMM's fp16-weight GEMM runs on this CPU (it needs AVX2 + F16C)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, torch.full((1, 8), 8.0)))


# what a proposer may be asked to draft in; "q8_0" and "int8" (Q8_0 weights, decode-time rows rounded to int8): EAGLE-3
# drafters only (decode.proposers.eagle3, on the kernel library of models.kernels)
DRAFTING_WEIGHTS = ("auto",) + WEIGHT_FORMATS + ("q8_0", "int8")


def drafting_weights(drafter: torch.nn.Module, choice: str | None = "auto") -> str:
    """The weight format of a drafter's inference copies, whatever the target computes in. "auto" (or None):
    float32 for a drafter with a GGUF's blocks attached (they run as they are), else float16 where the drafter
    packs on this CPU and FBGEMM's fp16 GEMM runs (see the module docstring: only which tokens are proposed can
    change), else float32 (the parameters as they are: a GPU, another dtype,
    a CPU without F16C). "float32" / "float16" force one (float16 where it cannot run is an error)."""
    choice = choice or "auto"
    if choice not in DRAFTING_WEIGHTS:
        raise ValueError(f"drafter weights {choice!r}: choose one of {', '.join(DRAFTING_WEIGHTS)}")
    if choice in ("q8_0", "int8"):
        kinds = "EAGLE-3 and DFlash drafters" if choice == "int8" else "EAGLE-3 drafters"
        raise ValueError(f"drafter weights {choice}: only {kinds} draft in it; use auto, float32 or float16")
    fp16_runs = packing_supported(drafter) and float16_weights_supported()
    if choice == "auto" and any(hasattr(m, GGUF_BLOCKS) for m in drafter.modules()):
        return "float32"  # a GGUF model's own quantized blocks on the kernel library (models.gguf_blocks)
    if choice == "auto":
        return "float16" if fp16_runs else "float32"
    if choice == "float16" and not fp16_runs:
        raise ValueError("drafter weights float16 need an fp32 drafter on a CPU with FBGEMM's fp16 GEMM "
                         "(AVX2 + F16C); use auto or float32")
    return choice


def packing_supported(module: torch.nn.Module) -> bool:
    """fp32 on CPU with oneDNN available, and not switched off by the environment."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.float32


def packed_for_inference(module: torch.nn.Module, weights: str = "float32") -> torch.nn.Module:
    """`module` itself where packing is unsupported, else a copy with every fp32 CPU nn.Linear
    replaced by a PackedLinear, or by a PackedLinearFP16 for weights="float16" (parameters otherwise
    shared). Cached until the weights change."""
    check_weight_format(weights)
    if not packing_supported(module):
        if weights == "float16":
            raise ValueError("float16 inference weights need an fp32 module on the CPU "
                             "(and packing not switched off by $" + DISABLE_ENV + ")")
        return module
    return cached_copy(_cache, module, (weights, gemm_padding(), weights_signature(module)),
                       lambda: clone_with_packed_linears(module, packed_class(weights)))


def packed_class(weights: str) -> type[torch.nn.Module]:
    """The inference linear for a weight format."""
    return PackedLinearFP16 if weights == "float16" else PackedLinear


def cached_copy(cache: weakref.WeakKeyDictionary, module: torch.nn.Module, key: tuple, build):
    """cache[module]'s copy while its key (the weights' signature) is unchanged, else build() stored under key."""
    hit = cache.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    copy_ = build()
    cache[module] = (key, copy_)
    return copy_


def weights_signature(module: torch.nn.Module) -> tuple:
    """Identity and in-place version of every linear weight: changes when any is trained or replaced."""
    return tuple((m.weight.data_ptr(), m.weight._version) for m in module.modules()
                 if isinstance(m, torch.nn.Linear))


def clone_with_packed_linears(module: torch.nn.Module, packed_class=PackedLinear) -> torch.nn.Module:
    if is_packable(module):
        return packed_class(module)
    clone = copy.copy(module)  # shallow: parameters and buffers shared; submodule dict rebuilt below
    clone._modules = {name: (None if child is None else clone_with_packed_linears(child, packed_class))
                      for name, child in module._modules.items()}
    return clone


def is_packable(module: torch.nn.Module) -> bool:
    if type(module) is not torch.nn.Linear:  # subclasses (LoRA layers, ...) keep their own forward
        return False
    w = module.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
