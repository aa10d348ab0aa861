"""The target's states over whole sequences by the engine's forward (decode.target_states.EngineStates), the feature
cache's pass for records the generator did not stage: every row is what the engine computes for that position while
it decodes the sequence (prefill, then a row at a time), on both target kinds' kernel paths; the feature cache built
with it holds those rows, computes only the unstaged records, and keys them apart from transformers' states."""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.runner import ModelRunner
from specdistill.decode.target_states import EngineStates
from specdistill.distill.feature_cache import compute_shard, feature_cache_dir, feature_cache_key, open_or_build
from specdistill.distill.feature_capture import FeatureStaging
from specdistill.models import kernels
from tests.decode.test_batch_generation import random_prompts
from tests.decode.test_batch_generation import target as target  # noqa: F401  (the two kernel-path targets)

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None,
                                reason=f"the kernel library does not load here: {kernels.unavailable()}")

LAYERS = [0, 1, 1]
PAD = 0


def decoded_rows(model, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, 3D], final [T, D]) as decoding computes them: the prompt in one forward, then each answer
    token in a forward of its own."""
    runner = ModelRunner(model, static_shapes=False)
    runner.feature_layers = LAYERS
    runner.start(len(prompt) + len(answer))
    features, finals = [], []
    for chunk in [prompt] + [[t] for t in answer]:
        hidden, _ = runner.forward(chunk)
        runner.cache.advance(len(chunk))
        features.append(runner.features.clone())
        finals.append(hidden.clone())
    return torch.cat(features), torch.cat(finals)


def close(got: torch.Tensor, exact: torch.Tensor) -> None:
    assert got.shape == exact.shape and got.dtype == exact.dtype
    assert torch.equal(got, exact)  # bit for bit


@pytest.mark.parametrize("lengths", [(9, 12), (70, 6), (5, 150)], ids=["short", "prompt-past-64-rows",
                                                                       "response-past-64-rows"])
def test_each_row_is_what_decoding_computes_at_that_position(target, lengths):  # noqa: F811
    prompt, answer = random_prompts(target.model.config.vocab_size, lengths=lengths, seed=5)
    features, final = EngineStates(target.model, LAYERS)(prompt, answer)
    exact_features, exact_final = decoded_rows(target.model, prompt, answer)
    close(features, exact_features)
    close(final, exact_final)


def test_the_cache_computes_unstaged_records_with_it_and_keys_them_apart(target, tmp_path):  # noqa: F811
    prompts = random_prompts(target.model.config.vocab_size, lengths=(5, 9, 7), seed=6)
    answers = random_prompts(target.model.config.vocab_size, lengths=(4, 6, 3), seed=7)
    records = [{"prompt_ids": p, "response_ids": a} for p, a in zip(prompts, answers)]
    staging = FeatureStaging(target.fingerprint, LAYERS, tmp_path)
    engine = EngineStates(target.model, LAYERS)
    staging.put(prompts[0], answers[0], *engine(prompts[0], answers[0]))  # the first record staged
    asked = []

    class Counting:
        name = engine.name

        def __call__(self, prompt, response):
            asked.append(prompt + response)
            return engine(prompt, response)

    windows = compute_shard(target, records, LAYERS, 64, 4, PAD, staging, Counting())
    assert asked == [p + a for p, a in zip(prompts[1:], answers[1:])]  # the staged one is read, not computed
    for record, window in zip(records, windows):  # stored in bf16
        features, final = decoded_rows(target.model, record["prompt_ids"], record["response_ids"])
        close(window.features, features.to(torch.bfloat16))
        close(window.final, final.to(torch.bfloat16))
    open_or_build(target, records, LAYERS, 64, 4, PAD, root=tmp_path, states=engine)
    by_engine = feature_cache_key(target.fingerprint, records, LAYERS, 64, engine.name)
    assert feature_cache_dir(by_engine, tmp_path).is_dir()
    assert by_engine != feature_cache_key(target.fingerprint, records, LAYERS, 64)  # transformers' states


@pytest.mark.parametrize("layers", [[], [0, 99], [-1]])
def test_layers_out_of_range_or_none_are_errors_that_name_them(target, layers):  # noqa: F811
    with pytest.raises(ValueError, match="layers"):
        EngineStates(target.model, layers)
