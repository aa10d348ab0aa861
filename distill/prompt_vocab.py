"""Training and judging a reduced draft head as the engine runs it with `prompt_vocab`.

With `prompt_vocab` the engine's `DraftModelProposer` gives a reduced head, per request, one more row for
every prompt token the head lacks: the drafter's input embedding of that token (`extend_head_by_prompt`).
A trainer that knows this can teach the drafter to copy from the prompt (the names and objects a GSM8K
answer takes from its question are 90% of the answer tokens an 8k head lacks); one that does not trains
those tokens out of the loss and judges the drafter without them.

Per row of a batch, the extension is that row's own prompt-only tokens, so the logits are

    [B, T, M + N]   M head rows, then N columns: row b's j-th prompt-only token (-inf past its own count)

and a target id maps to its head index, or to M + j where it is row b's j-th prompt-only token, or to the
absent column (`distill.batching.with_absent_column`) otherwise. The extra columns are hidden @ embedding,
as the engine scores them, so gradients reach those embedding rows.

A column opens at the first position whose input is its token (or everywhere when the row's window never
shows it: it was cut from the left). Answer positions follow the whole prompt, so there every column is
open, as in the engine; positions inside the prompt (the daemon's `prompt_weight`) see only the prompt
tokens read so far, so training there never draws on tokens the text has not reached yet.
"""

from __future__ import annotations

import torch

EXTRA_KEY = "extra_vocab"  # record key: the sorted target ids of its prompt that the head lacks


def prompt_only_tokens(prompt_ids: list[int], head_ids: set[int]) -> list[int]:
    """Sorted distinct prompt tokens that the reduced head lacks: the engine's per-request extension."""
    return sorted({int(t) for t in prompt_ids if int(t) not in head_ids})


def with_prompt_vocab(records: list[dict], vocab_map: torch.Tensor,
                      prompts: list[list[int]] | None = None) -> list[dict]:
    """Copies of `records` carrying EXTRA_KEY: the prompt-only tokens of each record's prompt (or of
    `prompts[i]`, the request's whole prompt when the record moved part of it to the response side)."""
    head_ids = set(vocab_map.tolist())
    prompts = prompts if prompts is not None else [r["prompt_ids"] for r in records]
    if len(prompts) != len(records):
        raise ValueError(f"with_prompt_vocab: {len(prompts)} prompts for {len(records)} records")
    return [{**r, EXTRA_KEY: prompt_only_tokens(p, head_ids)} for r, p in zip(records, prompts)]


def extra_id_matrix(extras: list[list[int]]) -> torch.Tensor:
    """[B, N] long: row b's prompt-only target ids, padded with -1 to the longest row (N >= 1)."""
    width = max(1, max((len(e) for e in extras), default=0))
    out = torch.full((len(extras), width), -1, dtype=torch.long)
    for b, ids in enumerate(extras):
        if ids:
            out[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def map_to_extended(ids: torch.Tensor, target_to_draft: torch.Tensor, extra_ids: torch.Tensor,
                    input_ids: torch.Tensor) -> torch.Tensor:
    """Target ids [B, T(, K)] -> indices into [M + N] extended logits; -1 where neither the head nor the
    row's prompt-only tokens hold the id. target_to_draft [V]: head index or -1; extra_ids [B, N] (-1 pad);
    input_ids [B, T], the text the positions read. An id maps to its column only where that column is open
    (`opened_columns`, as `extended_logits` masks it): before the text has read a prompt-only token its column
    is -inf, so a target id there is absent (its mass joins the tail bucket, its label leaves the loss)."""
    n_head = int(target_to_draft.max()) + 1
    mapped = target_to_draft[ids]
    opened = opened_columns(input_ids, extra_ids)  # [B, T, N]
    for b in range(extra_ids.shape[0]):
        for j, token in enumerate(extra_ids[b].tolist()):
            if token < 0:
                break
            is_open = opened[b, :, j] if ids.dim() == 2 else opened[b, :, j, None]  # [T(, 1)]
            mapped[b][(ids[b] == token) & is_open] = n_head + j
    return mapped


def extended_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    extra_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, M + N]: the reduced head's logits, then hidden @ input embedding of row b's prompt-only tokens
    (-inf in the padding columns and before a column's token is first read). The hidden state is the last one
    the model returns, after its final norm (the head's input in HF decoder models)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # [B, T, D]
    rows = model.get_input_embeddings().weight[extra_ids.clamp_min(0)]  # [B, N, D]
    extra = torch.einsum("btd,bnd->btn", hidden, rows.to(hidden.dtype))  # [B, T, N]
    closed = ~opened_columns(input_ids, extra_ids)  # [B, T, N]
    extra = extra.masked_fill(closed | (extra_ids < 0)[:, None, :], float("-inf"))
    return torch.cat([out.logits, extra.to(out.logits.dtype)], dim=-1)


def opened_columns(input_ids: torch.Tensor, extra_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, N] bool: row b's column j is open at position t once input_ids[b, :t + 1] holds its token, or
    at every position when the row never shows it (its window starts after it)."""
    hits = input_ids[:, :, None] == extra_ids[:, None, :]  # [B, T, N]
    return (hits.cumsum(1) > 0) | ~hits.any(1, keepdim=True)


def draft_logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """The logits a batch's indices refer to: [B, T, V_d], or [B, T, M + N] when it carries extra_ids."""
    if getattr(batch, "extra_ids", None) is None:
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return extended_logits(model, batch.input_ids, batch.attention_mask, batch.extra_ids)


def indices_to_target(indices: torch.Tensor, vocab_map: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
    """Draft indices [B, T] (head, then the row's extension) -> target ids [B, T]."""
    n_head = vocab_map.numel()
    head = vocab_map[indices.clamp_max(n_head - 1)]
    if extra_ids is None:
        return head
    extra = torch.gather(extra_ids, 1, (indices - n_head).clamp(0, extra_ids.shape[1] - 1))  # [B, T]
    return torch.where(indices < n_head, head, extra)
