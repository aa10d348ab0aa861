"""Tiny real pieces for the serving and online-distillation tests: a word-level chat tokenizer, a seeded
tiny target wrapped as a real models.target.Target, and drafters saved in the real drafter format."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from specdistill.models.drafters import save_drafter
from specdistill.models.target import Target, target_from_model
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


def save_target_dir(path: Path, seed: int = 0, peak: float = 4.0) -> Path:
    """The tiny target as an HF directory, loadable by models.target.load_target (and by a subprocess)."""
    model = make_tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=2, seed=seed, peak=peak)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def served_record(target: Target, request_id: str, prompt_ids: list[int], max_tokens: int = 12,
                  version: str = "v000000") -> dict:
    """A log record as the server writes it, with the target's real greedy output."""
    from specdistill.decode.request_log import SCHEMA_VERSION

    out = greedy_reference(target, prompt_ids, max_tokens)
    return {"schema": SCHEMA_VERSION, "id": request_id, "time": 0.0, "endpoint": "completions", "model": "tiny",
            "prompt": prompt_ids, "prompt_ids": prompt_ids, "output_ids": out,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens": max_tokens},
            "stats": {"drafted": 10, "accepted": 3}, "drafter_version": version,
            "target_fingerprint": target.fingerprint, "tokenizer_fingerprint": target.tokenizer_fingerprint}


def prompt_for(i: int) -> list[int]:
    return [8 + (i * 7) % 50, 8 + (i * 13) % 50, 8 + (i * 3) % 50, 9]
