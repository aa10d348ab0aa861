"""EAGLE-3's hidden states read off the teacher's own generation: no second pass of the target.

Writing the teacher data (distill.teacher_data, the built-in generator) runs the target over every prompt and
every answer token but the last; the feature cache (distill.feature_cache) then ran it over all of them again to
read the inputs of the drafter's three layers and the final normed state. With a `FeatureStaging`, the generator
keeps those rows as it computes them (`LayerCapture`: hooks on the generating copy's decoder layers and final
norm), feeds each answer's last token once more (`feed_last_tokens`: the one position generation never computes),
and stages every record's rows on disk; the feature cache takes a staged record instead of computing it.

Staged rows are the target's rows over the whole conversation, as decoding reads them (the feature cache cuts its
window out of them). Where the engine writes the greedy answers (decode.batch_generation, which stages its own
rows the same way) they are the engine's rows exactly; transformers' generating copy computes with the engine's
kernels (decode rows) and oneDNN (prefill). The feature pass computes unstaged records with the engine's forward on a
CPU (decode.target_states, the rows decoding computes) and with the model's own batched forward on a GPU.

Layout: $SPECDISTILL_CACHE/features/.staging/<target fingerprint>-<layers>/<record key>.safetensors, one file per
record (written to a temporary name and renamed: a file is whole or absent), named by a hash of the record's tokens.
A staged file whose shapes do not fit its record is not used (logged; the feature pass computes that record). The
feature cache removes the files it took once it is published; a job stopped between the two leaves them for its
rerun (the same records find them), and deleting `.staging` only costs that rerun its feature pass.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from specdistill.models.cache import cache_root
from specdistill.models.hf_compat import cache_argument

log = logging.getLogger("specdistill.feature_capture")

STORE_DTYPE = torch.bfloat16  # as distill.feature_cache stores them


class FeatureStaging:
    """Per-record hidden states (the drafter's layers' inputs [T, len(layers) x D], the final normed state
    [T, D]) of one target, staged on disk by the generator for the feature cache."""

    def __init__(self, target_fingerprint: str, layers: Sequence[int], root: str | Path | None = None):
        self.layers = [int(i) for i in layers]
        if not self.layers:
            raise ValueError("FeatureStaging: no layers to capture")
        name = f"{target_fingerprint[:24]}-{'-'.join(map(str, self.layers))}"
        self.directory = Path(root or cache_root()) / "features" / ".staging" / name

    def path(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> Path:
        digest = hashlib.sha256(repr((list(map(int, prompt_ids)), list(map(int, response_ids)))).encode())
        return self.directory / f"{digest.hexdigest()[:32]}.safetensors"

    def put(self, prompt_ids: Sequence[int], response_ids: Sequence[int], features: torch.Tensor,
            final: torch.Tensor) -> None:
        """features [T, len(layers) x D], final [T, D] over prompt + response (T positions), written atomically."""
        n = len(prompt_ids) + len(response_ids)
        if features.shape[0] != n or final.shape[0] != n:
            raise ValueError(f"staging {n} positions, got features {tuple(features.shape)} and final "
                             f"{tuple(final.shape)}")
        path = self.path(prompt_ids, response_ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({"features": features.to("cpu", STORE_DTYPE).contiguous(),
                   "final": final.to("cpu", STORE_DTYPE).contiguous()}, str(tmp))
        os.replace(tmp, path)

    def get(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The staged (features, final) of this record, or None when it has none that fits."""
        path = self.path(prompt_ids, response_ids)
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
        except Exception as error:  # a file that cannot be read is recomputed, never half-used
            log.warning("%s: unreadable staged hidden states (%s); the feature pass computes that record", path, error)
            return None
        n = len(prompt_ids) + len(response_ids)
        features, final = tensors.get("features"), tensors.get("final")
        if features is None or final is None or features.shape[0] != n or final.shape[0] != n \
                or features.shape[1] != len(self.layers) * final.shape[1]:
            log.warning("%s: staged hidden states do not fit their record (%d positions, %d layers); the feature pass "
                        "computes it", path, n, len(self.layers))
            return None
        return features, final

    def discard(self, records: Sequence[dict]) -> None:
        """Remove these records' staged files (once a feature cache holds them)."""
        for record in records:
            self.path(record["prompt_ids"], record["response_ids"]).unlink(missing_ok=True)


