"""The real embedded default target (SmolLM2-135M-Instruct): slow, needs the cache or a package registry."""

from __future__ import annotations

import time

import pytest
import torch

import specdistill.models.gguf_convert as gguf_convert
from specdistill.models.target import DEFAULT_TARGET, load_target

pytestmark = pytest.mark.slow


def refuse_conversion(*args, **kwargs):
    raise AssertionError("the cached default target was converted again")


def test_default_target_is_smollm2_and_answers_coherently(monkeypatch):
    load_target(None)  # builds the cache on first use
    monkeypatch.setattr(gguf_convert, "convert_gguf", refuse_conversion)
    start = time.monotonic()
    target = load_target(None)
    cached_load_s = time.monotonic() - start
    assert cached_load_s < 30  # a generous bound on a shared machine; a conversion alone takes ~20 s more
    config = target.model.config
    assert (target.name, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        (DEFAULT_TARGET, 30, 576, 49152)
    assert config.tie_word_embeddings and target.dtype == torch.float32
    assert target.tokenizer.convert_ids_to_tokens(sorted(target.eos_token_ids)) == ["<|im_end|>"]

    prompt = target.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    output = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                   pad_token_id=target.tokenizer.pad_token_id)
    answer = target.tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True)
    assert "Paris" in answer


def test_gguf_file_spec_gives_the_default_targets_weights(tmp_path, monkeypatch):
    """Loading the GGUF file by path converts it independently (own cache); same weights, same fingerprint."""
    import specdistill.models.embedded as embedded

    default = load_target(None)
    gguf = embedded.locate_embedded_gguf(tmp_path / "download")
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    from_file = load_target(str(gguf))
    assert from_file.fingerprint == default.fingerprint
