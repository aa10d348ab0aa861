"""Shared fixtures: tiny seeded Llama models and a tiny tokenizer, built offline in the tests themselves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))
torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    layers: int = 2,
    seed: int = 0,
    peak: float = 0.0,
    tie: bool = False,
) -> LlamaForCausalLM:
    """A seeded random Llama. `peak` > 0 scales the head so next-token distributions are peaked
    (a model with a clear greedy choice, so small drafters can learn it)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    if peak:
        with torch.no_grad():
            model.lm_head.weight.mul_(peak)
    return model


@pytest.fixture
def tiny_target() -> LlamaForCausalLM:
    return make_tiny_llama(seed=0, layers=2)


@pytest.fixture
def tiny_drafter() -> LlamaForCausalLM:
    return make_tiny_llama(seed=1, layers=1)
