"""A bounded replay buffer of served requests, scored by the target, that favours what the drafter gets wrong.

An entry is one logged request: its prompt and output token ids and the target's top-k distribution at
every output position, and at every prompt position after the first when the daemon learns from prompts
too (computed by the daemon, since logs carry tokens, not logits). Entries are drawn with probability
proportional to their priority, 1 + the number of output positions where the drafter's greedy token is
not the target's (refreshed after every update): requests the drafter already handles are drawn rarely,
not never. When full, the oldest entry goes first, so the buffer tracks live traffic.

A fixed fraction of requests (chosen by a hash of their id, so the choice survives restarts) is held out:
they are never trained on and the newest of them are the window a candidate drafter is judged on.

A training entry may also carry `samples`: the target's own sampled answers to the same prompt, with its
top-k along them (made by the daemon with `samples_per_request`). They are more in-domain text per request
the server saw, sequence-level KD on live prompts; `record(variant=j)` gives the j-th of them, 0 being the
logged output. They belong to their request: drawn, evicted and counted with it; held-out requests,
which judge the logged output, get none.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class Entry:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    topk_ids: list[list[int]]         # [R][K] target ids, most likely first
    topk_logprobs: list[list[float]]  # [R][K]
    max_new_tokens: int = 0           # the request's max_tokens (0 = unknown: the output length + 1)
    priority: float = 1.0
    prompt_topk_ids: list[list[int]] = field(default_factory=list)         # [P-1][K] predicting prompt[1:]
    prompt_topk_logprobs: list[list[float]] = field(default_factory=list)  # [P-1][K]
    samples: list[dict] = field(default_factory=list)  # the target's sampled answers: response_ids, topk_*

    @property
    def variants(self) -> int:
        """How many answers this entry trains on: the logged output and its samples."""
        return 1 + len(self.samples)

    def record(self, prompt_weight: float = 0.0, max_len: int = 0, variant: int = 0) -> dict:
        """The distill.batching record form. With prompt_weight > 0 (and the prompt's top-k scored), the
        positions predicting prompt tokens are taken as well, weighing prompt_weight against the output's 1:
        the prompt moves into the "response" side, keeping its newest positions when prompt + output would
        exceed max_len (the output is never cut for them). variant j >= 1 is the j-th sampled answer instead
        of the logged output, without the prompt's positions (the logged variant already carries them)."""
        if variant:
            sample = self.samples[variant - 1]
            return {"prompt_ids": self.prompt_ids, "response_ids": sample["response_ids"],
                    "topk_ids": sample["topk_ids"], "topk_logprobs": sample["topk_logprobs"]}
        if prompt_weight <= 0 or not self.prompt_topk_ids:
            return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "topk_ids": self.topk_ids,
                    "topk_logprobs": self.topk_logprobs}
        n_prompt = len(self.prompt_topk_ids)  # = len(prompt_ids) - 1
        room = max_len - 1 - len(self.response_ids) if max_len else n_prompt
        keep = max(0, min(n_prompt, room))
        start = n_prompt - keep             # prompt_ids[start + 1:] are predicted, from prompt_ids[:start + 1]
        return {"prompt_ids": self.prompt_ids[:start + 1],
                "response_ids": self.prompt_ids[start + 1:] + self.response_ids,
                "topk_ids": self.prompt_topk_ids[start:] + self.topk_ids,
                "topk_logprobs": self.prompt_topk_logprobs[start:] + self.topk_logprobs,
                "weights": [prompt_weight] * keep + [1.0] * len(self.response_ids)}


def is_held_out(request_id: str, every: int) -> bool:
    """Every `every`-th request by a hash of its id (stable across restarts); every <= 0 holds none out."""
    if every <= 0:
        return False
    return int(hashlib.sha1(request_id.encode()).hexdigest()[:8], 16) % every == 0


@dataclass
class ReplayBuffer:
    capacity: int                      # training entries kept
    holdout_capacity: int              # newest held-out entries kept
    train: "OrderedDict[str, Entry]" = field(default_factory=OrderedDict)
    holdout: deque = field(default_factory=deque)

    def __post_init__(self):
        if self.capacity < 1 or self.holdout_capacity < 0:
            raise ValueError(f"replay capacity must be >= 1 and holdout capacity >= 0, got {self.capacity}, "
                             f"{self.holdout_capacity}")

    def add(self, entry: Entry, held_out: bool) -> list[str]:
        """Insert; return the ids evicted to stay within capacity."""
        evicted = []
        if held_out:
            self.holdout.append(entry)
            while len(self.holdout) > self.holdout_capacity:
                evicted.append(self.holdout.popleft().id)
        else:
            self.train[entry.id] = entry
            while len(self.train) > self.capacity:
                evicted.append(self.train.popitem(last=False)[0])
        return evicted

    def __len__(self) -> int:
        return len(self.train)

    def ids(self) -> set[str]:
        return set(self.train) | {e.id for e in self.holdout}

    def sample(self, n: int, rng: random.Random) -> list[Entry]:
        """n training entries drawn with replacement, P(entry) proportional to its priority."""
        if not self.train:
            return []
        entries = list(self.train.values())
        return rng.choices(entries, weights=[e.priority for e in entries], k=n)


def mismatch_priority(drafter_tokens: list[int], target_tokens: list[int]) -> float:
    """1 + positions where the drafter's greedy token is not the target's."""
    return 1.0 + sum(int(d != t) for d, t in zip(drafter_tokens, target_tokens))