def check_layers(model, layers: list[int]) -> None:
    """The target must expose per-layer hidden states, and every index must be a layer of it."""
    config = model.config.get_text_config()
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        raise ValueError(f"eagle3_layers: the target ({type(model).__name__}) has no num_hidden_layers in its "
                         "config; EAGLE-3 needs a decoder whose per-layer hidden states it can read")
    bad = [i for i in layers if not 0 <= int(i) < n]
    if bad:
        raise ValueError(f"eagle3_layers: {bad} out of range for a target of {n} layers (0..{n - 1})")


class LayerCapture:
    """While open, every forward of `model` (a causal LM, or its generating copy) keeps the inputs of its decoder
    layers `layers` and its final norm's output, per call; `columns()` concatenates the calls along time."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int]):
        check_layers(model, layers)
        decoder = model.get_decoder()
        blocks, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        if blocks is None or norm is None:
            raise ValueError(f"feature capture: the target's decoder ({type(decoder).__name__}) has no `layers` and "
                             "`norm` to read hidden states from")
        self.blocks, self.norm, self.layers = blocks, norm, list(layers)
        self.inputs: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        self.finals: list[torch.Tensor] = []
        self.handles: list = []

    def __enter__(self) -> "LayerCapture":
        for i in self.inputs:  # each layer once (a layer may be named twice)
            self.handles.append(self.blocks[i].register_forward_pre_hook(self._keeper(i), with_kwargs=True))
        self.handles.append(self.norm.register_forward_hook(lambda module, args, out: self.finals.append(out.detach())))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _keeper(self, index: int):
        def keep(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.inputs[index].append(hidden.detach())
        return keep

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, C, len(layers) x D], final [B, C, D]): every call's rows side by side in time."""
        if not self.finals or any(len(v) != len(self.finals) for v in self.inputs.values()):
            raise RuntimeError("feature capture: the hooks saw different numbers of forwards (a layer skipped?)")
        features = torch.cat([torch.cat(self.inputs[i], dim=1) for i in self.layers], dim=-1)
        return features, torch.cat(self.finals, dim=1)


def feed_last_tokens(model: torch.nn.Module, sequences: torch.Tensor, prompt_mask: torch.Tensor, cache) -> None:
    """One more forward of the generated batch's last column (sequences [B, P + G], prompt_mask [B, P], the
    generation's cache): generation never feeds the token it produced last, so its rows are computed here. The
    positions follow the left padding as generate's did."""
    b, generated = sequences.shape[0], sequences.shape[1] - prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(b, generated)], dim=1)  # [B, P + G]
    positions = (mask.long().cumsum(-1) - 1)[:, -1:]  # [B, 1]
    model(input_ids=sequences[:, -1:], attention_mask=mask, position_ids=positions, use_cache=True,
          **cache_argument(model, cache))


def stage_rows(staging: FeatureStaging, capture: LayerCapture, prompts: Sequence[Sequence[int]],
               responses: Sequence[Sequence[int]], padded_prompt_len: int) -> None:
    """Stage each row's prompt + response positions out of the captured columns (left padding dropped)."""
    features, final = capture.columns()  # [B, C, 3D], [B, C, D]
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        start = padded_prompt_len - len(prompt)
        end = padded_prompt_len + len(response)
        if end > features.shape[1]:
            raise RuntimeError(f"feature capture: row {row} needs {end} columns, the forwards gave {features.shape[1]}")
        staging.put(prompt, response, features[row, start:end], final[row, start:end])
