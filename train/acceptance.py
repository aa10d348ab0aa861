"""Acceptance of the drafter being trained, measured with the real engine on held-out prompts."""

from __future__ import annotations

import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers import DraftModelProposer


@torch.no_grad()
def measure_acceptance(target, draft_model, vocab_map, prompts: list[list[int]], max_new_tokens: int,
                       gamma: int, prompt_vocab: bool = False) -> dict:
    """Greedy speculative decoding of each prompt at a fixed draft length (no adaptation, so that
    alpha measures the drafter alone). Returns the aggregate: tau, alpha, acceptance per position.
    prompt_vocab: a reduced head drafts each prompt's own tokens too (DraftModelProposer)."""
    was_training = draft_model.training
    draft_model.eval()
    proposer = DraftModelProposer(draft_model, gamma=gamma, vocab_map=vocab_map,
                                  eos_token_ids=target.eos_token_ids,
                                  target_vocab=target.model.get_output_embeddings().weight.shape[0],
                                  prompt_vocab=prompt_vocab)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    stats = [engine.generate(p, max_new_tokens).stats for p in prompts]
    draft_model.train(was_training)
    return aggregate_stats(stats)
