"""Drafters: what proposes tokens for the target to verify, and the one directory format they are saved in.

A drafter directory:
    manifest.json          {"format_version": 1, "kind", "target": {"name", "fingerprint",
                            "tokenizer_fingerprint"}, "vocab_map", "model", "config", "created", "extra"[,
                            "weights": "q8_0"]}: `weights`, draft models only, has a CPU load round the model to Q8_0
                            blocks that the int8 kernel computes (models.gguf_blocks.attach_q8_0_blocks)
    model/                 the draft LM (save_pretrained, safetensors), for kind draft_model
    vocab_map.safetensors  {"vocab_map": LongTensor [V_draft]}: draft head row -> target token id,
                           when the drafter's head covers only part of the target's vocabulary

Loading one against a target whose fingerprint differs from the manifest's is an error, never garbage.
Kinds other than draft_model and prompt_lookup plug in with `register_drafter_kind`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specdistill.models.cache import make_temp_sibling, publish_dir
from specdistill.models.draft_models import (
    build_small_drafter,
    build_truncated_drafter,
    merged_copy,
    parse_small_spec,
    replace_output_head,
)
from specdistill.models.fingerprint import tokenizer_fingerprint
from specdistill.models.gguf_blocks import attach_q8_0_blocks
from specdistill.models.real_targets import REAL_TARGETS, real_target_dir
from specdistill.models.target import Target, attach_gguf_blocks, load_causal_lm

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_DIR = "model"
VOCAB_MAP_FILE = "vocab_map.safetensors"
SAVED_WEIGHTS = ("q8_0",)  # a draft model's manifest `weights`: what a CPU load rounds it to
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ACCEPTED_SPECS = ("'truncated:N' (the target's first N layers), "
                  "'small:layers=L,hidden=H[,heads=..,kv_heads=..,intermediate=..,seed=..]' (a fresh small Llama), "
                  "'prompt_lookup' (alias 'ngram'), a drafter directory (with manifest.json), "
                  "an HF causal LM directory (with config.json), or a named real target as a draft model "
                  "('qwen2.5-coder-0.5b': fetched and converted like a target); any of these but prompt_lookup "
                  "followed by '+prompt_lookup' adds a prompt-lookup chain to its trees")
LOOKUP_SUFFIX = "+prompt_lookup"


@dataclass
class Drafter:
    kind: str  # "draft_model" | "prompt_lookup" | kinds registered later ("medusa", "lookahead", ...)
    model: torch.nn.Module | None  # an HF causal LM for kind draft_model
    vocab_map: torch.Tensor | None  # LongTensor [V_draft] -> target token id, when the head is reduced
    manifest: dict  # manifest.json contents, or a synthesized one for built-in specs
    path: str | None
    members: list["Drafter"] | None = None  # kind ensemble: the member drafters, in source order
    with_lookup: bool = False  # spec "...+prompt_lookup": decoding adds a prompt-lookup chain to each tree


DrafterLoader = Callable[[Path, dict, Target, str], Drafter]
_KIND_LOADERS: dict[str, DrafterLoader] = {}
# the trained kinds, each registered by its own module (which imports this one): imported when a manifest names it,
# so that load_drafter reads every kind this package writes whatever the caller imported first
BUILTIN_KINDS = {"eagle3": "specdistill.models.eagle3", "dflash": "specdistill.models.dflash",
                 "medusa": "specdistill.models.medusa", "lookahead": "specdistill.models.lookahead"}


def register_drafter_kind(kind: str, loader: DrafterLoader) -> None:
    """Teach load_drafter a new directory kind: loader(path, manifest, target, device) -> Drafter."""
    _KIND_LOADERS[kind] = loader


def kind_loader(kind: str) -> DrafterLoader | None:
    """The loader of a directory kind: a registered one, or a built-in kind's once its module is imported."""
    if kind not in _KIND_LOADERS and kind in BUILTIN_KINDS:
        importlib.import_module(BUILTIN_KINDS[kind])
    return _KIND_LOADERS.get(kind)


# ---- loading ---------------------------------------------------------------------------------------

