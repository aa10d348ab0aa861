"""The target's top-k along logged sequences from the server that serves it (`teacher_backend: openai`): the online
daemon then needs no target forward of its own, the serving engine scores with the weights it serves.

One request per sequence to the OpenAI-compatible completions endpoint, in vLLM's extension for it: the sequence as
token ids, `prompt_logprobs: k` and `max_tokens: 1`. vLLM answers `choices[0].prompt_logprobs`, one entry per
position: None for the first token, then {token id: {"logprob", "rank", ...}} holding the k most likely next tokens
given the tokens before, plus the actual token when it is not among them. Entry p is the distribution that predicts
token p from tokens [0, p), so the positions distill.teacher_data.teacher_forced_topk scores for (context, scored)
are entries len(context) .. len(context) + len(scored) - 1. vLLM computes them from the raw logits (no temperature),
which is the distribution the daemon distils. Servers that do not know `prompt_logprobs` answer a 400 or leave it
out: both are a TeacherUnavailable naming what came back.
"""

from __future__ import annotations

from collections.abc import Sequence


class TeacherUnavailable(RuntimeError):
    """The scoring server did not give the log-probabilities asked for (down, refused, or no prompt_logprobs)."""


def prompt_logprobs_body(model: str, ids: Sequence[int], k: int) -> dict:
    return {"model": model, "prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": k}


def topk_rows(prompt_logprobs: list, start: int, count: int, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """([count][k] ids, [count][k] log-probs), most likely first, of entries start .. start + count - 1."""
    if len(prompt_logprobs) < start + count:
        raise TeacherUnavailable(f"prompt_logprobs has {len(prompt_logprobs)} entries, {start + count} needed")
    ids, logprobs = [], []
    for entry in prompt_logprobs[start:start + count]:
        if not entry:
            raise TeacherUnavailable("an empty prompt_logprobs entry where a distribution was expected")
        ranked = sorted(((float(v["logprob"]), int(t)) for t, v in entry.items()), key=lambda x: (-x[0], x[1]))[:k]
        ids.append([t for _, t in ranked])
        logprobs.append([lp for lp, _ in ranked])
    return ids, logprobs


class OpenAIScorer:
    """teacher_forced_topk's contract, answered by an OpenAI-compatible server (vLLM)."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"teacher_url {url!r} must be an http(s) URL")
        self.url = url.rstrip("/").removesuffix("/v1") + "/v1/completions"
        self.model = model
        import httpx  # the `serve` extra: only this backend needs it

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self.transport_error = httpx.HTTPError

    def __call__(self, contexts: Sequence[Sequence[int]], scored: Sequence[Sequence[int]],
                 k: int) -> list[tuple[list[list[int]], list[list[float]]]]:
        return [self.score_one(list(context), list(tokens), k) for context, tokens in zip(contexts, scored)]

    def score_one(self, context: list[int], tokens: list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
        try:
            response = self.client.post(self.url, json=prompt_logprobs_body(self.model, context + tokens, k))
        except self.transport_error as e:
            raise TeacherUnavailable(f"{self.url}: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise TeacherUnavailable(f"{self.url} answered {response.status_code}: {response.text[:300]}")
        choices = response.json().get("choices") or [{}]
        entries = choices[0].get("prompt_logprobs")
        if entries is None:
            raise TeacherUnavailable(f"{self.url} returned no prompt_logprobs (a server without vLLM's extension)")
        return topk_rows(entries, len(context), len(tokens), k)

    def close(self) -> None:
        self.client.close()
