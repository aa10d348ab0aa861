"""What a target forward of N rows costs against one row: the price of verifying an N-node tree (and, at hundreds of
rows, of a prefill).

    python -m benchmarks.forward_rows [--target T] [--rows 1 2 4 8 12 16 24] [--context 300] [--reps 30] [--pages]
        [--out DIR]

The cost model (decode/cost_model.py, docs/design/cost-model.md) prices every draft by this ratio. One process
builds a ModelRunner per form of the kernel library this CPU runs (models/kernels: "fma", and "amx" where the CPU
has AMX: the default target's Q4_1 form on AMX-BF16, a K-quant GGUF's calls of 16+ rows on AMX-INT8 tiles;
$SPECDISTILL_NO_AMX selects the FMA form; with `--pages` also "fma 4k", the FMA form's weights in ordinary pages
instead of 2 MiB ones, models.huge_pages), fills each cache with the same `--context` tokens, then times forwards of
N rows after that prefix (logits for every row, as verification needs; the rows are not committed, so each forward
writes over the last), every (form, N) interleaved rep by rep. Checks that the forms give the same greedy token at
every row. Prints ms per forward and each as a multiple of its own one-row forward; writes DIR/forward_rows.json.
"""

from __future__ import annotations

import os

from benchmarks.harness import interleave, median_ms, parser, print_table, switched_off, write_report

MOST_ROWS = 512  # a long prompt's prefill


def runner_for(model, form: str, context: list[int], most_rows: int):
    """A ModelRunner whose kernel matrices are in `form` ("fma", "amx", "fma 4k": the FMA form's weights in
    ordinary pages, models.huge_pages), its cache holding `context` (committed)."""
    from specdistill.decode.runner import ModelRunner
    from specdistill.models.huge_pages import NO_HUGE_PAGES_ENV
    from specdistill.models.kernels import NO_AMX_ENV

    with switched_off(NO_AMX_ENV, form != "amx"), switched_off(NO_HUGE_PAGES_ENV, form.endswith("4k")):
        runner = ModelRunner(model)
    runner.start(len(context) + most_rows)
    runner.forward(context)
    runner.cache.advance(len(context))  # each timed forward writes its rows after it, uncommitted
    return runner


def forward_rows(runner, rows: int):
    """One forward of `rows` new tokens after the committed prefix (not committed); each row's argmax."""
    _, logits = runner.forward([1000 + 7 * i for i in range(rows)])
    return logits.argmax(-1)


def parse_args(argv=None):
    p = parser(__doc__, "forward_rows", reps=30)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--target", default=None, help="the target (models.target.load_target; default: the embedded one)")
    p.add_argument("--pages", action="store_true", help="also the FMA form with its weights in ordinary 4 KiB pages "
                   "(\"fma 4k\"; by default they are in 2 MiB pages where the OS gives them, models.huge_pages)")
    args = p.parse_args(argv)
    if any(not 1 <= r <= MOST_ROWS for r in args.rows) or args.context < 1 or args.reps < 1:
        p.error(f"--rows between 1 and {MOST_ROWS}, --context and --reps at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from specdistill.models.kernels import amx_int8_unavailable, amx_unavailable
    from specdistill.models.target import load_target

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    model = load_target(args.target).model
    context = [(37 * i) % 30000 + 100 for i in range(args.context)]
    amx = None in (amx_unavailable(), amx_int8_unavailable())
    forms = ["fma"] + (["fma 4k"] if args.pages else []) + (["amx"] if amx else [])
    runners = {form: runner_for(model, form, context, max(args.rows)) for form in forms}
    with torch.inference_mode():
        same = len(forms) == 1 or all(torch.equal(*[forward_rows(runners[f], r) for f in forms]) for r in args.rows)
        times = interleave({(f, r): (lambda f=f, r=r: forward_rows(runners[f], r)) for f in forms for r in args.rows},
                           args.reps, args.warmup)
    ms = median_ms(times)
    print(f"forward of N rows after {args.context} tokens, median of {args.reps}; forms give the same greedy "
          f"tokens: {same}")
    first = args.rows[0]
    print_table(["rows"] + [h for f in forms for h in (f"{f} form, ms", "x one row")],
                [[r] + [v for f in forms for v in (ms[f, r], ms[f, r] / ms[f, first])] for r in args.rows])
    results = {"target": args.target or "default", "context": args.context,
               "amx": amx_unavailable() or "available", "same_greedy_tokens": same,
               "ms": {f: {r: ms[f, r] for r in args.rows} for f in forms},
               "x_one_row": {f: {r: ms[f, r] / ms[f, first] for r in args.rows} for f in forms}}
    write_report(args.out, "forward_rows", results, args)
    return results


if __name__ == "__main__":
    main()
