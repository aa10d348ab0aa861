"""Every proposer kind through the engine's kernel path, greedy output token for token plain decoding's.

The tiny target here has its layer matrices exactly on the Q4_1 grid and its head exactly on the Q8_0 grid, as
the default target's are, so the engine runs it as it runs the default target where the kernel library loads: the
layers' GEMMs on the Q4_1 kernel, the fused layers (FMA form), the library's attention, the Q8_0 head and the
greedy head (AVX512-VNNI), EAGLE-3 drafting in int8. Each kind of drafter goes through `build_proposer` with
`--drafter-weights auto`, as decode.evaluate builds it, and the runtime facts say which of those paths ran.
tests/decode/test_real_target_lossless.py runs the same check on the real default target (slow).
"""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.decode.runtime_facts import runtime_facts
from specdistill.models import kernels
from specdistill.models.drafters import Drafter, load_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.gguf_blocks import attach_kquant_blocks
from specdistill.models.lookahead import LookaheadTokens
from specdistill.models.medusa import MedusaHeads
from specdistill.models.target import target_from_model
from tests.conftest import make_tiny_llama
from tests.models.kquant_fixtures import make_tiny_kquant_qwen2, write_gguf

GROUP = 32  # the kernels' group of weights sharing one step (Q4_1 and Q8_0)
PROMPTS = ([1, 5, 9, 3, 17, 22, 40, 5, 9, 3], [1, 30, 31, 32, 30, 31], [1, 7, 8, 9, 10, 11, 12, 13])


