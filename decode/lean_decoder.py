"""The engine's hot path: a Llama-family decoder forward written for the speculative loop.

Why: at batch size 1 on the CPU the target's weights stream through packed GEMMs in about half of a
forward's time; the rest was transformers' module machinery, about 100 small tensor operations and
their Python dispatch per decoder layer (output capture hooks, mask interfaces, deprecation wrappers,
rotary broadcasting, separate q/k/v and gate/up projections). This forward computes the same layers
with about 30 operations each: q, k and v in one packed GEMM, gate and up in one, fused RMSNorm, the
rotary embedding for the forward's positions computed once for all layers, grouped-query attention
over the unrepeated key/value cache (the query heads of a group folded into rows, as decode.attention
does), and the inputs of the layers EAGLE-3 reads captured as they pass. docs/journal.md, "The engine's
own speed", has the measured gain (`benchmarks/engine.py`). On the CPU in fp32 the RMSNorms and the rotary
embedding are one call each into the kernel library (models.kernels: `rms_norm_rows`, and `rope_qk`, which reads
q and k from the fused projection's rows and writes them rotated in the attention's layout, bit for bit
transformers' RoPE): 1.15x a forward at 1-16 rows (docs/journal.md, stop 47). So is the attention of forwards of
up to MAX_ROWS rows under the engine's masks (`attention_rows`: each (head, row) alone over the keys it sees, where
torch's CPU flash attention spent about 60 us a layer on setup for one row; docs/journal.md, stop 49); prefill and other
masks keep torch's SDPA, and $SPECDISTILL_SDPA_ATTENTION switches the kernel off for comparisons. Where every
projection is on the library's FMA form, a layer's decode-time rows run in two library calls (`FusedLayer`: the same
functions in the same order as LeanLayer's Python, so the same bits; $SPECDISTILL_UNFUSED_LAYERS runs the Python).

It reads the model's own parameters (the fused projections are packed copies on the CPU and plain
concatenated linears on CUDA, rebuilt when the weights change, like models.packed_linear's), uses the model's
own rotary module (so RoPE scaling variants stay the model's) and the engine's SpecCache. It runs only where it
computes exactly what transformers' Llama forward does, up to float rounding: `lean_supported` checks the
architecture and the configuration (model type, projections, activation, no sliding window, packing available on
the CPU) and anything else runs transformers' decoder as before. The tests compare the two forwards' outputs and
greedy decodes. On CUDA it is also the computation decode.step_graphs records as CUDA graphs (its cache writes then
go to explicit slots, `slots`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter

import torch
import torch.nn.functional as F

from specdistill.models import kernels
from specdistill.models.gguf_blocks import ATTRIBUTE as KQUANT_ATTRIBUTE
from specdistill.models.huge_pages import huge_pages_unavailable
from specdistill.models.kernel_linear import KernelLinear, KQuantLinear, Q41Linear, kquant_segments, q41_or_packed
from specdistill.models.kernels import MAX_ROWS, amx_unavailable
from specdistill.models.packed_linear import (
    cached_copy,
    gemm_padding,
    packed_class,
    packing_supported,
    weights_signature,
)

log = logging.getLogger("specdistill.lean")

__all__ = ["LeanDecoder", "lean_decoder", "lean_supported"]

# decoder layers laid out and computed exactly as LlamaDecoderLayer; Qwen2's is that layer with q/k/v biases (carried
# by the fused projection's bias) and, where configured, sliding-window layers (refused: `sliding_window_used`)
LEAN_MODEL_TYPES = ("llama", "qwen2")
DISABLE_ENV = "SPECDISTILL_NO_LEAN_DECODER"  # switch for side-by-side measurements and as an escape hatch
SDPA_ENV = "SPECDISTILL_SDPA_ATTENTION"  # torch's SDPA in place of the library's attention (comparisons, escape hatch)
UNFUSED_ENV = "SPECDISTILL_UNFUSED_LAYERS"  # every layer through LeanLayer's Python, not FusedLayer (the same bits)

_cache: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, LeanDecoder]]" = weakref.WeakKeyDictionary()


def lean_supported(model: torch.nn.Module) -> str | None:
    """None when the lean forward computes what `model`'s decoder does, else why not (for the log)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"${DISABLE_ENV} is set"
    config = model.config.get_text_config()
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {LEAN_MODEL_TYPES}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (the lean forward computes silu)"
    if sliding_window_used(config) or getattr(config, "pretraining_tp", 1) != 1:
        return "sliding-window attention or pretraining_tp"
    decoder = model.get_decoder()
    if next(decoder.parameters()).device.type != "cuda" and not packing_supported(decoder):
        return "its weights are not fp32 on the CPU (there the lean forward runs on packed weights)"
    layer = decoder.layers[0]
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    for part in parts:
        module = layer.get_submodule(part)
        if type(module) is not torch.nn.Linear:
            return f"{part} is a {type(module).__name__}, not a plain Linear (an adapter?)"
    return None


