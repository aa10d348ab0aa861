"""GGUF checkpoints -> plain HF directories (dequantized once, cached, then loaded like any local model).

transformers dequantizes a GGUF file on every load (about 20 s for 135M parameters) and cannot
`save_pretrained` the result, so the weights are moved into a freshly built model of the same config
(without its quantization_config) and saved as safetensors together with the tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdistill.models.cache import (
    CacheCorruptError,
    cache_root,
    check_cached_model,
    has_marker,
    make_temp_sibling,
    remove_incomplete,
    write_marker,
)

log = logging.getLogger(__name__)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def gguf_cache_dir(gguf_file: Path, digest: str) -> Path:
    """Where the conversion of `gguf_file` lives: keyed by content hash, so a changed file is reconverted."""
    return cache_root() / "targets" / f"gguf-{gguf_file.stem}-{digest[:16]}"


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize `gguf_file` into `out_dir`: fp32 safetensors, config, generation config, tokenizer."""
    log.info("dequantizing %s (once; later loads use the cache)", gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                      dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)  # the weights saved below are plain fp32
    config_dict.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    # built without storage and handed the loaded tensors themselves (assign): one copy of the weights in memory, not
    # two (peak RSS measured: Qwen2.5-Coder-0.5B 5.4 -> 3.9 GB; the 1.5B 9.0 GB, its fp32 weights 7.1 GB). Its
    # non-persistent buffers (rotary inv_freq) stay on meta: nothing saves them.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_converted(gguf_file: Path, final: Path, info: dict) -> Path:
    """The cached conversion of `gguf_file` at `final`, building it first if needed.

    Built in a temporary sibling and renamed into place with a marker, so that an interrupted build
    is never used; if another process finishes the same build first, its result is kept."""
    if final.exists():
        if has_marker(final):
            check_cached_model(final)
            return final
        remove_incomplete(final)
    tmp = make_temp_sibling(final)
    try:
        convert_gguf(gguf_file, tmp)
        write_marker(tmp, info)
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not has_marker(final):
            raise
        log.info("another process built %s first; using it", final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    check_cached_model(final)
    return final


def cached_gguf_dir(gguf_file: str | Path) -> Path:
    """An HF directory holding the dequantized `gguf_file` (converted on first use)."""
    gguf_file = Path(gguf_file).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    digest = file_sha256(gguf_file)
    final = gguf_cache_dir(gguf_file, digest)
    try:
        return ensure_converted(gguf_file, final, {"source": str(gguf_file), "sha256": digest})
    except CacheCorruptError:
        raise
    except Exception as err:
        raise RuntimeError(f"could not convert GGUF file {gguf_file}: {err}") from err
