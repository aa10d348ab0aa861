"""Drafters: built-in specs, the drafter directory round trip, and the errors that keep drafters honest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specdistill.models import drafters as drafters_module
from specdistill.models.draft_models import apply_lora, build_small_drafter, build_truncated_drafter
from specdistill.models.drafters import MANIFEST, load_drafter, save_drafter
from tests.conftest import ROOT

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 5, 9, 60]])  # [B=1, T=8]


def first_layers_logits(model, input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Reference by hand: embeddings, the first decoder layers, final norm, head. [B, T, V]"""
    inner = model.model
    positions = torch.arange(input_ids.shape[1])[None]  # [1, T]
    hidden = inner.embed_tokens(input_ids)  # [B, T, D]
    rope = inner.rotary_emb(hidden, positions)
    for layer in inner.layers[:num_layers]:
        out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
        hidden = out[0] if isinstance(out, tuple) else out  # causal SDPA when no mask is given
    return model.lm_head(inner.norm(hidden))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(TOKENS).logits  # [B, T, V]


# ---- truncated:N --------------------------------------------------------------------------------------

@torch.no_grad()
def test_reference_reproduces_full_target(target):
    torch.testing.assert_close(first_layers_logits(target.model, TOKENS, 3), logits(target.model))


@pytest.mark.parametrize("num_layers", [1, 2, 3])
@torch.no_grad()
def test_truncated_drafter_is_the_targets_first_layers(target, num_layers):
    drafter = load_drafter(f"truncated:{num_layers}", target)
    assert drafter.kind == "draft_model" and drafter.vocab_map is None
    assert len(drafter.model.model.layers) == num_layers == drafter.model.config.num_hidden_layers
    torch.testing.assert_close(logits(drafter.model), first_layers_logits(target.model, TOKENS, num_layers))


