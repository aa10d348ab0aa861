"""Benchmark: the default target's layer weights computed in their own 4-bit form (Q4_1) against fp32 `F.linear`.

    .venv/bin/python scripts/bench_q41_gemm.py [--rows 1 2 4 8 16] [--reps 9] [--out runs/bench_q41_gemm]

The default target ships as a Q4_1 GGUF: in every matrix of its 30 layers each group of 32 weights is q * d + m
with q in 0..15, so the dequantized fp32 weights the engine streams (425 MB a forward) hold 53 MB of information.
This script checks that (the largest deviation of any layer matrix from the 4-bit grid its group's min and max
define), packs the matrices two codes a byte, compiles a small AVX-512 kernel with the system's gcc (fp32
activations, fp32 accumulation: the weights are the target's exactly, only the summation order differs from
oneDNN's), checks it against `F.linear` and that a row is computed alike at 1 and 5 rows, then times all 210
matrices at each row count, interleaved rep by rep with `F.linear`. The kernel is a measurement, not part of the
engine: each of its calls goes through ctypes and an OpenMP fork, which the table includes. Prints a table and
writes DIR/bench_q41_gemm.json. Needs gcc and an AVX-512 CPU (a clear error otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GROUP = 32

KERNEL = r"""
#include <immintrin.h>
#include <stdint.h>
// y[R, N] = x[R, K] @ W^T, W[n, 32g + j] = q * d[n, g] + m[n, g]; packed[n, 16g + j] = q_j | q_{j+16} << 4.
// R <= 16, K / 32 <= 64 and even.
void q41_gemm(const float *x, int R, int K, const uint8_t *packed, const float *d, const float *m, int N, float *y) {
    int G = K / 32;
    float xs[16 * 64];  // per row and group: the sum of x, which m multiplies
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            float s = 0;
            for (int j = 0; j < 32; j++) s += x[r * K + g * 32 + j];
            xs[r * G + g] = s;
        }
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        __m512 acc[16][4];
        for (int r = 0; r < R; r++)
            for (int a = 0; a < 4; a++) acc[r][a] = _mm512_setzero_ps();
        const uint8_t *p = packed + (size_t)n * (K / 2);
        const float *dn = d + (size_t)n * G, *mn = m + (size_t)n * G;
        __m512i low = _mm512_set1_epi32(15);
        for (int g = 0; g < G; g += 2) {
            __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + g * 16)));
            __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + g * 16 + 16)));
            __m512 d0 = _mm512_set1_ps(dn[g]), d1 = _mm512_set1_ps(dn[g + 1]);
            __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b0, low)), d0);
            __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), d0);
            __m512 w2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b1, low)), d1);
            __m512 w3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), d1);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * K + g * 32;
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), acc[r][3]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m512 a = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
            float s = _mm512_reduce_add_ps(a);
            for (int g = 0; g < G; g++) s += mn[g] * xs[r * G + g];
            y[(size_t)r * N + n] = s;
        }
    }
}
"""


class Q41Weight:
    """One [N, K] matrix as Q4_1: packed [N, K/2] uint8 codes, step d and minimum m [N, K/32] fp32."""

    def __init__(self, packed: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor):
        self.packed, self.step, self.minimum = packed, step, minimum

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


def grid_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes [N, K/32, 32] in 0..15 as float, step [N, K/32], min [N, K/32]): each group's 4-bit grid
    from its min and max, the one Q4_1 quantizes on."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15)
    return codes, step, low


def grid_deviation(weight: torch.Tensor) -> float:
    """max |w - its 4-bit grid value| / max |w|: 0 when the matrix is exactly Q4_1."""
    codes, step, low = grid_codes(weight)
    rebuilt = (codes * step[..., None] + low[..., None]).reshape(weight.shape)
    return float((rebuilt - weight).abs().max() / weight.abs().max().clamp(min=1e-30))


def pack_q41(weight: torch.Tensor) -> Q41Weight:
    """[N, K] fp32 -> Q41Weight; byte j of group g holds code j (low nibble) and code j + 16 (high nibble)."""
    n, k = weight.shape
    if k % (2 * GROUP) or k // GROUP > 64:
        raise ValueError(f"pack_q41: K must be a multiple of {2 * GROUP} and at most {64 * GROUP}, got {k}")
    codes, step, low = grid_codes(weight)
    codes = codes.to(torch.uint8)  # [N, G, 32]
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    return Q41Weight(packed, step.contiguous(), low.contiguous())


def unpack_q41(w: Q41Weight) -> torch.Tensor:
    """Q41Weight -> the [N, K] fp32 matrix it stands for (the packing's inverse, for checks)."""
    n, k = w.shape
    bytes_ = w.packed.reshape(n, k // GROUP, 16)
    codes = torch.cat([bytes_ & 15, bytes_ >> 4], dim=-1).float()  # [N, G, 32]
    return (codes * w.step[..., None] + w.minimum[..., None]).reshape(n, k)


def avx512_available() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def build_kernel(directory: Path) -> ctypes.CDLL:
    """Compile KERNEL with gcc into directory and load it; a RuntimeError that names what is missing."""
    if shutil.which("gcc") is None:
        raise RuntimeError("bench_q41_gemm: needs gcc on PATH to build its kernel")
    if not avx512_available():
        raise RuntimeError("bench_q41_gemm: the kernel is AVX-512 and this CPU has no avx512f")
    source, library = directory / "q41.c", directory / "libq41.so"
    source.write_text(KERNEL)
    subprocess.run(["gcc", "-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(library)],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(library))
    pointer = ctypes.c_void_p
    lib.q41_gemm.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, pointer, pointer, ctypes.c_int, pointer]
    lib.q41_gemm.restype = None
    return lib


def q41_linear(lib: ctypes.CDLL, x: torch.Tensor, w: Q41Weight) -> torch.Tensor:
    """x [R, K] fp32 (R <= 16) -> [R, N], as F.linear(x, unpack_q41(w)) up to the summation order."""
    n, k = w.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= 16:
        raise ValueError(f"q41_linear: x must be fp32 [1..16, {k}], got {x.dtype} {list(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n)
    lib.q41_gemm(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), w.step.data_ptr(), w.minimum.data_ptr(), n,
                 y.data_ptr())
    return y


def layer_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every nn.Linear weight of the decoder layers (the head, tied to the embedding, is not Q4_1)."""
    return [module.weight.detach().float().contiguous() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name]


def time_rows(lib, weights: list[torch.Tensor], packed: list[Q41Weight], rows: int, reps: int) -> tuple[float, float]:
    """Median seconds for all matrices at `rows` rows: (F.linear, the Q4_1 kernel), interleaved, the first rep
    dropped."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    dense, q41 = [], []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        dense.append(time.perf_counter() - start)
        start = time.perf_counter()
        for w in packed:
            q41_linear(lib, inputs[w.shape[1]], w)
        q41.append(time.perf_counter() - start)
    return statistics.median(dense[1:]), statistics.median(q41[1:])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="runs/bench_q41_gemm")
    args = p.parse_args(argv)
    if any(not 1 <= r <= 16 for r in args.rows):
        p.error(f"--rows: each between 1 and 16 (the kernel's limit), got {args.rows}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from models.target import load_target
    weights = layer_matrices(load_target().model)
    deviation = max(grid_deviation(w) for w in weights)
    packed = [pack_q41(w) for w in weights]
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_kernel(Path(tmp))
        errors = []
        for w, q in zip(weights, packed):
            x = torch.randn(3, w.shape[1])
            reference = F.linear(x, w)
            errors.append(float((q41_linear(lib, x, q) - reference).abs().max() / reference.abs().max()))
        x = torch.randn(5, weights[0].shape[1])
        alike = torch.equal(q41_linear(lib, x[:1], packed[0]), q41_linear(lib, x, packed[0])[:1])
        timings = {rows: time_rows(lib, weights, packed, rows, args.reps) for rows in args.rows}
    report = {"matrices": len(weights), "parameters": sum(w.numel() for w in weights),
              "max_grid_deviation": deviation, "max_relative_error": max(errors), "row_alike_at_1_and_5": alike,
              "threads": torch.get_num_threads(), "reps": args.reps,
              "rows": [{"rows": r, "f_linear_ms": a * 1e3, "q41_ms": b * 1e3, "speedup": a / b}
                       for r, (a, b) in timings.items()]}
    print(f"{len(weights)} layer matrices, {report['parameters'] / 1e6:.1f}M weights; largest deviation from a 4-bit "
          f"grid of {GROUP}: {deviation:.1e}; kernel against F.linear: max relative error {max(errors):.1e}; a row "
          f"computed alike at 1 and 5 rows: {alike}")
    print("| rows | F.linear fp32, ms | Q4_1 kernel, ms | speedup |")
    print("|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['rows']} | {row['f_linear_ms']:.1f} | {row['q41_ms']:.1f} | {row['speedup']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_q41_gemm.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
