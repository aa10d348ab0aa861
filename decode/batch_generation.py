"""Greedy answers to many prompts from the engine's own forward, decoded side by side (continuous batching).

Why: transformers' `generate` pads every batch to its longest prompt, keeps a finished row in every step until the
batch's longest answer ends, and spends about half of a 16-row decode step of the 1.5B target around the GEMMs
(docs/results.md, "Teacher generation, where its time goes"). The teacher data of a drafter is greedy decoding of
thousands of prompts: the one job on this CPU where many rows per forward come for free.

How: each prompt is prefilled alone by the engine (decode.runner.ModelRunner, the decoding loop's own prefill) and
its keys and values are copied into a span of one shared cache (the arena: up to `max_batch` sequences, each in the
positions its prompt and longest answer need). Each step is then one forward with one row per sequence still
answering: the row writes its key and value at its span's next slot and attends to its own span's keys alone (the
kernel library's `attention_spans`). A sequence leaves as soon as it ends (EOS or max_new_tokens) and the next
prompt takes its place: no padding, no row after an answer's end.

Every row's numbers are the ones plain decoding of its prompt alone computes (the layer GEMMs compute each row alike
whatever the row count; the attention reads the same keys in the same order), so the answers are the engine's
plain greedy decodes token for token (tests/decode/test_batch_generation.py checks it against
decode.engine.SpeculativeEngine). With `staging`, each row's hidden states are kept as they pass (the inputs of the
drafter's layers and the final normed state, as decoding computes them), the last token of each answer is fed once
more for its own, and each record is staged (`staging.put`: distill.feature_capture's FeatureStaging) when its
sequence leaves. The teacher data's built-in backend calls it (distill.teacher_data, handed it by train/: decode and
distill never import each other).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from specdistill.decode.kv_cache import SpecCache
from specdistill.decode.runner import ModelRunner
from specdistill.models.kernels import MAX_ROWS

__all__ = ["batch_generation_unavailable", "generate_greedy_together"]


def batch_generation_unavailable(model: torch.nn.Module) -> str | None:
    """None where generate_greedy_together runs `model` (the engine's lean forward with the kernel library's
    attention: a Llama-family target on this CPU), else why not."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"the target is {param.dtype} on {param.device.type}: the kernel library's attention is the CPU's, fp32"
    return unavailable_on(ModelRunner(model, static_shapes=False))


def unavailable_on(runner: ModelRunner) -> str | None:
    if runner.lean is None:
        return "the engine's lean forward does not run this target (decode.lean_decoder.lean_supported)"
    if not runner.lean.kernel_attention:
        return "the kernel library's attention is not available here (models.kernels.unavailable)"
    return None


@dataclass
class Answering:
    """One prompt being answered: its span of the arena, what it has emitted, what its rows computed."""

    index: int  # the prompt's position in the caller's list
    prompt: list[int]
    base: int  # its span's first slot in the arena
    tokens: list[int] = field(default_factory=list)  # emitted so far
    cached: int = 0  # positions of this sequence in the arena: the prompt, then the answer tokens fed back
    done: bool = False  # its answer ended (EOS or max_new_tokens)
    features: list[torch.Tensor] = field(default_factory=list)  # [rows, len(layers) x D] per forward
    finals: list[torch.Tensor] = field(default_factory=list)  # [rows, D] per forward

    def emit(self, token: int, eos: set[int], max_new_tokens: int) -> None:
        self.tokens.append(token)
        self.done = token in eos or len(self.tokens) == max_new_tokens

    def finished(self, staging: bool) -> bool:
        """Nothing left to compute: the answer ended, and with staging its last token was fed too."""
        return self.done and (not staging or self.cached == len(self.prompt) + len(self.tokens))


class Arena:
    """One cache holding up to `regions` sequences side by side, each in a span of the positions it needs (decode.
    kv_cache.SpecCache, its layers' buffers shaped like the engine's own cache's): as many positions as the
    `regions` largest needs, first fit, a freed span merged with its free neighbours."""

    def __init__(self, runner: ModelRunner, needs: Sequence[int], regions: int):
        capacity = sum(sorted(needs, reverse=True)[:regions])
        self.cache = SpecCache(runner.num_layers, capacity)
        self.spans = [(0, capacity)]  # free [start, end), in order
        self.room = regions  # sequences it may still take

    def take(self, need: int) -> int | None:
        """The first free span's start for a sequence of `need` positions, or None (none fits, or it is full)."""
        if self.room == 0:
            return None
        for i, (start, end) in enumerate(self.spans):
            if end - start >= need:
                self.spans[i:i + 1] = [(start + need, end)] if end - start > need else []
                self.room -= 1
                return start
        return None

    def release(self, base: int, need: int) -> None:
        self.room += 1
        merged: list[tuple[int, int]] = []
        for start, end in sorted([*self.spans, (base, base + need)]):
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        self.spans = merged

    def load(self, source, base: int, length: int) -> None:
        """Copy positions [0, length) of `source` (the engine's cache after a prefill) to [base, base + length)."""
        for mine, theirs in zip(self.cache.layers, source.layers):
            if not mine.is_initialized:  # buffers shaped like the engine's: [1, Hkv, capacity, hd]
                mine.lazy_initialization(theirs.keys[:, :, :1], theirs.values[:, :, :1])
            mine.keys[:, :, base:base + length] = theirs.keys[:, :, :length]
            mine.values[:, :, base:base + length] = theirs.values[:, :, :length]


