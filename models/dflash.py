"""DFlash block drafters (Chen, Liang, Liu 2026, arXiv 2602.06036): a whole block drafted in ONE forward.

The target computed, at every verified position, hidden states at many layers. DFlash fuses several of them
(`target_layers`, spread from shallow to deep as the paper spreads them) into one context vector per position,
c_t = hidden_norm(fc([h_t^1; ...; h_t^K])), and runs a few Llama/Qwen3-style decoder layers over a BLOCK of
`block_size` positions that follows the last verified token:

    block row 0:       e(x_a)              the last verified token (the step's bonus token), at position a
    block rows 1..B-1: the mask embedding  at positions a + 1 .. a + B - 1, each predicting its own token

Every layer's attention reads, as keys and values, its own projections of the context c_t at every position
t < a (the target's features of the verified tokens: "KV injection") beside the block's own rows; within the
block the attention is bidirectional (a block is denoised at once, not causally). Row i's head gives the
distribution of x_{a+i} directly, with no sampled token fed back: all B - 1 drafts come from one forward.
The context is not updated through the layers (the same c_t enters every layer), so at decode time each
layer's context keys and values are computed once per verified position and kept in a cache (`DFlashCache`).

`DFlashDrafter.blocks` (training: many anchors per sequence, each a block over the context before it) and
`DFlashDrafter.block` (decoding: one block against the cache) share `DFlashLayer.project_context`,
`DFlashLayer.project_block` and `DFlashLayer.finish`; only how the keys are gathered differs, and tests pin the
two together.

The head covers the M draft tokens (`d2t`/`t2d` as EAGLE-3's, models.eagle3); the embedding is the target's,
frozen, not saved; the mask embedding is the drafter's own trained vector. Module names follow z-lab's DFlash
checkpoints (`fc`, `hidden_norm`, `layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `norm`), which
llama.cpp's converter reads (architecture `dflash`).

`target_layers` here are, as everywhere in this project (models.eagle3, decode.runner), the INPUTS of those
target layers (hidden_states[i]); DFlash's own `target_layer_ids` name layer OUTPUTS, i.e. ours minus one.

A drafter directory of kind `dflash`:
    manifest.json                config: ARCH_KEYS (+ the training config); extra: decoding options
    model/dflash.safetensors     the state dict above
"""

from __future__ import annotations

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

WEIGHTS_FILE = "dflash.safetensors"
MAX_BLOCK_SIZE = 32  # the paper trains 8-16; a CPU verifies a few rows for the price of one, not 32
MAX_LAYERS = 8
ARCH_KEYS = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "rms_norm_eps", "rope_theta", "draft_vocab_size", "vocab_size",
             "target_layers", "num_layers", "block_size")
DFLASH_INITS = ("random", "target_layers")