def sliding_window_used(config) -> bool:
    """Whether any layer attends over a sliding window: Qwen2 configs carry a `sliding_window` size even where
    `use_sliding_window` is off and every layer type is full attention (Qwen2.5's), Llama's only when it applies."""
    if getattr(config, "model_type", None) == "qwen2":
        layer_types = getattr(config, "layer_types", None) or []
        return bool(getattr(config, "use_sliding_window", False)) or any(t != "full_attention" for t in layer_types)
    return bool(getattr(config, "sliding_window", None))


def lean_decoder(model: torch.nn.Module, weights: str) -> "LeanDecoder | None":
    """The lean forward of `model`'s decoder with linear weights in `weights` format, or None where
    lean_supported says no. Cached until the weights change."""
    if lean_supported(model) is not None:
        return None
    decoder = model.get_decoder()
    # the norms' weights are read in place; their identity joins the linears' signature
    key = (weights, gemm_padding(), kernels.unavailable(), amx_unavailable(), huge_pages_unavailable(), sdpa_asked(),
           unfused_asked(), weights_signature(decoder), tuple(p.data_ptr() for p in decoder.parameters()))
    return cached_copy(_cache, decoder, key, lambda: built_decoder(decoder, weights))


def built_decoder(decoder: torch.nn.Module, weights: str) -> "LeanDecoder":
    """LeanDecoder over `linear_class`'s matrices; on the CPU in fp32 it logs how many run on the Q4_1 kernel."""
    lean = LeanDecoder(decoder, linear_class(decoder, weights))
    if next(decoder.parameters()).device.type == "cpu" and weights == "float32":
        linears = [m for layer in lean.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        on_kquant = sum(isinstance(m, KQuantLinear) for m in linears)
        if on_kquant:
            log.info("fp32 layer GEMMs: the K-quant kernels for %d of %d matrices (the GGUF's own blocks)",
                     on_kquant, len(linears))
            return lean
        on_q41 = sum(isinstance(m, Q41Linear) for m in linears)
        reason = kernels.unavailable()
        if reason is None and on_q41 < len(linears):
            reason = "the others are not on a 4-bit grid of 32"
        forms = Counter(m.codes.form for m in linears if isinstance(m, Q41Linear))
        log.info("fp32 layer GEMMs: the Q4_1 kernel for %d of %d matrices%s%s", on_q41, len(linears),
                 f" ({reason})" if reason else "", "".join(f", {n} in its {form} form" for form, n in forms.items()))
    return lean


def linear_class(decoder: torch.nn.Module, weights: str):
    """What the fused projections become: on the CPU in fp32, the Q4_1 kernel's matrices where they are exactly
    Q4_1 (models.kernel_linear), else packed copies (models.packed_linear); on CUDA the fused nn.Linear itself
    (cuBLAS reads it as it is)."""
    if next(decoder.parameters()).device.type == "cuda":
        return lambda linear: linear
    if weights == "float32" and kernels.unavailable() is None:
        return q41_or_packed
    return packed_class(weights)


def fused_linear(linears: list[torch.nn.Linear], packed_class) -> torch.nn.Module:
    """One packed GEMM computing the outputs of `linears` (same input) side by side."""
    fused = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                            bias=linears[0].bias is not None, device="meta", dtype=linears[0].weight.dtype)
    fused.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    if fused.bias is not None:
        fused.bias = torch.nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    segments = [kquant_segments(m) for m in linears]
    if all(s is not None for s in segments):  # a K-quant GGUF's blocks, side by side as the weights are
        setattr(fused, KQUANT_ATTRIBUTE, [block for s in segments for block in s])
    return packed_class(fused)


