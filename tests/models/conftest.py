"""Fixtures for the models tests: a tiny word-level tokenizer and tiny Targets built offline."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from specdistill.models.target import Target, target_from_model
from tests.conftest import make_tiny_llama

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, matching make_tiny_llama's pad/bos/eos ids


def make_tiny_tokenizer(vocab_size: int = 64, prefix: str = "w") -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids cover a tiny model's vocabulary: specials, then words w4, w5, ..."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"{prefix}{i}": i for i in range(len(SPECIALS), vocab_size)})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def make_tiny_target(seed: int = 0, layers: int = 2, vocab_size: int = 64, tie: bool = False) -> Target:
    model = make_tiny_llama(vocab_size=vocab_size, layers=layers, seed=seed, tie=tie)
    return target_from_model(model, make_tiny_tokenizer(vocab_size), name=f"tiny-{seed}")


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture
def target() -> Target:
    return make_tiny_target(seed=0, layers=3)


@pytest.fixture
def make_target():
    """The factory itself, for tests that need several distinct targets."""
    return make_tiny_target
