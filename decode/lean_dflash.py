"""The DFlash drafter's decoding forward on the CPU with fewer operations (as decode.lean_eagle3 is for EAGLE-3).

Why: a block of 8 rows through the default target's two-layer DFlash drafter cost 5.4 ms on a 2-core Zen 3 in
int8 weights (6.7 in float16, 0.45 of the target's one-row forward), of which the matrices were about 1.7 ms; the
rest was some seventy small tensor operations at 30-400 us each there (an RMSNorm of 8 x 576 about 40 us, torch's
SDPA over 308 keys with a mask about 330 us). This computes what `DFlashDrafter.block` / `add_context` / `logits`
compute (models.dflash) with q, k and v in one GEMM (k and v in one for the context), gate and up in one, the
rotary cos/sin looked up in a table, and, where the kernel library runs (decode.lean_decoder.row_ops_library), its
one-call RMSNorm, RoPE and decode-time attention over the unrepeated cache: 3.0 ms in int8, 4.0 in float16, the
same greedy drafts (`python -m benchmarks.dflash_drafting DRAFTER`, both forwards in one process). Only which
tokens are drafted can change (a few ulps from torch's operations): the target verifies every draft. The
drafter's parameters are untouched; the matrices are packed copies in the proposer's weight format
(models.kernel_linear: int8 on the library's kernel; models.packed_linear: fp16 or fp32). Tests pin its outputs
to the drafter's; $SPECDISTILL_NO_LEAN_DRAFTER (decode.lean_eagle3) keeps the drafter's own modules.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdistill.decode.lean_decoder import fused_linear, rms_norm_rows_or_torch, row_ops_library, sdpa_asked
from specdistill.decode.lean_eagle3 import attend_rows, lean_eagle3_runs, rotary_tables
from specdistill.models.dflash import DFlashCache, DFlashDrafter
from specdistill.models.feature_drafter import rotate
from specdistill.models.kernel_linear import int8_inference_copy
from specdistill.models.packed_linear import packed_class

__all__ = ["LeanDFlash", "lean_dflash"]


def lean_dflash(drafter: DFlashDrafter, weights: str) -> "LeanDFlash | None":
    """The lean forward of `drafter` with its matrices in `weights` format ("int8": rounded to Q8_0 on the kernel
    library's int8 kernel, models.kernel_linear.int8_inference_copy; else models.packed_linear's packed copies), or
    None where it does not pack (not fp32 on the CPU) or $SPECDISTILL_NO_LEAN_DRAFTER switches it off."""
    if not lean_eagle3_runs(drafter):
        return None
    return LeanDFlash(drafter, int8_inference_copy if weights == "int8" else packed_class(weights))


class LeanLayer:
    """One DFlash layer's matrices and norms, packed (see the module docstring)."""

    def __init__(self, layer, packed):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], packed)
        self.kv = fused_linear([attn.k_proj, attn.v_proj], packed)
        self.o = packed(attn.o_proj)
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj], packed)
        self.down = packed(mlp.down_proj)
        self.intermediate = mlp.gate_proj.out_features
        self.norm_in = (layer.input_layernorm.weight, layer.input_layernorm.eps)
        self.norm_post = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        self.norm_q = (attn.q_norm.weight, attn.q_norm.eps)
        self.norm_k = (attn.k_norm.weight, attn.k_norm.eps)


