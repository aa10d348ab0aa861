"""Tiny real pieces for the serving and online-distillation tests: a word-level chat tokenizer, a seeded
tiny target wrapped as a real models.target.Target, and drafters saved in the real drafter format."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from models.drafters import save_drafter
from models.target import Target, target_from_model
from tests.conftest import make_tiny_llama

VOCAB = 64
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", "system", ":"]  # pad/bos/eos = 0/1/2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_target(seed: int = 0, peak: float = 4.0) -> Target:
    """A peaked tiny target (clear greedy choices, so a small drafter can learn it)."""
    return target_from_model(make_tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=2, seed=seed, peak=peak),
                             make_tokenizer(), "tiny-chat")


def save_tiny_drafter(path: Path, target: Target, seed: int = 1) -> Path:
    model = make_tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=seed)
    return save_drafter(path, model, target, "draft_model", config={"seed": seed})


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@torch.inference_mode()
def greedy_reference(target: Target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation by plain full-sequence forwards (no cache, no engine)."""
    seq, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(target.model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(token)
        seq.append(token)
        if token in target.eos_token_ids:
            break
    return out