@pytest.mark.parametrize("tie", [False, True])
def test_training_truncated_drafter_leaves_target_unchanged(make_target, tie):
    target = make_target(layers=3, tie=tie)
    before = {name: tensor.clone() for name, tensor in target.model.state_dict().items()}
    draft = build_truncated_drafter(target.model, 2).train()
    draft.requires_grad_(True)
    optimizer = torch.optim.SGD(draft.parameters(), lr=1.0)
    for _ in range(3):
        loss = draft(TOKENS, labels=TOKENS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, tensor in target.model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"target weight {name} changed"
    changed = [name for name, tensor in draft.state_dict().items() if not torch.equal(tensor, before[name])]
    assert "model.embed_tokens.weight" in changed and "model.layers.0.mlp.down_proj.weight" in changed
    assert draft.config.tie_word_embeddings == tie
    assert target.model.config.num_hidden_layers == 3  # the config was copied, not edited


@pytest.mark.parametrize("spec", ["truncated:0", "truncated:4", "truncated:x"])
def test_truncated_layer_count_is_checked(target, spec):
    with pytest.raises(ValueError, match="truncated"):
        load_drafter(spec, target)


# ---- small, prompt lookup, unknown specs ---------------------------------------------------------------

def test_small_drafter_speaks_target_vocabulary(target):
    drafter = load_drafter("small:layers=1,hidden=16,heads=2", target)
    config = drafter.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (1, 16, 2)
    assert logits(drafter.model).shape == (1, TOKENS.shape[1], target.vocab_size)
    assert config.eos_token_id == target.model.config.eos_token_id


def test_small_drafter_is_seeded_and_copies_embeddings_when_sizes_match(target):
    a = build_small_drafter(target.model, layers=1, hidden=32, seed=3)
    b = build_small_drafter(target.model, layers=1, hidden=32, seed=3)
    torch.testing.assert_close(logits(a), logits(b))
    assert torch.equal(a.get_input_embeddings().weight, target.model.get_input_embeddings().weight)


@pytest.mark.parametrize("spec,match", [("small:layers=1", "lacks hidden"),
                                        ("small:layers=1,hidden=16,depth=2", "depth"),
                                        ("small:layers=1,hidden=15,heads=2", "divide")])
def test_small_spec_errors_name_the_problem(target, spec, match):
    with pytest.raises(ValueError, match=match):
        load_drafter(spec, target)


@pytest.mark.parametrize("spec", ["prompt_lookup", "ngram"])
def test_prompt_lookup_has_no_model(target, spec):
    drafter = load_drafter(spec, target)
    assert drafter.kind == "prompt_lookup" and drafter.model is None and drafter.vocab_map is None


def test_unknown_spec_lists_accepted_forms(target):
    with pytest.raises(ValueError, match="truncated:N.*prompt_lookup"):
        load_drafter("medusa-please", target)


def test_missing_drafter_path_is_file_not_found(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(str(tmp_path / "nope"), target)


# ---- the drafter directory -----------------------------------------------------------------------------

@dataclass
class JobConfig:
    lr: float = 1e-3
    out: Path = Path("runs/x")


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_gives_identical_logits(make_target, tmp_path, tie):
    target = make_target(layers=3, tie=tie)
    draft = build_truncated_drafter(target.model, 2)
    with torch.no_grad():
        draft.model.norm.weight.mul_(1.5)  # make it differ from anything rebuilt from the target
    path = save_drafter(tmp_path / "drafter", draft, target, "draft_model", JobConfig(), extra={"step": 7})
    loaded = load_drafter(str(path), target)
    assert loaded.kind == "draft_model" and loaded.path == str(path)
    torch.testing.assert_close(logits(loaded.model), logits(draft), rtol=0, atol=0)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format_version"] == 1 and manifest["kind"] == "draft_model"
    assert manifest["target"] == {"name": target.name, "fingerprint": target.fingerprint,
                                  "tokenizer_fingerprint": target.tokenizer_fingerprint}
    assert manifest["config"] == {"lr": 1e-3, "out": "runs/x"} and manifest["extra"] == {"step": 7}
    assert manifest["vocab_map"] is None and manifest["created"]


def test_reduced_vocabulary_round_trip(target, tmp_path):
    from specdistill.models.draft_models import replace_output_head

    draft = build_truncated_drafter(target.model, 1)
    vocab_map = torch.tensor([2, 7, 9, 11, 40, 63])
    replace_output_head(draft, len(vocab_map))
    path = save_drafter(tmp_path / "reduced", draft, target, "draft_model", {}, vocab_map=vocab_map)
    loaded = load_drafter(str(path), target)
    assert torch.equal(loaded.vocab_map, vocab_map) and loaded.vocab_map.dtype == torch.long
    torch.testing.assert_close(logits(loaded.model), logits(draft), rtol=0, atol=0)  # [B, T, 6]


def test_vocab_map_outside_target_vocabulary_is_refused(target, tmp_path):
    draft = build_truncated_drafter(target.model, 1)
    with pytest.raises(ValueError, match="outside"):
        save_drafter(tmp_path / "bad", draft, target, "draft_model", {}, vocab_map=torch.tensor([1, 64]))
    assert not (tmp_path / "bad").exists()


def test_prompt_lookup_directory_round_trip(target, tmp_path):
    path = save_drafter(tmp_path / "pl", None, target, "prompt_lookup", {"max_ngram": 3})
    drafter = load_drafter(str(path), target)
    assert drafter.kind == "prompt_lookup" and drafter.manifest["config"] == {"max_ngram": 3}


def test_loading_against_another_target_raises_naming_both(make_target, tmp_path):
    target, other = make_target(seed=0), make_target(seed=1)
    path = save_drafter(tmp_path / "d", build_truncated_drafter(target.model, 1), target, "draft_model", {})
    with pytest.raises(ValueError) as info:
        load_drafter(str(path), other)
    message = str(info.value)
    assert target.fingerprint in message and other.fingerprint in message and MANIFEST in message
    assert load_drafter(str(path), other, allow_target_mismatch=True).model is not None


def test_loading_with_another_tokenizer_raises_even_when_allowed(target, tmp_path, tiny_tokenizer):
    from specdistill.models.target import target_from_model
    from tests.models.conftest import make_tiny_tokenizer

    path = save_drafter(tmp_path / "d", None, target, "prompt_lookup", {})
    renamed = target_from_model(target.model, make_tiny_tokenizer(prefix="v"), name="renamed-vocab")
    with pytest.raises(ValueError, match="tokenizer"):
        load_drafter(str(path), renamed, allow_target_mismatch=True)


def test_hf_directory_with_another_vocabulary_raises(make_target, target, tmp_path):
    big = make_target(seed=2, vocab_size=80)
    big.model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="80-token head.*64 tokens"):
        load_drafter(str(tmp_path / "hf"), target)


def test_hf_directory_with_same_tokenizer_loads(target, tmp_path):
    draft = build_truncated_drafter(target.model, 1)
    draft.save_pretrained(tmp_path / "hf")
    target.tokenizer.save_pretrained(tmp_path / "hf")
    loaded = load_drafter(str(tmp_path / "hf"), target)
    torch.testing.assert_close(logits(loaded.model), logits(draft))


def test_hf_directory_with_another_tokenizer_raises(target, tmp_path):
    from tests.models.conftest import make_tiny_tokenizer

    build_truncated_drafter(target.model, 1).save_pretrained(tmp_path / "hf")
    make_tiny_tokenizer(prefix="v").save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="another tokenizer"):
        load_drafter(str(tmp_path / "hf"), target)


