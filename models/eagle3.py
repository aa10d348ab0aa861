"""EAGLE-3 drafters (Li et al. 2025): one decoder layer over the target's own hidden states.

The target already computed, at every position t, hidden states at many layers. EAGLE-3 fuses three of
them (low, middle, high: the inputs of layers 2, L // 2 and L - 3 of an L-layer target, as EAGLE-3 and
vLLM choose) into one feature g_t = fc([h_t^low; h_t^mid; h_t^high]) and runs ONE Llama-style decoder
layer whose input at position t is the target's input embedding of token t + 1 (the token sampled
from h_t) beside g_t:

    step 0:  o_t^0 = Layer(e(x_{t+1}), g_t)                  -> logits of x_{t+2}
    step j:  o_t^j = Layer(e(x_{t+1+j}), o_t^{j-1})          -> logits of x_{t+2+j}

Step j > 0 is what drafting does: the drafter feeds its own output back with the token it drafted,
because the target's features of drafted positions do not exist yet. The layer concatenates the two
inputs (each RMS-normed: `input_layernorm` on the embedding, `hidden_norm` on the state) to [2D] before
q/k/v; the residual stream is the state. Step j's query at t attends to the step-0 keys at positions
<= t (the real context) and to the step-1..j keys at t itself (its own chain so far): exactly what a
drafted node sees at inference (the committed context in the drafter's cache and its ancestors in the
tree). Positions: step j at t sits at position t + j. `Eagle3Drafter.unroll` (training: every step
over the rows a loss counts, every position of the sequence their context) and `Eagle3Drafter.rows`
(decoding, a few rows against a cache) share `Eagle3Layer.project` and `Eagle3Layer.finish`; only how
the attention's keys are gathered differs, and tests pin the two together.

The head covers the M draft tokens (`d2t`: target id of draft index i is i + d2t[i], EAGLE-3's offset
form; `t2d`: [V] bool, whether a target token is draftable). The embedding is the target's, frozen,
and is not saved. Module names follow vLLM's `llama_eagle3` and speculators' Eagle3 checkpoints
(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), so an export is a rename at most.

A drafter directory of kind `eagle3`:
    manifest.json                config: ARCH_KEYS (+ the training config); extra: decoding options
    model/eagle3.safetensors     the state dict above
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from specdistill.models.drafters import register_drafter_kind
from specdistill.models.feature_drafter import (
    ReducedVocab,
    SwiGLU,
    check_shapes,
    copy_mlp,
    full_vocab_map,
    inverse_frequencies,
    load_kind,
    rope_tables,
    rotate,
    save_weights,
    start_like_target,
    target_shapes,
)

WEIGHTS_FILE = "eagle3.safetensors"
ARCH_KEYS = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "rms_norm_eps", "rope_theta", "draft_vocab_size", "vocab_size",
             "target_layers")


def default_target_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers (vLLM's choice): the inputs of layers 2, L // 2, L - 3."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def eagle3_config(target_model: nn.Module, draft_vocab_size: int, target_layers: list[int] | None = None,
                  intermediate_size: int = 0) -> dict:
    """The drafter's shape from the target's config (its attention and MLP shapes, RoPE base); a positive
    intermediate_size widens (or narrows) the layer's MLP instead of the target's width."""
    num_layers = target_model.config.get_text_config().num_hidden_layers
    layers = list(target_layers) if target_layers else default_target_layers(num_layers)
    config = {**target_shapes(target_model, draft_vocab_size, intermediate_size), "target_layers": layers}
    check_config(config, num_layers)
    return config


def check_config(config: dict, target_num_layers: int | None = None) -> None:
    """Errors that name the field: layer indices, vocabulary sizes, head shapes."""
    missing = [key for key in ARCH_KEYS if key not in config]
    if missing:
        raise ValueError(f"eagle3 config lacks {', '.join(missing)}")
    layers = config["target_layers"]
    if len(layers) != 3:
        raise ValueError(f"eagle3_layers: EAGLE-3 fuses 3 target layers (low, middle, high), got {layers}")
    if target_num_layers is not None and not all(0 <= int(i) < target_num_layers for i in layers):
        raise ValueError(f"eagle3_layers: {layers} out of range for a target of {target_num_layers} layers "
                         f"(indices 0..{target_num_layers - 1}: the input of that layer)")
    check_shapes(config, "eagle3", "eagle3_intermediate_size")


class Eagle3Attention(nn.Module):
    """q/k/v read the [2D] concatenation of the normed embedding and normed state (hence 2 x hidden)."""

    def __init__(self, config: dict):
        super().__init__()
        d, hd = config["hidden_size"], config["head_dim"]
        self.num_heads, self.num_kv_heads, self.head_dim = (config["num_attention_heads"],
                                                            config["num_key_value_heads"], hd)
        self.q_proj = nn.Linear(2 * d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)


class Eagle3Layer(nn.Module):
    """The decoder layer, split at the attention so that training and decoding gather keys their own way."""

    def __init__(self, config: dict):
        super().__init__()
        d, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = SwiGLU(config)
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)  # [hd / 2]

    def project(self, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor):
        """embeds, state [..., T, D], positions [T] or [..., T] -> q [..., H, T, hd], k, v [..., Hkv, T, hd]
        (q, k rotated)."""
        attn = self.self_attn
        # under bf16 autocast (training) the fused feature arrives in bf16: normed in the norm's dtype, the fused kernel
        state = state.to(self.hidden_norm.weight.dtype)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)  # [..., T, 2D]
        q = attn.q_proj(x).unflatten(-1, (attn.num_heads, attn.head_dim)).transpose(-3, -2)
        k = attn.k_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim)).transpose(-3, -2)
        v = attn.v_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim)).transpose(-3, -2)
        cos, sin = rope_tables(self.inv_freq, positions, x.dtype)  # [..., 1, T, hd]: every head
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """state [..., T, D] (the residual) + attention output [..., H, T, hd] -> the layer's output [..., T, D]."""
        hidden = state + self.self_attn.o_proj(attended.transpose(-3, -2).flatten(-2))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def gather_rows(x: torch.Tensor, rows: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """x [B, ..., T, ..., F] (T at `dim`, the last dim F) -> the same at rows [B, W] of T per batch entry."""
    dim = dim % x.dim()
    index = rows.view(rows.shape[0], *[1] * (dim - 1), rows.shape[1], *[1] * (x.dim() - dim - 1))
    return x.gather(dim, index.expand(*x.shape[:dim], rows.shape[1], *x.shape[dim + 1:]))


class Eagle3Drafter(ReducedVocab, nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        check_config(config)
        self.config = dict(config)
        d, m = config["hidden_size"], config["draft_vocab_size"]
        self.fc = nn.Linear(3 * config["target_hidden_size"], d, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = nn.RMSNorm(d, eps=config["rms_norm_eps"])
        self.lm_head = nn.Linear(d, m, bias=False)
        self.register_buffer("d2t", torch.zeros(m, dtype=torch.long))  # draft index i -> target id i + d2t[i]
        self.register_buffer("t2d", torch.zeros(config["vocab_size"], dtype=torch.bool))  # [V] draftable

    @property
    def target_layers(self) -> list[int]:
        return list(self.config["target_layers"])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three layers' states [..., 3 x D_target] -> g [..., D]. (Tried: training fc on
        features divided by their per-dimension RMS, against the massive activations of SmolLM2's residual
        stream; held-out tau 1.107 against 1.274 at step 60 of smollm2_eagle3, so not kept.)"""
        return self.fc(features.to(self.norm.weight.dtype))  # fc may be a packed copy: no .weight

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output [..., D] -> draft logits [..., M]."""
        return self.lm_head(self.norm(out))

    def unroll(self, embeds: list[torch.Tensor], features: torch.Tensor,
               rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test over whole (right-padded) sequences.

        embeds: per step j, [B, T, D] the embedding of token t + 1 + j at row t (anything past the end);
        features: [B, T, 3 x D_target]; rows: [B, W] the positions whose steps are computed (any order;
        default all T). Every position's step-0 keys and values are the context; only the rows' queries,
        layer outputs and later steps are computed, so a loss that counts few positions (the response,
        not the prompt) pays for those. Returns per step j the outputs o^j [B, W, D]. Row t of step j
        attends to step-0 positions <= t and to its own rows of steps 1..j (see the module docstring)."""
        layer = self.midlayer
        b, t = features.shape[:2]
        positions = torch.arange(t, device=features.device)  # [T]
        rows = positions.expand(b, t) if rows is None else rows  # [B, W]
        scale = 1.0 / math.sqrt(layer.self_attn.head_dim)
        groups = layer.self_attn.num_heads // layer.self_attn.num_kv_heads
        fused = self.fuse(features)  # [B, T, D]
        state = gather_rows(fused, rows)  # [B, W, D]
        causal = positions[None, None, None, :] <= rows[:, None, :, None]  # [B, 1, W, T]: step-0 keys a row sees
        context_k = context_v = None
        chain_k, chain_v, outputs = [], [], []
        for j, embed in enumerate(embeds):
            if j == 0:  # every position's keys and values (the context); the rows' queries
                q, k, v = layer.project(embed, fused, positions)  # [B, H, T, hd], [B, Hkv, T, hd]
                q = gather_rows(q, rows, dim=-2)  # [B, H, W, hd]
                context_k, context_v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
            else:
                q, k, v = layer.project(gather_rows(embed, rows), state, rows + j)  # [B, H, W, hd], [B, Hkv, W, hd]
                chain_k.append(k.repeat_interleave(groups, dim=-3))
                chain_v.append(v.repeat_interleave(groups, dim=-3))
            scores = (q @ context_k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B, H, W, T]
            own = [(q * key).sum(-1, keepdim=True) for key in chain_k]  # j x [B, H, W, 1]: the chain, diagonal
            weights = torch.softmax(torch.cat([scores, *own], dim=-1) * scale, dim=-1)  # [B, H, W, T + j]
            attended = weights[..., :t] @ context_v
            for i, value in enumerate(chain_v):
                attended = attended + weights[..., t + i:t + i + 1] * value
            state = layer.finish(state, attended)  # [B, W, D]
            outputs.append(state)
        return outputs

    def rows(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, cache: "DraftCache",
             visible: torch.Tensor) -> torch.Tensor:
        """Decoding: n new rows against the drafter's cache. embeds, states [n, D]; positions [n];
        visible [n, cache.length + n] bool: which cached rows and new rows each new row attends to.
        The new rows' keys are appended to the cache (uncommitted until the caller commits them).
        Returns the outputs [n, D]."""
        layer = self.midlayer
        q, k, v = layer.project(embeds, states, positions)  # [H, n, hd], [Hkv, n, hd]
        keys, values = cache.append(k, v)  # [Hkv, L + n, hd]
        groups = layer.self_attn.num_heads // layer.self_attn.num_kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)  # [H, n, hd]
        return layer.finish(states, attended)

    @classmethod
    def for_target(cls, target_model: nn.Module, vocab_map: torch.Tensor | None,
                   target_layers: list[int] | None = None, seed: int = 0, init: str = "random",
                   intermediate_size: int = 0) -> "Eagle3Drafter":
        """A fresh drafter for `target_model`: the layer and fc initialised as Llama's (normal, std 0.02,
        seeded), the head the target's own rows for the draft vocabulary, the norm the target's final norm
        (the head starts reading the target's way). init "target_layer": then the layer and fc start as the
        target's own high layer (`start_from_target_layer`). intermediate_size: the MLP's width (0: the
        target's)."""
        if init not in EAGLE3_INITS:
            raise ValueError(f"eagle3_init: one of {EAGLE3_INITS}, got {init!r}")
        vocab_map = full_vocab_map(target_model, vocab_map)
        drafter = cls(eagle3_config(target_model, vocab_map.numel(), target_layers, intermediate_size))
        start_like_target(drafter, target_model, vocab_map, seed)
        if init == "target_layer":
            start_from_target_layer(drafter, target_model)
        drafter.set_vocab(vocab_map)
        return drafter.to(device=target_model.get_output_embeddings().weight.device)

    def save_pretrained(self, directory: str | Path) -> None:
        save_weights(self, directory, WEIGHTS_FILE)


EAGLE3_INITS = ("random", "target_layer")


@torch.no_grad()
def start_from_target_layer(drafter: Eagle3Drafter, target_model: nn.Module) -> None:
    """Start the drafter as the target's high layer h (the last of `target_layers`) applied to its own input.

    fc passes the high feature through (g_t = h_t^high, the other two blocks zero); the layer's state half
    of q/k/v, its o_proj, MLP and norms are layer h's (`hidden_norm` is h's input norm). The embedding half
    of q/k/v keeps its random start, so the token x_{t+1} enters from the first step. Step 0 then computes
    what the target's layer h computes at t, over the same context: training starts from the target's own
    attention and MLP instead of noise (the head and final norm are the target's already). Weights only: a
    target whose projections carry biases (Qwen's q/k/v) starts without them, as the drafter has none.
    A wider MLP than the target's holds h's in its first rows (gate, up) and columns (down); down's other
    columns start at zero, so the start is still h's output and the new units grow from there. A narrower
    one keeps h's first units."""
    high = drafter.target_layers[-1]
    layer = target_model.get_decoder().layers[high]
    d = drafter.config["hidden_size"]  # the target's (eagle3_config)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.detach().to(dst.device, dst.dtype))

    drafter.fc.weight.zero_()
    drafter.fc.weight[:, 2 * d:].copy_(torch.eye(d))  # [D, 3D]: the high block passes through
    mid, attn = drafter.midlayer, drafter.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        copy(getattr(attn, name).weight[:, d:], getattr(layer.self_attn, name).weight)  # [out, D] of [out, 2D]
    copy(attn.o_proj.weight, layer.self_attn.o_proj.weight)
    copy_mlp(mid.mlp, layer.mlp)
    copy(mid.hidden_norm.weight, layer.input_layernorm.weight)
    copy(mid.post_attention_layernorm.weight, layer.post_attention_layernorm.weight)


class DraftCache:
    """The drafter layer's keys and values [Hkv, capacity, hd] for one sequence: `length` committed rows,
    then the rows of the tree being drafted (rolled back by moving `length`, as the target's cache)."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int, device, dtype):
        attn = drafter.midlayer.self_attn
        shape = (attn.num_kv_heads, capacity, attn.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # committed rows
        self.used = 0  # committed + this step's tree rows

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.used + k.shape[-2]
        if end > self.keys.shape[1]:
            raise RuntimeError(f"EAGLE-3 draft cache overflow: {end} rows, capacity {self.keys.shape[1]}")
        self.keys[:, self.used:end] = k
        self.values[:, self.used:end] = v
        self.used = end
        return self.keys[:, :end], self.values[:, :end]

    def commit(self) -> None:
        """Keep every row appended so far (the context rows of the accepted positions)."""
        self.length = self.used

    def drop_uncommitted(self) -> None:
        self.used = self.length


register_drafter_kind("eagle3", partial(load_kind, "eagle3", Eagle3Drafter, WEIGHTS_FILE, ARCH_KEYS, check_config))
