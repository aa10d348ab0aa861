"""models.export: an eagle3 drafter as a speculators EAGLE-3 checkpoint, the names and config vLLM reads,
and the exported weights giving the same draft logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig

from specdistill.models.drafters import save_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.export import (
    CONFIG_FILE,
    TARGET_DIR,
    WEIGHTS_FILE,
    draft_logits_from_export,
    export_speculators,
    load_speculators_export,
    main,
)
from specdistill.models.target import load_target
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_target, make_tiny_tokenizer

# The names vLLM's Eagle3LlamaForCausalLM.load_weights accepts (vllm/model_executor/models/llama_eagle3.py,
# read at commit 00bd1493): "midlayer." or "layers.0." for the decoder layer; q/k/v_proj and gate/up_proj
# are stacked by LlamaModel.load_weights; "d2t" becomes draft_id_to_target_id; "t2d" is skipped;
# embed_tokens is optional (absent: vLLM shares the target's). speculators writes "layers.0." (its
# convert/eagle/eagle3_converter.py renames midlayer. to layers.0.; models/eagle3/core.py builds `layers`).
EXPECTED_NAMES = [
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]

# The parameters of vLLM's Eagle3LlamaForCausalLM (same file) that a checkpoint without embed_tokens fills.
VLLM_PARAMS = {
    "model.fc.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
    "draft_id_to_target_id",
}


def vllm_param_name(name: str) -> str | None:
    """The parameter a checkpoint tensor lands in, following Eagle3LlamaForCausalLM.load_weights and
    LlamaModel.load_weights (stacked_params_mapping) of vllm/model_executor/models/llama_eagle3.py."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for param, shard in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                         (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")):
        if shard in name:
            return name.replace(shard, param)
    return name


