"""Exports for vLLM's speculative decoding of the kinds other than EAGLE-3 (models.export dispatches here for
`--format vllm`; EAGLE-3 goes to the speculators format, which is what vLLM loads for `method: eagle3`).

draft_model -> an HF model directory vLLM loads as `{"method": "draft_model", "model": DIR}`: the draft LM
    (a `truncated:N` or `small:` spec materialised, or a trained drafter directory), with its tokenizer (the
    target's) and a head over the target's whole vocabulary, as vLLM's draft must have. A reduced head
    (vocab_map: draft row -> target id) is written back exactly: row vocab_map[i] of the exported head is row
    i of the drafter's, so the exported logits at those ids are the drafter's logits. Every other id's row
    is a copy of the row of the nearest smaller id in the draft vocabulary: its logit equals that token's,
    never exceeds the largest draft logit, and a tie goes to the smaller id (argmax takes the first), so
    vLLM's greedy draft is the drafter's. The ids below the draft vocabulary's smallest (none when it holds
    the special tokens, as trained ones do) copy the smallest's row and could win a tie with it; the export
    logs how many there are.
medusa -> vLLM's Medusa checkpoint (`vllm/model_executor/models/medusa.py`, `transformers_utils/configs/
    medusa.py`, read in vLLM 0.32.0): config.json {"model_type": "medusa", "architectures": ["MedusaModel"],
    hidden_size, vocab_size, num_heads, num_hidden_layers, medusa_fc_bias}, weights
    blocks.{head}.layers.{block}.weight/.bias (x + SiLU(W x + b), ours exactly) and lm_heads.{head}.weight.
    vLLM's token_map path sizes its heads by the full vocabulary and cannot load a truncated one, so the heads
    are written over the whole vocabulary; when the drafter decodes with a candidate vocabulary (vocab_map,
    config `draft_vocab`, the only rows training fits), every other id gets the row of the nearest smaller
    candidate, as for draft models: vLLM's argmax over all ids then lands on the candidate ours proposes
    (untrained rows would otherwise win it). Heads vLLM cannot compute are
    refused with the reason: sequential (Hydra) heads read the tree's tokens, a prefix layer re-reads the
    context; vLLM's Medusa reads only the last hidden state.

Each export directory also holds `specdistill_export.json`: the source drafter, its kind, the target's name
and fingerprint it was aligned to (exporting against another target is refused by the drafter loader), and
what vLLM's speculative config needs.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdistill.models.cache import make_temp_sibling, publish_dir
from specdistill.models.drafters import Drafter
from specdistill.models.medusa import projection_rows

log = logging.getLogger(__name__)

PROVENANCE_FILE = "specdistill_export.json"
MEDUSA_WEIGHTS = "model.safetensors"


def export_vllm_draft_model(drafter: Drafter, target, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `drafter` (kind draft_model, loaded for `target`) as a full-vocabulary HF model directory."""
    if drafter.kind != "draft_model":
        raise ValueError(f"export_vllm_draft_model takes a draft_model drafter, got kind {drafter.kind!r}")
    model = copy.deepcopy(drafter.model).to("cpu", dtype)
    vocab = target.vocab_size
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    if drafter.vocab_map is not None:
        head = model.get_output_embeddings().weight.detach()  # [M, D]
        full = full_vocabulary_rows(head, drafter.vocab_map.cpu(), vocab)  # [V, D]
        below = int((torch.arange(vocab) < int(drafter.vocab_map.min())).sum())
        if below:
            log.warning("%d token ids lie below the draft vocabulary's smallest id %d: their rows copy it and win "
                        "a tie with it in vLLM's argmax", below, int(drafter.vocab_map.min()))
        linear = torch.nn.Linear(full.shape[1], vocab, bias=False, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(full)
        model.set_output_embeddings(linear)
        tied = False
    model.config.get_text_config().tie_word_embeddings = tied
    model.config.tie_word_embeddings = tied
    model.config.vocab_size = vocab
    provenance = provenance_of(drafter, target, method="draft_model",
                               extra={"draft_vocab": None if drafter.vocab_map is None else drafter.vocab_map.numel()})

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        target.tokenizer.save_pretrained(tmp)

    return publish_export(out, write, provenance)


def full_vocabulary_rows(head: torch.Tensor, vocab_map: torch.Tensor, vocab: int) -> torch.Tensor:
    """head [M, D] over draft ids -> [V, D] over target ids: row vocab_map[i] = head[i]; any other id t gets
    the row of the largest draft-vocabulary id below t (the smallest one's for ids below all of them)."""
    order = torch.argsort(vocab_map)
    sorted_ids = vocab_map[order]  # [M] ascending target ids
    below = torch.searchsorted(sorted_ids, torch.arange(vocab), right=True) - 1  # [V] index into sorted_ids
    return head[order[below.clamp(min=0)]]


def export_vllm_medusa(drafter: Drafter, target, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `drafter` (kind medusa) as vLLM's Medusa checkpoint, or refuse heads vLLM cannot compute."""
    heads = drafter.model
    config = heads.config
    if getattr(heads, "sequential", False):
        raise ValueError("medusa drafter has sequential (Hydra) heads, which read the embedding of the tree's "
                         "previous token; vLLM's Medusa heads read only the target's last hidden state, so it "
                         "cannot serve them")
    if getattr(heads, "prefix", None) is not None:
        raise ValueError("medusa drafter has a prefix-attention layer (Hydra++), which re-reads the context; vLLM's "
                         "Medusa heads read only the target's last hidden state, so it cannot serve it")
    vocab = target.vocab_size  # vLLM's heads cover the target's ids (ours may hold a candidate vocabulary's only)
    state = medusa_state(heads, dtype, drafter.vocab_map, vocab)
    vllm_config = {"model_type": "medusa", "architectures": ["MedusaModel"],
                   "hidden_size": int(config["hidden_size"]), "vocab_size": vocab,
                   "num_heads": int(config["num_heads"]), "num_hidden_layers": int(config["num_layers"]),
                   "medusa_fc_bias": True, "truncated_vocab_size": vocab,
                   "torch_dtype": str(dtype).removeprefix("torch.")}
    provenance = provenance_of(drafter, target, method="medusa",
                               extra={"draft_vocab": None if drafter.vocab_map is None else drafter.vocab_map.numel()})

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(vllm_config, indent=2) + "\n")
        save_file(state, str(tmp / MEDUSA_WEIGHTS), metadata={"format": "pt"})

    return publish_export(out, write, provenance)


def medusa_state(heads: torch.nn.Module, dtype: torch.dtype, vocab_map: torch.Tensor | None = None,
                 vocab: int | None = None) -> dict[str, torch.Tensor]:
    """Our names (heads.{i}.blocks.{j}.linear.*, heads.{i}.proj.weight) under vLLM's; with a candidate
    vocabulary vocab_map [M], each head's projection over the `vocab` target ids keeps the candidates' rows (a
    reduced head's own [M, D], models.medusa.projection_rows) and fills every other id from the nearest smaller
    candidate (full_vocabulary_rows)."""
    state = {}
    rows = projection_rows(heads, vocab_map)  # K x [M, D] in vocab_map's order, or K x [V, D]
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            state[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight
            state[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias
        proj = rows[i].detach().cpu()
        if vocab_map is not None:
            ids = vocab_map.long().cpu()
            proj = full_vocabulary_rows(proj, ids, vocab if vocab is not None else head.proj.weight.shape[0])
        state[f"lm_heads.{i}.weight"] = proj
    return {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in state.items()}


def provenance_of(drafter: Drafter, target, method: str, extra: dict) -> dict:
    return {"format": "vllm", "vllm_method": method, "kind": drafter.kind,
            "source": drafter.path or drafter.manifest.get("config", {}).get("spec"),
            "target": {"name": target.name, "fingerprint": target.fingerprint}, **extra}


def publish_export(out: Path, write, provenance: dict) -> Path:
    """write(tmp) into a temporary sibling of `out`, the provenance beside it, then renamed into place."""
    tmp = make_temp_sibling(out)
    try:
        write(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s drafter to %s (vLLM method %s)", provenance["kind"], out, provenance["vllm_method"])
    return out


def is_vllm_export(path: Path) -> bool:
    return (path / PROVENANCE_FILE).is_file()
