"""Benchmark: the default target's layer weights computed in their own 4-bit form (Q4_1) against fp32 `F.linear`.

    .venv/bin/python scripts/bench_q41_gemm.py [--rows 1 2 4 8 16] [--reps 9] [--out runs/bench_q41_gemm]

The default target ships as a Q4_1 GGUF: in every matrix of its 30 layers each group of 32 weights is q * d + m
with q in 0..15, so the dequantized fp32 weights the engine streams (425 MB a forward) hold 53 MB of information.
This script checks that (the largest deviation of any layer matrix from the 4-bit grid its group's min and max
define), packs the matrices two codes a byte, builds the engine's Q4_1 kernel (models.q41_linear: AVX-512, gcc,
fp32 activations and accumulation; the weights are the target's exactly, only the summation order differs from
oneDNN's), checks it against `F.linear` and that a row is computed alike at 1 and 5 rows, then times all 210
matrices at each row count, interleaved rep by rep with `F.linear` (each kernel call goes through ctypes and an
OpenMP fork, as in the engine). The same for the tied head (its GGUF form is Q8_0: int8 codes, one step per group
of 32) on the library's Q8_0 kernel. Prints two tables and writes DIR/bench_q41_gemm.json. Needs gcc and an
AVX-512 CPU (a clear error otherwise).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.q41_linear import (GROUP, MAX_ROWS, build_kernel, grid_deviation, pack_q41, pack_q80,  # noqa: E402
                               q41_linear, q80_deviation, q80_gemm)


def layer_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every nn.Linear weight of the decoder layers (the head, tied to the embedding, is not Q4_1)."""
    return [module.weight.detach().float().contiguous() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name]


def time_rows(kernel, weights: list[torch.Tensor], packed: list, rows: int, reps: int) -> tuple[float, float]:
    """Median seconds for all matrices at `rows` rows: (F.linear, kernel(x, packed matrix)), interleaved, the first
    rep dropped."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    dense, q41 = [], []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        dense.append(time.perf_counter() - start)
        start = time.perf_counter()
        for w in packed:
            kernel(inputs[w.shape[1]], w)
        q41.append(time.perf_counter() - start)
    return statistics.median(dense[1:]), statistics.median(q41[1:])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="runs/bench_q41_gemm")
    args = p.parse_args(argv)
    if any(not 1 <= r <= MAX_ROWS for r in args.rows):
        p.error(f"--rows: each between 1 and {MAX_ROWS} (the kernel's limit), got {args.rows}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from models.target import load_target
    model = load_target().model
    weights = layer_matrices(model)
    head = model.get_output_embeddings().weight.detach().float().contiguous()  # the tied embedding: Q8_0
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
        timings = {rows: time_rows(functools.partial(q41_linear, lib), weights, packed, rows, args.reps)
                   for rows in args.rows}
        head_deviation = q80_deviation(head)
        head_packed = pack_q80(head)
        x = torch.randn(3, head.shape[1])
        reference = F.linear(x, head)
        head_error = float((q80_gemm(lib, x, head_packed) - reference).abs().max() / reference.abs().max())
        head_timings = {rows: time_rows(functools.partial(q80_gemm, lib), [head], [head_packed], rows, args.reps)
                        for rows in args.rows}
    report = {"matrices": len(weights), "parameters": sum(w.numel() for w in weights),
              "max_grid_deviation": deviation, "max_relative_error": max(errors), "row_alike_at_1_and_5": alike,
              "threads": torch.get_num_threads(), "reps": args.reps,
              "rows": [{"rows": r, "f_linear_ms": a * 1e3, "q41_ms": b * 1e3, "speedup": a / b}
                       for r, (a, b) in timings.items()],
              "head": {"shape": list(head.shape), "max_grid_deviation": head_deviation,
                       "max_relative_error": head_error,
                       "rows": [{"rows": r, "f_linear_ms": a * 1e3, "q80_ms": b * 1e3, "speedup": a / b}
                                for r, (a, b) in head_timings.items()]}}
    print(f"{len(weights)} layer matrices, {report['parameters'] / 1e6:.1f}M weights; largest deviation from a 4-bit "
          f"grid of {GROUP}: {deviation:.1e}; kernel against F.linear: max relative error {max(errors):.1e}; a row "
          f"computed alike at 1 and 5 rows: {alike}")
    print("| rows | F.linear fp32, ms | Q4_1 kernel, ms | speedup |")
    print("|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['rows']} | {row['f_linear_ms']:.1f} | {row['q41_ms']:.1f} | {row['speedup']:.2f}x |")
    print(f"the head {list(head.shape)}: largest deviation from an 8-bit grid of {GROUP}: {head_deviation:.1e}; "
          f"Q8_0 kernel against F.linear: {head_error:.1e}")
    print("| rows | head, F.linear fp32, ms | head, Q8_0 kernel, ms | speedup |")
    print("|---|---|---|---|")
    for row in report["head"]["rows"]:
        print(f"| {row['rows']} | {row['f_linear_ms']:.2f} | {row['q80_ms']:.2f} | {row['speedup']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_q41_gemm.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