def test_unknown_manifest_kind_and_version_raise(target, tmp_path):
    path = save_drafter(tmp_path / "d", None, target, "prompt_lookup", {})
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "kind": "telepathy"}))
    with pytest.raises(ValueError, match="telepathy"):
        load_drafter(str(path), target)
    (path / MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version"):
        load_drafter(str(path), target)


# ---- atomic saving -------------------------------------------------------------------------------------

def fail_midway(*args, **kwargs):
    raise OSError("disk full (simulated)")


def test_failed_save_leaves_no_partial_directory(target, tmp_path, monkeypatch):
    monkeypatch.setattr(drafters_module, "save_file", fail_midway)  # the model is written, the map is not
    draft = build_truncated_drafter(target.model, 1)
    with pytest.raises(OSError, match="simulated"):
        save_drafter(tmp_path / "d", draft, target, "draft_model", {}, vocab_map=torch.arange(64))
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_drafter(target, tmp_path, monkeypatch):
    path = save_drafter(tmp_path / "d", None, target, "prompt_lookup", {"version": 1})
    monkeypatch.setattr(drafters_module, "save_file", fail_midway)
    draft = build_truncated_drafter(target.model, 1)
    with pytest.raises(OSError):
        save_drafter(path, draft, target, "draft_model", {}, vocab_map=torch.arange(64))
    assert load_drafter(str(path), target).manifest["config"] == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_overwrite_replaces_the_whole_directory(target, tmp_path):
    path = save_drafter(tmp_path / "d", build_truncated_drafter(target.model, 1), target, "draft_model", {})
    save_drafter(path, None, target, "prompt_lookup", {})
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_unserializable_config_fails_before_writing(target, tmp_path):
    with pytest.raises(TypeError, match=r"config\.fn"):
        save_drafter(tmp_path / "d", None, target, "prompt_lookup", {"fn": object()})
    assert not (tmp_path / "d").exists()


# ---- LoRA ----------------------------------------------------------------------------------------------

def test_lora_is_merged_on_save(target, tmp_path):
    draft = apply_lora(build_truncated_drafter(target.model, 2), r=4, alpha=8)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # lora_B starts at zero; make the adapters matter
    trainable = [name for name, param in draft.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    path = save_drafter(tmp_path / "lora", draft, target, "draft_model", {"lora_r": 4})
    loaded = load_drafter(str(path), target)
    assert not any("lora" in name for name, _ in loaded.model.named_parameters())
    torch.testing.assert_close(logits(loaded.model), logits(draft), rtol=1e-5, atol=1e-5)
    assert any("lora_A" in name for name, _ in draft.named_parameters())  # the caller's model kept its adapters


def test_full_vocab_view_of_a_reduced_head_scores_only_its_tokens():
    from specdistill.models.draft_models import full_vocab_view, reduce_head
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(seed=2)
    vocab_map = torch.tensor([2, 5, 9, 40])
    full_logits = model(torch.tensor([[1, 2, 3]])).logits
    reduce_head(model, vocab_map)
    view = full_vocab_view(model, vocab_map, 64)
    logits = view(torch.tensor([[1, 2, 3]])).logits  # [1, 3, 64]
    torch.testing.assert_close(logits[..., vocab_map], full_logits[..., vocab_map])
    outside = torch.ones(64, dtype=torch.bool)
    outside[vocab_map] = False
    assert torch.isinf(logits[..., outside]).all()
    assert model.get_output_embeddings().weight.shape == (4, 32)  # the original is untouched


def test_a_grown_head_scores_new_tokens_as_the_tied_full_head_would_and_keeps_the_old_rows():
    from specdistill.models.draft_models import grow_head, reduce_head
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(seed=3, tie=True)
    ids = torch.tensor([[1, 2, 3, 7]])
    full_logits = model(ids).logits  # [1, 4, 64]
    vocab_map = torch.tensor([2, 5, 9, 40])
    reduce_head(model, vocab_map)
    old_rows = model.get_output_embeddings().weight.detach().clone()
    grown = grow_head(model, vocab_map, torch.tensor([17, 3]))
    assert grown.tolist() == [2, 5, 9, 40, 17, 3]
    assert model.get_output_embeddings().weight.shape == (6, 32)
    torch.testing.assert_close(model.get_output_embeddings().weight[:4], old_rows)
    torch.testing.assert_close(model(ids).logits, full_logits[..., grown])  # tied: input row = head row
    with pytest.raises(ValueError, match="already in the vocab_map"):
        grow_head(model, grown, torch.tensor([9]))


def test_a_named_real_target_loads_as_a_draft_model_by_its_name(target, tmp_path, monkeypatch):
    """`--drafter qwen2.5-coder-0.5b`: the named target's cached directory as a plain draft model (here a stand-in
    directory in place of the fetched one), recorded under its name; with no GGUF marker nothing is attached."""
    draft = build_truncated_drafter(target.model, 1)
    draft.save_pretrained(tmp_path / "small")
    target.tokenizer.save_pretrained(tmp_path / "small")
    asked = []
    monkeypatch.setattr(drafters_module, "real_target_dir", lambda name: asked.append(name) or tmp_path / "small")
    loaded = load_drafter("qwen2.5-coder-0.5b", target)
    assert asked == ["qwen2.5-coder-0.5b"] and loaded.kind == "draft_model"
    assert loaded.manifest["config"] == {"spec": "qwen2.5-coder-0.5b"}
    assert not any(hasattr(m, "kquant_blocks") for m in loaded.model.modules())
    torch.testing.assert_close(logits(loaded.model), logits(draft))


def test_a_fresh_interpreter_reads_every_built_in_kind_whatever_it_imported_first():
    """load_drafter imports the module of the kind a manifest names: a caller that imported only models.drafters
    loads an EAGLE-3, DFlash, Medusa or [LA] directory too."""
    code = ("from specdistill.models import drafters as d\n"
            "assert set(d._KIND_LOADERS) == {'draft_model', 'ensemble', 'prompt_lookup'}, sorted(d._KIND_LOADERS)\n"
            "assert all(d.kind_loader(kind) is not None for kind in d.BUILTIN_KINDS)\n"
            "assert d.kind_loader('nonsense') is None\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_every_kind_a_module_registers_is_a_built_in_kind():
    registered = {m for path in (ROOT / "models").glob("*.py")
                  for m in re.findall(r'register_drafter_kind\("(\w+)"', path.read_text())}
    assert registered == set(drafters_module.BUILTIN_KINDS) | {"draft_model", "ensemble", "prompt_lookup"}
