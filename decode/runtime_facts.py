"""What a run computed with, resolved: the facts a report records beside its figures (decode.evaluate).

A run's options name choices (`--dtype auto`, `--drafter-weights auto`); what runs is decided later, on this
machine, by the modules that build the engine's inference copies: whether the kernel library loaded and in which
form, which matrices went onto it, whether the greedy head and the fused layers run, how oneDNN's fp32 GEMMs are
padded, which format each drafter drafts in. Each fact is read back here from the engines that ran (their
ModelRunner and proposer) or from the function that decides it, never re-derived from the options, so that a report
says what ran; and this is the one place to update when a new decision appears.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch

from specdistill.decode.lean_decoder import lean_supported

# the kernel library's state, read here only (one line to re-point if the library moves again)
from specdistill.models.kernels import (
    amx_unavailable,
    cpu_flags,
    fallbacks,
    greedy_head_unavailable,
    int8_unavailable,
)
from specdistill.models.kernels import flavour as kernel_flavour
from specdistill.models.kernels import unavailable as kernel_unavailable
from specdistill.models.packed_linear import gemm_padding, gemm_padding_source, inference_weights

__all__ = ["KERNEL_FLAGS", "git_commit", "kernel_facts", "runtime_facts"]

ROOT = Path(__file__).resolve().parents[1]  # the checkout this code runs from (site-packages when installed)
# the CPU features the engine's kernels and torch's choose by: FBGEMM's fp16 GEMM (avx2, f16c), the kernel library
# (avx512f; its int8 kernels avx512bw + avx512_vnni; its AMX form amx_tile + amx_bf16 + avx512_bf16), bf16 targets
KERNEL_FLAGS = ("avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                "amx_int8")
ENV_PREFIX = "SPECDISTILL_"  # the engine's switches ($SPECDISTILL_NO_Q41, _FULL_HEAD, _UNFUSED_LAYERS, _GEMM_PAD, ...)


def runtime_facts(target, engines: Mapping[str, object]) -> dict:
    """The report's runtime section. target: models.target.Target; engines: {method name: the
    decode.engine.SpeculativeEngine it ran on}. The target's facts come from the first engine's runner (every engine
    over one target shares its cached inference copies); each engine with a proposer gives a drafter entry."""
    runner = next((engine.target for engine in engines.values()), None)
    return {
        "target": target_facts(target, runner),
        "drafters": {name: {"kind": engine.proposer.name, "weights": engine.proposer.weight_format()}
                     for name, engine in engines.items() if engine.proposer is not None},
        "kernel_library": kernel_facts(),
        "fp32_gemm_padding": padding_facts(),
        "cpu_flags": [flag for flag in KERNEL_FLAGS if flag in cpu_flags()],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels torch's own CPU ops dispatch to
        "switches": {key: value for key, value in sorted(os.environ.items()) if key.startswith(ENV_PREFIX)},
        "torch": torch.__version__,
        "specdistill": project_version(),
        "git_commit": git_commit(),
    }


def target_facts(target, runner) -> dict:
    """Precision and what the engine's runner (decode.runner.ModelRunner) computes the target's forward with."""
    facts = {"precision": target.precision, "dtype": str(target.dtype).removeprefix("torch."),
             "device": str(target.device), "linear_weights": inference_weights(target.model)}
    if runner is None:  # no engine of ours ran (peers only)
        return facts
    lean = runner.lean
    if lean is not None:
        layers = lean.layers
        matrices = [m for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    else:  # transformers' decoder on packed copies: every module with in_features is one matrix
        layers, matrices = [], [m for m in runner.decoder.modules() if hasattr(m, "in_features")]
    facts.update({
        "decoder": "lean" if lean is not None else f"transformers ({lean_supported(runner.model)})",  # and why
        "layer_matrices": dict(Counter(matrix_kind(m) for m in matrices)),
        "fused_layers": sum(layer.fused is not None for layer in layers),  # decode.lean_decoder.FusedLayer
        "layers": runner.num_layers,
        "kernel_attention": bool(lean is not None and lean.kernel_attention),
        "head": matrix_kind(runner.head),
        "greedy_head": runner.greedy_head is not None,  # greedy steps' argmax without every logit
    })
    return facts


def matrix_kind(module: torch.nn.Module) -> str:
    """A matrix's inference class with its kernel form where it has one: "Q41Linear (fma)", "PackedLinearFP16".
    The kernel library's matrices carry their form on `codes` (read by attribute so that this module imports the
    library's state functions only). A K-quant matrix names its segments' formats: "KQuantLinear (Q4_K+Q6_K)"."""
    if callable(describe := getattr(module, "describe", None)):
        return describe()
    form = getattr(getattr(module, "codes", None), "form", None)
    return type(module).__name__ + (f" ({form})" if form else "")


def kernel_facts() -> dict:
    """The kernel library (models.kernels): loaded or not (and why not), its build ("avx512" or "avx2"); the form
    its matrices are packed in where their shapes allow ("amx" where this process may use the tiles, else "fma");
    whether its int8 kernels (int8 drafting) run, and whether greedy steps take its greedy head; and every fast path
    this process fell back from so far, with its cost."""
    unavailable = kernel_unavailable()
    no_amx = amx_unavailable()
    return {"state": "loaded" if unavailable is None else "unavailable", "unavailable_reason": unavailable,
            "build": None if unavailable else kernel_flavour()[0],
            "form": None if unavailable else ("fma" if no_amx else "amx"),
            "amx_unavailable_reason": None if unavailable else no_amx,
            "int8_unavailable_reason": None if unavailable else int8_unavailable(),
            "greedy_head_unavailable_reason": None if unavailable else greedy_head_unavailable(),
            "fallbacks": fallbacks()}


def padding_facts() -> dict:
    """models.packed_linear.gemm_padding's choice ("B:T": calls of fewer than B rows compute T; "off") and where it
    came from."""
    below, rows = gemm_padding()
    return {"choice": "off" if below == 0 else f"{below}:{rows}", "source": gemm_padding_source()}


def project_version() -> str | None:
    try:
        return importlib.metadata.version("specdistill")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(root: Path = ROOT) -> str | None:
    """The checkout's short commit hash, with "-dirty" where its files differ from the commit (untracked ones
    included); None where the code does not run from a git checkout (an installed package) or git fails. Reads
    only: --no-optional-locks keeps `git status` from refreshing the index."""
    if not (root / ".git").exists():
        return None
    try:
        head = git(root, "rev-parse", "--short", "HEAD")
        changed = git(root, "status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if changed else "")


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()