class LeanDFlash:
    """add_context / block / logits of a DFlashDrafter on packed, fused weights (see the module docstring)."""

    def __init__(self, drafter: DFlashDrafter, packed):
        attn = drafter.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.block_size = drafter.block_size
        self.layers = [LeanLayer(layer, packed) for layer in drafter.layers]
        self.fc = packed(drafter.fc)
        self.lm_head = packed(drafter.lm_head)
        self.norm_context = (drafter.hidden_norm.weight, drafter.hidden_norm.eps)
        self.norm_out = (drafter.norm.weight, drafter.norm.eps)
        self.mask_embedding = drafter.mask_embedding.detach()  # [D]
        self.inv_freq = drafter.layers[0].inv_freq  # [hd / 2], the same in every layer
        self.dtype = drafter.norm.weight.dtype
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype)  # [P, hd]: positions 0..P-1
        self.native = row_ops_library(drafter, drafter.norm.weight.shape[0], self.head_dim)
        # the library's decode-time attention (None: SDPA), as the target's lean forward (the same switch)
        self.attention = self.native if self.native is not None and self.head_dim <= 256 and not sdpa_asked() else None
        self.norm = functools.partial(rms_norm_rows_or_torch, self.native)

    def rotary(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, hd] of positions start .. start + count - 1, from a table grown (doubled) as needed."""
        if start + count > self.cos.shape[0]:
            self.cos, self.sin = rotary_tables(self.inv_freq, max(start + count, 2 * self.cos.shape[0], 1024),
                                               self.dtype)
        return self.cos[start:start + count], self.sin[start:start + count]

    def head_norm(self, x: torch.Tensor, heads: int, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        """x [n, heads x hd] -> each head's RMSNorm, [n, heads, hd]."""
        n = x.shape[0]
        return self.norm(x.reshape(n * heads, self.head_dim), norm).view(n, heads, self.head_dim)

    def add_context(self, features: torch.Tensor, cache: DFlashCache) -> None:
        """As DFlashDrafter.add_context: the target's features [k, K x D_target] of the next k verified positions ->
        every layer's context keys and values, appended to the cache."""
        context = self.norm(self.fc(features.to(self.dtype)), self.norm_context)  # [k, D]
        k_rows, hkv, hd = context.shape[0], self.kv_heads, self.head_dim
        cos, sin = self.rotary(cache.length, k_rows)  # [k, hd]
        per_layer = []
        for layer in self.layers:
            kv = layer.kv(context)  # [k, 2 Hkv hd]
            keys = rotate(self.head_norm(kv[:, :hkv * hd], hkv, layer.norm_k).transpose(0, 1), cos, sin)
            per_layer.append((keys, kv[:, hkv * hd:].reshape(k_rows, hkv, hd).transpose(0, 1)))  # [Hkv, k, hd]
        cache.append(per_layer)

    def block(self, first: torch.Tensor, position: int, cache: DFlashCache) -> torch.Tensor:
        """As DFlashDrafter.block: first [D] the embedding of the last verified token at `position` (=
        cache.length) -> the last layer's outputs [B, D] (nothing cached)."""
        if position != cache.length:
            raise RuntimeError(f"DFlash block at position {position} but the drafter's context holds {cache.length}")
        size, h, hkv, hd = self.block_size, self.heads, self.kv_heads, self.head_dim
        hidden = torch.cat([first.to(self.dtype)[None], self.mask_embedding.expand(size - 1, -1)])  # [B, D]
        cos, sin = self.rotary(position, size)
        visible = torch.ones(size, cache.length + size, dtype=torch.bool)  # [B, L + B]: the context and the block
        for i, layer in enumerate(self.layers):
            fused = layer.qkv(self.norm(hidden, layer.norm_in))  # [B, (H + 2 Hkv) hd]
            q = self.head_norm(fused[:, :h * hd], h, layer.norm_q)  # [B, H, hd]
            k = self.head_norm(fused[:, h * hd:(h + hkv) * hd], hkv, layer.norm_k)  # [B, Hkv, hd]
            v = fused[:, (h + hkv) * hd:]  # [B, Hkv hd]
            if self.native is not None:
                packed = torch.cat([q.flatten(1), k.flatten(1), v], dim=-1)
                q, k = self.native.rope_qk(packed, h, hkv, hd, cos.contiguous(), sin.contiguous())  # [H|Hkv, B, hd]
            else:
                q, k = rotate(q.transpose(0, 1), cos, sin), rotate(k.transpose(0, 1), cos, sin)
            keys, values = cache.with_block(i, k, v.reshape(size, hkv, hd).transpose(0, 1))  # [Hkv, L + B, hd]
            hidden = hidden + layer.o(attend_rows(self.attention, q, keys, values, visible))
            gate, up = layer.gate_up(self.norm(hidden, layer.norm_post)).split(layer.intermediate, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return hidden

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The last layer's outputs [..., D] -> draft logits [..., M]."""
        return self.lm_head(self.norm(out, self.norm_out))

