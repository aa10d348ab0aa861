"""A GGUF target's own quantized blocks (K-quants, and the Q8_0 / Q5_0 a small model mixes in), found again for
the model loaded from its conversion (models.gguf_convert), so that the engine computes its matrices from the
file's 1.0 GB of blocks rather than its 7.1 GB of fp32 weights.

`attach_kquant_blocks(model, gguf_file)` reads the file's Q4_K, Q6_K, Q8_0 and Q5_0 tensors, finds the nn.Linear
each one is (llama.cpp's tensor names, `HF_NAMES`; a Llama file's q and k rows permuted back as transformers' loader
does), checks that the blocks dequantize to exactly that linear's weights (a single differing weight and the matrix
keeps its fp32 path, with a WARNING naming it), and sets `linear.kquant_blocks = [KQuantBlocks]`. The engine's choice of
kernel reads that attribute (models.kernel_linear.kquant_segments). The model's parameters are not touched.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from specdistill.models.cache import MARKER
from specdistill.models.kquant import BLOCK_BYTES, BLOCK_WEIGHTS, KQuantBlocks, dequantize
from specdistill.models.quant_formats import INT8_OUTPUT_BLOCK

log = logging.getLogger("specdistill.kernels")

ATTRIBUTE = "kquant_blocks"
HF_NAMES = {  # llama.cpp's tensor name (without ".weight") -> transformers' module, {i} the layer
    "output": "lm_head",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
PERMUTED = ("attn_q", "attn_k")  # llama.cpp's converter permutes these rows for Llama models (rope layout)


def module_name(tensor_name: str) -> str | None:
    """llama.cpp's "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj"; None for anything else."""
    stem = tensor_name.removesuffix(".weight")
    layer = re.match(r"blk\.(\d+)\.(.+)$", stem)
    key = f"blk.{{i}}.{layer.group(2)}" if layer else stem
    pattern = HF_NAMES.get(key)
    return None if pattern is None else pattern.format(i=layer.group(1) if layer else "")


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row permutation transformers applies to a Llama GGUF's q or k matrix (its reverse_permute_weights):
    row i of the model is row order[i] of the file."""
    index = torch.arange(rows)
    return index.reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def file_blocks(tensor) -> KQuantBlocks:
    """A GGUFReader tensor of a K-quant type -> KQuantBlocks [N, K/256 * bytes] (copied out of the memory map)."""
    kind = tensor.tensor_type.name
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
    return KQuantBlocks(kind, raw.reshape(raw.shape[0], -1))


def heads_for(model: torch.nn.Module, short: str) -> int:
    config = model.config.get_text_config()
    return config.num_attention_heads if short == "attn_q" else config.num_key_value_heads


def gguf_source(directory: Path) -> Path | None:
    """The GGUF file a cached conversion was made from, as its marker records it (models.cache), or None: no
    marker, or a bare file name (the embedded default's, a Q4_1 file not kept after its conversion)."""
    marker = Path(directory) / MARKER
    if not marker.is_file():
        return None
    source = json.loads(marker.read_text())
    source = Path(str(source.get("gguf") or source.get("source") or ""))
    return source if source.is_absolute() and source.suffix == ".gguf" else None


def attach_kquant_blocks(model: torch.nn.Module, gguf_file: str | Path) -> dict[str, int]:
    """Attach each quantized tensor of `gguf_file` to the model's linear it is exactly (see the module docstring),
    where the file holds Q4_K or Q6_K tensors (a K-quant file: its Q8_0 and Q5_0 tensors then join them; a Q4_1 file
    such as the default target's keeps its exact Q4_1 / Q8_0 kernels, nothing attached). A file that cannot be read
    as a GGUF attaches nothing, with a WARNING. Returns {"attached": n, "differing": n, "unmatched": n}."""
    from gguf import GGUFReader

    counts = {"attached": 0, "differing": 0, "unmatched": 0}
    try:
        reader = GGUFReader(str(gguf_file))
    except (ValueError, OSError) as err:
        log.warning("%s cannot be read as a GGUF file (%s): its matrices run in fp32", gguf_file, err)
        return counts
    if not any(t.tensor_type.name in ("Q4_K", "Q6_K") for t in reader.tensors):
        return counts
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    modules = dict(model.named_modules())
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in BLOCK_BYTES:
            continue
        linear = modules.get(module_name(tensor.name) or "")
        if not isinstance(linear, torch.nn.Linear):
            counts["unmatched"] += tensor.name != "token_embd.weight"  # the embedding is a lookup, not a GEMM
            continue
        blocks = file_blocks(tensor)
        short = tensor.name.split(".")[-2]
        if architecture == "llama" and short in PERMUTED:
            order = llama_row_order(blocks.raw.shape[0], heads_for(model, short))
            blocks = KQuantBlocks(blocks.kind, blocks.raw[order].contiguous())
        if not torch.equal(dequantize(blocks), linear.weight.detach().float()):
            log.warning("%s: its %s blocks do not dequantize to %s's weights; that matrix stays on fp32",
                        tensor.name, blocks.kind, module_name(tensor.name))
            counts["differing"] += 1
            continue
        setattr(linear, ATTRIBUTE, [blocks])
        counts["attached"] += 1
    log.info("K-quant blocks of %s: %d matrices attached, %d differing, %d without a linear", Path(gguf_file).name,
             counts["attached"], counts["differing"], counts["unmatched"])
    return counts


def attach_q8_0_blocks(model: torch.nn.Module) -> int:
    """Round each fp32 CPU nn.Linear of `model` whose rows and columns are whole blocks of 32 (the int8 kernel's
    Q8_0 form) to Q8_0 with gguf-py's quantizer, as llama.cpp's `llama-quantize` would, and attach those blocks
    (`linear.kquant_blocks`): the engine then computes it on the int8 kernel, at a quarter of fp32's bytes. Unlike
    `attach_kquant_blocks` this changes the model: each weight becomes its Q8_0 value (dequantized), so every path,
    kernel or not, computes the same model. For a draft model trained from a K-quant sibling (its own blocks stale
    once it trained): only which tokens it proposes can change, never what the target keeps. Returns how many."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rounded = 0
    for linear in model.modules():
        w = getattr(linear, "weight", None)
        if (not isinstance(linear, torch.nn.Linear) or w.dtype != torch.float32 or w.device.type != "cpu"
                or w.shape[0] % INT8_OUTPUT_BLOCK or w.shape[1] % BLOCK_WEIGHTS["Q8_0"]):
            continue
        raw = quantize(w.detach().numpy(), GGMLQuantizationType.Q8_0)  # uint8 [N, K / 32 * 34]
        blocks = KQuantBlocks("Q8_0", torch.from_numpy(raw))
        with torch.no_grad():
            w.copy_(dequantize(blocks))
        setattr(linear, ATTRIBUTE, [blocks])
        rounded += 1
    return rounded
