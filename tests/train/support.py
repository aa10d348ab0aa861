"""Shared fixtures' makers for the self-drafting training tests: a peaked tiny target and its greedy records."""

from __future__ import annotations

import torch

from specdistill.models.target import target_from_model
from tests.conftest import make_tiny_llama
from tests.distill.conftest import make_tiny_tokenizer


def peaked_tiny_target(vocab_size: int, seed: int):
    """A tiny target with a clear greedy choice at every step (head scaled x40): learnable by small drafters."""
    model = make_tiny_llama(vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return target_from_model(model, make_tiny_tokenizer(), name="tiny")


def greedy_records(target, vocab_size: int, n: int = 40, new_tokens: int = 16) -> list[dict]:
    """n teacher-data records: seeded random prompts (ids 9..V-1) and the target's greedy answers."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(9, vocab_size, (4 + i % 5,), generator=gen).tolist()
        with torch.no_grad():
            ids = target.model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                        eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)
        out.append({"prompt_id": f"p{i}", "prompt_ids": prompt, "response_ids": ids[0, len(prompt):].tolist()})
    return out
