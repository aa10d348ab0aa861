"""A DFlash drafter as the checkpoint llama.cpp's own converter reads: `python -m models.export DRAFTER --format
dflash --out DIR`, then `convert_hf_to_gguf.py DIR --target-model-dir DIR/target` gives a GGUF of architecture
`dflash` that `llama-server --spec-type draft-dflash` drafts with (decode.llamacpp_convert does both).

The layout is z-lab's DFlash checkpoint (models.dflash names its modules after it), with the two things ours has
that z-lab's do not, in the forms llama.cpp already reads from other exports:

- the reduced head: our `lm_head` [M, D] and `d2t` offsets, read by the converter's DSpark class (architecture
  `DSparkDraftModel`, no Markov head, so llama.cpp runs it as a plain DFlash drafter and scatters the M logits to
  the target ids; a full-vocabulary head is a plain `DFlashDraftModel`);
- the trained mask embedding: llama.cpp feeds a mask TOKEN to the block's rows 1..B-1, so the export names one
  (`mask_token_id`, default the vocabulary's last id, a padding or rare id no anchor is) and ships the target's
  input embedding with that row replaced by ours (`mask_embedding.pt`, which the converter patches in).

`target_layer_ids` are DFlash's (layer outputs): ours (layer inputs) minus one. The target's config and tokenizer
go to DIR/target, as for EAGLE-3 (models.export.write_target_files).

vLLM (`--format vllm`, speculative method `dflash`) loads the same files with one difference: its
`DFlashDraftModel` class (qwen3_dflash) takes the reduced head itself (`draft_vocab_size`, `d2t`) where its
`DSparkDraftModel` is another model family, so that export always names `DFlashDraftModel` (`engine="vllm"`). It
reads `mask_embedding.pt` in place of the mask token's row, as llama.cpp's converter does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdistill.models.dflash import DFlashDrafter

ARCH_FULL, ARCH_REDUCED = "DFlashDraftModel", "DSparkDraftModel"
ENGINES = ("llamacpp", "vllm")  # who reads the export: llama.cpp's converter, or vLLM's qwen3_dflash
MARKER = "specdistill_dflash_export"


def mask_token(target, requested: int | None) -> int:
    """The target id whose embedding row carries the mask embedding in the export: `requested`, else the last id;
    never an end-of-sequence id (the block's anchor row may be one only at the very end, but refuse it anyway)."""
    token = target.vocab_size - 1 if requested is None else int(requested)
    if not 0 <= token < target.vocab_size:
        raise ValueError(f"--mask-token-id {token}: outside the target's vocabulary of {target.vocab_size}")
    if token in set(target.eos_token_ids):
        raise ValueError(f"--mask-token-id {token}: an end-of-sequence id of the target; pick an unused id")
    return token


def dflash_hf_config(drafter: DFlashDrafter, target, mask_token_id: int, engine: str = "llamacpp") -> dict:
    """config.json for llama.cpp's converter or for vLLM (Qwen3 keys, DFlash's dflash_config); a reduced head is
    a DSpark class for the converter, DFlash's own class for vLLM (module docstring)."""
    c = drafter.config
    reduced = c["draft_vocab_size"] < c["vocab_size"] and engine == "llamacpp"
    text = target.model.config.get_text_config()
    return {
        "architectures": [ARCH_REDUCED if reduced else ARCH_FULL],
        "model_type": "qwen3",
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_layers"], "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"],
        "max_position_embeddings": getattr(text, "max_position_embeddings", 8192),
        "vocab_size": c["vocab_size"], "draft_vocab_size": c["draft_vocab_size"], "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float32", "sample_from_anchor": False, "markov_head_type": "vanilla",
        "dflash_config": {"mask_token_id": mask_token_id, "block_size": c["block_size"],
                          "target_layer_ids": [layer - 1 for layer in c["target_layers"]]},
        MARKER: True,
    }


def dflash_tensors(drafter: DFlashDrafter, target) -> dict[str, torch.Tensor]:
    """Our state dict under z-lab's names (the converter adds "model."), plus the target's input embedding that
    the mask row is patched into; no mask_embedding (mask_embedding.pt) and no t2d (the converter drops it)."""
    state = {name: t.detach().float().cpu().contiguous() for name, t in drafter.state_dict().items()
             if name not in ("mask_embedding", "t2d", "d2t")}
    state["d2t"] = drafter.d2t.detach().long().cpu().contiguous()
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().float().cpu().contiguous()
    return state


def export_dflash(drafter_path: str | Path, out: str | Path, target, *, mask_token_id: int | None = None,
                  engine: str = "llamacpp") -> Path:
    """Write the drafter at `drafter_path` (kind dflash, aligned to `target`) as llama.cpp's converter (engine
    "llamacpp") or vLLM (engine "vllm") reads it; atomic: `out` is either the finished export or unchanged."""
    from specdistill.models.drafters import load_drafter
    from specdistill.models.export import TARGET_DIR, check_out_dir, write_target_files

    if engine not in ENGINES:
        raise ValueError(f"dflash export engine {engine!r}: one of {', '.join(ENGINES)}")
    drafter_path, out = Path(drafter_path), check_out_dir(out, drafter_path)  # an earlier export is replaced
    loaded = load_drafter(drafter_path, target, device="cpu")  # refuses a drafter aligned to another target
    if loaded.kind != "dflash":
        raise ValueError(f"{drafter_path}: a drafter of kind {loaded.kind!r}; --format dflash exports dflash drafters")
    drafter = loaded.model.float()
    if drafter.config["hidden_size"] != target.model.get_input_embeddings().weight.shape[1]:
        raise ValueError("llama.cpp's dflash graph reads the target's embedding: the drafter's hidden_size must be "
                         "the target's")
    token = mask_token(target, mask_token_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(dflash_hf_config(drafter, target, token, engine), indent=2) + "\n")
        save_file(dflash_tensors(drafter, target), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save({"mask_token_id": token, "embedding": drafter.mask_embedding.detach().float().cpu().clone()},
                   tmp / "mask_embedding.pt")
        write_target_files(target, tmp / TARGET_DIR)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_dflash_export(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get(MARKER))
