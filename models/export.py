"""Export a drafter for a serving engine: `python -m models.export DRAFTER --format speculators --out DIR`.

Only kind `eagle3` exports for now, to the checkpoint format of the `speculators` library's EAGLE-3
models (the HF repos `RedHatAI/...-speculator.eagle3`), which vLLM serves with
`--speculative-config '{"method": "eagle3", "model": DIR, ...}'` (or `vllm serve DIR`: vLLM then reads the
verifier from the config and serves it with DIR as its drafter). The export directory:

    config.json         speculators' Eagle3SpeculatorConfig (below), plus a `specdistill` provenance key
    model.safetensors   the drafter's weights under speculators' names (below)
    target/             the target's config.json and tokenizer files, for llama.cpp's converter (below)

llama.cpp converts the export with its own `convert_hf_to_gguf.py EXPORT --target-model-dir EXPORT/target` (read in
the tree llama-cpp-python 0.3.36 vendors, `conversion/llama.py`): it refuses an EAGLE-3 drafter without
--target-model-dir, reads the target's `vocab_size` and `num_hidden_layers` from that directory's config.json (the
aux layer ids and target_hidden_size it takes from ours), and writes that directory's tokenizer into the draft GGUF,
whose vocabulary llama-server requires to be the target's. So the export carries them (`target/`); vLLM ignores the
folder. The converter needs the `sentencepiece` module even for a BPE tokenizer (it tries that loader first and only
a missing tokenizer.model, not a missing module, makes it fall back). It maps our names as we write them: fc -> fc,
layers.0.{input_layernorm, hidden_norm, q/k/v/o_proj, post_attention_layernorm, mlp} -> blk.0.{attn_norm,
attn_norm_2, attn_q/k/v/output, ffn_norm, ffn_gate/up/down} (q and k permuted for its interleaved RoPE), norm ->
output_norm, lm_head -> output, d2t -> absolute target ids (d2t + arange), t2d dropped.

What was read to choose the names (public sources, read in 2026-08):
  * vLLM `vllm/model_executor/models/llama_eagle3.py` (commit 00bd1493):
    `Eagle3LlamaForCausalLM.load_weights` skips any name containing "t2d", renames "d2t" to
    `draft_id_to_target_id` (a [draft_vocab_size] int64 parameter; `compute_logits` scatters draft logit i to
    target id i + d2t[i], every other id -inf), prefixes every name without "lm_head" with "model.";
    `LlamaModel.load_weights` renames "midlayer." to "layers.0." and stacks q/k/v_proj into qkv_proj and
    gate/up_proj into gate_up_proj. `embed_tokens` is optional: without it, the drafter has no embedding
    of its own (`process_eagle_weight` leaves `has_own_embed_tokens` False) and vLLM shares the target's,
    which is what our drafter does. `fc` takes 3 x `target_hidden_size` when the config has it. The
    decoder layer is ours: input_layernorm on the embedding, hidden_norm on the state, q/k/v over their
    [2D] concatenation (embedding first), the residual the un-normed state when `norm_before_residual`
    is false; the model's final norm gives the head's input and the pre-norm sum the next step's state.
  * vLLM `vllm/transformers_utils/configs/speculators/base.py` and `algos.py` (several versions): a
    config.json with `speculators_config` is a speculators model; it must have
    `speculators_config.proposal_methods[0].speculative_tokens` (newer versions honour
    `default_proposal_method`), `speculators_config.verifier.name_or_path`, `speculators_model_type` and
    a dict `transformer_layer_config`, which becomes the drafter's HF config; `update_eagle3` copies
    `draft_vocab_size`, `target_hidden_size`, `norm_before_residual` (DEFAULT TRUE when absent, so we
    write false explicitly), `norm_before_fc`, `fc_norm`, `norm_output` and, when present,
    `eagle_aux_hidden_state_layer_ids`, and picks the architecture from transformer_layer_config's
    `model_type` ("llama" -> Eagle3LlamaForCausalLM).
  * vLLM's aux-layer capture (`EagleModelMixin._maybe_add_hidden_state` in
    `vllm/model_executor/models/interfaces.py`, and the loop of `llama.py`): while running layer idx it
    appends the residual stream ENTERING layer idx when `idx in aux_hidden_state_layers` (a membership
    test), so the fused features are concatenated in ascending layer order, each layer once;
    `get_eagle3_aux_layers_from_config` (`vllm/v1/.../eagle3_utils.py`) takes the ids from the drafter's
    `eagle_aux_hidden_state_layer_ids`, else the target's default (2, L // 2, L - 3). Our `target_layers`
    use the same "input of layer i" convention (HF hidden_states[i]), but our features are concatenated
    in `target_layers` order: the export writes the ids sorted and permutes fc's column blocks to match.
    A drafter that fuses one layer twice cannot be served (vLLM would capture it once): refused.
  * speculators (github.com/vllm-project/speculators, commit c05b95b3): `models/eagle3/config.py`
    (`Eagle3SpeculatorConfig`: architectures ["Eagle3Speculator"], speculators_model_type "eagle3",
    transformer_layer_config, draft_vocab_size, norm_before_residual, target_hidden_size,
    eagle_aux_hidden_state_layer_ids, norm_before_fc, fc_norm, norm_output, embed_requires_grad),
    `config.py` (SpeculatorsConfig: algorithm, proposal_methods, default_proposal_method, verifier
    {name_or_path, architectures}), `proposals/greedy.py` (proposal_type "greedy", speculative_tokens,
    verifier_accept_k, accept_tolerance), `convert/eagle/eagle3_converter.py` (renames "midlayer." to
    "layers.0.", builds transformer_layer_config as a LlamaConfig with tie_word_embeddings false and
    max_position_embeddings from the verifier), `models/eagle3/core.py` and `model.py` (state dict:
    fc, layers.0.*, norm, lm_head, d2t [draft] int64, t2d [target vocab] bool with exactly
    draft_vocab_size true entries, optional embed_tokens).

Names chosen: speculators' own (`layers.0.*`, not EAGLE's `midlayer.*`; vLLM accepts both), d2t/t2d
always written (speculators omits them for a full-vocabulary head; vLLM then uses the identity, which a
zero d2t also gives), embed_tokens only with `--with-embed-tokens` (a copy of the target's input
embedding; vLLM shares the target's otherwise). transformer_layer_config carries both `rope_theta` and
`rope_parameters` (transformers 4 and 5 read different ones) and no `rope_scaling`: our drafter applies
plain RoPE whatever the target does. The verifier is the target's name, except the embedded default,
which is written as its hub id (HuggingFaceTB/SmolLM2-135M-Instruct); note that the embedded target is
that model dequantized from a 4-bit GGUF, so its fingerprint (in `specdistill`) is not the hub
checkpoint's. `--verifier` overrides the name.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdistill.models.cache import make_temp_sibling, publish_dir
from specdistill.models.drafters import MANIFEST, load_drafter, read_manifest
from specdistill.models.eagle3 import Eagle3Drafter, check_config
from specdistill.models.embedded import EMBEDDED_NAME
from specdistill.models.export_dflash import is_dflash_export
from specdistill.models.export_vllm import export_vllm_draft_model, export_vllm_medusa, is_vllm_export

log = logging.getLogger(__name__)

FORMATS = ("speculators", "vllm", "dflash")
VLLM_KINDS = ("draft_model", "eagle3", "medusa", "dflash")  # what vLLM's speculative decoding loads
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_PREFIX = "layers.0."  # speculators' name of the one decoder layer (our `midlayer.`)
TARGET_DIR = "target"  # the target's config.json and tokenizer, for llama.cpp's converter (--target-model-dir)


# ---- export ----------------------------------------------------------------------------------------

def export_speculators(drafter_path: str | Path, out: str | Path, target, *, num_speculative_tokens: int = 5,
                       verifier: str | None = None, dtype: torch.dtype = torch.float32,
                       with_embed_tokens: bool = False) -> Path:
    """Write the eagle3 drafter at `drafter_path`, checked against `target`, as a speculators EAGLE-3
    checkpoint at `out` (atomically: a temporary sibling renamed into place). Returns `out`."""
    drafter_path = Path(drafter_path).expanduser().absolute()
    out = check_out_dir(out, drafter_path)
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    kind = drafter_kind(drafter_path)
    if kind != "eagle3":
        raise ValueError(f"drafter {drafter_path} is of kind {kind!r}; only kind 'eagle3' can be exported to "
                         "the speculators format for now")
    drafter = load_drafter(str(drafter_path), target)  # checks the manifest's target fingerprint
    model: Eagle3Drafter = drafter.model
    config = speculators_config(model, target, drafter.manifest, num_speculative_tokens, verifier, dtype)
    state = speculators_state(model, dtype, target if with_embed_tokens else None)
    tmp = make_temp_sibling(out)
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        write_target_files(target, tmp / TARGET_DIR)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported eagle3 drafter %s to %s (speculators format, aux layers %s)", drafter_path, out,
             config["eagle_aux_hidden_state_layer_ids"])
    return out


def write_target_files(target, directory: Path) -> None:
    """The target's HF config.json and tokenizer files in `directory`: what llama.cpp's converter reads through
    --target-model-dir (module docstring), so that an export converts with no file copied in by hand."""
    directory.mkdir(parents=True)
    text = target.model.config.get_text_config()
    text.save_pretrained(directory)  # config.json: vocab_size, num_hidden_layers, hidden_size, architectures
    target.tokenizer.save_pretrained(directory)  # tokenizer.json, tokenizer_config.json, its chat template
    written = json.loads((directory / CONFIG_FILE).read_text())
    if written.get("vocab_size") != target.vocab_size:
        raise ValueError(f"the target's config says vocab_size {written.get('vocab_size')!r} but its embedding "
                         f"has {target.vocab_size} rows; llama.cpp's converter would write the wrong vocabulary")


def check_out_dir(out: str | Path, drafter_path: Path | None) -> Path:
    """`out` may be absent, an empty directory or an earlier export (replaced); anything else is refused.
    drafter_path: the drafter directory exported (None for a built-in spec), which `out` must not replace."""
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file; give a directory path (it is created)")
    if drafter_path is not None and (out.resolve() == drafter_path.resolve()
                                     or drafter_path.resolve().is_relative_to(out.resolve())):
        raise ValueError(f"--out {out} would replace the drafter directory {drafter_path} itself")
    if out.is_dir() and any(out.iterdir()) and not (is_speculators_dir(out) or is_vllm_export(out)
                                                    or is_dflash_export(out)):
        raise ValueError(f"--out {out} is a non-empty directory that is not an earlier export; "
                         "give a new or empty directory (an earlier export there is replaced)")
    return out


def export_for_vllm(drafter_spec: str | Path, out: str | Path, target, *, num_speculative_tokens: int = 5,
                    verifier: str | None = None, dtype: torch.dtype = torch.float32) -> tuple[Path, str]:
    """`--format vllm`: the drafter (a directory, or a built-in draft-model spec such as truncated:4) in the
    format vLLM loads for its kind; returns (out, vLLM's speculative `method`). Kinds vLLM does not load are
    refused naming the ones it does."""
    text = str(drafter_spec)
    is_dir = (Path(text).expanduser() / MANIFEST).is_file()
    source = Path(text).expanduser().absolute()
    out = check_out_dir(out, source if is_dir else None)
    if is_dir and drafter_kind(source) == "eagle3":
        return export_speculators(source, out, target, num_speculative_tokens=num_speculative_tokens,
                                  verifier=verifier, dtype=dtype), "eagle3"
    if is_dir and drafter_kind(source) == "dflash":
        from specdistill.models.export_dflash import export_dflash

        return export_dflash(source, out, target, engine="vllm"), "dflash"
    drafter = load_drafter(str(source) if is_dir else text, target)  # checks the manifest's target fingerprint
    if drafter.with_lookup:
        raise ValueError(f"drafter {text!r}: '+prompt_lookup' is a decoding option of ours, not a drafter vLLM "
                         "loads; export the drafter without it")
    if drafter.kind == "draft_model":
        return export_vllm_draft_model(drafter, target, out, dtype), "draft_model"
    if drafter.kind == "medusa":
        return export_vllm_medusa(drafter, target, out, dtype), "medusa"
    raise ValueError(f"drafter {text!r} is of kind {drafter.kind!r}, which vLLM's speculative decoding does not "
                     f"load (it loads {', '.join(VLLM_KINDS)}; prompt lookup is its built-in `ngram` method)")


def is_speculators_dir(path: Path) -> bool:
    try:
        return "speculators_model_type" in json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False


def drafter_kind(path: Path) -> str:
    if not (path / MANIFEST).is_file():
        raise ValueError(f"{path} is not a drafter directory (no {MANIFEST}); export takes a trained drafter "
                         "directory")
    return str(read_manifest(path)["kind"])


def aux_layer_order(target_layers: Sequence[int]) -> list[int]:
    """Positions of `target_layers` in ascending layer order (vLLM concatenates the captured layers so);
    refuses a layer fused twice, which vLLM's membership test would capture once."""
    layers = [int(i) for i in target_layers]
    if len(set(layers)) != len(layers):
        raise ValueError(f"eagle3 drafter fuses target layers {layers}, one of them twice; vLLM captures each "
                         "aux layer once (eagle_aux_hidden_state_layer_ids is a set of layer indices), so this "
                         "drafter cannot be served by it; train one with three distinct eagle3_layers")
    return sorted(range(len(layers)), key=lambda k: layers[k])


def speculators_state(model: Eagle3Drafter, dtype: torch.dtype, target=None) -> dict[str, torch.Tensor]:
    """The drafter's state dict under speculators' names: floats in `dtype`, d2t int64, t2d bool, fc's
    column blocks in ascending aux-layer order; `embed_tokens.weight` from `target` when given."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("midlayer."):
            name = LAYER_PREFIX + name[len("midlayer."):]
        state[name] = tensor.detach().to("cpu")
    width = model.config["target_hidden_size"]
    order = aux_layer_order(model.target_layers)
    state["fc.weight"] = torch.cat([state["fc.weight"][:, k * width:(k + 1) * width] for k in order], dim=1)
    for name, tensor in state.items():
        if tensor.is_floating_point():
            state[name] = tensor.to(dtype)
    state["d2t"] = state["d2t"].to(torch.int64)
    state["t2d"] = state["t2d"].to(torch.bool)
    if target is not None:
        state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().to("cpu", dtype)
    return {name: tensor.contiguous() for name, tensor in state.items()}


def speculators_config(model: Eagle3Drafter, target, manifest: dict, num_speculative_tokens: int,
                       verifier: str | None, dtype: torch.dtype) -> dict:
    """config.json: speculators' Eagle3SpeculatorConfig, with our provenance under `specdistill`."""
    c = model.config
    text = target.model.config.get_text_config()
    embed_dim = target.model.get_input_embeddings().weight.shape[1]
    if c["hidden_size"] != embed_dim:
        raise ValueError(f"eagle3 drafter hidden size {c['hidden_size']} differs from the target's embedding "
                         f"size {embed_dim}; vLLM feeds the target's embeddings to the drafter layer")
    if c["target_hidden_size"] != text.hidden_size:
        raise ValueError(f"eagle3 drafter fuses {c['target_hidden_size']}-wide features but the target's hidden "
                         f"size is {text.hidden_size}")
    if c["vocab_size"] != target.vocab_size:
        raise ValueError(f"eagle3 drafter was built for a {c['vocab_size']}-token vocabulary but the target has "
                         f"{target.vocab_size}")
    layers = [int(i) for i in model.target_layers]
    aux_ids = [layers[k] for k in aux_layer_order(layers)]
    if 0 in aux_ids:
        log.warning("the drafter fuses the input of layer 0 (the embeddings); vLLM versions before "
                    "EagleModelMixin (residual None at layer 0) cannot capture it")
    dtype_name = str(dtype).removeprefix("torch.")
    layer_config = {
        "model_type": "llama",
        "vocab_size": int(target.vocab_size), "hidden_size": int(c["hidden_size"]),
        "intermediate_size": int(c["intermediate_size"]), "num_hidden_layers": 1,
        "num_attention_heads": int(c["num_attention_heads"]), "num_key_value_heads": int(c["num_key_value_heads"]),
        "head_dim": int(c["head_dim"]), "hidden_act": "silu",
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", None) or 4096),
        "initializer_range": 0.02, "rms_norm_eps": float(c["rms_norm_eps"]), "use_cache": True,
        "rope_theta": float(c["rope_theta"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(c["rope_theta"])},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(text, "bos_token_id", None), "eos_token_id": getattr(text, "eos_token_id", None),
        "pad_token_id": getattr(text, "pad_token_id", None),
        "dtype": dtype_name, "torch_dtype": dtype_name,
    }
    name = verifier or (EMBEDDED_HUB_ID if target.name == EMBEDDED_NAME else target.name)
    architectures = list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])
    recorded = manifest.get("target") or {}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(c["draft_vocab_size"]),
        "target_hidden_size": int(c["target_hidden_size"]),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": architectures},
        },
        "specdistill": {
            "kind": "eagle3",
            "target_name": target.name,
            "target_fingerprint": target.fingerprint,
            "tokenizer_fingerprint": target.tokenizer_fingerprint,
            "target_layers": layers,
            "drafter_created": manifest.get("created"),
            "recorded_target": recorded.get("name"),
            "exported": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    }


