"""Batched generation by the target through HF `generate`, shared by self-prompting and teacher data.

Every sampling knob is set explicitly, so that the model's own generation_config (top_k=50 by HF default,
repetition penalties) cannot silently change the distribution the drafter is taught.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence

import torch
from transformers import GenerationConfig

from specdistill.distill.feature_capture import FeatureStaging, LayerCapture, feed_last_tokens, stage_rows
from specdistill.models.hf_compat import output_cache
from specdistill.models.kernel_linear import GreedyHead, greedy_head_for, q41_for_inference
from specdistill.models.kernels import MAX_ROWS

__all__ = ["generate_batch", "cut_at_eos", "left_pad", "pad_token_id"]


def pad_token_id(tokenizer, eos_token_ids: Collection[int]) -> int:
    """The tokenizer's pad id, else an EOS id (padding is masked out and stripped either way)."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if not eos_token_ids:
        raise ValueError("the target's tokenizer has neither a pad token nor an EOS token")
    return min(eos_token_ids)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T]) with the sequences right-aligned."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("cannot generate from an empty batch or an empty prompt")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def cut_at_eos(tokens: Sequence[int], eos_token_ids: Collection[int]) -> list[int]:
    """Tokens up to and including the first EOS; all of them when there is none."""
    for i, tok in enumerate(tokens):
        if tok in eos_token_ids:
            return list(tokens[: i + 1])
    return list(tokens)


def generation_config(max_new_tokens: int, do_sample: bool, temperature: float, top_p: float,
                      pad_id: int, eos_token_ids: Collection[int]) -> GenerationConfig:
    sampling = dict(temperature=temperature, top_p=top_p, top_k=0) if do_sample else {}
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=do_sample, num_beams=1,
        repetition_penalty=1.0, pad_token_id=pad_id, eos_token_id=sorted(eos_token_ids), **sampling,
    )


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_id: int,
                   eos_token_ids: Collection[int], do_sample: bool = False, temperature: float = 1.0,
                   top_p: float = 1.0, staging: FeatureStaging | None = None) -> list[list[int]]:
    """New tokens per prompt, each cut after its first EOS (kept). Sampling draws from torch's global RNG
    (HF generate takes no generator): callers seed it, inside `torch.random.fork_rng` to leave theirs be.
    On CPU in fp32 the model generates through its packed inference copy (models.packed_linear), its exactly-Q4_1
    matrices (the default target's layers) on the Q4_1 kernel where it runs (models.kernel_linear); greedy runs read
    each token from the greedy head there (`ArgmaxLogits`: the same tokens, 1.14x faster; docs/journal.md, stop 50).
    staging: also stage every row's hidden states at staging.layers (distill.feature_capture), read off this
    generation's own forwards plus one of the last tokens; the tokens are the same either way."""
    device = next(model.parameters()).device
    greedy = None if do_sample or device.type != "cpu" else greedy_head_for(model.get_output_embeddings())
    model = q41_for_inference(model)
    input_ids, attention_mask = left_pad(prompts, pad_id, device)       # [B, T]
    config = generation_config(max_new_tokens, do_sample, temperature, top_p, pad_id, eos_token_ids)
    config.return_dict_in_generate = staging is not None  # the generation's cache, for feed_last_tokens
    with argmax_head(model, greedy), (LayerCapture(model, staging.layers) if staging else contextlib.nullcontext()) \
            as capture:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        if staging is not None:
            feed_last_tokens(model, out.sequences, attention_mask, output_cache(out))
            out = out.sequences
    new = out[:, input_ids.shape[1]:].tolist()                         # [B, <= max_new_tokens]
    responses = [cut_at_eos(row, eos_token_ids) for row in new]
    if staging is not None:
        stage_rows(staging, capture, prompts, responses, input_ids.shape[1])
    return responses


class ArgmaxLogits(torch.nn.Module):
    """An inference head whose logits keep each row's argmax alone (0 there, -inf elsewhere), taken by the greedy
    head (models.kernel_linear.GreedyHead: exactly the argmax of `head`'s logits, ties to the first, without computing
    them all): greedy decoding reads the same token from them as from `head`'s. Rows past MAX_ROWS, and a row the
    greedy head gives no token (a NaN), get `head`'s own logits."""

    def __init__(self, head: torch.nn.Module, greedy: GreedyHead, vocab_size: int):
        super().__init__()
        self.head, self.greedy, self.vocab_size = head, greedy, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., V]
        rows = x.reshape(-1, x.shape[-1])
        if not 1 <= rows.shape[0] <= MAX_ROWS or rows.dtype != torch.float32:
            return self.head(x)
        tokens, _ = self.greedy.tokens(rows)
        if bool((tokens < 0).any()):
            return self.head(x)
        logits = torch.full((rows.shape[0], self.vocab_size), float("-inf"))
        logits[torch.arange(rows.shape[0]), tokens] = 0.0
        return logits.view(*x.shape[:-1], self.vocab_size)


@contextlib.contextmanager
def argmax_head(model: torch.nn.Module, greedy: GreedyHead | None):
    """While open, `model`'s output head is an ArgmaxLogits over it (greedy generation only); None: unchanged."""
    if greedy is None:
        yield
        return
    head = model.get_output_embeddings()
    model.set_output_embeddings(ArgmaxLogits(head, greedy, head.out_features))
    try:
        yield
    finally:
        model.set_output_embeddings(head)