def default_target_layers(num_target_layers: int, count: int) -> list[int]:
    """The paper's choice: `count` layers spread evenly from the second layer's output to the output of layer
    L - 3 (z-lab's build_target_layer_ids), as layer INPUTS (+1): e.g. 30 layers, 3 of them -> [2, 15, 28]."""
    if count == 1:
        return [num_target_layers // 2 + 1]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (count - 1))) + 1 for i in range(count)]


def dflash_config(target_model: nn.Module, draft_vocab_size: int, num_layers: int = 1, block_size: int = 8,
                  target_layers: list[int] | None = None, intermediate_size: int = 0) -> dict:
    """The drafter's shape from the target's config (attention and MLP shapes, RoPE base) and DFlash's own:
    num_layers decoder layers, blocks of block_size rows, the fused target layers (default: the paper's, as
    many as the drafter has layers)."""
    count = target_model.config.get_text_config().num_hidden_layers
    layers = list(target_layers) if target_layers else default_target_layers(count, num_layers)
    config = {**target_shapes(target_model, draft_vocab_size, intermediate_size),
              "target_layers": [int(i) for i in layers], "num_layers": int(num_layers), "block_size": int(block_size)}
    check_config(config, count)
    return config


def check_config(config: dict, target_num_layers: int | None = None) -> None:
    """Errors that name the field (the training config's spelling, dflash.<key>)."""
    missing = [key for key in ARCH_KEYS if key not in config]
    if missing:
        raise ValueError(f"dflash config lacks {', '.join(missing)}")
    if not 2 <= config["block_size"] <= MAX_BLOCK_SIZE:
        raise ValueError(f"dflash.block_size: a block is the verified token and 1..{MAX_BLOCK_SIZE - 1} drafts, "
                         f"so 2..{MAX_BLOCK_SIZE}; got {config['block_size']}")
    if not 1 <= config["num_layers"] <= MAX_LAYERS:
        raise ValueError(f"dflash.layers: 1..{MAX_LAYERS} decoder layers, got {config['num_layers']}")
    layers = config["target_layers"]
    if not layers:
        raise ValueError("dflash.target_layers: at least one target layer to fuse")
    if target_num_layers is not None and not all(1 <= int(i) < target_num_layers for i in layers):
        raise ValueError(f"dflash.target_layers: {layers} out of range for a target of {target_num_layers} layers "
                         f"(1..{target_num_layers - 1}: the input of that layer, the output of the one before)")
    check_shapes(config, "dflash", "dflash.intermediate_size")


class DFlashAttention(nn.Module):
    """Qwen3's attention (per-head RMS norms on q and k), which DFlash's checkpoints and llama.cpp's `dflash`
    graph have; its keys and values are projected from the context as well as from the block."""

    def __init__(self, config: dict):
        super().__init__()
        d, hd, eps = config["hidden_size"], config["head_dim"], config["rms_norm_eps"]
        self.num_heads, self.num_kv_heads, self.head_dim = (config["num_attention_heads"],
                                                            config["num_key_value_heads"], hd)
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=eps)
        self.k_norm = nn.RMSNorm(hd, eps=eps)


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer whose attention keys are the context's and the block's."""

    def __init__(self, config: dict):
        super().__init__()
        d, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = SwiGLU(config)  # gate/up/down, as Llama's and Qwen3's
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)  # [hd / 2]

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, D] (already normed) -> k (normed, rotated), v [..., Hkv, T, hd]."""
        attn = self.self_attn
        k = attn.k_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim))  # [..., T, Hkv, hd]
        # under bf16 autocast (training) the projections arrive in bf16: normed in the norms' dtype, the fused kernel
        k = attn.k_norm(k.to(attn.k_norm.weight.dtype)).transpose(-3, -2)
        v = attn.v_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim)).transpose(-3, -2)
        cos, sin = rope_tables(self.inv_freq, positions, k.dtype)  # [..., 1, T, hd]
        return rotate(k, cos, sin), v

    def project_context(self, context: torch.Tensor, positions: torch.Tensor):
        """The fused target context c [..., T, D] at positions [..., T] -> its keys, values [..., Hkv, T, hd]
        (no input norm: hidden_norm normed it once for every layer, as DFlash does)."""
        return self.keys_values(context.to(self.input_layernorm.weight.dtype), positions)

    def project_block(self, hidden: torch.Tensor, positions: torch.Tensor):
        """The block's states [..., R, D] at positions [..., R] -> q [..., H, R, hd], k, v [..., Hkv, R, hd]."""
        attn = self.self_attn
        x = self.input_layernorm(hidden)
        q = attn.q_proj(x).unflatten(-1, (attn.num_heads, attn.head_dim))  # [..., R, H, hd]
        q = attn.q_norm(q.to(attn.q_norm.weight.dtype)).transpose(-3, -2)
        cos, sin = rope_tables(self.inv_freq, positions, q.dtype)
        k, v = self.keys_values(x, positions)
        return rotate(q, cos, sin), k, v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """hidden [..., R, D] (the residual) + attention output [..., H, R, hd] -> the layer's output [..., R, D]."""
        hidden = hidden + self.self_attn.o_proj(attended.transpose(-3, -2).flatten(-2))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [..., H, R, hd] over keys, values [..., Hkv, S, hd] where visible [..., R, S] -> [..., H, R, hd]."""
        groups = self.self_attn.num_heads // self.self_attn.num_kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=-3), values.repeat_interleave(groups, dim=-3)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible.unsqueeze(-3))


class DFlashDrafter(ReducedVocab, nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        check_config(config)
        self.config = dict(config)
        d, m = config["hidden_size"], config["draft_vocab_size"]
        self.fc = nn.Linear(len(config["target_layers"]) * config["target_hidden_size"], d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=config["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config["num_layers"]))
        self.norm = nn.RMSNorm(d, eps=config["rms_norm_eps"])
        self.lm_head = nn.Linear(d, m, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(d))  # [D]: what the block's rows 1..B-1 read
        self.register_buffer("d2t", torch.zeros(m, dtype=torch.long))  # draft index i -> target id i + d2t[i]
        self.register_buffer("t2d", torch.zeros(config["vocab_size"], dtype=torch.bool))  # [V] draftable

    @property
    def target_layers(self) -> list[int]:
        return list(self.config["target_layers"])

    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target layers' states [..., K x D_target] -> the context c [..., D]."""
        return self.hidden_norm(self.fc(features.to(self.norm.weight.dtype)).to(self.hidden_norm.weight.dtype))

    def block_inputs(self, first: torch.Tensor) -> torch.Tensor:
        """The embeddings of each block's verified token [..., D] -> the block's input rows [..., B, D]: that
        embedding, then the mask embedding B - 1 times."""
        first = first.to(self.mask_embedding.dtype)
        masks = self.mask_embedding.expand(*first.shape[:-1], self.block_size - 1, first.shape[-1])
        return torch.cat([first.unsqueeze(-2), masks], dim=-2)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The last layer's output [..., D] -> draft logits [..., M]."""
        return self.lm_head(self.norm(out))

    def blocks(self, features: torch.Tensor, first: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training: A blocks per sequence over the whole (right-padded) sequences.

        features [B, T, K x D_target] (the target's, at every position), first [B, A, D] the embedding of the
        token at each anchor, anchors [B, A] the positions a where the blocks start. Block (b, a) holds rows at
        positions a .. a + B - 1; its rows attend to the context at positions < a and to every row of their own
        block (no other block). Returns the last layer's outputs [B, A, B_size, D]."""
        b, t = features.shape[:2]
        a, size = anchors.shape[1], self.block_size
        context = self.fuse(features)  # [B, T, D]
        positions = (anchors[..., None] + torch.arange(size, device=anchors.device)).flatten(1)  # [B, A x Bs]
        hidden = self.block_inputs(first).flatten(1, 2)  # [B, A x Bs, D]
        before = torch.arange(t, device=anchors.device) < anchors[..., None]  # [B, A, T]: the context each sees
        to_context = before.repeat_interleave(size, dim=1)  # [B, A x Bs, T]
        block_of = torch.arange(a, device=anchors.device).repeat_interleave(size)  # [A x Bs]
        to_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, A x Bs, A x Bs]
        visible = torch.cat([to_context, to_block], dim=-1)  # [B, A x Bs, T + A x Bs]
        context_positions = torch.arange(t, device=anchors.device).expand(b, t)  # [B, T]
        for layer in self.layers:
            context_k, context_v = layer.project_context(context, context_positions)  # [B, Hkv, T, hd]
            q, k, v = layer.project_block(hidden, positions)  # [B, H, R, hd], [B, Hkv, R, hd]
            attended = layer.attend(q, torch.cat([context_k, k], dim=-2), torch.cat([context_v, v], dim=-2), visible)
            hidden = layer.finish(hidden, attended)  # [B, R, D]
        return hidden.unflatten(1, (a, size))

    def block(self, first: torch.Tensor, position: int, cache: "DFlashCache") -> torch.Tensor:
        """Decoding: one block after the cached context. first [D] the embedding of the last verified token,
        position its position (= cache.length: the context covers every position before it). Returns the last
        layer's outputs [B_size, D]; row i's head drafts the token at position + i. Nothing is cached."""
        if position != cache.length:
            raise RuntimeError(f"DFlash block at position {position} but the drafter's context holds {cache.length}")
        hidden = self.block_inputs(first)  # [Bs, D]
        positions = torch.arange(position, position + self.block_size, device=hidden.device)  # [Bs]
        visible = torch.ones(self.block_size, cache.length + self.block_size, dtype=torch.bool, device=hidden.device)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project_block(hidden, positions)  # [H, Bs, hd], [Hkv, Bs, hd]
            keys, values = cache.with_block(i, k, v)  # [Hkv, L + Bs, hd]
            hidden = layer.finish(hidden, layer.attend(q, keys, values, visible))
        return hidden

    def add_context(self, features: torch.Tensor, cache: "DFlashCache") -> None:
        """Decoding: the target's features [k, K x D_target] of the next k verified positions -> every layer's
        context keys and values, appended to the cache (committed)."""
        context = self.fuse(features)  # [k, D]
        positions = torch.arange(cache.length, cache.length + context.shape[0], device=context.device)  # [k]
        cache.append([layer.project_context(context, positions) for layer in self.layers])

    @classmethod
    def for_target(cls, target_model: nn.Module, vocab_map: torch.Tensor | None, num_layers: int = 1,
                   block_size: int = 8, target_layers: list[int] | None = None, seed: int = 0,
                   init: str = "random", intermediate_size: int = 0) -> "DFlashDrafter":
        """A fresh drafter for `target_model`: linears initialised as Llama's (normal, std 0.02, seeded), the head
        the target's own rows for the draft vocabulary, the final norm the target's, the mask embedding the mean
        of the target's input embeddings (a "typical token" to start from). init "target_layers": the layers
        start as the target's layers after its deepest fused one (`start_from_target_layers`)."""
        if init not in DFLASH_INITS:
            raise ValueError(f"dflash.init: one of {DFLASH_INITS}, got {init!r}")
        vocab_map = full_vocab_map(target_model, vocab_map)
        drafter = cls(dflash_config(target_model, vocab_map.numel(), num_layers, block_size, target_layers,
                                    intermediate_size))
        start_like_target(drafter, target_model, vocab_map, seed)
        with torch.no_grad():
            drafter.mask_embedding.copy_(target_model.get_input_embeddings().weight.detach().float().mean(0).cpu())
        if init == "target_layers":
            start_from_target_layers(drafter, target_model)
        drafter.set_vocab(vocab_map)
        return drafter.to(device=target_model.get_output_embeddings().weight.device)

    def save_pretrained(self, directory: str | Path) -> None:
        save_weights(self, directory, WEIGHTS_FILE)


@torch.no_grad()
def start_from_target_layers(drafter: DFlashDrafter, target_model: nn.Module) -> None:
    """Drafter layer i starts as the target's layer h + i, h the deepest fused layer (clipped to the last), and
    fc passes that layer's input through (its block of fc the identity, the others zero); hidden_norm is layer
    h's input norm. The first layer's context keys and values are then exactly what the target's layer h
    computed at those positions (before the q/k norms, which start at one): attention and MLP start from the
    target's own instead of noise. Weights only (a target's q/k/v biases are not carried)."""
    decoder_layers = target_model.get_decoder().layers
    high, d = drafter.target_layers[-1], drafter.config["hidden_size"]
    k = len(drafter.target_layers)
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, (k - 1) * d:].copy_(torch.eye(d))  # [D, K x D]: the deepest block passes through
    drafter.hidden_norm.weight.copy_(decoder_layers[high].input_layernorm.weight.detach().float().cpu())
    for i, layer in enumerate(drafter.layers):
        source = decoder_layers[min(high + i, len(decoder_layers) - 1)]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight.detach().float().cpu())
        copy_mlp(layer.mlp, source.mlp)
        layer.input_layernorm.weight.copy_(source.input_layernorm.weight.detach().float().cpu())
        layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight.detach().float().cpu())


