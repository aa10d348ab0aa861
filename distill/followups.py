"""Second turns: the target's own answer, then a follow-up that asks to rework it, answered by the target again.

    follow_up_prompts(prompts, records, tokenizer, eos_ids, requests, share, seed) -> [Prompt]

A chat's second turn mostly rewrites, shortens, lists or continues what the first answer said: the answer is
in the context and much of it comes back. Single-turn teacher data never shows a drafter that, and a drafter
trained on it does not copy: on MT-bench's second turns (the default target's own first answers in the
context) a 2-gram lookup in the context names the target's next token at 0.59 of the positions, the GPU-trained
EAGLE-3 drafter at 0.45 (docs/journal.md, "Second turns"). These prompts give the teacher data such turns: for a
share of the training prompts, the conversation [their messages, the target's first answer (the greedy one,
else the first sample), a follow-up request] is answered by the target like any prompt (distill.teacher_data,
its own content-addressed cache).

The requests are generic reworking instructions (FOLLOW_UPS, or a file of one per line), written for this
project and sharing no text with any evaluation set. Which prompts get one, and which request, is a function
of (seed, prompt id): the same under any order of the prompts or number of processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from pathlib import Path

from specdistill.distill.prompts import Prompt

__all__ = ["FOLLOW_UPS", "follow_up_prompts", "load_follow_ups", "follow_up_id"]

FOLLOW_UPS = (
    "Rewrite your answer so that it is shorter.",
    "Please rewrite your previous answer in a more formal tone.",
    "Can you make your answer simpler, so that a child could understand it?",
    "Summarize your answer in a few sentences.",
    "Turn your answer into a bulleted list.",
    "Expand on your answer with more detail.",
    "Rewrite your answer as an email to a friend.",
    "Please repeat your answer, but fix any mistakes you find in it.",
    "Give your answer again with a short title at the top.",
    "Rewrite the first paragraph of your answer.",
    "Can you continue where you left off?",
    "Rewrite your answer in the first person.",
    "Make your answer more persuasive.",
    "Rewrite your answer without using any technical terms.",
    "Now add a conclusion to your answer.",
    "Please restate your answer as a numbered list of steps.",
    "Rewrite your answer in a friendlier tone.",
    "What is the most important point of your answer? Explain it in more depth.",
    "Rewrite your answer as a short story.",
    "Give me a shorter version of your answer, keeping the key facts.",
    "Now write the same answer for an expert audience.",
    "Please rewrite your answer with headings for each part.",
    "Can you explain your answer again with an example?",
    "Rewrite your answer so that each sentence is on its own line.",
)


def load_follow_ups(path: str | Path) -> list[str]:
    """Follow-up requests from a text file, one per line; blank lines and lines starting with # are skipped."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"follow_ups: no such file {file}")
    requests = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    requests = [r for r in requests if r and not r.startswith("#")]
    if not requests:
        raise ValueError(f"follow_ups: {file} holds no requests (one per line)")
    return requests


def follow_up_prompts(prompts: Sequence[Prompt], records: Sequence[dict], tokenizer, eos_ids: Collection[int],
                      requests: Sequence[str], share: float, seed: int = 0) -> list[Prompt]:
    """Second-turn prompts for about `share` of `prompts` that have a first answer in `records` (teacher-data
    rows: prompt_id, sample_idx 0, response_ids: the greedy answer when the data keeps one, else the first
    sample), in the prompts' order. A conversation's messages are the
    prompt's, the answer as an assistant turn (decoded without its EOS; an answer cut by max_new_tokens stays
    cut, as a served first turn would be) and the chosen request as a user turn."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"follow_up_share: must be in [0, 1], got {share}")
    if not requests:
        raise ValueError("follow_ups: no follow-up requests to choose from")
    answers = {r["prompt_id"]: list(r["response_ids"]) for r in records if r["sample_idx"] == 0}
    out = []
    for prompt in prompts:
        answer = answers.get(prompt.id)
        if answer is None or unit_hash(seed, prompt.id, "take") >= share:
            continue
        if answer and answer[-1] in eos_ids:
            answer = answer[:-1]
        text = tokenizer.decode(answer, skip_special_tokens=True).strip()
        if not text:
            continue  # an empty first answer has nothing to rework
        index = int(unit_hash(seed, prompt.id, "request") * len(requests))
        messages = [*prompt.messages, {"role": "assistant", "content": text},
                    {"role": "user", "content": requests[index]}]
        out.append(Prompt(id=follow_up_id(prompt.id, index), messages=messages))
    return out


def follow_up_id(prompt_id: str, request_index: int) -> str:
    return f"{prompt_id}>followup:{request_index}"


def unit_hash(seed: int, prompt_id: str, purpose: str) -> float:
    """A number in [0, 1) fixed by (seed, prompt id, purpose)."""
    digest = hashlib.sha256(f"{seed}\0{prompt_id}\0{purpose}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