@torch.inference_mode()
def generate_greedy_together(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                             eos_token_ids: Collection[int], max_batch: int, staging=None) -> list[list[int]]:
    """Each prompt's greedy answer (new tokens, cut after the first EOS, kept), decoded `max_batch` at a time by
    the engine's forward; the same tokens as the engine's plain decoding of each prompt alone. staging: also stage
    every record's hidden states: an object with `layers` (the target layers whose inputs it keeps) and
    `put(prompt, answer, features [T, len(layers) x D], final [T, D])` (distill.feature_capture.FeatureStaging)."""
    if not 1 <= max_batch <= MAX_ROWS:
        raise ValueError(f"max_batch must be in [1, {MAX_ROWS}] (the kernels' rows per forward), got {max_batch}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("cannot generate from an empty list of prompts or an empty prompt")
    layers = model.config.get_text_config().num_hidden_layers
    if staging is not None and not all(0 <= int(i) < layers for i in staging.layers):
        raise ValueError(f"staging layers {list(staging.layers)}: out of range for a target of {layers} layers")
    runner = ModelRunner(model, static_shapes=False)
    reason = unavailable_on(runner)
    if reason is not None:
        raise RuntimeError(f"engine generation: {reason}")
    runner.feature_layers = list(staging.layers) if staging is not None else []
    eos, staged = set(eos_token_ids), staging is not None
    needs = [len(p) + max_new_tokens for p in prompts]  # the prompt, and every answer token fed back
    arena = Arena(runner, needs, max_batch)
    pending = list(range(len(prompts)))[::-1]  # popped from the end: the caller's order
    active: list[Answering] = []
    answers: dict[int, list[int]] = {}
    while pending or active:
        while pending and (base := arena.take(needs[pending[-1]])) is not None:  # with none active, any fits
            index = pending.pop()
            active.append(admit(runner, base, arena, index, list(prompts[index]), eos, max_new_tokens))
        rows = [seq for seq in active if not seq.finished(staged)]
        if rows:
            step(runner, arena, rows, eos, max_new_tokens)
        for seq in [seq for seq in active if seq.finished(staged)]:
            active.remove(seq)
            arena.release(seq.base, needs[seq.index])
            answers[seq.index] = seq.tokens
            if staging is not None:
                staging.put(seq.prompt, seq.tokens, torch.cat(seq.features), torch.cat(seq.finals))
    return [answers[i] for i in range(len(prompts))]


def admit(runner: ModelRunner, base: int, arena: Arena, index: int, prompt: list[int], eos: set[int],
          max_new_tokens: int) -> Answering:
    """Prefill `prompt` alone with the engine (its first answer token from the last row) and move its keys and
    values to its span of the arena, from `base`."""
    n = len(prompt)
    runner.start(n)
    hidden, best = runner.forward_greedy(prompt, logits_rows=slice(n - 1, None))  # [n, D], [1]
    seq = Answering(index, prompt, base, cached=n)
    arena.load(runner.cache, seq.base, n)
    keep_rows(runner, seq, hidden)
    seq.emit(int(best[0]), eos, max_new_tokens)
    return seq


def step(runner: ModelRunner, arena: Arena, rows: list[Answering], eos: set[int], max_new_tokens: int) -> None:
    """One forward of one row per sequence: its last emitted token at its next position, attending to its own
    span; a sequence whose answer has ended (fed for its hidden states alone) emits nothing."""
    positions = torch.tensor([seq.cached for seq in rows])  # [N]
    bases = torch.tensor([seq.base for seq in rows])  # [N]
    ids = torch.tensor([[seq.tokens[seq.cached - len(seq.prompt)] for seq in rows]])  # [1, N]
    spans = torch.stack([bases, bases + positions + 1], dim=1)  # [N, 2]: its span up to the row itself
    last, features = runner.lean(ids, None, None, positions[None], arena.cache, runner.feature_layers,
                                 slots=bases + positions, spans=spans)  # [1, N, D], each [1, N, D]
    hidden = last[0]
    if runner.feature_layers:
        runner.features = torch.cat([f[0] for f in features], dim=-1)  # [N, len(layers) x D]
    best = runner.greedy_tokens(hidden).tolist()  # [N]
    for row, seq in enumerate(rows):
        keep_rows(runner, seq, hidden[row:row + 1], row)
        seq.cached += 1
        if not seq.done:
            seq.emit(best[row], eos, max_new_tokens)


def keep_rows(runner: ModelRunner, seq: Answering, hidden: torch.Tensor, row: int | None = None) -> None:
    """Keep the hidden states of the rows `seq` just had computed (all of the forward's, or its `row`)."""
    if not runner.feature_layers:
        return
    features = runner.features if row is None else runner.features[row:row + 1]
    seq.features.append(features.clone())
    seq.finals.append(hidden.clone())
