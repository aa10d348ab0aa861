"""A tiny offline target for the distill tests: a seeded tiny Llama, a word-level tokenizer with a chat
template, and a Target-shaped wrapper (models.target.Target's fields and methods that distill uses)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from tests.conftest import make_tiny_llama

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
ROLES = ["user", "assistant", "system"]
VOCAB_SIZE = 64
IM_END = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIALS) - len(ROLES))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ROLES + words)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass
class TinyTarget:
    model: object
    tokenizer: PreTrainedTokenizerFast
    name: str = "tiny"
    fingerprint: str = "tiny-fingerprint"

    @property
    def eos_token_ids(self) -> set[int]:
        return {self.tokenizer.eos_token_id, IM_END}

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def make_tiny_target(seed: int = 0, fingerprint: str = "tiny-fingerprint") -> TinyTarget:
    return TinyTarget(make_tiny_llama(vocab_size=VOCAB_SIZE, seed=seed), make_tiny_tokenizer(),
                      fingerprint=fingerprint)


@pytest.fixture
def tiny_chat_target() -> TinyTarget:
    return make_tiny_target()