class FusedLayer:
    """A LeanLayer's forward over at most MAX_ROWS rows after the committed prefix in two calls into the kernel
    library (models.kernels: `layer_rows_attention` up to the MLP's gate and up projections, `layer_rows_down`
    after torch's SiLU and product) instead of thirty-odd tensor operations: the same functions in the same order,
    so the same bits (tests compare them), about 1.5 ms less a forward of the default target on 2 cores
    (docs/journal.md, stop 49). Its keys and values go straight into the cache's rows. Where it runs: every
    projection on the FMA form (AMX hosts keep LeanLayer's Python: not measured there) or every projection over a
    K-quant GGUF's own blocks (KQuantLinear), the library's attention, no fixed-shape slots."""

    def __init__(self, layer: LeanLayer, work: torch.Tensor):
        self.lib, self.work = layer.native, work  # work: shared by a decoder's layers, sized by `work_floats`
        # the library's Q41Matrix or KQuantProjection of each projection, which the layer (this FusedLayer's owner)
        # keeps alive
        self.matrices = [m.matrix for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.norm_in, self.norm_post = layer.norm_in, layer.norm_post
        self.heads, self.kv_heads = layer.q_size // layer.head_dim, layer.kv_size // layer.head_dim
        self.head_dim, self.scaling, self.intermediate = layer.head_dim, layer.scaling, layer.intermediate

    @staticmethod
    def work_floats(layer: LeanLayer, hidden: int) -> int:
        """Scratch floats a call needs for MAX_ROWS rows (the library's layout: normed, qkv, q, k, attended)."""
        width = layer.q_size + 2 * layer.kv_size
        return MAX_ROWS * (hidden + width + layer.q_size + layer.kv_size + layer.q_size)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layer,
                 visible: torch.Tensor) -> torch.Tensor:
        """As LeanLayer.__call__ with `visible`: x [1, N, D] -> [1, N, D]."""
        n = x.shape[1]
        owner = cache_layer.owner
        start, keys, values = owner.length, cache_layer.keys, cache_layer.values  # [1, Hkv, max_len, hd]
        if start + n > owner.max_len:
            raise RuntimeError(f"KV cache overflow: {start + n} positions needed, {owner.max_len} allocated")
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        qkv, o, gate_up, down = self.matrices
        out, both = self.lib.layer_rows_attention(x, self.norm_in[0], self.norm_in[1], qkv, self.heads, self.kv_heads,
                                                  self.head_dim, cos, sin, keys[0], values[0], start, visible,
                                                  self.scaling, o, self.norm_post[0], self.norm_post[1], gate_up,
                                                  self.work)  # [1, N, D], [N, 2I]
        activated = F.silu(both[:, :self.intermediate]) * both[:, self.intermediate:]  # [N, I], as LeanLayer
        self.lib.layer_rows_down(out, activated, down, self.work)  # out += down(activated)
        return out


def direct_call(linear: torch.nn.Module):
    """What computes `linear` in the lean forward: a kernel matrix's `rows` (models.kernel_linear.KernelLinear: the
    same GEMM without nn.Module's dispatch, about 4 us a call, 120 calls a forward), else the module itself."""
    return linear.rows if isinstance(linear, (KernelLinear, KQuantLinear)) else linear


