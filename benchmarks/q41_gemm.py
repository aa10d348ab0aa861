"""The default target's matrices computed from their own 4-bit (Q4_1) and 8-bit (Q8_0) codes against fp32 F.linear.

    python -m benchmarks.q41_gemm [--rows 1 2 4 8 16] [--reps 9] [--out DIR]

The decision it backs: docs/design/exact-kernels.md. The default target ships as a Q4_1 GGUF (each group of 32
weights is q * d + m, q in 0..15), so the fp32 weights the engine would stream (425 MB a forward) hold 53 MB of
information. This checks that (the largest deviation of any layer matrix from its group's 4-bit grid), packs the
engine's 120 layer matrices (q, k, v fused; gate and up fused) in each form of the kernel library this CPU runs
(models/kernels: "fma", AVX-512 FMAs; "amx", AMX-BF16 tiles over x split exactly into three bf16 parts; fp32
accumulation in both), checks each against F.linear and that a row is computed alike alone and among 19, then
times all matrices per row count, each form interleaved rep by rep with F.linear, through the library's own entry
points (as models.kernel_linear binds them). The same for the tied head (Q8_0). Needs the kernel library (a C++
compiler, an AVX-512 CPU): a clear error otherwise. Writes DIR/q41_gemm.json.
"""

from __future__ import annotations

import sys

from benchmarks.harness import interleave, median_ms, parser, print_table, write_report


def layer_matrices(model) -> list:
    """The engine's 120 layer matrices (decode.lean_decoder): per layer q, k and v fused, o, gate and up fused,
    down (the head, tied to the embedding, is Q8_0 and measured apart)."""
    import torch

    matrices = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                      [mlp.down_proj]):
            matrices.append(torch.cat([m.weight.detach().float() for m in group]).contiguous())
    return matrices


def bind(lib, w):
    """x [R, K] fp32 -> [R, N] for packed weights `w` in their form, through the library's entry point for it."""
    from specdistill.models.quant_formats import Q41Weight

    if isinstance(w, Q41Weight):
        if w.form == "amx":
            return lambda x: lib.q41_amx(x, w.packed, w.step, w.minimum)
        return lib.Q41Matrix(w.packed, w.step, w.minimum).gemm
    if w.form == "amx":
        return lambda x: lib.q80_amx(x, w.codes, w.step)
    return lambda x: lib.q80_gemm(x, w.codes, w.step)


def check(gemm, x, dense) -> tuple[float, bool]:
    """(max relative error against F.linear, each of x's rows computed alike alone and among all of them)."""
    import torch
    import torch.nn.functional as F

    y, reference = gemm(x), F.linear(x, dense)
    alike = all(torch.equal(gemm(x[i:i + 1].contiguous())[0], y[i]) for i in range(x.shape[0]))
    return float((y - reference).abs().max() / reference.abs().max()), alike


def bench(name: str, lib, pack, dense: list, forms: list[str], args) -> dict:
    """One kind of matrix (the layers' Q4_1 or the head's Q8_0): each form checked, then all timed."""
    import torch
    import torch.nn.functional as F

    gemms = {form: [bind(lib, pack(w, form)) for w in dense] for form in forms}
    result = {"forms": {}, "rows": []}
    for form in forms:
        checks = [check(gemm, torch.randn(19, w.shape[1]), w) for w, gemm in zip(dense, gemms[form])]
        result["forms"][form] = {"max_relative_error": max(e for e, _ in checks),
                                 "rows_alike_at_1_and_19": all(a for _, a in checks)}
    for rows in args.rows:
        x = {k: torch.randn(rows, k) for k in {w.shape[1] for w in dense}}
        calls = {"F.linear": lambda x=x: [F.linear(x[w.shape[1]], w) for w in dense],
                 **{form: (lambda form=form, x=x: [gemm(x[w.shape[1]]) for w, gemm in zip(dense, gemms[form])])
                    for form in forms}}
        ms = median_ms(interleave(calls, args.reps, args.warmup))
        result["rows"].append({"rows": rows, **{f"{k}_ms": v for k, v in ms.items()},
                               **{f"{form}_speedup": ms["F.linear"] / ms[form] for form in forms}})
    for form, c in result["forms"].items():
        print(f"{name}, {form} form against F.linear: max relative error {c['max_relative_error']:.1e}, rows alike: "
              f"{c['rows_alike_at_1_and_19']}")
    print_table(["rows", "F.linear fp32, ms"] + [h for f in forms for h in (f"{f} form, ms", "speedup")],
                [[r["rows"], r["F.linear_ms"]] + [v for f in forms for v in (r[f + "_ms"], r[f + "_speedup"])]
                 for r in result["rows"]])
    return result


def parse_args(argv=None):
    from specdistill.models.kernels import MAX_ROWS

    p = parser(__doc__, "q41_gemm", reps=9)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = p.parse_args(argv)
    if any(not 1 <= r <= MAX_ROWS for r in args.rows):
        p.error(f"--rows: each between 1 and {MAX_ROWS} (the kernel's limit), got {args.rows}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from specdistill.models.kernels import amx_unavailable, library, unavailable
    from specdistill.models.quant_formats import GROUP, grid_deviation, pack_q41, pack_q80, q80_deviation
    from specdistill.models.target import load_target

    if (why := unavailable()) is not None:
        sys.exit(f"benchmarks.q41_gemm: the kernel library does not run here: {why}")
    lib = library()
    model = load_target().model
    weights = layer_matrices(model)
    head = model.get_output_embeddings().weight.detach().float().contiguous()  # the tied embedding: Q8_0
    forms = ["fma"] + (["amx"] if amx_unavailable() is None else [])
    results = {"matrices": len(weights), "parameters": sum(w.numel() for w in weights),
               "max_grid_deviation": max(grid_deviation(w) for w in weights), "head_shape": list(head.shape),
               "head_max_grid_deviation": q80_deviation(head), "amx": amx_unavailable() or "available"}
    print(f"{len(weights)} layer matrices, {results['parameters'] / 1e6:.1f}M weights; largest deviation from a "
          f"4-bit grid of {GROUP}: {results['max_grid_deviation']:.1e}; the head {list(head.shape)} from an "
          f"8-bit grid: {results['head_max_grid_deviation']:.1e}; the AMX form: {results['amx']}")
    results["layers"] = bench("layers (Q4_1)", lib, pack_q41, weights, forms, args)
    results["head"] = bench("head (Q8_0)", lib, pack_q80, [head], forms, args)
    write_report(args.out, "q41_gemm", results, args)
    return results


if __name__ == "__main__":
    main()
