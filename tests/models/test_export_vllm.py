"""`python -m models.export DRAFTER --format vllm`: every kind vLLM's speculative decoding loads, in its format.

Draft models: the exported full-vocabulary model's logits at the draft vocabulary's ids are the drafter's, and
its greedy token is the drafter's (mapped); built-in specs are materialised. Medusa: vLLM's names, shapes and
config keys, and vLLM's computation on them gives our heads' logits. Kinds vLLM cannot load, heads it cannot
compute and drafters of another target are refused, naming why, with nothing written.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdistill.models.draft_models import build_truncated_drafter, reduce_head
from specdistill.models.drafters import save_drafter
from specdistill.models.export import export_for_vllm, main
from specdistill.models.export_vllm import PROVENANCE_FILE, full_vocabulary_rows
from specdistill.models.medusa import MedusaHeads
from specdistill.models.target import load_target
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_target, make_tiny_tokenizer


def reduced_drafter(target, tmp_path, vocab_map: torch.Tensor):
    """A 1-layer truncated drafter whose head covers `vocab_map`'s target ids only, saved as a drafter dir."""
    model = build_truncated_drafter(target.model, 1)
    reduce_head(model, vocab_map)
    with torch.no_grad():  # a head of its own, not the target's rows
        model.get_output_embeddings().weight.normal_(0, 0.5)
    save_drafter(tmp_path / "d", model, target, "draft_model", config={}, vocab_map=vocab_map)
    return model


def test_full_vocabulary_rows_put_each_draft_row_at_its_id_and_copy_the_nearest_smaller():
    head = torch.arange(4.0)[:, None].repeat(1, 2)  # row i = [i, i]
    vocab_map = torch.tensor([5, 0, 9, 2])  # draft row -> target id
    full = full_vocabulary_rows(head, vocab_map, 12)
    assert full[:, 0].tolist() == [1, 1, 3, 3, 3, 0, 0, 0, 0, 2, 2, 2]


def test_a_reduced_head_is_written_back_to_the_full_vocabulary(target, tmp_path):
    vocab_map = torch.tensor([0, 1, 2, 7, 11, 20, 33, 40, 41, 63])
    drafter_model = reduced_drafter(target, tmp_path, vocab_map)
    out, method = export_for_vllm(tmp_path / "d", tmp_path / "out", target)
    assert method == "draft_model"
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.vocab_size == target.vocab_size and not exported.config.tie_word_embeddings
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = exported(ids).logits  # [3, 9, V]
        draft = drafter_model(ids).logits  # [3, 9, M]
    torch.testing.assert_close(full[..., vocab_map], draft)
    assert torch.equal(full.argmax(-1), vocab_map[draft.argmax(-1)])  # vLLM's greedy draft is the drafter's
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["target"]["fingerprint"] == target.fingerprint and provenance["draft_vocab"] == 10
    assert (out / "tokenizer.json").is_file()


def test_a_built_in_spec_is_materialised(target, tmp_path):
    out, method = export_for_vllm("truncated:2", tmp_path / "out", target)
    exported = AutoModelForCausalLM.from_pretrained(out)
    reference = build_truncated_drafter(target.model, 2)
    ids = torch.tensor([[3, 9, 27, 5, 11]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, reference(ids).logits)
    assert exported.config.num_hidden_layers == 2
    assert json.loads((out / PROVENANCE_FILE).read_text())["source"] == "truncated:2"


def save_medusa(target, tmp_path, vocab_map: torch.Tensor | None = None, **kw) -> MedusaHeads:
    config = target.model.config
    heads = MedusaHeads(3, 2, config.hidden_size, config.vocab_size, **kw)
    torch.manual_seed(4)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0, 0.2)
    save_drafter(tmp_path / "m", heads, target, "medusa", config=dict(heads.config), extra={"tree": [[0]]},
                 vocab_map=vocab_map)
    return heads


