"""Inference copies of a model whose fp32 CPU linear layers use oneDNN's pre-packed weights.

Why: at batch size 1 a forward over a few tokens streams every weight from memory once, so it
should cost about what a one-token forward costs. The default CPU path (MKL through F.linear) does
not: it re-packs each weight on every call, and measured on this project's 2-core machine the
linear layers of the default target (30 layers + the 49k-token head) took 47 ms for 1 row and
71-94 ms for 2-16 rows. With the weights packed once for oneDNN they took 20 ms for 1 row and 23-30
ms for 2-16 rows (`scripts/bench_packing.py`). That makes plain decoding about twice as fast and
verifying a draft of k tokens nearly free: both halves of a speculative step's cost change.

The copy shares every parameter with the original (only the packed weights are new memory), so the
original keeps training, saving and serving as before. A packed copy is stale once its weights
change: `packed_for_inference` caches copies by the weights' identity and version counter, so a
model trained since it was packed is packed again.

Numerics: packed and unpacked results differ by float rounding (max 2e-6 on these matrices), the
same order as F.linear's own differences between one row and several; greedy outputs are checked
token for token against the target in the tests and benchmarks as before.
"""

from __future__ import annotations

import copy
import os
import weakref

import torch

__all__ = ["PackedLinear", "packed_for_inference", "packing_supported"]

# env switch for side-by-side measurements (scripts/bench_packing.py) and as an escape hatch
DISABLE_ENV = "SPECDISTILL_NO_PACKING"

_cache: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]]" = weakref.WeakKeyDictionary()


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. Inference only (no autograd)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("PackedLinear is for inference; train the original module")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_supported(module: torch.nn.Module) -> bool:
    """fp32 on CPU with oneDNN available, and not switched off by the environment."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.float32


def packed_for_inference(module: torch.nn.Module) -> torch.nn.Module:
    """`module` itself where packing is unsupported, else a copy with every fp32 CPU nn.Linear
    replaced by a PackedLinear (parameters otherwise shared). Cached until the weights change."""
    if not packing_supported(module):
        return module
    key = weights_signature(module)
    hit = _cache.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    packed = clone_with_packed_linears(module)
    _cache[module] = (key, packed)
    return packed


def weights_signature(module: torch.nn.Module) -> tuple:
    """Identity and in-place version of every linear weight: changes when any is trained or replaced."""
    return tuple((m.weight.data_ptr(), m.weight._version) for m in module.modules()
                 if isinstance(m, torch.nn.Linear))


def clone_with_packed_linears(module: torch.nn.Module) -> torch.nn.Module:
    if is_packable(module):
        return PackedLinear(module)
    clone = copy.copy(module)  # shallow: parameters and buffers shared; submodule dict rebuilt below
    clone._modules = {name: (None if child is None else clone_with_packed_linears(child))
                      for name, child in module._modules.items()}
    return clone


def is_packable(module: torch.nn.Module) -> bool:
    if type(module) is not torch.nn.Linear:  # subclasses (LoRA layers, ...) keep their own forward
        return False
    w = module.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
