"""Fingerprints: stable for the same weights and vocabulary, different as soon as either changes."""

from __future__ import annotations

import copy

import torch

from specdistill.models.fingerprint import fingerprint_target, tokenizer_fingerprint, weights_fingerprint
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_tokenizer


def test_stable_across_calls_and_rebuilds():
    a, b = make_tiny_llama(seed=0), make_tiny_llama(seed=0)
    assert weights_fingerprint(a) == weights_fingerprint(a) == weights_fingerprint(b)
    assert len(weights_fingerprint(a)) == 64 and int(weights_fingerprint(a), 16) >= 0


def test_changes_when_one_weight_changes():
    model = make_tiny_llama(seed=0)
    before = weights_fingerprint(model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 0.25
    assert weights_fingerprint(model) != before


def test_differs_between_different_models():
    assert weights_fingerprint(make_tiny_llama(seed=0)) != weights_fingerprint(make_tiny_llama(seed=1))
    assert weights_fingerprint(make_tiny_llama(layers=2)) != weights_fingerprint(make_tiny_llama(layers=3))


def test_same_checkpoint_in_bf16_has_the_same_fingerprint():
    """A drafter trained against a bf16 target on GPU must load against the fp32 target on CPU."""
    model = make_tiny_llama(seed=0)
    assert weights_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == weights_fingerprint(model)


def test_tied_embeddings_hashed_once_and_differ_from_untied():
    tied = make_tiny_llama(seed=0, tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = make_tiny_llama(seed=0, tie=False)
    assert weights_fingerprint(tied) != weights_fingerprint(untied)


def test_tokenizer_fingerprint_tracks_the_vocabulary():
    assert tokenizer_fingerprint(make_tiny_tokenizer()) == tokenizer_fingerprint(make_tiny_tokenizer())
    assert tokenizer_fingerprint(make_tiny_tokenizer()) != tokenizer_fingerprint(make_tiny_tokenizer(prefix="v"))
    assert tokenizer_fingerprint(make_tiny_tokenizer(64)) != tokenizer_fingerprint(make_tiny_tokenizer(65))


def test_tokenizer_fingerprint_survives_save_and_reload(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_fingerprint(tokenizer)


def test_target_fingerprint_depends_on_weights_and_tokenizer():
    model, tokenizer = make_tiny_llama(seed=0), make_tiny_tokenizer()
    base = fingerprint_target(model, tokenizer)
    assert fingerprint_target(model, make_tiny_tokenizer()) == base
    assert fingerprint_target(model, make_tiny_tokenizer(prefix="v")) != base
    assert fingerprint_target(make_tiny_llama(seed=1), tokenizer) != base
