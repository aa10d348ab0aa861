"""The EAGLE-3 drafter's decoding rows on the CPU, written for the speculative loop (as decode.lean_decoder is
for the target).

Why: a drafting call over 1-3 rows cost about 1 ms on the 2-core CPU (in decoding, its weights cold after the
target's forward), of which the GEMMs were about half; the rest was the per-operation cost of some forty small
tensor operations (separate q/k/v and gate/up projections, the rotary angles recomputed from positions every
call, keys and values repeated per query head). Per step the proposer makes about two such calls, about a
tenth of a step. This computes what `Eagle3Drafter.rows` / `fuse` / `logits` compute (models.eagle3, the
training code's layer) with fewer operations: q, k and v in one packed GEMM, gate and up in one, the rotary
cos/sin looked up in a table grown as positions need it (the same float operations as `Eagle3Layer.project`, so
the same values), q and k rotated together, and grouped-query attention over the unrepeated cache (a group's
query heads folded into rows, as the target's lean forward does). Weights are packed copies
(models.packed_linear: fp16 under `drafting_weights`' float16); the drafter's own parameters are untouched. Its
RMSNorms and RoPE are the target's lean forward's one-call kernels where they run (decode.lean_decoder).
Measured in docs/journal.md, "Lean EAGLE-3 drafting rows".

Used by the proposer's dynamic (depth by depth) path wherever the drafter packs on the CPU; the fixed-shape
steps (decode.draft_steps, CUDA graphs) keep the drafter's own modules. Tests pin its outputs to the
drafter's.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from specdistill.decode.lean_decoder import (
    fused_linear,
    rms_norm_rows_or_torch,
    row_ops_library,
    sdpa_asked,
    unfused_asked,
)
from specdistill.models.eagle3 import DraftCache, Eagle3Drafter
from specdistill.models.feature_drafter import rope_tables, rotate
from specdistill.models.kernel_linear import Q8Int8Linear, int8_inference_copy, q80_inference_copy
from specdistill.models.kernels import MAX_ROWS
from specdistill.models.packed_linear import packed_class, packing_supported

__all__ = ["DISABLE_ENV", "LeanEagle3", "attend_rows", "lean_eagle3", "lean_eagle3_runs", "rotary_tables"]

DISABLE_ENV = "SPECDISTILL_NO_LEAN_DRAFTER"  # switch for side-by-side measurements and as an escape hatch


def lean_eagle3(drafter: Eagle3Drafter, weights: str) -> "LeanEagle3 | None":
    """The lean rows of `drafter` with linear weights in `weights` format ("q8_0": rounded to Q8_0 on the kernel
    library, models.kernel_linear.q80_inference_copy; "int8": the same weights times rows rounded to int8 on its
    int8 kernel (AVX512-VNNI or the AVX2 build), int8_inference_copy), or None where it does not pack (not fp32 on
    the CPU) or the environment switches it off."""
    if not lean_eagle3_runs(drafter):
        return None
    kernels = {"q8_0": q80_inference_copy, "int8": int8_inference_copy}
    return LeanEagle3(drafter, kernels.get(weights) or packed_class(weights))


def lean_eagle3_runs(drafter: Eagle3Drafter) -> bool:
    return os.environ.get(DISABLE_ENV, "") in ("", "0") and packing_supported(drafter)


class LeanEagle3:
    """fuse / rows / logits of an Eagle3Drafter on packed, fused weights (see the module docstring)."""

    def __init__(self, drafter: Eagle3Drafter, packed):
        layer, attn, mlp = drafter.midlayer, drafter.midlayer.self_attn, drafter.midlayer.mlp
        self.fc = packed(drafter.fc)
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], packed)
        self.o = packed(attn.o_proj)
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj], packed)
        self.down = packed(mlp.down_proj)
        self.lm_head = packed(drafter.lm_head)
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = mlp.gate_proj.out_features
        self.norm_embed = (layer.input_layernorm.weight, layer.input_layernorm.eps)
        self.norm_state = (layer.hidden_norm.weight, layer.hidden_norm.eps)
        self.norm_post = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        self.norm_out = (drafter.norm.weight, drafter.norm.eps)
        self.inv_freq = layer.inv_freq  # [hd / 2]
        self.dtype = drafter.norm.weight.dtype
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype)  # [P, hd]: positions 0..P-1
        # RMSNorm and RoPE in one kernel call each where the library runs (decode.lean_decoder.row_ops_library)
        self.native = row_ops_library(drafter, drafter.norm.weight.shape[0], self.head_dim)
        # and its attention, as the target's lean forward (decode.lean_decoder: the same switch)
        self.kernel_attention = self.native is not None and self.head_dim <= 256 and not sdpa_asked()
        # on int8 matrices, a depth's rows and its head's top-K in one library call each (`FusedRows`)
        self.fused = FusedRows(self) if FusedRows.applies(self) else None

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3 x D_target] -> g [..., D]."""
        return self.fc(features.to(self.dtype))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., D] -> draft logits [..., M]."""
        return self.lm_head(rms_norm_rows_or_torch(self.native, out, self.norm_out))

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> cos, sin [n, hd], from a table grown (doubled) as positions need it."""
        self.grow_rotary(int(positions.max()) + 1)
        return self.cos[positions], self.sin[positions]

    def grow_rotary(self, need: int) -> None:
        """The cos/sin tables [P, hd] to at least `need` positions."""
        if need > self.cos.shape[0]:
            self.cos, self.sin = rotary_tables(self.inv_freq, max(need, 2 * self.cos.shape[0], 1024), self.dtype)

    def top(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """out [n, D] -> each row's k most probable draft indices under the head: (log-probabilities [n, k]
        descending, indices [n, k]), as log_softmax(logits(out)).topk(k)."""
        if self.fused is not None and out.shape[0] <= MAX_ROWS:
            return self.fused.top(out, k)
        top = torch.log_softmax(self.logits(out).float(), dim=-1).topk(min(k, self.lm_head.out_features), dim=-1)
        return top.values, top.indices

    def rows(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
             visible: torch.Tensor) -> torch.Tensor:
        """As Eagle3Drafter.rows: embeds, states [n, D]; positions [n]; visible [n, cache.used + n] bool.
        Appends the rows' keys and values to `cache`; returns the outputs [n, D]."""
        n, d = states.shape
        if self.fused is not None and n <= MAX_ROWS:
            return self.fused.rows(embeds, states, positions, cache, visible)
        h, hkv, hd = self.heads, self.kv_heads, self.head_dim
        norm = functools.partial(rms_norm_rows_or_torch, self.native)
        x = torch.cat([norm(embeds, self.norm_embed), norm(states, self.norm_state)], dim=-1)
        fused = self.qkv(x)  # [n, (H + 2 Hkv) hd]: q heads, k heads, v heads
        qkv = fused.view(n, h + 2 * hkv, hd).transpose(0, 1)  # [H + 2 Hkv, n, hd]
        cos, sin = self.rotary(positions)  # [n, hd]
        if self.native is not None:
            q, k = self.native.rope_qk(fused.contiguous(), h, hkv, hd, cos.contiguous(), sin.contiguous())
        else:
            qk = rotate(qkv[:h + hkv], cos, sin)  # [H + Hkv, n, hd]
            q, k = qk[:h], qk[h:]
        keys, values = cache.append(k, qkv[h + hkv:])  # [Hkv, L + n, hd]
        attended = attend_rows(self.native if self.kernel_attention else None, q, keys, values, visible)  # [n, H hd]
        hidden = states + self.o(attended)
        gate, up = self.gate_up(norm(hidden, self.norm_post)).split(self.intermediate, dim=-1)
        return hidden + self.down(F.silu(gate) * up)


def rotary_tables(inv_freq: torch.Tensor, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos, sin [size, hd] for positions 0..size-1: the drafters' layers' own tables
    (models.feature_drafter.rope_tables), without their head axis."""
    cos, sin = rope_tables(inv_freq, torch.arange(size), dtype)  # [1, size, hd] each
    return cos[0], sin[0]


def attend_rows(native, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
    """q [H, n, hd] over keys, values [Hkv, T, hd] where visible [n, T] -> [n, H hd]: the kernel library's
    decode-time attention (`native`; calls of at most MAX_ROWS rows), else SDPA with a group's query heads folded
    into rows over the unrepeated keys (longer calls, a prompt's context rows: SDPA's blocking)."""
    h, n, hd = q.shape
    if native is not None and n <= MAX_ROWS:
        return native.attention_rows(q.contiguous(), keys, values, visible.contiguous(), hd ** -0.5)
    hkv = keys.shape[0]
    groups = h // hkv
    folded = q.reshape(hkv, groups * n, hd)  # row g*n + i: query head hkv*G + g, row i
    mask = visible.repeat(groups, 1) if groups > 1 else visible  # [G n, T]
    attended = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)  # [Hkv, G n, hd]
    return attended.reshape(h, n, hd).transpose(0, 1).reshape(n, h * hd)


class FusedRows:
    """LeanEagle3's rows and head on int8 matrices in one library call each (models.kernels: `eagle3_rows`,
    `eagle3_top`): the same operations in the same order as LeanEagle3.rows / logits + log_softmax + topk, without
    the twenty-odd tensor operations and their dispatch a drafting depth costs in Python (SiLU from the library's
    exp: a few ulps from torch's). Decode-time calls (at most MAX_ROWS rows); longer ones keep the Python.
    $SPECDISTILL_UNFUSED_LAYERS keeps the Python everywhere, as for the target's layers."""

    def __init__(self, lean: LeanEagle3):
        self.lean, self.lib = lean, lean.native
        self.matrices = {name: getattr(lean, name).matrix  # the library's Int8Matrix
                         for name in ("qkv", "o", "gate_up", "down", "lm_head")}

    @staticmethod
    def applies(lean: LeanEagle3) -> bool:
        linears = (lean.qkv, lean.o, lean.gate_up, lean.down, lean.lm_head)
        return (lean.kernel_attention and lean.dtype == torch.float32 and not unfused_asked()
                and all(isinstance(m, Q8Int8Linear) for m in linears) and lean.intermediate % 16 == 0
                and lean.head_dim % 32 == 0 and lean.norm_out[0].shape[0] % 16 == 0)

    def rows(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
             visible: torch.Tensor) -> torch.Tensor:
        """As LeanEagle3.rows (embeds, states [n, D]; positions [n]; visible [n, cache.used + n] bool)."""
        lean, m = self.lean, self.matrices
        n, d = states.shape
        start, end = cache.used, cache.used + n
        if end > cache.keys.shape[1]:
            raise RuntimeError(f"EAGLE-3 draft cache overflow: {end} rows, capacity {cache.keys.shape[1]}")
        lean.grow_rotary(int(positions.max()) + 1)
        embeds, states = embeds.contiguous(), states.contiguous()
        positions, visible = positions.to(torch.int64).contiguous(), visible.contiguous()
        (w_embed, e_embed), (w_state, e_state), (w_post, e_post) = lean.norm_embed, lean.norm_state, lean.norm_post
        out = self.lib.eagle3_rows(embeds, states, w_embed, e_embed, w_state, e_state, m["qkv"], lean.heads,
                                   lean.kv_heads, lean.head_dim, lean.cos, lean.sin, positions, cache.keys,
                                   cache.values, start, visible, lean.head_dim ** -0.5, m["o"], w_post, e_post,
                                   m["gate_up"], m["down"])  # [n, D]
        cache.used = end
        return out

    def top(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As LeanEagle3.top."""
        k = min(k, self.lean.lm_head.out_features)
        weight, eps = self.lean.norm_out
        values, indices = self.lib.eagle3_top(out.contiguous(), weight, eps, self.matrices["lm_head"], k)
        return values, indices
