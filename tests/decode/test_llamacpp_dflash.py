"""DFlash drafters for llama.cpp and vLLM: the export llama.cpp's own converter reads (models/export_dflash.py) and
vLLM's variant of it, and (slow, with `make llamacpp`) the converted GGUF computing our drafter's block as
llama.cpp's `dflash` graph computes it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdistill.models.dflash import DFlashDrafter
from specdistill.models.drafters import save_drafter
from specdistill.models.export_dflash import ARCH_FULL, ARCH_REDUCED, export_dflash


@pytest.fixture(scope="module")
def target():
    from specdistill.models.target import load_target

    return load_target(None)


def saved_dflash(target, path, vocab_map=None, **kw):
    drafter = DFlashDrafter.for_target(target.model, vocab_map, num_layers=2, block_size=4, target_layers=[2, 15, 27],
                                       seed=3, **kw)
    with torch.no_grad():
        drafter.mask_embedding.normal_(0, 1, generator=torch.Generator().manual_seed(1))
    save_drafter(path, drafter, target, "dflash", config={**drafter.config})
    return drafter


def test_the_export_names_dflash_layers_masks_and_the_reduced_head_as_llamacpp_reads_them(target, tmp_path):
    vocab_map = torch.arange(0, target.vocab_size, 5)[:2048]
    drafter = saved_dflash(target, tmp_path / "drafter", vocab_map)
    out = export_dflash(tmp_path / "drafter", tmp_path / "export", target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCH_REDUCED] and config["draft_vocab_size"] == 2048
    assert config["dflash_config"] == {"mask_token_id": target.vocab_size - 1, "block_size": 4,
                                       "target_layer_ids": [1, 14, 26]}  # DFlash names layer outputs: ours - 1
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    assert "mask_embedding" not in state and "t2d" not in state
    assert torch.equal(state["d2t"] + torch.arange(2048), vocab_map)  # offsets, as the converter's DSpark class reads
    assert torch.equal(state["layers.1.self_attn.k_norm.weight"], drafter.layers[1].self_attn.k_norm.weight)
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == target.vocab_size - 1 and torch.equal(mask["embedding"], drafter.mask_embedding)
    assert (out / "target" / "config.json").is_file() and (out / "target" / "tokenizer.json").is_file()


def test_the_vllm_export_is_dflashs_own_class_carrying_the_reduced_head(target, tmp_path):
    from specdistill.models.export import export_for_vllm

    vocab_map = torch.arange(0, target.vocab_size, 5)[:2048]
    saved_dflash(target, tmp_path / "drafter", vocab_map)
    out, method = export_for_vllm(tmp_path / "drafter", tmp_path / "export", target)
    config = json.loads((out / "config.json").read_text())
    assert method == "dflash" and config["architectures"] == [ARCH_FULL]  # vLLM's DSpark is another family
    assert config["draft_vocab_size"] == 2048 and config["vocab_size"] == target.vocab_size
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out / "model.safetensors"))["d2t"] + torch.arange(2048), vocab_map)
    assert (out / "mask_embedding.pt").is_file()
    with pytest.raises(ValueError, match="engine 'sglang'"):
        export_dflash(tmp_path / "drafter", tmp_path / "other", target, engine="sglang")
    assert not (tmp_path / "other").exists()


def test_a_full_vocabulary_head_is_plain_dflash_and_an_earlier_export_is_replaced(target, tmp_path):
    saved_dflash(target, tmp_path / "drafter")
    export_dflash(tmp_path / "drafter", tmp_path / "export", target, mask_token_id=7)
    out = export_dflash(tmp_path / "drafter", tmp_path / "export", target, mask_token_id=9)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCH_FULL] and config["dflash_config"]["mask_token_id"] == 9
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export.")]  # no temporary left behind


def test_bad_exports_are_refused_naming_the_problem(target, tmp_path):
    saved_dflash(target, tmp_path / "drafter")
    with pytest.raises(ValueError, match="end-of-sequence"):
        export_dflash(tmp_path / "drafter", tmp_path / "a", target, mask_token_id=sorted(target.eos_token_ids)[0])
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        export_dflash(tmp_path / "drafter", tmp_path / "b", target, mask_token_id=target.vocab_size)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="non-empty directory"):
        export_dflash(tmp_path / "drafter", tmp_path / "busy", target)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    from specdistill.models.eagle3 import Eagle3Drafter

    eagle = Eagle3Drafter.for_target(target.model, None, [2, 15, 27])
    save_drafter(tmp_path / "eagle", eagle, target, "eagle3", config={**eagle.config})
    with pytest.raises(ValueError, match="kind 'eagle3'"):
        export_dflash(tmp_path / "eagle", tmp_path / "c", target)


# ---- llama.cpp's dflash graph on the converted GGUF (slow) --------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def neox_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """ggml's LLAMA_ROPE_TYPE_NEOX (DFlash's) on [T, H, hd]: dimension i rotates with i + hd / 2."""
    hd = x.shape[-1]
    angles = positions.double()[:, None] * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]  # [T, 1, hd / 2]
    first, second = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def llamacpp_dflash_logits(gguf, hidden: list[torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """What llama.cpp's `dflash` graph (src/models/dflash.cpp) computes from the GGUF: the target features of the
    context positions 0..a-1 (hidden[i] [a, D_target]: the input of target layer i) fused by fc and the encoder's
    norm and injected as each layer's keys/values (k_norm, NeoX RoPE, no input norm); the block [tokens[0], mask,
    ...] at positions a.., attending to every context position and every block row; output_norm, output, the
    draft logits scattered to d2t's target ids, -inf elsewhere. Returns [block, V]."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    w = {t.name: torch.from_numpy(t.data.copy()).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    meta = {k.removeprefix("dflash."): v.contents() for k, v in reader.fields.items() if k.startswith("dflash.")}
    mask_id = reader.fields["tokenizer.ggml.mask_token_id"].contents()
    eps, heads, kv_heads, theta = (meta["attention.layer_norm_rms_epsilon"], meta["attention.head_count"],
                                   meta["attention.head_count_kv"], meta["rope.freq_base"])
    a, size = hidden[0].shape[0], meta["block_size"]
    g = torch.cat([hidden[i] for i in meta["target_layers"]], dim=-1) @ w["fc.weight"].T
    g = rms_norm(g, w["enc.output_norm.weight"], eps)  # [a, D]
    block = torch.tensor([tokens[0]] + [mask_id] * (size - 1))
    h = w["token_embd.weight"][block]  # [Bs, D]
    ctx_pos, block_pos = torch.arange(a), torch.arange(a, a + size)
    for il in range(meta["block_count"]):
        p = f"blk.{il}."
        ck = neox_rope(rms_norm((g @ w[p + "attn_k.weight"].T).view(a, kv_heads, -1), w[p + "attn_k_norm.weight"],
                                eps), ctx_pos, theta)
        cv = (g @ w[p + "attn_v.weight"].T).view(a, kv_heads, -1)
        x = rms_norm(h, w[p + "attn_norm.weight"], eps)
        q = neox_rope(rms_norm((x @ w[p + "attn_q.weight"].T).view(size, heads, -1), w[p + "attn_q_norm.weight"], eps),
                      block_pos, theta)
        k = neox_rope(rms_norm((x @ w[p + "attn_k.weight"].T).view(size, kv_heads, -1), w[p + "attn_k_norm.weight"],
                               eps), block_pos, theta)
        v = (x @ w[p + "attn_v.weight"].T).view(size, kv_heads, -1)
        keys, values = (torch.cat(pair).repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
                        for pair in ((ck, k), (cv, v)))
        attended = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values)  # no mask
        h = h + attended.transpose(0, 1).reshape(size, -1) @ w[p + "attn_output.weight"].T
        m = rms_norm(h, w[p + "ffn_norm.weight"], eps)
        h = h + (torch.nn.functional.silu(m @ w[p + "ffn_gate.weight"].T) * (m @ w[p + "ffn_up.weight"].T)) \
            @ w[p + "ffn_down.weight"].T
    draft = rms_norm(h, w["output_norm.weight"], eps) @ w["output.weight"].T  # [Bs, M]
    logits = torch.full((size, w["token_embd.weight"].shape[0]), float("-inf"))
    logits[:, w["d2t"].long()] = draft
    return logits