class DFlashCache:
    """Every drafter layer's context keys and values [Hkv, capacity, hd] for one sequence: one row per verified
    position, committed as they come (the block's own rows are never cached: each step drafts a new block)."""

    def __init__(self, drafter: DFlashDrafter, capacity: int, device, dtype):
        attn = drafter.layers[0].self_attn
        shape = (len(drafter.layers), attn.num_kv_heads, capacity, attn.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = drafter.block_size
        self.length = 0  # context rows

    def append(self, per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """per_layer: each layer's (k, v) [Hkv, k, hd] of the next positions."""
        end = self.length + per_layer[0][0].shape[-2]
        if end + self.block_size > self.keys.shape[2]:
            raise RuntimeError(f"DFlash draft cache overflow: {end} rows and a block, capacity {self.keys.shape[2]}")
        for i, (k, v) in enumerate(per_layer):
            self.keys[i, :, self.length:end] = k
            self.values[i, :, self.length:end] = v
        self.length = end

    def with_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s context keys and values followed by the block's k, v [Hkv, Bs, hd] (written past the
        context, not committed) -> [Hkv, L + Bs, hd]."""
        end = self.length + k.shape[-2]
        self.keys[layer, :, self.length:end] = k
        self.values[layer, :, self.length:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]


register_drafter_kind("dflash", partial(load_kind, "dflash", DFlashDrafter, WEIGHTS_FILE, ARCH_KEYS, check_config))

__all__ = ["DFlashCache", "DFlashDrafter", "MAX_BLOCK_SIZE", "MAX_LAYERS", "check_config", "default_target_layers",
           "dflash_config"]