def on_q41_grid(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the nearest matrix that is exactly Q4_1 (per group of 32: code * d + m, code in 0..15), d and m
    fp16 values as a GGUF stores them (what the kernels' AMX form also needs)."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).half().float()
    low = low.half().float()
    codes = torch.round((groups - low) / step).clamp(0, 15)
    return (codes * step + low).reshape(n, k)


def on_q80_grid(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the nearest matrix that is exactly Q8_0 (per group of 32: code * d, code in -127..127, d an fp16
    value), as the default target's tied head is."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    step = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(groups / step).clamp(-127, 127) * step).reshape(n, k)


def kernel_target(seed: int = 8):
    """A tiny Llama (hidden 128, head_dim 32: shapes the library takes) on the default target's grids."""
    model = make_tiny_llama(hidden_size=128, layers=2, seed=seed, peak=4.0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                grid = on_q80_grid if name == "lm_head" else on_q41_grid
                module.weight.copy_(grid(module.weight))
    return target_from_model(model, None, "tiny-q41")


def every_kind(target, truncated: int, eagle3_layers: list[int], medusa_heads: int) -> dict[str, Drafter]:
    """One drafter of each kind (untrained: losslessness does not depend on training) and +prompt_lookup hybrids."""
    model = target.model

    def eagle3():
        return Eagle3Drafter.for_target(model, None, eagle3_layers, seed=3).eval()

    hybrid = Drafter("eagle3", eagle3(), None, {}, None, with_lookup=True)
    return {
        f"truncated:{truncated}": load_drafter(f"truncated:{truncated}", target),
        f"truncated:{truncated}+prompt_lookup": load_drafter(f"truncated:{truncated}+prompt_lookup", target),
        "medusa": Drafter("medusa", MedusaHeads.from_target(model, num_heads=medusa_heads).eval(), None, {}, None),
        "lookahead": Drafter("lookahead", LookaheadTokens.from_target(model, 3, seed=0).eval(), None, {}, None),
        "eagle3": Drafter("eagle3", eagle3(), None, {}, None),
        "eagle3+prompt_lookup": hybrid,
        "prompt_lookup": load_drafter("prompt_lookup", target),
        "ensemble": Drafter("ensemble", None, None, {"max_tree_nodes": 8}, None, members=[
            load_drafter("truncated:1", target), load_drafter(f"truncated:{truncated}", target)]),
    }


def assert_every_kind_decodes_plain_decodings_output(target, drafters: dict[str, Drafter], prompts,
                                                     max_new_tokens: int) -> dict:
    """Greedy speculative decoding with each drafter (the full depth drafted every step) equals plain decoding on
    every prompt, and each drafted something; returns the runtime facts of the engines that ran."""
    eos = target.eos_token_ids
    plain_engine = SpeculativeEngine(target.model, None, eos)
    plain = [plain_engine.generate(prompt, max_new_tokens).tokens for prompt in prompts]
    engines = {"baseline": plain_engine}
    for name, drafter in drafters.items():
        proposer = build_proposer(drafter, target.model, gamma=4, eos_token_ids=eos, drafter_weights="auto")
        engines[name] = engine = SpeculativeEngine(target.model, proposer, eos, adaptive=False)
        drafted = 0
        for prompt, expected in zip(prompts, plain):
            generation = engine.generate(prompt, max_new_tokens)
            assert generation.tokens == expected, f"{name}: greedy output differs from plain decoding's"
            drafted += generation.stats.drafted
        assert drafted > 0, f"{name} drafted nothing: its trees never reached the verification path"
    return runtime_facts(target, engines)


def assert_the_fast_paths_ran(facts: dict) -> None:
    """Where the kernel library runs: every layer matrix on the Q4_1 kernel, the head on Q8_0's, and where the CPU
    takes them the greedy head (where it pays, the head in the FMA form) and fused layers (every matrix FMA form)."""
    target, kernels = facts["target"], facts["kernel_library"]
    if kernels["state"] != "loaded":
        return
    matrices = target["layer_matrices"]
    assert set(matrices) <= {"Q41Linear (fma)", "Q41Linear (amx)"} and sum(matrices.values()) == 4 * target["layers"]
    assert target["head"].startswith("Q80Linear") and target["kernel_attention"]
    if kernels["greedy_head_unavailable_reason"] is None and target["head"] == "Q80Linear (fma)":
        assert target["greedy_head"]
    if set(matrices) == {"Q41Linear (fma)"} and "SPECDISTILL_UNFUSED_LAYERS" not in facts["switches"]:
        assert target["fused_layers"] == target["layers"]


def test_every_proposer_kind_is_lossless_on_the_kernel_path():
    target = kernel_target()
    facts = assert_every_kind_decodes_plain_decodings_output(target, every_kind(target, 1, [0, 1, 1], 3),
                                                             PROMPTS, 32)
    assert_the_fast_paths_ran(facts)
    weights = {name: drafter["weights"] for name, drafter in facts["drafters"].items()}
    assert weights["prompt_lookup"] is None and weights["lookahead"] is None  # no weights of their own
    assert weights["eagle3"] == weights["eagle3+prompt_lookup"]  # the hybrid drafts with its inner drafter's
    assert facts["drafters"]["truncated:1+prompt_lookup"]["kind"] == "draft_model+prompt_lookup"
    if facts["kernel_library"]["state"] == "loaded":  # auto: int8 where its int8 kernels run, else Q8_0
        assert weights["eagle3"] == ("int8" if facts["kernel_library"]["int8_unavailable_reason"] is None
                                     else "q8_0")
    assert "auto" not in weights.values()


@pytest.mark.parametrize("switch", ["SPECDISTILL_UNFUSED_LAYERS", "SPECDISTILL_FULL_HEAD"])
def test_the_switched_off_paths_are_reported_and_stay_lossless(switch, monkeypatch):
    """The escape hatches change what runs, the report says so, and the output stays plain decoding's."""
    monkeypatch.setenv(switch, "1")
    target = kernel_target(seed=9)
    drafters = {"eagle3": Drafter("eagle3", Eagle3Drafter.for_target(target.model, None, [0, 1, 1], seed=3).eval(),
                                  None, {}, None)}
    facts = assert_every_kind_decodes_plain_decodings_output(target, drafters, PROMPTS[:1], 24)
    assert facts["switches"][switch] == "1"
    assert facts["target"]["fused_layers" if switch == "SPECDISTILL_UNFUSED_LAYERS" else "greedy_head"] in (0, False)


def test_every_proposer_kind_is_lossless_on_a_kquant_qwen2(tmp_path):
    """A real-size target's path in small: a Qwen2 (q/k/v biases, untied head) whose linears are a GGUF's Q4_K and
    Q6_K blocks, attached from the file as models.target attaches them, every matrix (head included) on the K-quant
    kernels where the CPU has AVX512-VNNI or runs the library's AVX2 build, each drafter kind's greedy output plain
    decoding's."""
    model, tensors = make_tiny_kquant_qwen2(seed=4)
    attach_kquant_blocks(model, write_gguf(tmp_path / "tiny.gguf", "qwen2", tensors))
    target = target_from_model(model, None, "tiny-kquant-qwen2")
    facts = assert_every_kind_decodes_plain_decodings_output(target, every_kind(target, 1, [0, 1, 1], 3), PROMPTS,
                                                             32)
    if kernels.kquant_unavailable() is None:
        matrices = facts["target"]["layer_matrices"]
        assert all(kind.startswith("KQuantLinear (") for kind in matrices), matrices
        assert "Q6_K" in "".join(matrices) and facts["target"]["head"] == "KQuantLinear (Q6_K)"
        assert facts["target"]["fused_layers"] == facts["target"]["layers"]  # each layer in two library calls