# ---- reading an export back (tests, checks) --------------------------------------------------------

def load_speculators_export(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, the state dict) of an export directory."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{path / CONFIG_FILE}: speculators_model_type is "
                         f"{config.get('speculators_model_type')!r}, not 'eagle3'")
    return config, load_file(str(path / WEIGHTS_FILE))


def drafter_from_export(path: str | Path) -> Eagle3Drafter:
    """An Eagle3Drafter rebuilt from an export alone (its target_layers the sorted aux ids, its fc in that
    order): what the export means, for comparing with the drafter it came from."""
    config, state = load_speculators_export(path)
    layer = config["transformer_layer_config"]
    if config.get("norm_before_residual", True) or any(config.get(k) for k in ("norm_before_fc", "fc_norm",
                                                                                 "norm_output")):
        raise ValueError(f"{path}: only norm_before_residual=false without fc norms is an Eagle3Drafter")
    rope = layer.get("rope_parameters") or {}
    arch = {"hidden_size": layer["hidden_size"], "target_hidden_size": config["target_hidden_size"],
            "num_attention_heads": layer["num_attention_heads"],
            "num_key_value_heads": layer["num_key_value_heads"], "head_dim": layer["head_dim"],
            "intermediate_size": layer["intermediate_size"], "rms_norm_eps": layer["rms_norm_eps"],
            "rope_theta": float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
            "draft_vocab_size": config["draft_vocab_size"], "vocab_size": layer["vocab_size"],
            "target_layers": list(config["eagle_aux_hidden_state_layer_ids"])}
    check_config(arch)
    ours = {}
    for name, tensor in state.items():
        if name == "embed_tokens.weight":
            continue
        if name.startswith(LAYER_PREFIX):
            name = "midlayer." + name[len(LAYER_PREFIX):]
        ours[name] = tensor.float() if tensor.is_floating_point() else tensor
    drafter = Eagle3Drafter(arch)
    drafter.load_state_dict(ours, strict=True)
    return drafter.eval()