def load_drafter(spec: str | Path, target: Target, device: str | None = None,
                 allow_target_mismatch: bool = False) -> Drafter:
    """A drafter for `target` from a spec (see ACCEPTED_SPECS), on `device` (default: the target's) in the
    target's dtype."""
    device = str(target.device) if device is None else device
    text = str(spec).strip()
    if text.endswith(LOOKUP_SUFFIX):
        base = text[:-len(LOOKUP_SUFFIX)]
        if base in ("", "prompt_lookup", "ngram") or base.endswith(LOOKUP_SUFFIX):
            raise ValueError(f"drafter spec {text!r}: '+prompt_lookup' follows another drafter's spec, once")
        drafter = load_drafter(base, target, device, allow_target_mismatch)
        if drafter.kind == "lookahead":
            raise ValueError(f"drafter spec {text!r}: a lookahead ([LA]) drafter cannot take a prompt-lookup chain")
        drafter.with_lookup = True
        return drafter
    if text in ("prompt_lookup", "ngram"):
        return Drafter("prompt_lookup", None, None, synthesize_manifest(target, "prompt_lookup", text), None)
    if text.startswith("truncated:"):
        model = build_truncated_drafter(target.model, parse_layer_count(text))
        return Drafter("draft_model", model.to(device), None, synthesize_manifest(target, "draft_model", text), None)
    if text.startswith("small:"):
        model = build_small_drafter(target.model, **parse_small_spec(text[len("small:"):]))
        return Drafter("draft_model", model.to(device), None, synthesize_manifest(target, "draft_model", text), None)
    if text in REAL_TARGETS:  # the classic pair: a smaller sibling of the target, as it comes
        directory = real_target_dir(text)
        drafter = load_hf_drafter(directory, target, device, name=text)
        if torch.device(device).type == "cpu":  # it drafts on its GGUF's own blocks, as a target would run
            attach_gguf_blocks(drafter.model, directory)
        return drafter
    path = Path(text).expanduser()
    if (path / MANIFEST).is_file():
        return load_drafter_dir(path, target, device, allow_target_mismatch)
    if (path / "config.json").is_file():
        return load_hf_drafter(path, target, device)
    if path.exists():
        raise ValueError(f"{path} has neither {MANIFEST} (a drafter directory) nor config.json (an HF model)")
    if "/" in text or text.startswith((".", "~")):
        raise FileNotFoundError(f"drafter path {text!r} does not exist; accepted drafter specs: {ACCEPTED_SPECS}")
    raise ValueError(f"unknown drafter spec {text!r}; accepted: {ACCEPTED_SPECS}")


def parse_layer_count(text: str) -> int:
    try:
        return int(text.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"drafter spec {text!r}: expected truncated:N with an integer N") from None


def synthesize_manifest(target: Target, kind: str, spec: str) -> dict:
    """The manifest a built-in drafter would be saved with (it is aligned to `target` by construction)."""
    return build_manifest(target, kind, {"spec": spec}, has_vocab_map=False, has_model=kind == "draft_model",
                          extra=None)


def load_drafter_dir(path: Path, target: Target, device: str, allow_target_mismatch: bool) -> Drafter:
    manifest = read_manifest(path)
    check_manifest_target(manifest, target, path / MANIFEST, allow_target_mismatch)
    loader = kind_loader(manifest["kind"])
    if loader is None:
        raise ValueError(f"{path / MANIFEST}: unknown drafter kind {manifest['kind']!r} "
                         f"(known: {', '.join(sorted(set(_KIND_LOADERS) | set(BUILTIN_KINDS)))})")
    return loader(path, manifest, target, device)


def read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from err
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file}: format_version {manifest.get('format_version')!r} is not supported "
                         f"(this code reads version {FORMAT_VERSION})")
    missing = [key for key in ("kind", "target") if key not in manifest]
    if missing:
        raise ValueError(f"{file} lacks {', '.join(missing)}")
    return manifest


def check_manifest_target(manifest: dict, target: Target, manifest_path: Path, allow_target_mismatch: bool) -> None:
    """Same tokenizer always; same target weights unless explicitly allowed (then a warning)."""
    recorded = manifest["target"]
    recorded_tok = recorded.get("tokenizer_fingerprint")
    if recorded_tok and recorded_tok != target.tokenizer_fingerprint:
        raise ValueError(f"drafter {manifest_path} was trained with another tokenizer (fingerprint {recorded_tok}) "
                         f"than target {target.name!r} has (fingerprint {target.tokenizer_fingerprint}); "
                         "its token ids would be garbage for this target")
    recorded_fp = recorded.get("fingerprint")
    if recorded_fp != target.fingerprint:
        message = (f"drafter {manifest_path} was aligned to target {recorded.get('name')!r} "
                   f"(fingerprint {recorded_fp}), but the loaded target {target.name!r} has fingerprint "
                   f"{target.fingerprint}")
        if not allow_target_mismatch:
            raise ValueError(message + "; load the target it was trained for, or pass "
                                       "allow_target_mismatch=True to use it anyway")
        log.warning("%s; loading anyway (allow_target_mismatch=True)", message)


