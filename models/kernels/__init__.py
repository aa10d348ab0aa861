"""The engine's CPU kernel library: native C++ sources in `csrc/`, built by torch's cpp_extension into the cache
(`build.py`: verified before every load), exposed as checked functions (`csrc/bindings.cpp`).

What it holds (AVX-512, and on a CPU without it the same sources' AVX2 flavour: build.py; the design note
docs/design/exact-kernels.md says why each exists):
- exact GEMMs over the default target's own grids: Q4_1 layer matrices (`Q41Matrix.gemm`, `q41_amx`) and its Q8_0
  head (`q80_gemm`, `q80_amx`), fp32 activations and accumulation, every row computed alike whatever the row count;
- the lean forwards' row operations (`rms_norm_rows`, `rope_qk`) and decode-time attention (`attention_rows`);
- a decoder layer's decode-time rows in two calls (`layer_rows_attention`, `layer_rows_down`);
- on AVX512-VNNI and in the AVX2 build, int8 drafting GEMMs (`Int8Matrix.gemm`), an EAGLE-3 drafting depth in two
  calls (`eagle3_rows`, `eagle3_top`), the greedy head's exact argmax (`q8_argmax`), and a GGUF's own blocks with
  int8 activations as llama.cpp computes them (`Q4KMatrix`, `Q6KMatrix`, `Q50Matrix`, `Q80Matrix`, fused as
  `KQuantProjection`: docs/design/kquant-kernels.md), calls of many rows on AMX-INT8 tiles where the CPU has them
  (`tile_rows`).

`library()` is the loaded module, or None where it cannot run (`unavailable()` says why). Every fallback from a
fast path is a WARNING once per process naming the reason and its cost (`warn_fallback`), and `fallbacks()` lists
them for the reports (decode.runtime_facts.kernel_facts).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

from specdistill.models.cache import cache_root
from specdistill.models.kernels import build

log = logging.getLogger("specdistill.kernels")

DISABLE_ENV = "SPECDISTILL_NO_Q41"  # the whole library off (comparisons)
NO_AMX_ENV = "SPECDISTILL_NO_AMX"  # the FMA forms everywhere (comparisons)
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw")
AMX_INT8_FLAGS = ("amx_tile", "amx_int8", "avx512_vnni", "avx512bw")
# The fewest rows a K-quant call runs on AMX-INT8 tiles: at 16 rows the 1.5B's Q4_K gate/up is level with the VNNI
# loop and its Q6_K down 1.4x faster, at 32 rows 1.5x / 2.2x (docs/design/kquant-kernels.md, "Tiles for many rows").
KQUANT_TILE_ROWS = 16
MAX_ROWS = 64  # decode-time calls (trees, chains, single rows); longer calls are prefill, left to oneDNN
LIBRARY_COST = ("the engine falls back to oneDNN's packed fp32 GEMMs and torch's attention: plain decoding "
                "about 1.5x slower")
_fallbacks: dict[str, str] = {}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), read once; empty where there is no such file."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def flavour() -> tuple[str | None, str | None]:
    """The library's build this CPU runs ("avx512" or "avx2", $SPECDISTILL_KERNEL_ISA may ask for "avx2"), or
    (None, why none)."""
    return build.flavour_for(cpu_flags(), os.environ.get(build.ISA_ENV, ""))


def kernel_directory(isa: str | None = None) -> Path:
    """Content-addressed by the flavour (None: this process's), sources, flags and torch version
    (build.source_digest)."""
    isa = isa or flavour()[0] or "avx512"
    return cache_root() / "kernels" / f"cpu-{isa}-{build.source_digest(isa)}"


def warn_fallback(what: str, reason: str, cost: str) -> None:
    """A WARNING, once per process and `what`, that a fast path is not taken; kept for the reports."""
    if what not in _fallbacks:
        _fallbacks[what] = f"{reason}; {cost}"
        log.warning("%s: not used (%s); %s", what, reason, cost)


def fallbacks() -> dict[str, str]:
    """Every fast path this process fell back from so far: {what: "reason; cost"}."""
    return dict(_fallbacks)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str | None]:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None, "no C++ compiler (c++ or g++) on PATH"
    isa, why_not = flavour()
    if isa is None:
        return None, why_not
    try:
        path = build.verified_library(kernel_directory(isa), build=functools.partial(build.compile_into, flavour=isa),
                                      warn=log.warning)
        return build.import_library(path), None
    except (RuntimeError, OSError, ImportError) as error:
        return None, str(error)


def unavailable() -> str | None:
    """None when the engine may use the library, else why not (a failed build's WARNING is logged once)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"${DISABLE_ENV} is set"
    reason = _load()[1]
    if reason is not None:
        warn_fallback("the CPU kernel library", reason, LIBRARY_COST)
    return reason


def library() -> ModuleType | None:
    """The loaded library where the engine may use it, else None (see `unavailable`)."""
    return _load()[0] if unavailable() is None else None


@functools.lru_cache(maxsize=None)
def _tiles_granted(flags: tuple[str, ...], what: str, cost: str) -> str | None:
    """Asks Linux once for this process's tile state, where the CPU has `flags`; None when granted, else why not
    (a refusal is a WARNING naming `what` falls back and its `cost`)."""
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        return f"this CPU has no {', '.join(missing)}"
    if _load()[0].amx_request() != 0:
        reason = "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        warn_fallback(what, reason, cost)
        return reason
    return None


def _amx_unavailable(flags: tuple[str, ...], what: str, cost: str) -> str | None:
    if (why := unavailable()) is not None:
        return why
    if flavour()[0] == "avx2":
        return "the library's AVX2 flavour has no AMX forms"
    if os.environ.get(NO_AMX_ENV, "") not in ("", "0"):
        return f"${NO_AMX_ENV} is set"
    return _tiles_granted(flags, what, cost)


def amx_unavailable() -> str | None:
    """None when the AMX forms may run in this process, else why not ($SPECDISTILL_NO_AMX keeps the FMA forms)."""
    return _amx_unavailable(AMX_FLAGS, "the AMX kernel forms",
                            "a 14-row verification's GEMMs run on the FMA form, about 2x costlier")


def amx_int8_unavailable() -> str | None:
    """None when the K-quant GEMMs may run calls of many rows on AMX-INT8 tiles (kquant_amx.cpp), else why not
    ($SPECDISTILL_NO_AMX keeps them on the VNNI loop)."""
    return _amx_unavailable(AMX_INT8_FLAGS, "the K-quant GEMMs' AMX-INT8 tiles",
                            "a prefill's GEMMs run on the VNNI loop, about 2x slower at 64 rows and more")


def int8_unavailable() -> str | None:
    """None when the int8 kernels the engine picks for speed (drafting GEMMs, the greedy head) run natively here: on
    AVX512-VNNI (vpdpbusd), or in the library's AVX2 build (vpmaddubsw, csrc/int8_avx2.h: the same numbers; on a
    2-core Zen 3 the 1.5B's EAGLE-3 drafter's matrices 1.35x / 1.6x / 1.9x faster than the Q8_0 kernel's FMA form at
    1 / 4 / 8 rows, `python -m benchmarks.drafting_matrices`); else why not."""
    if flavour()[0] == "avx2":
        return unavailable()
    missing = [f for f in ("avx512bw", "avx512_vnni") if f not in cpu_flags()]
    return unavailable() or (f"this CPU has no {', '.join(missing)}" if missing else None)


def greedy_head_unavailable() -> str | None:
    """None where greedy steps take the int8 greedy head (models.kernel_linear.GreedyHead): where the int8 kernels run,
    except in the AVX2 build, where its int8 pass is no faster than computing every logit (the default target's
    forward level at one row, 0.88-0.96x at 2-8; 2-core Zen 3, `python -m benchmarks.greedy_head`)."""
    if flavour()[0] == "avx2":
        return "the library's AVX2 build, where the greedy head is no faster than the full head"
    return int8_unavailable()


def kquant_unavailable() -> str | None:
    """None when a GGUF's own blocks (Q4_K, Q6_K, Q5_0, Q8_0) may run on the library's int8 GEMMs: where the int8
    kernels run (`int8_unavailable`; the AVX2 build has its own loops for all four, csrc/kquant_avx2.h and
    q8_0_avx2.h); else why not."""
    return int8_unavailable()
