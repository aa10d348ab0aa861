"""Benchmark: the default target's layer weights computed in their own 4-bit form (Q4_1) against fp32 `F.linear`.

    .venv/bin/python scripts/bench_q41_gemm.py [--rows 1 2 4 8 16] [--reps 9] [--out runs/bench_q41_gemm]

The default target ships as a Q4_1 GGUF: in every matrix of its 30 layers each group of 32 weights is q * d + m
with q in 0..15, so the dequantized fp32 weights the engine streams (425 MB a forward) hold 53 MB of information.
This script checks that (the largest deviation of any layer matrix from the 4-bit grid its group's min and max
define), packs the engine's 120 layer matrices (q, k, v fused; gate and up fused) in each form of the engine's
Q4_1 kernel this CPU runs (models.q41_linear, built with gcc: "fma", AVX-512 FMAs; "amx", AMX-BF16 tiles over x
split exactly into three bf16 parts; fp32 accumulation in both, the target's weights exactly), checks each against
`F.linear` and that a row is computed alike alone and among 19, then times all matrices at each row count,
interleaved rep by rep with `F.linear` (each kernel call goes through ctypes and an OpenMP fork, as in the engine).
The same for the tied head (its GGUF form is Q8_0: int8 codes, one step per group of 32). Prints two tables and
writes DIR/bench_q41_gemm.json. Needs gcc and an AVX-512 CPU (a clear error otherwise).
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

from models.q41_linear import (GROUP, MAX_ROWS, amx_unavailable, build_kernel, grid_deviation,  # noqa: E402
                               pack_q41, pack_q80, q41_linear, q80_deviation, q80_gemm)


def layer_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The engine's 120 layer matrices (decode.lean_decoder): per layer q, k and v fused, o, gate and up fused,
    down (the head, tied to the embedding, is not Q4_1)."""
    matrices = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                      [mlp.down_proj]):
            matrices.append(torch.cat([m.weight.detach().float() for m in group]).contiguous())
    return matrices


def time_rows(kernels: dict, weights: dict, rows: int, reps: int) -> dict[str, float]:
    """Median seconds for all matrices at `rows` rows, per kernel name (kernels[name](x, weights[name][i])),
    interleaved rep by rep, the first rep dropped."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights["F.linear"]}}
    times = {name: [] for name in kernels}
    for _ in range(reps + 1):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for w in weights[name]:
                kernel(inputs[w.shape[1]], w)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def check(gemm, x: torch.Tensor, dense: torch.Tensor, packed) -> tuple[float, bool]:
    """(max relative error against F.linear, each of x's rows computed alike alone and among all of them)."""
    y, reference = gemm(x, packed), F.linear(x, dense)
    alike = all(torch.equal(gemm(x[i:i + 1].contiguous(), packed)[0], y[i]) for i in range(x.shape[0]))
    return float((y - reference).abs().max() / reference.abs().max()), alike


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="runs/bench_q41_gemm")
    args = p.parse_args(argv)
    if any(not 1 <= r <= MAX_ROWS for r in args.rows):
        p.error(f"--rows: each between 1 and {MAX_ROWS} (the kernel's limit), got {args.rows}")
    return args


def bench(name: str, gemm, pack, dense: list[torch.Tensor], forms: list[str], rows: list[int], reps: int) -> dict:
    """One kind of matrix (the layers' Q4_1 or the head's Q8_0): each form checked, then all timed."""
    packed = {form: [pack(w, form) for w in dense] for form in forms}
    kernels = {"F.linear": F.linear, **{form: gemm for form in forms}}
    result = {"forms": {}, "rows": []}
    for form in forms:
        checks = [check(gemm, torch.randn(19, w.shape[1]), w, q) for w, q in zip(dense, packed[form])]
        result["forms"][form] = {"max_relative_error": max(e for e, _ in checks),
                                 "rows_alike_at_1_and_19": all(a for _, a in checks)}
    for r in rows:
        times = time_rows(kernels, {"F.linear": dense, **packed}, r, reps)
        result["rows"].append({"rows": r, **{f"{k}_ms": v * 1e3 for k, v in times.items()},
                               **{f"{form}_speedup": times["F.linear"] / times[form] for form in forms}})
    print(f"{name}: " + "; ".join(f"{form} form against F.linear: max relative error {c['max_relative_error']:.1e}, "
                                  f"rows alike: {c['rows_alike_at_1_and_19']}" for form, c in result["forms"].items()))
    print("| rows | F.linear fp32, ms | " + " | ".join(f"{form} form, ms | speedup" for form in forms) + " |")
    print("|---|---|" + "---|---|" * len(forms))
    for row in result["rows"]:
        print(f"| {row['rows']} | {row['F.linear_ms']:.2f} | " + " | ".join(
            f"{row[form + '_ms']:.2f} | {row[form + '_speedup']:.2f}x" for form in forms) + " |")
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    from models.target import load_target
    model = load_target().model
    weights = layer_matrices(model)
    head = model.get_output_embeddings().weight.detach().float().contiguous()  # the tied embedding: Q8_0
    forms = ["fma"] + (["amx"] if amx_unavailable() is None else [])
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_kernel(Path(tmp))
        report = {"matrices": len(weights), "parameters": sum(w.numel() for w in weights),
                  "max_grid_deviation": max(grid_deviation(w) for w in weights), "head_shape": list(head.shape),
                  "head_max_grid_deviation": q80_deviation(head), "threads": torch.get_num_threads(),
                  "reps": args.reps, "amx": amx_unavailable() or "available"}
        print(f"{len(weights)} layer matrices, {report['parameters'] / 1e6:.1f}M weights; largest deviation from a "
              f"4-bit grid of {GROUP}: {report['max_grid_deviation']:.1e}; the head {list(head.shape)} from an "
              f"8-bit grid: {report['head_max_grid_deviation']:.1e}; the AMX form: {report['amx']}")
        report["layers"] = bench("layers (Q4_1)", functools.partial(q41_linear, lib), pack_q41, weights, forms,
                                 args.rows, args.reps)
        report["head"] = bench("head (Q8_0)", functools.partial(q80_gemm, lib), pack_q80, [head], forms, args.rows,
                               args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_q41_gemm.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
