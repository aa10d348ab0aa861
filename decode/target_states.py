"""The target's hidden states over whole sequences as the decoding engine computes them (the feature cache's pass).

EAGLE-3 and DFlash drafters train on the target's hidden states at a few layers (the inputs of those decoder
layers) and on its final normed state. Decoding reads them off the engine's own forward (decode.runner.ModelRunner:
on a named real target the GGUF's own K-quant blocks on the kernel library, on the default target the Q4_1 kernel
and oneDNN for prefill), so training should see the same numbers, not those of transformers' fp32 model over the
same weights. Where the teacher generation staged a record's states (distill.feature_capture) they are the engine's
already; `EngineStates` computes the rest, one record at a time, the head skipped: its prompt in one forward as the
engine prefills it, its response in forwards of up to 64 rows (the kernels' decode-time calls).

Every row's numbers are then what the engine computes for that position when it decodes the sequence: a decode-time
call computes each row alike whatever the rows beside it (tests/decode/test_target_states.py checks them bit for bit
against a prefill followed by single-row steps). A whole record in one forward would not be: past 64 rows the
default target's prefill runs oneDNN's GEMMs and torch's attention, whose last bits differ.

It is also the fast way on this CPU: on the 1.5B real target 4.0x the fp32 model's batched pass (46.5 s against
185.4 s for 32 records, benchmarks/feature_pass.py), whose final states lie 3% (relative L2) from the engine's:
the K-quant kernels round each row to int8 as llama.cpp does.

distill never imports decode: train/ hands `EngineStates` to distill.feature_cache as its `states`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdistill.decode.runner import ModelRunner
from specdistill.models.kernels import MAX_ROWS

__all__ = ["EngineStates"]


class EngineStates:
    """Callable (prompt, response): the engine's states over the whole record at `layers`, (features
    [T, len(layers) x D], final [T, D]), both fp32 on the CPU. `name` says which arithmetic made them (it joins
    the feature cache's key)."""

    name = "engine"

    def __init__(self, model: torch.nn.Module, layers: Sequence[int]):
        n = model.config.get_text_config().num_hidden_layers
        bad = [int(i) for i in layers if not 0 <= int(i) < n]
        if not layers or bad:
            raise ValueError(f"target states: layers {list(layers)} must be non-empty and within 0..{n - 1}")
        self.model, self.layers = model, [int(i) for i in layers]
        self.runner: ModelRunner | None = None  # built at the first sequence: a cache found whole needs none

    @torch.inference_mode()
    def __call__(self, prompt: Sequence[int], response: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows over prompt + response (T positions) as decoding computes them: the prompt in one forward (the
        engine's prefill), the response in forwards of at most MAX_ROWS rows (the kernels' decode-time calls, which
        compute each row as a single-row step does)."""
        if len(prompt) == 0:
            raise ValueError("target states: an empty prompt")
        if self.runner is None:
            self.runner = ModelRunner(self.model, static_shapes=False)
            self.runner.feature_layers = self.layers
        self.runner.start(len(prompt) + len(response))
        response = [int(t) for t in response]
        chunks = [[int(t) for t in prompt]] + [response[i:i + MAX_ROWS] for i in range(0, len(response), MAX_ROWS)]
        features, finals = [], []
        for chunk in chunks:
            hidden, _, _ = self.runner.run(chunk, None, None, slice(0, 0), None)  # [n, D], no head
            self.runner.cache.advance(len(chunk))
            features.append(self.runner.features.float().cpu())
            finals.append(hidden.float().cpu())
        return torch.cat(features), torch.cat(finals)  # [T, len(layers) x D], [T, D]