def vllm_reads(config: dict) -> tuple[dict, dict]:
    """(speculative config, draft model config) as vLLM derives them from a speculators config.json:
    SpeculatorsConfig.validate_speculators_config / build_vllm_speculative_config
    (vllm/transformers_utils/configs/speculators/base.py) and update_eagle3 (.../speculators/algos.py)."""
    spec = config["speculators_config"]
    methods = spec["proposal_methods"]
    chosen = next((m for m in methods if m.get("proposal_type") == spec.get("default_proposal_method")), methods[0])
    assert spec["verifier"]["name_or_path"]
    assert isinstance(config["transformer_layer_config"], dict)
    speculative = {"method": config["speculators_model_type"], "num_speculative_tokens": chosen["speculative_tokens"]}
    draft = dict(config["transformer_layer_config"])
    draft["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        draft["target_hidden_size"] = config["target_hidden_size"]
    draft["norm_before_residual"] = config.get("norm_before_residual", True)  # vLLM's default is True
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        draft[key] = config.get(key, False)
    draft["architectures"] = [{"llama": "Eagle3LlamaForCausalLM"}[draft.get("model_type", "llama")]]
    if config.get("eagle_aux_hidden_state_layer_ids"):
        draft["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return speculative, draft


def save_eagle(path, target, layers=None, vocab=None, seed=3, intermediate_size=0):
    vocab_map = None if vocab is None else torch.tensor(vocab)
    drafter = Eagle3Drafter.for_target(target.model, vocab_map, layers, seed=seed, intermediate_size=intermediate_size)
    with torch.no_grad():  # norms away from their init, so a swapped norm would show
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    save_drafter(path, drafter, target, "eagle3", config={**drafter.config})
    return drafter.eval()


def hidden_by_layer(target, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The input of every target layer i (HF hidden_states[i], vLLM's aux capture of layer i)."""
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    return dict(enumerate(out.hidden_states[:-1]))


def unroll_inputs(target, steps=3, length=7, seed=0):
    ids = torch.randint(4, target.vocab_size, (2, length + steps), generator=torch.Generator().manual_seed(seed))
    embed = target.model.get_input_embeddings()
    with torch.no_grad():
        embeds = [embed(ids[:, 1 + j:1 + j + length]) for j in range(steps)]
    hidden = {i: h[:, :length] for i, h in hidden_by_layer(target, ids[:, :length]).items()}
    return ids, embeds, hidden


# ---- config ----------------------------------------------------------------------------------------

def test_config_is_what_vllm_and_speculators_read(target, tmp_path):
    drafter = save_eagle(tmp_path / "d", target, vocab=list(range(0, 64, 2)))
    export_speculators(tmp_path / "d", tmp_path / "out", target, num_speculative_tokens=4)
    config = json.loads((tmp_path / "out" / CONFIG_FILE).read_text())
    text = target.model.config

    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    speculative, draft = vllm_reads(config)
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 4}
    assert config["speculators_config"]["verifier"] == {"name_or_path": target.name,
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["proposal_type"] == "greedy"
    assert draft["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert draft["norm_before_residual"] is False  # written: vLLM would assume True
    assert not (draft["norm_before_fc"] or draft["fc_norm"] or draft["norm_output"])
    assert draft["draft_vocab_size"] == 32 and draft["vocab_size"] == target.vocab_size == 64
    assert draft["target_hidden_size"] == text.hidden_size == draft["hidden_size"]
    assert draft["num_hidden_layers"] == 1
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps"):
        assert draft[key] == drafter.config[key], key
    assert draft["head_dim"] == drafter.config["head_dim"] == text.hidden_size // text.num_attention_heads
    assert draft["max_position_embeddings"] == text.max_position_embeddings == 512
    assert draft["rope_theta"] == draft["rope_parameters"]["rope_theta"] == drafter.config["rope_theta"]
    assert "rope_scaling" not in draft and draft["tie_word_embeddings"] is False and draft["hidden_act"] == "silu"
    # the 3-layer target's default layers are [2, 1, 0]; vLLM captures them in ascending order
    assert drafter.target_layers == [2, 1, 0] and draft["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["specdistill"]["target_fingerprint"] == target.fingerprint
    assert config["specdistill"]["target_layers"] == [2, 1, 0]

    layer = LlamaConfig(**config["transformer_layer_config"])  # a valid LlamaConfig, as speculators builds it
    assert (layer.hidden_size, layer.num_hidden_layers, layer.vocab_size, layer.head_dim) == (32, 1, 64, 8)


# What llama.cpp's convert_hf_to_gguf.py reads from an EAGLE-3 checkpoint (conversion/llama.py of the tree that
# llama-cpp-python 0.3.36 vendors): the architecture names it registers for the Llama converter, the hparams it
# detects EAGLE-3 by (draft_vocab_size, and num_hidden_layers 1 once transformer_layer_config is merged in), the keys
# it copies into the GGUF, and from --target-model-dir the target's config.json and tokenizer.
LLAMACPP_EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator",
                                 "Eagle3DraftModel"}


def test_the_export_carries_what_llamacpps_converter_reads(target, tmp_path):
    save_eagle(tmp_path / "d", target, layers=[2, 0, 1])
    out = export_speculators(tmp_path / "d", tmp_path / "out", target)
    config, _ = load_speculators_export(out)
    assert config["architectures"][0] in LLAMACPP_EAGLE3_ARCHITECTURES
    merged = {**config, **config["transformer_layer_config"]}  # what its index_tensors does
    assert "draft_vocab_size" in merged and merged["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["norm_before_residual"] is False
    assert config["target_hidden_size"] == target.model.config.hidden_size
    target_config = json.loads((out / TARGET_DIR / CONFIG_FILE).read_text())  # its --target-model-dir
    assert target_config["vocab_size"] == target.vocab_size
    assert target_config["num_hidden_layers"] == target.model.config.num_hidden_layers == 3
    text = "w5 w9 w63 w4"
    tokenizer = AutoTokenizer.from_pretrained(out / TARGET_DIR)  # the vocabulary written into the draft GGUF
    assert tokenizer(text)["input_ids"] == target.tokenizer(text)["input_ids"]
    assert tokenizer.get_vocab() == target.tokenizer.get_vocab()


def test_verifier_name_can_be_overridden(target, tmp_path):
    save_eagle(tmp_path / "d", target)
    export_speculators(tmp_path / "d", tmp_path / "out", target, verifier="org/tiny")
    config, _ = load_speculators_export(tmp_path / "out")
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # the default


# ---- tensors ---------------------------------------------------------------------------------------

def test_tensor_names_shapes_and_dtypes_are_what_vllm_loads(target, tmp_path):
    vocab = [0, 1, 2, 3, 9, 17, 40, 63]
    drafter = save_eagle(tmp_path / "d", target, vocab=vocab)
    export_speculators(tmp_path / "d", tmp_path / "out", target)
    config, state = load_speculators_export(tmp_path / "out")
    assert sorted(state) == sorted(EXPECTED_NAMES)
    d, hd = 32, 8
    heads, kv, inter, m, v = 4, 2, 64, len(vocab), 64
    shapes = {"fc.weight": (d, 3 * d), "layers.0.input_layernorm.weight": (d,), "layers.0.hidden_norm.weight": (d,),
              "layers.0.self_attn.q_proj.weight": (heads * hd, 2 * d),
              "layers.0.self_attn.k_proj.weight": (kv * hd, 2 * d),
              "layers.0.self_attn.v_proj.weight": (kv * hd, 2 * d),
              "layers.0.self_attn.o_proj.weight": (d, heads * hd), "layers.0.post_attention_layernorm.weight": (d,),
              "layers.0.mlp.gate_proj.weight": (inter, d), "layers.0.mlp.up_proj.weight": (inter, d),
              "layers.0.mlp.down_proj.weight": (d, inter), "norm.weight": (d,), "lm_head.weight": (m, d),
              "d2t": (m,), "t2d": (v,)}
    assert {name: tuple(t.shape) for name, t in state.items()} == shapes
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.float32 for name, t in state.items() if name not in ("d2t", "t2d"))
    # EAGLE-3 offsets: draft index i is target id i + d2t[i]; t2d marks exactly the draft tokens
    assert (torch.arange(m) + state["d2t"]).tolist() == vocab
    assert state["t2d"].nonzero().flatten().tolist() == vocab and int(state["t2d"].sum()) == m
    # every tensor lands in a vLLM parameter, and every parameter is filled
    assert {vllm_param_name(n) for n in state} - {None} == VLLM_PARAMS
    assert torch.equal(state["lm_head.weight"], drafter.lm_head.weight)


def test_bfloat16_export_and_embed_tokens(target, tmp_path):
    save_eagle(tmp_path / "d", target)
    export_speculators(tmp_path / "d", tmp_path / "out", target, dtype=torch.bfloat16, with_embed_tokens=True)
    config, state = load_speculators_export(tmp_path / "out")
    assert state["embed_tokens.weight"].shape == (64, 32)
    assert torch.equal(state["embed_tokens.weight"].float(),
                       target.model.get_input_embeddings().weight.to(torch.bfloat16).float())
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    assert config["transformer_layer_config"]["dtype"] == "bfloat16"
    assert vllm_param_name("embed_tokens.weight") == "model.embed_tokens.weight"


# ---- the exported weights mean the same drafter ----------------------------------------------------

@pytest.mark.parametrize("layers", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_round_trip_gives_the_same_draft_logits(target, tmp_path, layers):
    drafter = save_eagle(tmp_path / "d", target, layers=layers, vocab=list(range(4, 60, 3)))
    export_speculators(tmp_path / "d", tmp_path / "out", target)
    _, embeds, hidden = unroll_inputs(target)
    with torch.no_grad():
        features = torch.cat([hidden[i] for i in drafter.target_layers], dim=-1)
        expected = [drafter.logits(out) for out in drafter.unroll(embeds, features)]
    got = draft_logits_from_export(tmp_path / "out", embeds, hidden)
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected):
        if layers == sorted(layers):
            assert torch.equal(a, b)  # nothing reordered: the very same computation
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fc's blocks permuted: summation order
    assert not torch.equal(expected[0], expected[1])  # the steps differ, so the check is not vacuous


def vllm_step0_logits(config: dict, state: dict, embeds: torch.Tensor, hidden: dict) -> torch.Tensor:
    """The first draft step as vLLM's Eagle3LlamaForCausalLM computes it from the export alone
    (llama_eagle3.py: combine_hidden_states = fc over the aux states in capture order; LlamaDecoderLayer
    with layer_idx 0 and norm_before_residual false; LlamaModel's final norm; compute_logits scattering
    the draft logits to target ids i + d2t[i], every other id -inf). Causal attention over positions 0..T-1,
    neox-style RoPE (rotate-half), as vLLM's Llama attention."""
    layer = config["transformer_layer_config"]
    eps, hd = layer["rms_norm_eps"], layer["head_dim"]
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    w = {name: t.float() for name, t in state.items() if t.is_floating_point()}

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x):  # [B, H, T, hd]
        inv = 1.0 / layer["rope_parameters"]["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
        angles = torch.arange(x.shape[-2]).float()[:, None] * inv
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    aux = torch.cat([hidden[i] for i in sorted(config["eagle_aux_hidden_state_layer_ids"])], dim=-1)
    h = aux @ w["fc.weight"].T
    residual = h
    x = torch.cat([rms(embeds, w["layers.0.input_layernorm.weight"]), rms(h, w["layers.0.hidden_norm.weight"])], -1)
    b, t, _ = x.shape
    q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(b, t, heads, hd).transpose(1, 2)
    k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * hd)
    h = attn @ w["layers.0.self_attn.o_proj.weight"].T + residual
    mlp_in = rms(h, w["layers.0.post_attention_layernorm.weight"])
    gate, up = mlp_in @ w["layers.0.mlp.gate_proj.weight"].T, mlp_in @ w["layers.0.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T
    draft = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((b, t, layer["vocab_size"]), float("-inf"))
    full[..., torch.arange(config["draft_vocab_size"]) + state["d2t"]] = draft
    return full


@pytest.mark.parametrize("layers, width", [(None, 0), ([1, 2, 0], 0), (None, 200)])  # 200: a wider MLP
def test_vllm_computation_on_the_export_matches_the_drafter(target, tmp_path, layers, width):
    vocab = list(range(3, 64, 2))
    drafter = save_eagle(tmp_path / "d", target, layers=layers, vocab=vocab, intermediate_size=width)
    export_speculators(tmp_path / "d", tmp_path / "out", target)
    config, state = load_speculators_export(tmp_path / "out")
    assert config["transformer_layer_config"]["intermediate_size"] == drafter.config["intermediate_size"]
    _, embeds, hidden = unroll_inputs(target, steps=1)
    with torch.no_grad():
        features = torch.cat([hidden[i] for i in drafter.target_layers], dim=-1)
        draft = drafter.logits(drafter.unroll(embeds, features)[0])
    expected = torch.full(draft.shape[:-1] + (target.vocab_size,), float("-inf"))
    expected[..., drafter.vocab_map] = draft
    torch.testing.assert_close(vllm_step0_logits(config, state, embeds[0], hidden), expected, rtol=1e-4, atol=1e-5)


# ---- refusals --------------------------------------------------------------------------------------

def test_refuses_a_drafter_of_another_kind(target, tmp_path):
    save_drafter(tmp_path / "d", None, target, "prompt_lookup", config={})
    with pytest.raises(ValueError, match="'prompt_lookup'"):
        export_speculators(tmp_path / "d", tmp_path / "out", target)
    assert not (tmp_path / "out").exists()


def test_refuses_a_drafter_aligned_to_another_target(target, tmp_path):
    save_eagle(tmp_path / "d", target)
    other = make_tiny_target(seed=1, layers=3)
    with pytest.raises(ValueError, match="fingerprint"):
        export_speculators(tmp_path / "d", tmp_path / "out", other)
    assert not (tmp_path / "out").exists()


def test_refuses_a_drafter_fusing_a_layer_twice(target, tmp_path):
    save_eagle(tmp_path / "d", target, layers=[0, 1, 1])
    with pytest.raises(ValueError, match="twice"):
        export_speculators(tmp_path / "d", tmp_path / "out", target)


def test_out_directory_rules(target, tmp_path):
    save_eagle(tmp_path / "d", target)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="existing file"):
        export_speculators(tmp_path / "d", tmp_path / "file", target)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an earlier export"):
        export_speculators(tmp_path / "d", tmp_path / "busy", target)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="drafter directory"):
        export_speculators(tmp_path / "d", tmp_path / "d", target)
    export_speculators(tmp_path / "d", tmp_path / "out", target, num_speculative_tokens=2)
    export_speculators(tmp_path / "d", tmp_path / "out", target, num_speculative_tokens=3)  # replaces an export
    config, _ = load_speculators_export(tmp_path / "out")
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE, TARGET_DIR])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


# ---- command line ----------------------------------------------------------------------------------

@pytest.fixture
def target_dir(tmp_path):
    path = tmp_path / "target"
    make_tiny_llama(layers=3, seed=0).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def test_cli_exports(target_dir, tmp_path, capsys):
    target = load_target(str(target_dir))
    save_eagle(tmp_path / "d", target)
    code = main([str(tmp_path / "d"), "--format", "speculators", "--out", str(tmp_path / "out"),
                 "--target", str(target_dir), "--num-speculative-tokens", "3"])
    assert code == 0 and str(tmp_path / "out") in capsys.readouterr().out
    config, state = load_speculators_export(tmp_path / "out")
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["specdistill"]["target_fingerprint"] == target.fingerprint
    assert sorted(state) == sorted(EXPECTED_NAMES)


def test_cli_errors_are_clear(target_dir, tmp_path, capsys):
    target = load_target(str(target_dir))
    save_eagle(tmp_path / "d", target)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "d"), "--out", str(tmp_path / "file"), "--target", str(target_dir)])
    assert exit_info.value.code == 2 and "is an existing file" in capsys.readouterr().err
    save_drafter(tmp_path / "lookup", None, target, "prompt_lookup", config={})
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "lookup"), "--out", str(tmp_path / "out"), "--target", str(target_dir)])
    assert exit_info.value.code == 2 and "kind 'prompt_lookup'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--target", str(target_dir)])
    assert exit_info.value.code == 2 and "not a drafter directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