@pytest.mark.slow
def test_llamacpps_converter_turns_our_dflash_export_into_the_same_drafter(target, tmp_path):
    """Our export through llama.cpp's own converter, read back and computed as llama.cpp's dflash graph computes
    it, gives our drafter's block logits on the embedded default target's own features."""
    from specdistill.decode.llamacpp_convert import LlamacppNotBuiltError, check_converter_modules, converter_script

    try:
        script = converter_script()
        check_converter_modules()
    except (LlamacppNotBuiltError, RuntimeError) as err:
        pytest.skip(str(err))
    vocab_map = torch.arange(0, target.vocab_size, 7)[:4096]
    drafter = saved_dflash(target, tmp_path / "drafter", vocab_map, init="target_layers")
    export = export_dflash(tmp_path / "drafter", tmp_path / "export", target)
    gguf = tmp_path / "dflash.gguf"
    subprocess.run([sys.executable, str(script), str(export), "--target-model-dir", str(export / "target"),
                    "--outfile", str(gguf), "--outtype", "f32"], check=True, capture_output=True)
    ids = target.encode_chat([{"role": "user", "content": "Name three colours of the sea."}])
    a = len(ids) - 1  # the anchor: the last token; the context is every position before it
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in drafter.target_layers], dim=-1)  # [1, T, 3D]
        first = target.model.get_input_embeddings()(torch.tensor([[ids[a]]]))  # [1, 1, D]
        out = drafter.blocks(features, first, torch.tensor([[a]]))[0, 0]  # [Bs, D]
        ours = torch.full((drafter.block_size, target.vocab_size), float("-inf"))
        ours[:, vocab_map] = drafter.logits(out)
        theirs = llamacpp_dflash_logits(gguf, [h[0, :a] for h in hidden], [ids[a]])
    assert torch.equal(ours[1:].argmax(-1), theirs[1:].argmax(-1))  # rows 1.. are the drafts
    torch.testing.assert_close(theirs[:, vocab_map], ours[:, vocab_map], rtol=1e-4, atol=1e-3)


def test_each_dflash_drafter_is_one_llamacpp_dflash_method_drafting_a_block_of_gamma():
    from types import SimpleNamespace

    from specdistill.decode.llamacpp_peer import DFLASH, EAGLE3, SPEC_ARGS, feature_drafters

    drafters = {"runs/d": SimpleNamespace(kind="dflash", path="runs/d"),
                "runs/d+prompt_lookup": SimpleNamespace(kind="dflash", path="runs/d"),
                "runs/e": SimpleNamespace(kind="eagle3", path="runs/e")}
    assert feature_drafters(drafters, "dflash") == {DFLASH: "runs/d"}  # DIR and DIR+prompt_lookup: one drafter
    assert feature_drafters(drafters, "eagle3") == {EAGLE3: "runs/e"}
    args = SPEC_ARGS["dflash"]("d.gguf", 7)
    assert args[args.index("--spec-type") + 1] == "draft-dflash" and args[args.index("--spec-draft-n-max") + 1] == "7"
    assert args[args.index("--spec-draft-p-min") + 1] == "0"  # no cut-off: the whole block every step
