"""A reduced draft vocabulary: the M target tokens the teacher data uses most.

A small drafter spends most of its time in its [V, D] head. Predicting only the tokens the target
actually emits cuts that cost; verification maps draft indices back to target ids exactly
(`vocab_map[i]` is the target id of draft index i), so losslessness is untouched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def count_response_tokens(records: Iterable[dict]) -> Counter:
    counts: Counter = Counter()
    for record in records:
        counts.update(record["response_ids"])
    return counts


def select_draft_vocab(counts: Counter, size: int, target_vocab: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties by id), `always` included, sorted: [M] long."""
    if not 0 < size <= target_vocab:
        raise ValueError(f"draft_vocab must be in [1, {target_vocab}], got {size}")
    chosen = [t for t in always if 0 <= t < target_vocab]
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    filler = (t for t in range(target_vocab) if t not in set(chosen))
    while len(chosen) < size:  # too little data to fill the head: pad with low ids, harmless
        chosen.append(next(filler))
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


def inverse_map(vocab_map: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[V] long: the draft index of each target id, -1 where the reduced head has none."""
    inverse = torch.full((target_vocab,), -1, dtype=torch.long)
    inverse[vocab_map] = torch.arange(vocab_map.numel())
    return inverse


def coverage(counts: Counter, vocab_map: torch.Tensor) -> float:
    """Fraction of response tokens the reduced head can predict."""
    total = sum(counts.values())
    kept = set(vocab_map.tolist())
    return sum(c for t, c in counts.items() if t in kept) / total if total else 0.0


def tokens_to_add(counts: Counter, vocab_map: torch.Tensor, max_new: int, min_count: int) -> torch.Tensor:
    """[N] long, N <= max_new: the most frequent target ids (ties by id) that the reduced head lacks and
    that occur at least `min_count` times, for a head that follows the traffic (the online daemon)."""
    kept = set(vocab_map.tolist())
    missing = [t for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_count and t not in kept]
    return torch.tensor(missing[:max(max_new, 0)], dtype=torch.long)