class LeanLayer:
    """One LlamaDecoderLayer's computation on packed weights."""

    def __init__(self, layer: torch.nn.Module, packed_class, native=None):
        attn, mlp = layer.self_attn, layer.mlp
        self.native = native  # the kernel library's RMSNorm and RoPE (`row_ops_library`), or None: torch's
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], packed_class)
        self.o = packed_class(attn.o_proj)
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj], packed_class)
        self.intermediate = mlp.gate_proj.out_features
        self.down = packed_class(mlp.down_proj)
        # what __call__ calls: straight into the kernel library where a projection is a kernel matrix (direct_call)
        self.project_qkv, self.project_o = direct_call(self.qkv), direct_call(self.o)
        self.project_gate_up, self.project_down = direct_call(self.gate_up), direct_call(self.down)
        self.norm_in = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm_post = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.fused: FusedLayer | None = None  # set by LeanDecoder where the layer runs in the library's two calls

    def fusable(self) -> bool:
        """Whether FusedLayer computes this layer: the library's row operations, and projections all FMA-form Q4_1
        (the default target) or all over a K-quant GGUF's own blocks (a real-size target)."""
        projections = (self.qkv, self.o, self.gate_up, self.down)
        return self.native is not None and (
            all(isinstance(m, Q41Linear) and m.codes.form == "fma" for m in projections)
            or all(isinstance(m, KQuantLinear) for m in projections))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layer,
                 mask: torch.Tensor | None, slots: torch.Tensor | None = None,
                 visible: torch.Tensor | None = None, spans: torch.Tensor | None = None) -> torch.Tensor:
        """x [1, N, D], cos/sin [1, 1, N, hd], mask [1, 1, G*N, T] (tiled for the groups) -> [1, N, D].
        slots [N]: the cache positions to write (a fixed-shape step, decode.step_graphs; several sequences in one
        cache, decode.batch_generation); None: after the committed prefix. visible [N, T] bool, where the kernel
        library runs: the same mask as keys each row sees, for its attention kernel (`mask` is then not read).
        spans [N, 2] int64, where the kernel library runs: row n sees the cache's keys [spans[n, 0], spans[n, 1])
        and nothing else (`attention_spans`; `mask` and `visible` are then not read)."""
        n = x.shape[1]
        if self.fused is not None and visible is not None and slots is None and cache_layer.is_initialized:
            return self.fused(x, cos, sin, cache_layer, visible)  # n <= MAX_ROWS: visible is given only then
        qkv = self.project_qkv(self.rms_norm(x, self.norm_in))  # [1, N, (H + 2 Hkv) hd]
        v = qkv[..., self.q_size + self.kv_size:].view(1, n, -1, self.head_dim).transpose(1, 2)  # [1, Hkv, N, hd]
        if self.native is not None:
            q, k = self.native.rope_qk(qkv.contiguous(), self.q_size // self.head_dim, self.kv_size // self.head_dim,
                                       self.head_dim, cos.contiguous(), sin.contiguous())
            q, k = q[None], k[None]  # [1, H, N, hd], [1, Hkv, N, hd]
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(1, n, -1, self.head_dim).transpose(1, 2)  # [1, H, N, hd]
            k = k.view(1, n, -1, self.head_dim).transpose(1, 2)  # [1, Hkv, N, hd]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # [1, Hkv, T, hd]
        keys, values = cache_layer.update(k, v) if slots is None else cache_layer.write(k, v, slots)
        if spans is not None:
            out = self.native.attention_spans(q[0], keys[0], values[0], spans, self.scaling)[None]  # [1, N, H*hd]
        elif visible is not None:
            out = self.native.attention_rows(q[0], keys[0], values[0], visible.contiguous(),
                                              self.scaling)[None]  # [1, N, H*hd]
        else:
            out = self.sdpa(q, keys, values, mask)
        x = x + self.project_o(out)
        both = self.project_gate_up(self.rms_norm(x, self.norm_post))  # [1, N, 2I]
        gate, up = both.split([self.intermediate, self.intermediate], dim=-1)
        return x + self.project_down(F.silu(gate) * up)

    def sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [1, H, N, hd], keys/values [1, Hkv, T, hd], mask [1, 1, G*N, T] -> [1, N, H*hd], by torch's SDPA with
        each group's query heads folded into rows."""
        heads, kv_heads, n = q.shape[1], keys.shape[1], q.shape[2]
        folded = q.reshape(1, kv_heads, heads // kv_heads * n, self.head_dim)  # row g*N + i: head hkv*G + g
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=self.scaling)
        return out.reshape(1, heads, n, self.head_dim).transpose(1, 2).reshape(1, n, -1)

    def rms_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        return rms_norm_rows_or_torch(self.native, x, norm)


