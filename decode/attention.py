"""Grouped-query attention over a tree without repeating the key/value cache.

A Llama-family target with grouped-query attention (SmolLM2-135M: 9 query heads, 3 key/value heads)
runs transformers' `sdpa` attention. For one query row it folds each group's query heads into the row
dimension, so attention reads the key/value heads as they are. For several rows with a mask, which is
every tree verification, it instead copies the whole key/value cache once per group (`repeat_kv`):
on the 2-core CPU about 1 ms of a 23 ms five-row forward at 300 tokens of context, 2 ms at 600.

`grouped_query_sdpa` folds the rows the same way for any number of them: the query [B, H, N, d] of
H = G x Hkv heads becomes [B, Hkv, G x N, d] (row g x N + i is query head hkv x G + g at row i), the
mask [B, 1, N, T] is tiled G times along its rows to match, and one attention call over the unrepeated
keys and values gives every head's output, reshaped back. Each (head, row) attends to exactly the keys,
values and mask entries it did before: the same attention, without the copies. Anything else (no
mask, one row, per-head masks, position biases, soft-capping, sliding windows) goes to transformers'
own `sdpa` unchanged.

The tiling is the same for every layer of a forward: a caller that built the mask can tile it once and
pass the result as the keyword `grouped_mask` (`grouped_mask_argument`), which transformers hands to
every layer's attention; decode.runner does, saving a tiling per layer (30 on SmolLM2: 0-3% of a
multi-row forward on the 2-core CPU, docs/journal.md).

`use_grouped_query_sdpa(model)` switches a model that runs `sdpa` to it, with the masks transformers
builds for `sdpa` (a custom attention without a registered mask function would get none, and padding
would be ignored); decode.runner does this for the models it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["GROUPED_SDPA", "grouped_mask_argument", "grouped_query_sdpa", "use_grouped_query_sdpa"]

GROUPED_SDPA = "specdistill_grouped_sdpa"
GROUPED_MASK = "grouped_mask"  # keyword: the mask already tiled for the query's groups
_UNSUPPORTED = ("position_bias", "softcap", "sliding_window", "s_aux")


def grouped_query_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, N, d], key/value [B, Hkv, T, d], attention_mask [B, 1, N, T] -> ([B, N, H, d], None).
    kwargs[GROUPED_MASK], if given: the same mask tiled [B, 1, G*N, T] (used when its shape fits)."""
    groups = getattr(module, "num_key_value_groups", 1)
    tiled = kwargs.pop(GROUPED_MASK, None)
    b, h, n, d = query.shape
    if (groups == 1 or n == 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or any(kwargs.get(k) is not None for k in _UNSUPPORTED)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    folded = query.reshape(b, h // groups, groups * n, d)  # [B, Hkv, G*N, d]
    if tiled is not None and tiled.shape == (b, 1, groups * n, attention_mask.shape[-1]):
        mask = tiled
    else:
        mask = tile_mask(attention_mask, groups)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, h, n, d).transpose(1, 2).contiguous(), None  # [B, N, H, d]


def tile_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, N, T] -> [B, 1, G*N, T]: row g*N + i is row i."""
    return mask.repeat(1, 1, groups, 1)


def grouped_mask_argument(model: torch.nn.Module, mask: torch.Tensor) -> dict:
    """{GROUPED_MASK: `mask` [B, 1, N, T] tiled} for a forward of `model` whose attention is grouped_query_sdpa
    over several rows, else {}. Pass it to the model with that mask, so each layer does not tile it again."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(model.config, "_attn_implementation", None) != GROUPED_SDPA or mask.shape[-2] == 1 or heads == kv_heads:
        return {}
    return {GROUPED_MASK: tile_mask(mask, heads // kv_heads)}


def use_grouped_query_sdpa(model: torch.nn.Module) -> None:
    """Run `model`'s attention through grouped_query_sdpa if it runs transformers' `sdpa` (else leave it)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(GROUPED_SDPA, grouped_query_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # masks built as for sdpa (padding included)
    config._attn_implementation = GROUPED_SDPA
