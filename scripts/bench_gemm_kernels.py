"""Benchmark: the default target's linear layers alone (30 layers' q/k/v/o/gate/up/down and the 49k-token head,
random fp32 weights) for N rows under three fp32 GEMM kernels: oneDNN's packed weights (what the engine runs,
models.packed_linear), MKL's packed sgemm packed for exactly N rows (`torch.ops.mkl._mkl_reorder_linear_weight`,
what Inductor uses for a static batch), and F.linear (MKL's sgemm, unpacked).

    .venv/bin/python scripts/bench_gemm_kernels.py [--rows 1 2 3 4 5 8 12 16] [--reps 7] [--out DIR]

GEMMs only, no attention or norms, the kernels interleaved rep by rep (order reversed every other rep), median of
`--reps` after one warm-up rep. A kernel that wins here need not win in a forward: on a 2-core Intel Xeon with
AMX MKL's packing took 0.67-0.92x oneDNN's time here (two runs), and made plain decoding 1.05-1.12x faster and
speculative decoding no faster (BENCHMARKS.md "MKL's packed sgemm against oneDNN's packing").
Also checks that MKL's packings for 2-16 rows compute a row bit for bit alike. Prints a table; writes
DIR/gemm_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # the default target, smollm2-135m
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [out, in]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 12, 16])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="runs/bench_gemm_kernels")
    return p.parse_args(argv)


def target_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) * 0.02 for shape in LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]]


def kernels_for(weights: list[torch.Tensor], rows: int) -> dict:
    """{kernel: run(inputs)} with each kernel's weights prepared (MKL's packed for `rows`)."""
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    return {
        "onednn packed": lambda x: [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                                    for p, w in zip(onednn, weights)],
        "mkl packed": lambda x: [torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, rows)
                                 for p, w in zip(mkl, weights)],
        "F.linear": lambda x: [F.linear(x[w.shape[1]], w) for w in weights],
    }


def time_kernels(weights: list[torch.Tensor], rows: int, reps: int) -> dict[str, float]:
    inputs = {HIDDEN: torch.randn(rows, HIDDEN), INTERMEDIATE: torch.randn(rows, INTERMEDIATE)}
    kernels = kernels_for(weights, rows)
    names = list(kernels)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 1):
        for name in names if rep % 2 else names[::-1]:
            start = time.perf_counter()
            kernels[name](inputs)
            samples[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(times[1:]) for name, times in samples.items()}


def mkl_rows_alike(sizes=(2, 4, 8, 16)) -> bool:
    """Whether MKL's packings for `sizes` rows give the first rows bit for bit the same outputs."""
    weight, x = torch.randn(INTERMEDIATE, HIDDEN), torch.randn(max(sizes), HIDDEN)
    outs = [torch.ops.mkl._mkl_linear(x[:size], torch.ops.mkl._mkl_reorder_linear_weight(weight, size), weight,
                                      None, size)[:sizes[0]] for size in sizes]
    return all(torch.equal(out, outs[0]) for out in outs)


@torch.inference_mode()
def main(argv=None) -> dict:
    args = parse_args(argv)
    weights = target_weights()
    table = [{"rows": rows, **time_kernels(weights, rows, args.reps)} for rows in args.rows]
    report = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "mkl_rows_alike": mkl_rows_alike(), "ms": table}
    kernels = [k for k in table[0] if k != "rows"]
    print(f"the default target's linear layers, ms (torch threads {report['threads']}, {report['cpu_capability']}):")
    print("| rows | " + " | ".join(kernels) + " | mkl packed / onednn |")
    print("|---" * (len(kernels) + 2) + "|")
    for row in table:
        print(f"| {row['rows']} | " + " | ".join(f"{row[k]:.1f}" for k in kernels)
              + f" | {row['mkl packed'] / row['onednn packed']:.2f} |")
    print(f"MKL's packings for 2-16 rows compute a row alike: {report['mkl_rows_alike']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_kernels.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