def rms_norm_rows_or_torch(native, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """F.rms_norm over the last dimension with norm = (weight, eps): in one kernel call where `native` is the
    kernel library (a few ulps from torch's order), else torch's."""
    if native is None:
        return F.rms_norm(x, x.shape[-1:], *norm)
    return native.rms_norm_rows(x.contiguous(), *norm)


def row_ops_library(decoder: torch.nn.Module, hidden: int, head_dim: int):
    """The kernel library for the lean forward's RMSNorm and RoPE where they apply (fp32 on the CPU, the kernel
    available, hidden a multiple of 16 and head_dim of 32), else None (torch's operations)."""
    param = next(decoder.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32 or hidden % 16 or head_dim % 32:
        return None
    return kernels.library()


def sdpa_asked() -> bool:
    """$SPECDISTILL_SDPA_ATTENTION set: the lean forwards attend with torch's SDPA, not the library's kernel."""
    return os.environ.get(SDPA_ENV, "") not in ("", "0")


def unfused_asked() -> bool:
    """$SPECDISTILL_UNFUSED_LAYERS set: every layer through LeanLayer's Python (comparisons, escape hatch)."""
    return os.environ.get(UNFUSED_ENV, "") not in ("", "0")


def kernel_visibility(mask: torch.Tensor) -> torch.Tensor | None:
    """The keys each row sees, [N, T] bool, for the kernel library's attention (`attention_rows`): from an additive mask
    [1, 1, N, T] of the engine's kind (decode.tree.attention_bias: 0 where a row sees a key, the dtype's most
    negative value where not) over at most MAX_ROWS rows, else None (longer forwards, prefill, and any other mask
    go to torch's SDPA)."""
    rows = mask[0, 0]
    if rows.shape[0] > MAX_ROWS or mask.shape[:2] != (1, 1):
        return None
    visible = rows == 0
    if not bool((visible | (rows == torch.finfo(rows.dtype).min)).all()):
        return None
    return visible


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanDecoder:
    """A Llama-family decoder's forward over a SpecCache (see the module docstring)."""

    def __init__(self, decoder: torch.nn.Module, packed_class):
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        config = decoder.config
        self.native = row_ops_library(decoder, config.hidden_size, decoder.layers[0].self_attn.head_dim)
        self.layers = [LeanLayer(layer, packed_class, self.native) for layer in decoder.layers]
        # decode-time attention in the library too (models.kernels' attention_rows) where its head size fits
        self.kernel_attention = self.native is not None and self.layers[0].head_dim <= 256 and not sdpa_asked()
        if self.kernel_attention and not unfused_asked() and all(
                layer.fusable() for layer in self.layers):  # each layer's rows in two library calls (FusedLayer)
            work = torch.empty(max(FusedLayer.work_floats(layer, config.hidden_size) for layer in self.layers))
            for layer in self.layers:
                layer.fused = FusedLayer(layer, work)
        self.norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None)
                                                     or config.num_attention_heads)

    def __call__(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, mask: torch.Tensor,
                 position_ids: torch.Tensor, cache, feature_layers: list[int], slots: torch.Tensor | None = None,
                 spans: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [1, N] (or inputs_embeds [1, N, D]), mask [1, 1, N, T] additive, position_ids [1, N]
        -> (the final normed hidden states [1, N, D], the inputs of `feature_layers`, each [1, N, D]).
        slots [N]: where the rows' keys and values go; spans [N, 2]: the keys each row sees, in place of `mask`
        (None then; see LeanLayer: only where the kernel library's attention runs, `kernel_attention`)."""
        if spans is not None and (slots is None or not self.kernel_attention):
            raise ValueError("spans need slots to write to and the kernel library's attention (kernel_attention)")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary_emb(x, position_ids)  # [1, N, hd] each
        cos, sin = cos[:, None], sin[:, None]
        visible = kernel_visibility(mask) if self.kernel_attention and spans is None else None  # [N, T] bool, or None
        grouped = None if visible is not None or spans is not None else \
            mask.repeat(1, 1, self.groups, 1) if self.groups > 1 else mask
        wanted, features = set(feature_layers), {}
        for index, layer in enumerate(self.layers):
            if index in wanted:
                features[index] = x
            x = layer(x, cos, sin, cache.layers[index], grouped, slots, visible, spans)
        return rms_norm_rows_or_torch(self.native, x, self.norm), [features[i] for i in feature_layers]