def load_draft_model_kind(path: Path, manifest: dict, target: Target, device: str) -> Drafter:
    vocab_map = load_vocab_map(path / manifest["vocab_map"]) if manifest.get("vocab_map") else None
    head_rows = None if vocab_map is None else vocab_map.numel()
    model = load_draft_model(path / manifest.get("model", MODEL_DIR), target.dtype, head_rows)
    check_head_size(model, target, vocab_map, path)
    weights = manifest.get("weights")
    if weights not in (None, *SAVED_WEIGHTS):
        raise ValueError(f"{path / MANIFEST}: `weights` must be one of {', '.join(SAVED_WEIGHTS)} or absent, "
                         f"got {weights!r}")
    if weights == "q8_0" and torch.device(device).type == "cpu" and target.dtype == torch.float32:
        log.info("drafter %s drafts on Q8_0 blocks: %d matrices", path, attach_q8_0_blocks(model))
    return Drafter("draft_model", model.to(device).eval(), vocab_map.to(device) if vocab_map is not None else None,
                   manifest, str(path))


def load_prompt_lookup_kind(path: Path, manifest: dict, target: Target, device: str) -> Drafter:
    return Drafter("prompt_lookup", None, None, manifest, str(path))


def load_ensemble_kind(path: Path, manifest: dict, target: Target, device: str) -> Drafter:
    """An ensemble directory: `members` lists member drafter directories (relative paths), each a
    complete drafter directory of its own, checked against the same target."""
    names = manifest.get("members")
    if not isinstance(names, list) or not names:
        raise ValueError(f"{path / MANIFEST}: an ensemble needs a non-empty list `members`")
    for key, least in (("max_tree_nodes", 2), ("branches", 1)):  # optional; the decoder's defaults are 16 and 1
        value = manifest.get(key, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{path / MANIFEST}: `{key}` must be an integer >= {least}, got {value!r}")
    members = []
    for name in names:
        member_path = (path / name).resolve()
        if not (member_path / MANIFEST).is_file():
            raise FileNotFoundError(f"{path / MANIFEST}: member {name!r} has no {MANIFEST} at {member_path}")
        members.append(load_drafter_dir(member_path, target, device, allow_target_mismatch=False))
    return Drafter("ensemble", None, None, manifest, str(path), members=members)


register_drafter_kind("draft_model", load_draft_model_kind)
register_drafter_kind("ensemble", load_ensemble_kind)
register_drafter_kind("prompt_lookup", load_prompt_lookup_kind)


def load_vocab_map(file: Path) -> torch.Tensor:
    vocab_map = load_file(str(file))["vocab_map"]
    if vocab_map.dim() != 1 or vocab_map.dtype != torch.long:
        raise ValueError(f"{file}: vocab_map must be a 1-D int64 tensor, "
                         f"got {vocab_map.dtype} {tuple(vocab_map.shape)}")
    return vocab_map


def load_draft_model(model_dir: Path, dtype: torch.dtype, head_rows: int | None) -> torch.nn.Module:
    """Build the model from its config and load every weight strictly (from_pretrained would silently
    re-initialise missing weights); `head_rows` sizes a reduced-vocabulary head."""
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if head_rows is not None:
        replace_output_head(model, head_rows)
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    if not state:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    check_all_weights_loaded(model, state, result, model_dir)
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model


def check_all_weights_loaded(model, state: dict, result, model_dir: Path) -> None:
    """Every parameter came from the checkpoint, either directly or tied to one that did."""
    loaded = {tensor.data_ptr() for name, tensor in model.state_dict().items() if name in state}
    params = model.state_dict()
    missing = [name for name in result.missing_keys if params[name].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise ValueError(f"{model_dir} does not match its config: missing {missing}, "
                         f"unexpected {list(result.unexpected_keys)}")


def load_hf_drafter(path: Path, target: Target, device: str, name: str | None = None) -> Drafter:
    """A plain HF causal LM used as a drafter: same vocabulary and, when it has one, same tokenizer. `name`: the
    spec it was asked by (a named real target), recorded in its manifest in place of the path."""
    model = load_causal_lm(str(path), target.dtype)
    check_head_size(model, target, None, path)
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        draft_tok = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(path)))
        if draft_tok != target.tokenizer_fingerprint:
            raise ValueError(f"drafter {path} has another tokenizer (fingerprint {draft_tok}) than target "
                             f"{target.name!r} (fingerprint {target.tokenizer_fingerprint})")
    manifest = synthesize_manifest(target, "draft_model", name or str(path))
    return Drafter("draft_model", model.to(device).eval(), None, manifest, str(path))


