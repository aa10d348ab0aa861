"""Stable fingerprints of a model's weights and of a tokenizer's vocabulary.

A drafter records the fingerprint of the target it was aligned to; loading it against anything else
is an error. The weight fingerprint must therefore not depend on where or how the target was loaded:
every value is rounded to bfloat16 before hashing, so the same checkpoint gives the same digest in
fp32 on CPU and in bf16 on CUDA. (An fp16 load rounds differently and gets a different digest.)

Per tensor it hashes the name, the shape and every (rounded) value, so any single changed weight
changes the digest; hashing the bf16 bytes of 135M parameters takes about half a second on one core.
"""

from __future__ import annotations

import hashlib
import json

import torch


def unique_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict in order, each storage once (tied embeddings appear under their first name)."""
    seen, tensors = set(), []
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors.append((name, tensor))
    return tensors


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's values as bytes; floating point values rounded to bfloat16 first."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.to(torch.bfloat16).view(torch.int16)  # numpy has no bfloat16: hash the bit patterns
    return memoryview(flat.cpu().contiguous().numpy()).cast("B")


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """Hex sha256 over names, shapes and values of the model's weights."""
    digest = hashlib.sha256()
    for name, tensor in unique_named_tensors(model):
        digest.update(f"{name}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Hex sha256 over the vocabulary (token, id) pairs and the special tokens; "none" for no tokenizer."""
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    special = sorted((str(token), tokenizer.convert_tokens_to_ids(str(token)))
                     for token in tokenizer.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def fingerprint_target(model: torch.nn.Module, tokenizer) -> str:
    """One hex digest of a target: its weights and its tokenizer."""
    combined = f"weights:{weights_fingerprint(model)}\ntokenizer:{tokenizer_fingerprint(tokenizer)}"
    return hashlib.sha256(combined.encode()).hexdigest()
