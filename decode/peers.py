"""Methods the evaluation runs side by side: our engine (baseline / speculative) and transformers'
own `generate` peers (plain greedy, assisted generation, prompt lookup), all behind one call:
prompt ids -> new token ids, the wall time, and the engine's statistics when there are any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from specdistill.decode.engine import SpeculativeEngine, truncate_at_eos
from specdistill.decode.metrics import RequestStats
from specdistill.decode.proposers import Proposer
from specdistill.decode.report import BASELINE, TurnResult
from specdistill.decode.runner import synchronized_clock
from specdistill.decode.sampling import SamplingConfig
from specdistill.models.draft_models import full_vocab_view

# transformers' own default for prompt lookup (its docs suggest 10); our proposer's depth is set apart
HF_PROMPT_LOOKUP_NUM_TOKENS = 10


@dataclass
class TurnOutput:
    tokens: list[int]  # new tokens only, ending with EOS if one was emitted
    wall_s: float  # time.perf_counter around the whole generation, device synchronized
    stats: RequestStats | None  # the engine's statistics; None for transformers' generate


@dataclass
class Method:
    name: str
    run: Callable[[list[int]], TurnOutput]
    # greedy output must equal the baseline's token for token: decode.evaluate exits non-zero where it does not;
    # False for peers whose arithmetic differs from our engine's (reported, never failing the run)
    lossless: bool = True
    close: Callable[[], None] | None = None  # frees what it holds (a vLLM worker process) after the evaluation
    fallible: bool = False  # runs in another process (a vLLM worker): if it dies mid-run (RuntimeError), the
    #                         evaluation drops this method and reports why instead of ending
    engine: SpeculativeEngine | None = None  # our engine's methods: what ran on it (decode.runtime_facts reads it)


def engine_method(name: str, target, proposer: Proposer | None, max_new_tokens: int,
                  sampling: SamplingConfig, adaptive: bool = True, **engine_options) -> Method:
    """Our engine; proposer None is plain autoregressive decoding (the baseline). adaptive=False
    drafts the proposer's full depth every step (tau then measures acceptance alone). engine_options: further
    SpeculativeEngine keywords."""
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=adaptive, **engine_options)

    def run(prompt_ids: list[int]) -> TurnOutput:
        start = synchronized_clock(target.device)
        generation = engine.generate(prompt_ids, max_new_tokens, sampling)
        return TurnOutput(generation.tokens, synchronized_clock(target.device) - start, generation.stats)

    return Method(name, run, engine=engine)


def hf_method(name: str, target, max_new_tokens: int, sampling: SamplingConfig,
              generation_options: dict | None = None, assistant_model: torch.nn.Module | None = None) -> Method:
    """transformers' `model.generate` with a generation config built here (not the model's, whose
    sampling defaults would otherwise leak in), batch size 1, stopping at any of the target's EOS ids.
    generation_options: extra GenerationConfig fields (prompt_lookup_num_tokens=...)."""
    config = hf_generation_config(target, max_new_tokens, sampling, generation_options or {})
    generate_kwargs = {} if assistant_model is None else {"assistant_model": assistant_model}
    eos = target.eos_token_ids

    @torch.inference_mode()
    def run(prompt_ids: list[int]) -> TurnOutput:
        input_ids = torch.tensor([prompt_ids], device=target.device)  # [1, T]
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)
        start = synchronized_clock(target.device)
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=config, **generate_kwargs)  # [1, T + new]
        wall = synchronized_clock(target.device) - start
        return TurnOutput(truncate_at_eos(out[0, len(prompt_ids):].tolist(), eos), wall, None)

    return Method(name, run, lossless=False)  # its own kernels may round differently from our engine


def hf_generation_config(target, max_new_tokens: int, sampling: SamplingConfig, extra: dict) -> GenerationConfig:
    eos = sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    options = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                   pad_token_id=pad if pad is not None else (eos[0] if eos else None))
    if sampling.greedy:
        options.update(do_sample=False)
    else:
        options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k or None)
    return GenerationConfig(**options, **extra)


def assisted_skip_reason(drafter, target) -> str | None:
    """Why transformers' assisted generation cannot use this drafter (None when it can)."""
    if drafter.kind != "draft_model" or drafter.model is None:
        return f"drafter kind {drafter.kind!r} has no draft model to pass as assistant_model"
    if drafter.vocab_map is not None:
        return None  # runs through a full-vocabulary view of the same weights (assistant_model_of)
    draft_vocab = drafter.model.get_output_embeddings().weight.shape[0]
    target_vocab = target.model.get_output_embeddings().weight.shape[0]
    if draft_vocab != target_vocab:
        return f"the drafter's vocabulary ({draft_vocab}) differs from the target's ({target_vocab})"
    return None


def assistant_model_of(drafter, target) -> torch.nn.Module:
    """The drafter as transformers' assisted generation needs it: over the target's full vocabulary.
    A reduced head is wrapped (same weights, -inf logits outside its vocab_map), so both engines
    run the very same drafter."""
    if drafter.vocab_map is None:
        return drafter.model
    return full_vocab_view(drafter.model, drafter.vocab_map, target.model.get_output_embeddings().weight.shape[0])



# ---- where a peer's greedy output leaves the baseline's ------------------------------------------------------------

def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first position where `tokens` differ from `reference` (the shorter one's length when one is a prefix of the
    other, e.g. one stopped early), or None when they are equal."""
    for position, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return position
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def divergences(results: Sequence[TurnResult], method: str) -> list[dict]:
    """For each turn of `method` that has a baseline turn: the first position where its tokens leave the baseline's
    (None: identical). `prompt_differs`: an earlier turn of the question diverged, so this turn was prompted with
    another answer than the baseline's and its divergence is not the peer's arithmetic alone."""
    baseline = {(r.question_id, r.turn): r.tokens for r in results if r.method == BASELINE}
    out, diverged = [], set()
    for r in results:  # in run order: a question's turns in turn order
        if r.method != method or (r.question_id, r.turn) not in baseline:
            continue
        position = first_divergence(r.tokens, baseline[(r.question_id, r.turn)])
        out.append({"question_id": r.question_id, "turn": r.turn, "position": position,
                    "prompt_differs": r.question_id in diverged})
        if position is not None:
            diverged.add(r.question_id)
    return out


def format_divergences(summary: dict) -> str:
    """One line per method whose summary has "first_divergence": QUESTION/TURN then the first differing position
    ('=' identical; '*' after an earlier turn diverged, so the prompt differed too)."""
    lines = []
    for name, row in summary.items():
        if row.get("first_divergence") is None:
            continue
        cells = [f"{d['question_id']}/{d['turn']} {'=' if d['position'] is None else d['position']}"
                 f"{'*' if d['prompt_differs'] else ''}" for d in row["first_divergence"]]
        lines.append(f"  {name}: {', '.join(cells) or 'no turns'}")
    if not lines:
        return ""
    return ("first token where each peer's answer leaves the baseline's (question/turn position; '=' same tokens, "
            "'*' its prompt already differed)\n" + "\n".join(lines))
