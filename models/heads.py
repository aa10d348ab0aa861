"""Output-head surgery for drafters."""

from __future__ import annotations

import torch


def reduce_head(model: torch.nn.Module, vocab_map: torch.Tensor) -> torch.nn.Module:
    """Replace the model's [V, D] output head by the [M, D] rows of `vocab_map` (copied, untied from
    the input embeddings, which keep the full vocabulary). Returns the model, changed in place."""
    head = model.get_output_embeddings()
    rows = head.weight.detach()[vocab_map.to(head.weight.device)].clone()  # [M, D]
    reduced = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    with torch.no_grad():
        reduced.weight.copy_(rows)
    model.set_output_embeddings(reduced)
    model.config.tie_word_embeddings = False
    text_config = model.config.get_text_config()
    text_config.tie_word_embeddings = False
    return model
