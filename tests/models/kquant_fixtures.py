"""Random K-quant blocks, tiny K-quant targets and their GGUF files, for the K-quant tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdistill.models.gguf_blocks import ATTRIBUTE
from specdistill.models.kquant import BLOCK_BYTES, BLOCK_WEIGHTS, SUPER, KQuantBlocks, dequantize


def random_blocks(kind: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> KQuantBlocks:
    """[n, k] of valid `kind` blocks: random codes and scales, fp16 steps sized for weights of about 0.1 * scale."""
    g = torch.Generator().manual_seed(seed)
    per = BLOCK_WEIGHTS[kind]
    raw = torch.randint(0, 256, (n, k // per, BLOCK_BYTES[kind]), generator=g, dtype=torch.uint8)
    if kind in ("Q5_0", "Q8_0"):  # w = d * code, |code| <= 16 or 128
        steps = torch.rand(n, k // per, 1, generator=g) * (6e-3 if kind == "Q5_0" else 8e-4) * scale
        raw[..., 0:2] = steps.half().view(torch.uint8).reshape(n, k // per, 2)
    elif kind == "Q4_K":  # w = d sc q - dmin m, sc, m < 64, q < 16
        steps = torch.rand(n, k // SUPER, 2, generator=g) * torch.tensor([3e-4, 2e-4]) * scale
        raw[..., 0:4] = steps.half().view(torch.uint8).reshape(n, k // SUPER, 4)
    else:  # w = d sc (q - 32), |sc| <= 128, |q - 32| <= 32
        steps = (torch.rand(n, k // SUPER, 1, generator=g) * 4e-5 + 1e-5) * scale
        raw[..., 208:210] = steps.half().view(torch.uint8).reshape(n, k // SUPER, 2)
    return KQuantBlocks(kind, raw.reshape(n, -1))


def write_gguf(path: Path, architecture: str, tensors: dict[str, KQuantBlocks]) -> Path:
    """A GGUF file holding `tensors` (llama.cpp's names) as raw K-quant blocks: what attach_kquant_blocks reads."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    for name, blocks in tensors.items():
        writer.add_tensor(name, blocks.raw.numpy().astype(np.uint8),
                          raw_dtype=GGMLQuantizationType[blocks.kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def make_tiny_kquant_qwen2(seed: int = 0, layers: int = 2, int8_parts: bool = False):
    """A seeded Qwen2 of the shapes the K-quant kernels take (hidden 256, intermediate 512, head_dim 64, GQA 4/2,
    untied head, non-zero q/k/v biases) whose every linear is exactly K-quant blocks: Q4_K, with Q6_K for v and
    down in odd layers and for the head, as a Q4_K_M file mixes them; `int8_parts`: v Q8_0 and down Q5_0 in even
    layers, as the 0.5B's file mixes them. Returns (model, {gguf name: blocks})."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    tensors: dict[str, KQuantBlocks] = {}
    modules = dict(model.named_modules())
    names = {f"model.layers.{i}.{hf}": f"blk.{i}.{short}" for i in range(layers)
             for hf, short in LAYER_TENSORS.items()}
    names["lm_head"] = "output"
    with torch.no_grad():
        for index, (hf, gguf_name) in enumerate(names.items()):
            linear = modules[hf]
            blocks = random_blocks(tiny_kind(hf, gguf_name, int8_parts), linear.out_features, linear.in_features,
                                   seed=seed * 1000 + index, scale=8.0 if hf == "lm_head" else 1.0)
            linear.weight.copy_(dequantize(blocks))
            tensors[f"{gguf_name}.weight"] = blocks
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model, tensors


def tiny_kind(hf: str, gguf_name: str, int8_parts: bool) -> str:
    """The format make_tiny_kquant_qwen2 gives a linear (see there)."""
    if hf == "lm_head":
        return "Q6_K"
    short, odd_layer = gguf_name.split(".")[-1], int(hf.split(".")[2]) % 2 == 1
    if short not in ("attn_v", "ffn_down"):
        return "Q4_K"
    if odd_layer:
        return "Q6_K"
    return ("Q8_0" if short == "attn_v" else "Q5_0") if int8_parts else "Q4_K"


def attach_directly(model, tensors: dict[str, KQuantBlocks]) -> None:
    """Set every linear's blocks as models.gguf_blocks would (for tests that do not go through a file)."""
    from specdistill.models.gguf_blocks import module_name

    modules = dict(model.named_modules())
    for name, blocks in tensors.items():
        setattr(modules[module_name(name)], ATTRIBUTE, [blocks])
