"""Teacher records -> padded training batches with the loss placed on response positions only.

A record is one target generation: prompt_ids, response_ids and optionally, per response token,
the target's top-k (ids, log-probs) of the distribution it was produced from and a loss weight
("weights", 1 where absent). The drafter reads prompt + response; the logit at position t predicts
token t + 1, so the response token j is predicted at position P - 1 + j, and that is where its label,
mask, top-k and weight go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.distill.prompt_vocab import EXTRA_KEY, extra_id_matrix, map_to_extended


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] 1 for real tokens
    labels: torch.Tensor  # [B, T] the target's next token (draft-vocabulary index when reduced), 0 where masked
    loss_mask: torch.Tensor  # [B, T] bool, True on positions predicting a response token
    topk_ids: torch.Tensor | None = None  # [B, T, K] target ids (draft-vocabulary index when reduced)
    topk_logprobs: torch.Tensor | None = None  # [B, T, K]
    weights: torch.Tensor | None = None  # [B, T] per-position loss weights (records' "weights"), 0 where masked
    extra_ids: torch.Tensor | None = None  # [B, N] row b's prompt-only target ids past a reduced head (-1 pad):
    #                                        labels and top-k index [M + N] extended logits (distill.prompt_vocab)

    def to(self, device) -> "Batch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**moved)


def batches_by_length(records: list[dict], batch_size: int) -> list[list[int]]:
    """Record indices in batches of similar length (prompt + response, shortest first): a right-padded
    batch costs a forward as wide as its longest row, and under a causal mask a real position's output does
    not depend on the padding after it, so grouping by length only saves time."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["response_ids"]))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def fit_to_length(prompt: list[int], response: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """Cut the response to leave room for at least one prompt token, then the prompt from the
    left (its end, next to the response, is what conditions the response)."""
    response = response[: max_len - 1]
    keep = max_len - len(response)
    return prompt[-keep:], response


def collate(records: list[dict], pad_id: int, max_len: int, target_to_draft: torch.Tensor | None = None,
            with_weights: bool = False) -> Batch:
    """records -> Batch; `target_to_draft` [V] maps target ids to a reduced head's indices (-1 = absent).
    Batch.weights ([B, T], on the response positions) comes from each record's "weights" list (one float
    per fitted response token; missing or None = all 1) when a record has that key or `with_weights`;
    positions that later leave the loss (labels outside a reduced head) keep their weight, the mask zeroes it.
    Records with "extra_vocab" (distill.prompt_vocab, reduced heads only) index a head extended per row."""
    fitted = [fit_to_length(list(r["prompt_ids"]), list(r["response_ids"]), max_len) for r in records]
    width = max(len(p) + len(r) for p, r in fitted)
    has_topk = "topk_ids" in records[0] and records[0]["topk_ids"] is not None
    k = len(records[0]["topk_ids"][0]) if has_topk and len(records[0]["topk_ids"]) else 0
    b = len(records)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    labels = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    topk_ids = torch.zeros(b, width, max(k, 1), dtype=torch.long) if has_topk else None
    topk_lp = torch.full((b, width, max(k, 1)), float("-inf")) if has_topk else None
    weights = torch.zeros(b, width) if with_weights or any("weights" in r for r in records) else None
    for i, ((prompt, response), record) in enumerate(zip(fitted, records)):
        seq = prompt + response
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        start = len(prompt) - 1  # the position that predicts response[0]
        span = slice(start, start + len(response))
        labels[i, span] = torch.tensor(response)
        loss_mask[i, span] = True
        if has_topk and response:
            topk_ids[i, span] = torch.tensor(record["topk_ids"][: len(response)], dtype=torch.long)
            topk_lp[i, span] = torch.tensor(record["topk_logprobs"][: len(response)], dtype=torch.float)
        if weights is not None:
            weights[i, span] = torch.tensor(response_weights(record, len(response), i), dtype=torch.float)
    batch = Batch(input_ids, attention, labels, loss_mask, topk_ids, topk_lp, weights)
    extras = [r.get(EXTRA_KEY) for r in records]
    if any(e is not None for e in extras):
        if target_to_draft is None:
            raise ValueError("records carry extra_vocab (a prompt-extended reduced head) but no target_to_draft map")
        batch.extra_ids = extra_id_matrix([e or [] for e in extras])
    return batch if target_to_draft is None else to_draft_vocab(batch, target_to_draft)


def response_weights(record: dict, n_response: int, row: int) -> list[float]:
    """A record's loss weights for its first n_response (fitted) response tokens; missing or None = 1."""
    weights = record.get("weights")
    weights = [1.0] * n_response if weights is None else list(weights)[:n_response]
    if len(weights) != n_response:
        raise ValueError(f"record {row}: {len(weights)} weights for {n_response} response tokens")
    return weights


def to_draft_vocab(batch: Batch, target_to_draft: torch.Tensor) -> Batch:
    """Express labels and top-k ids in a reduced head's indices. A label outside the reduced
    vocabulary cannot be predicted by the drafter: it leaves the loss (rare by construction).
    A top-k id outside it points at index n_draft, one past the head, where the trainer appends a
    -inf logit column (`with_absent_column`): both sides then give it no mass and the target's
    probability there joins the tail bucket. With batch.extra_ids, row b's prompt-only tokens index the
    columns after the head, so the absent index is M + N."""
    def mapped_ids(ids: torch.Tensor) -> torch.Tensor:
        if batch.extra_ids is None:
            return target_to_draft[ids]
        return map_to_extended(ids, target_to_draft, batch.extra_ids, batch.input_ids)

    labels = mapped_ids(batch.labels)
    loss_mask = batch.loss_mask & (labels >= 0)
    batch.labels = labels.clamp_min(0)
    batch.loss_mask = loss_mask
    if batch.topk_ids is not None:
        n_draft = int(target_to_draft.max()) + 1 + (0 if batch.extra_ids is None else batch.extra_ids.shape[1])
        mapped = mapped_ids(batch.topk_ids)
        batch.topk_logprobs = batch.topk_logprobs.masked_fill(mapped < 0, float("-inf"))
        batch.topk_ids = torch.where(mapped < 0, torch.full_like(mapped, n_draft), mapped)
    return batch


def with_absent_column(draft_logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V_d] -> [B, T, V_d + 1] with a -inf logit for target tokens outside a reduced head."""
    absent = draft_logits.new_full((*draft_logits.shape[:-1], 1), float("-inf"))
    return torch.cat([draft_logits, absent], dim=-1)