def vllm_medusa_logits(config: dict, state: dict, hidden: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's Medusa (model_executor/models/medusa.py) on its checkpoint: per head, blocks of
    x + SiLU(W x + b), then lm_heads.{i}."""
    out = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            x = x + torch.nn.functional.silu(x @ state[f"blocks.{i}.layers.{j}.weight"].T
                                             + state[f"blocks.{i}.layers.{j}.bias"])
        out.append(x @ state[f"lm_heads.{i}.weight"].T)
    return out


def test_medusa_heads_export_to_vllms_names_and_compute_the_same_logits(target, tmp_path):
    heads = save_medusa(target, tmp_path)
    out, method = export_for_vllm(tmp_path / "m", tmp_path / "out", target)
    assert method == "medusa"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["medusa_fc_bias"]) == (3, 2, True)
    assert config["vocab_size"] == config["truncated_vocab_size"] == target.vocab_size
    state = load_file(str(out / "model.safetensors"))
    d, v = target.model.config.hidden_size, target.vocab_size
    expected = {f"blocks.{i}.layers.{j}.{p}": (d, d) if p == "weight" else (d,)
                for i in range(3) for j in range(2) for p in ("weight", "bias")}
    expected |= {f"lm_heads.{i}.weight": (v, d) for i in range(3)}
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    hidden = torch.randn(5, d)
    with torch.no_grad():
        ours = [head(hidden) for head in heads.heads]
    for a, b in zip(vllm_medusa_logits(config, state, hidden), ours):
        torch.testing.assert_close(a, b)


def test_medusa_heads_with_a_candidate_vocabulary_draft_the_same_tokens_in_vllm(target, tmp_path):
    """Training fits the candidates' rows only; vLLM's Medusa argmaxes over every id, so the export must make
    the candidate ours proposes win there too, with the candidates' logits unchanged."""
    vocab_map = torch.tensor([0, 2, 3, 9, 17, 30, 31, 50, 63])
    heads = save_medusa(target, tmp_path, vocab_map=vocab_map)
    with torch.no_grad():  # untrained rows that would win vLLM's argmax over the full vocabulary
        for head in heads.heads:
            head.proj.weight[~torch.isin(torch.arange(target.vocab_size), vocab_map)] *= 20
    save_drafter(tmp_path / "m", heads, target, "medusa", config=dict(heads.config), extra={"tree": [[0]]},
                 vocab_map=vocab_map)
    out, _ = export_for_vllm(tmp_path / "m", tmp_path / "out", target)
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    assert state["lm_heads.0.weight"].shape == (target.vocab_size, target.model.config.hidden_size)
    hidden = torch.randn(64, target.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = [head(hidden)[:, vocab_map] for head in heads.heads]  # [64, M]: what our decoding ranks
    untouched = [head.proj.weight.detach().clone() for head in heads.heads]
    for full, candidates in zip(vllm_medusa_logits(config, state, hidden), ours):
        torch.testing.assert_close(full[:, vocab_map], candidates)
        assert torch.equal(full.argmax(-1), vocab_map[candidates.argmax(-1)])  # vLLM drafts our token
    for head, before in zip(heads.heads, untouched):  # the drafter itself is not modified by exporting
        assert torch.equal(head.proj.weight, before)
    assert json.loads((out / PROVENANCE_FILE).read_text())["draft_vocab"] == vocab_map.numel()


def test_reduced_medusa_heads_export_as_the_full_heads_holding_the_same_rows(target, tmp_path):
    """Heads that store only the candidates' rows (medusa.reduced_heads, the real-size target's) export to the
    same vLLM checkpoint as full heads whose candidate rows are those."""
    vocab_map = torch.tensor([0, 2, 3, 9, 17, 30, 31, 50, 63])
    full = save_medusa(target, tmp_path / "full", vocab_map=vocab_map)
    config = target.model.config
    reduced = MedusaHeads(3, 2, config.hidden_size, vocab_map.numel(), reduced=True)
    with torch.no_grad():
        reduced.load_state_dict({name: (value[vocab_map] if name.endswith("proj.weight") else value)
                                 for name, value in full.state_dict().items()})
    save_drafter(tmp_path / "reduced" / "m", reduced, target, "medusa", config=dict(reduced.config),
                 extra={"tree": [[0]]}, vocab_map=vocab_map)
    exports = [export_for_vllm(tmp_path / kind / "m", tmp_path / kind / "out", target)[0]
               for kind in ("full", "reduced")]
    states = [load_file(str(out / "model.safetensors")) for out in exports]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    configs = [json.loads((out / "config.json").read_text()) for out in exports]
    assert configs[0] == configs[1] and configs[1]["vocab_size"] == target.vocab_size


@pytest.mark.parametrize("kw, reason", [({"sequential": True}, "sequential"),
                                        ({"prefix": {"num_heads": 2, "intermediate_size": 16, "rope_theta": 1e4}},
                                         "prefix-attention")])
def test_medusa_heads_vllm_cannot_compute_are_refused(target, tmp_path, kw, reason):
    save_medusa(target, tmp_path, **kw)
    with pytest.raises(ValueError, match=reason):
        export_for_vllm(tmp_path / "m", tmp_path / "out", target)
    assert not (tmp_path / "out").exists()


def test_kinds_vllm_does_not_load_and_foreign_targets_are_refused(target, tmp_path):
    save_drafter(tmp_path / "lookup", None, target, "prompt_lookup", config={})
    with pytest.raises(ValueError, match="draft_model, eagle3, medusa"):
        export_for_vllm(tmp_path / "lookup", tmp_path / "out", target)
    reduced_drafter(target, tmp_path, torch.arange(0, 64, 2))
    with pytest.raises(ValueError, match="fingerprint"):
        export_for_vllm(tmp_path / "d", tmp_path / "out", make_tiny_target(seed=1, layers=3))
    with pytest.raises(ValueError, match="prompt_lookup"):
        export_for_vllm("truncated:1+prompt_lookup", tmp_path / "out", target)
    assert not (tmp_path / "out").exists()


def test_cli_format_vllm(tmp_path, capsys):
    path = tmp_path / "target"
    make_tiny_llama(layers=3, seed=0).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    code = main(["truncated:1", "--format", "vllm", "--out", str(tmp_path / "out"), "--target", str(path)])
    assert code == 0 and str(tmp_path / "out") in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 1
    code = main(["truncated:2", "--format", "vllm", "--out", str(tmp_path / "out"), "--target", str(path)])
    assert code == 0  # an earlier export is replaced
    target = load_target(str(path))
    save_drafter(tmp_path / "lookup", None, target, "prompt_lookup", config={})
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "lookup"), "--format", "vllm", "--out", str(tmp_path / "x"), "--target", str(path)])
    assert exit_info.value.code == 2 and "ngram" in capsys.readouterr().err