@torch.no_grad()
def draft_logits_from_export(path: str | Path, embeds: list[torch.Tensor],
                             features_by_layer: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Per unroll step, the draft logits [B, T, M] the exported weights give; `features_by_layer[i]` is the
    input of target layer i [B, T, D] (the export fuses its aux layers in ascending order, as vLLM does)."""
    drafter = drafter_from_export(path)
    features = torch.cat([features_by_layer[i] for i in drafter.target_layers], dim=-1)
    return [drafter.logits(out) for out in drafter.unroll([e.float() for e in embeds], features.float())]


# ---- command line ----------------------------------------------------------------------------------

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("drafter", help="a drafter directory (manifest.json); for --format vllm also a built-in draft "
                   "model spec (truncated:N, small:...)")
    p.add_argument("--format", choices=FORMATS, default="speculators",
                   help="speculators: the speculators library's EAGLE-3 checkpoint, which vLLM loads for "
                        "method eagle3 (kind eagle3 only); vllm: what vLLM loads for the drafter's kind "
                        "(draft_model: an HF directory with a full-vocabulary head; eagle3: speculators; "
                        "medusa: vLLM's Medusa checkpoint); dflash: the checkpoint llama.cpp's convert_hf_to_gguf.py "
                        "turns into a `dflash` GGUF (kind dflash only; models/export_dflash.py)")
    p.add_argument("--out", required=True, help="output directory (created; an earlier export there is replaced)")
    p.add_argument("--target", default=None, help="the target the drafter was trained for: an HF model directory, "
                   "a .gguf file, a hub id in the local HF cache, or nothing for the embedded default "
                   "(SmolLM2-135M-Instruct); its fingerprint must match the drafter's manifest")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=5,
                   help="speculative_tokens of the greedy proposal method (vLLM's num_speculative_tokens)")
    p.add_argument("--verifier", default=None, help="verifier name_or_path written to the config (what vLLM loads "
                   "as the target); default: the target's name (the embedded default: its hub id)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the exported weights")
    p.add_argument("--mask-token-id", type=int, default=None, help="--format dflash: the target id whose embedding "
                   "row carries the drafter's mask embedding (default: the vocabulary's last id)")
    p.add_argument("--with-embed-tokens", action="store_true",
                   help="also write embed_tokens.weight (a copy of the target's input embedding); by default "
                        "vLLM shares the target's")
    return p


def main_dflash(parser: argparse.ArgumentParser, args, load_target) -> int:
    from specdistill.models.export_dflash import export_dflash

    try:
        target = load_target(args.target)
    except (ValueError, OSError) as err:
        parser.error(f"argument --target: {err}")
    try:
        out = export_dflash(args.drafter, args.out, target, mask_token_id=args.mask_token_id)
    except (ValueError, FileNotFoundError) as err:
        parser.error(f"argument drafter: {err}")
    sys.stdout.write(f"{out}\n")
    log.info("convert it with llama.cpp's convert_hf_to_gguf.py %s --target-model-dir %s/%s", out, out, TARGET_DIR)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specdistill.models.target import load_target  # deferred so --help stays fast

    if args.format == "vllm":
        try:
            target = load_target(args.target)
        except (ValueError, OSError) as err:
            parser.error(f"argument --target: {err}")
        try:
            out, method = export_for_vllm(args.drafter, args.out, target,
                                          num_speculative_tokens=args.num_speculative_tokens,
                                          verifier=args.verifier, dtype=DTYPES[args.dtype])
        except (ValueError, FileNotFoundError) as err:
            parser.error(f"argument drafter: {err}")
        sys.stdout.write(f"{out}\n")
        log.info("serve it with vLLM's speculative_config {'method': %r, 'model': %r, ...}", method, str(out))
        return 0
    if args.format == "dflash":
        return main_dflash(parser, args, load_target)
    try:
        out = check_out_dir(args.out, Path(args.drafter).expanduser().absolute())
    except ValueError as err:
        parser.error(str(err))
    drafter_path = Path(args.drafter).expanduser().absolute()
    try:
        kind = drafter_kind(drafter_path)
    except (ValueError, OSError) as err:
        parser.error(f"argument drafter: {err}")
    if kind != "eagle3":
        parser.error(f"argument drafter: {drafter_path} is of kind {kind!r}; only kind 'eagle3' can be exported "
                     f"to the {args.format} format for now")
    try:
        target = load_target(args.target)
    except (ValueError, OSError) as err:
        parser.error(f"argument --target: {err}")
    try:
        export_speculators(drafter_path, out, target, num_speculative_tokens=args.num_speculative_tokens,
                           verifier=args.verifier, dtype=DTYPES[args.dtype], with_embed_tokens=args.with_embed_tokens)
    except ValueError as err:
        parser.error(f"argument drafter: {err}")
    sys.stdout.write(f"{out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
