"""An EAGLE-3 drafter's matrices in the two forms the engine drafts with on the CPU: int8 rows times Q8_0 weights
(`Q8Int8Linear`, the library's int8 kernel: AVX512-VNNI or the AVX2 build's loop) against the same Q8_0 weights on
the Q8_0 kernel's FMA form (`q80_inference_copy`), what eagle3_drafting_weights chooses between.

    python -m benchmarks.drafting_matrices [--rows 1 4 8] [--reps 30] [--out DIR]
        [--hidden 1536 --intermediate 8960 --heads 12 --kv-heads 2 --head-dim 128 --draft-vocab 8192]

The decision it backs: decode/proposers/eagle3.py (`eagle3_drafting_weights`) and docs/design/exact-kernels.md (the
AVX2 build's int8 loop). The default shapes are the 1.5B's drafter (configs/distill/qwen_coder_eagle3.yaml); the
embedded target's: `--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64`. Random weights (their
values do not change the time): fc (3 states into one), qkv over [embedding | state], o, gate/up, down and the
reduced head, one pass over all of them per row count, the forms interleaved rep by rep (medians). Checks first that
the int8 form is the Q8_0 product up to x's rounding. Needs the kernel library's int8 kernels. Writes
DIR/drafting_matrices.json.
"""

from __future__ import annotations

import sys

from benchmarks.harness import interleave, median_ms, parser, print_table, write_report


def drafter_shapes(args) -> list[tuple[int, int]]:
    """[(out, in)] of an EAGLE-3 drafter's matrices: fc, qkv, o, gate/up, down, head."""
    d, attention = args.hidden, args.heads * args.head_dim
    return [(d, 3 * d), ((args.heads + 2 * args.kv_heads) * args.head_dim, 2 * d), (d, attention),
            (2 * args.intermediate, d), (d, args.intermediate), (args.draft_vocab, d)]


def relative_difference(a, reference) -> float:
    return float((a - reference).abs().max() / reference.abs().max())


def parse_args(argv=None):
    p = parser(__doc__, "drafting_matrices", reps=30)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    for name, default in (("hidden", 1536), ("intermediate", 8960), ("heads", 12), ("kv-heads", 2), ("head-dim", 128),
                          ("draft-vocab", 8192)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from specdistill.models import kernels
    from specdistill.models.kernel_linear import Q8Int8Linear, q80_inference_copy, q80_rounded_linear

    if (why := kernels.int8_unavailable()) is not None:
        sys.exit(f"benchmarks.drafting_matrices: the int8 kernels do not run here: {why}")
    torch.manual_seed(0)
    linears = [torch.nn.Linear(k, n, bias=False) for n, k in drafter_shapes(args)]
    forms = {"q8_0": [q80_inference_copy(m) for m in linears],
             "int8": [Q8Int8Linear(q80_rounded_linear(m), kernels.library()) for m in linears]}
    with torch.inference_mode():
        inputs = {rows: [torch.randn(rows, m.in_features) for m in linears] for rows in args.rows}
        worst = max(relative_difference(i8(x), q8(x))
                    for q8, i8, x in zip(forms["q8_0"], forms["int8"], inputs[max(args.rows)]))
        calls = {(form, rows): (lambda ms=matrices, xs=inputs[rows]: [m(x) for m, x in zip(ms, xs)])
                 for form, matrices in forms.items() for rows in args.rows}
        ms = median_ms(interleave(calls, args.reps, args.warmup))
    print(f"{sum(n * k for n, k in drafter_shapes(args)) / 1e6:.1f}M weights a pass; the int8 form within {worst:.4f} "
          f"(max relative difference) of the Q8_0 product; medians of {args.reps}, ms")
    print_table(["rows", "q8_0 (FMA form)", "int8", "x"],
                [[r, ms["q8_0", r], ms["int8", r], ms["q8_0", r] / ms["int8", r]] for r in args.rows])
    results = {"shapes": drafter_shapes(args), "int8_relative_difference": worst,
               "ms": {f"{form} {rows}": value for (form, rows), value in ms.items()}}
    write_report(args.out, "drafting_matrices", results, args)
    return results


if __name__ == "__main__":
    main()
