"""The real default target (SmolLM2-135M-Instruct, embedded: its layer matrices Q4_1, its tied head Q8_0) through
every drafter kind on the engine's fast paths as it picks them by default (the Q4_1 kernel, the Q8_0 head, the
greedy head, fused layers where the CPU takes them; decode.runtime_facts says which ran), greedy output token for
token plain decoding's on real prompts. Slow: the target (fetched once into the cache) and a few minutes of decoding
on 2 cores. tests/decode/test_kernel_path_lossless.py runs the same check on a tiny target in `make test`.
"""

from __future__ import annotations

import pytest

from specdistill.models.eagle3 import default_target_layers
from specdistill.models.target import load_target
from tests.decode.test_kernel_path_lossless import (
    assert_every_kind_decodes_plain_decodings_output,
    assert_the_fast_paths_ran,
    every_kind,
)

pytestmark = pytest.mark.slow

QUESTIONS = ("Write a short haiku about the sea.",
             "def fibonacci(n):\n    # complete this Python function, then explain it\n")
# each kind once and a +prompt_lookup hybrid (the draft-model hybrid and the ensemble run in the tiny test only)
KINDS = ("truncated:2", "medusa", "lookahead", "eagle3", "prompt_lookup", "eagle3+prompt_lookup")


def test_every_drafter_kind_decodes_the_real_targets_own_output():
    target = load_target()
    layers = target.model.config.num_hidden_layers
    prompts = [target.encode_chat([{"role": "user", "content": question}]) for question in QUESTIONS]
    drafters = every_kind(target, truncated=2, eagle3_layers=default_target_layers(layers), medusa_heads=2)
    drafters = {name: drafters[name] for name in KINDS}
    facts = assert_every_kind_decodes_plain_decodings_output(target, drafters, prompts, max_new_tokens=32)
    kernels = facts["kernel_library"]
    if "avx512f" in facts["cpu_flags"] and "SPECDISTILL_NO_Q41" not in facts["switches"]:  # what this test is for
        assert kernels["state"] == "loaded", f"the fast paths did not run: {kernels['unavailable_reason']}"
    assert_the_fast_paths_ran(facts)
    if kernels["state"] == "loaded":  # the default target's grids: every layer matrix on the kernel
        assert sum(facts["target"]["layer_matrices"].values()) == 4 * layers == 120
    assert {drafter["kind"] for drafter in facts["drafters"].values()} == {
        "draft_model", "medusa", "lookahead", "eagle3", "prompt_lookup", "eagle3+prompt_lookup"}
