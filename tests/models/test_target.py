"""load_target on local directories, its errors, and the Target helpers (chat encoding, EOS ids)."""

from __future__ import annotations

import time

import pytest
import torch

import specdistill.models.target as target_module
from specdistill.models.fingerprint import fingerprint_target
from specdistill.models.target import HubUnreachableError, load_target, target_from_model
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s>{% endif %}")


def save_tiny_hf_dir(directory, seed: int = 0, chat: bool = True):
    model, tokenizer = make_tiny_llama(seed=seed), make_tiny_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    model.generation_config.eos_token_id = [2, 7]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def test_local_directory_loads_frozen_fp32_with_fingerprint(tmp_path):
    model, tokenizer = save_tiny_hf_dir(tmp_path / "m")
    target = load_target(str(tmp_path / "m"))
    assert target.name == str(tmp_path / "m")
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    assert not target.model.training and not any(p.requires_grad for p in target.model.parameters())
    assert target.model.config._attn_implementation == "sdpa"
    assert target.fingerprint == fingerprint_target(model, tokenizer)
    tokens = torch.tensor([[1, 5, 9, 13]])
    torch.testing.assert_close(target.model(tokens).logits, model(tokens).logits)


def test_bf16_load_keeps_the_fingerprint(tmp_path):
    save_tiny_hf_dir(tmp_path / "m")
    fp32 = load_target(str(tmp_path / "m"))
    bf16 = load_target(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.fingerprint == fp32.fingerprint


def test_encode_chat_uses_the_tokenizers_template(tmp_path):
    save_tiny_hf_dir(tmp_path / "m")
    target = load_target(str(tmp_path / "m"))
    ids = target.encode_chat([{"role": "user", "content": "w5 w6"}])
    assert ids == [1, 5, 6, 2, 1] and all(isinstance(i, int) for i in ids)


def test_encode_chat_without_template_is_a_clear_error(tmp_path):
    save_tiny_hf_dir(tmp_path / "m", chat=False)
    with pytest.raises(ValueError, match="no chat template"):
        load_target(str(tmp_path / "m")).encode_chat([{"role": "user", "content": "w5"}])


def test_eos_ids_join_tokenizer_and_generation_config(tmp_path):
    save_tiny_hf_dir(tmp_path / "m")
    assert load_target(str(tmp_path / "m")).eos_token_ids == {2, 7}


def test_target_from_model_freezes_in_place():
    model = make_tiny_llama().train()
    target = target_from_model(model, make_tiny_tokenizer())
    assert target.model is model and not model.training
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("spec", ["./no/such/dir", "~/no-such-target-dir", "missing.gguf", "/abs/missing"])
def test_missing_paths_are_file_not_found(spec):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(spec)


def test_directory_without_config_and_non_gguf_file_are_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_target(str(tmp_path / "weights.bin"))


def test_unreachable_hub_fails_fast_with_advice(monkeypatch):
    monkeypatch.setattr(target_module, "hub_reachable", lambda: False)
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match="unreachable.*local directory"):
        load_target("no-such-org/no-such-model")
    assert time.monotonic() - start < 10


def test_hub_offline_env_means_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not target_module.hub_reachable()