def check_head_size(model: torch.nn.Module, target: Target, vocab_map: torch.Tensor | None, path) -> None:
    rows = model.get_output_embeddings().weight.shape[0]
    expected = target.vocab_size if vocab_map is None else vocab_map.numel()
    if rows != expected:
        what = "the target's vocabulary" if vocab_map is None else "its vocab_map"
        raise ValueError(f"drafter {path} has a {rows}-token head but {what} has {expected} tokens "
                         f"(target {target.name!r})")
    if vocab_map is not None and (int(vocab_map.min()) < 0 or int(vocab_map.max()) >= target.vocab_size):
        raise ValueError(f"drafter {path}: vocab_map points outside the target's {target.vocab_size} tokens")


# ---- saving ----------------------------------------------------------------------------------------

def save_drafter(path: str | Path, model: torch.nn.Module | None, target: Target, kind: str, config,
                 vocab_map: torch.Tensor | None = None, extra: dict | None = None, weights: str | None = None) -> Path:
    """Write a drafter directory at `path`, atomically (a reader sees the old directory or the complete
    new one, never a partial write). LoRA adapters are merged into a copy first. `config` is the
    resolved training config: a dict or a dataclass. `weights` (draft models): "q8_0" has the loader round the
    model to Q8_0 blocks on a CPU (models.gguf_blocks.attach_q8_0_blocks), as a model trained from a K-quant
    sibling drafts; None keeps its weights as saved."""
    if weights not in (None, *SAVED_WEIGHTS) or (weights is not None and kind != "draft_model"):
        raise ValueError(f"save_drafter: weights {weights!r} (kind {kind!r}): only a draft_model takes one of "
                         f"{', '.join(SAVED_WEIGHTS)}")
    path = Path(path).expanduser().absolute()
    if kind == "draft_model" and model is None:
        raise ValueError("save_drafter: kind 'draft_model' needs a model")
    if model is not None and not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_drafter: {type(model).__name__} has no save_pretrained (pass the HF model, "
                        "unwrapped from DDP/accelerate)")
    if vocab_map is not None:
        vocab_map = checked_vocab_map(vocab_map, target)
    manifest = build_manifest(target, kind, config, vocab_map is not None, model is not None, extra)
    if weights is not None:
        manifest["weights"] = weights
    manifest_text = json.dumps(manifest, indent=2)  # fail on unserializable config before writing anything
    tmp = make_temp_sibling(path)
    try:
        if model is not None:
            merged_copy(model).save_pretrained(tmp / MODEL_DIR)
        if vocab_map is not None:
            save_file({"vocab_map": vocab_map}, str(tmp / VOCAB_MAP_FILE))
        (tmp / MANIFEST).write_text(manifest_text)
        publish_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved %s drafter to %s", kind, path)
    return path


def checked_vocab_map(vocab_map: torch.Tensor, target: Target) -> torch.Tensor:
    vocab_map = torch.as_tensor(vocab_map)
    if vocab_map.dim() != 1 or vocab_map.is_floating_point():
        raise ValueError(f"vocab_map must be a 1-D integer tensor, got {vocab_map.dtype} {tuple(vocab_map.shape)}")
    if int(vocab_map.min()) < 0 or int(vocab_map.max()) >= target.vocab_size:
        raise ValueError(f"vocab_map points outside the target's {target.vocab_size} tokens")
    return vocab_map.detach().to(device="cpu", dtype=torch.long).contiguous()


def build_manifest(target: Target, kind: str, config, has_vocab_map: bool, has_model: bool,
                   extra: dict | None) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "target": {"name": target.name, "fingerprint": target.fingerprint,
                   "tokenizer_fingerprint": target.tokenizer_fingerprint},
        "vocab_map": VOCAB_MAP_FILE if has_vocab_map else None,
        "model": MODEL_DIR if has_model else None,
        "config": jsonable(config, "config"),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "extra": jsonable(extra or {}, "extra"),
    }


def jsonable(value, where: str):
    """`value` as plain JSON types (dataclasses, paths, dtypes and enums converted); names the bad key."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(key): jsonable(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(item, where) for item in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value, where)
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    raise TypeError(f"{where} = {value!r} ({type(value).__name__}) cannot be written to {MANIFEST}")
