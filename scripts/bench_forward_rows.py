"""Benchmark: the target's forward over N new rows (a verification's shape) with each form of the Q4_1 / Q8_0
kernel this CPU runs (models.q41_linear: "fma", and "amx" where the CPU has AMX-BF16), side by side.

    .venv/bin/python scripts/bench_forward_rows.py [--rows 1 2 4 8 12 16 24] [--context 300] [--reps 30] [--out DIR]

One process builds a ModelRunner per form ($SPECDISTILL_NO_AMX for the FMA form), fills each cache with the same
`--context` tokens, then times forwards of N rows after that prefix (logits for every row; the rows are not
committed, so each forward writes over the last), the forms interleaved rep by rep so the machine's drift hits
both alike. Checks that both forms give the same greedy token at every row. Prints a table (ms per forward, and each as a multiple of its own one-row forward:
what a tree of N nodes costs against plain decoding); writes DIR/forward_rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decode.runner import ModelRunner  # noqa: E402  (ROOT on sys.path first)
from models.q41_linear import NO_AMX_ENV, amx_unavailable  # noqa: E402
from models.target import load_target  # noqa: E402


def runner_for(model, form: str, context: list[int]) -> ModelRunner:
    """A ModelRunner whose kernel matrices are in `form`, its cache holding `context`."""
    old = os.environ.pop(NO_AMX_ENV, None)
    if form == "fma":
        os.environ[NO_AMX_ENV] = "1"
    try:
        runner = ModelRunner(model)
    finally:
        os.environ.pop(NO_AMX_ENV, None)
        if old is not None:
            os.environ[NO_AMX_ENV] = old
    runner.start(len(context) + 64)
    runner.forward(context)
    runner.cache.advance(len(context))  # committed: each timed forward writes its rows after it, uncommitted
    return runner


def forward_rows(runner: ModelRunner, rows: int) -> torch.Tensor:
    """One forward of `rows` new tokens after the committed prefix (not committed); returns each row's argmax."""
    _, logits = runner.forward([1000 + 7 * i for i in range(rows)])
    return logits.argmax(-1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="runs/bench_forward_rows")
    args = p.parse_args(argv)
    if any(not 1 <= r <= 64 for r in args.rows) or args.context < 1 or args.reps < 1:
        p.error("--rows between 1 and 64, --context and --reps at least 1")
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    model = load_target().model
    context = [(37 * i) % 30000 + 100 for i in range(args.context)]
    forms = ["fma"] + (["amx"] if amx_unavailable() is None else [])
    runners = {form: runner_for(model, form, context) for form in forms}
    times = {form: {r: [] for r in args.rows} for form in forms}
    with torch.inference_mode():
        same = all(torch.equal(*[forward_rows(runners[f], r) for f in forms]) if len(forms) > 1
                   else True for r in args.rows)
        for _ in range(args.reps):
            for rows in args.rows:
                for form in forms:
                    start = time.perf_counter()
                    forward_rows(runners[form], rows)
                    times[form][rows].append(time.perf_counter() - start)
    table = {form: {r: statistics.median(t) * 1e3 for r, t in by_rows.items()} for form, by_rows in times.items()}
    report = {"context": args.context, "reps": args.reps, "threads": torch.get_num_threads(),
              "amx": amx_unavailable() or "available", "same_greedy_tokens": same, "ms": table}
    print(f"forward of N rows after {args.context} tokens, median of {args.reps}; forms give the same greedy tokens: "
          f"{same}")
    print("| rows | " + " | ".join(f"{f} form, ms | x one row" for f in forms) + " |")
    print("|---|" + "---|---|" * len(forms))
    for r in args.rows:
        print(f"| {r} | " + " | ".join(f"{table[f][r]:.2f} | {table[f][r] / table[f][args.rows[0]]:.2f}" for f in forms)
              + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forward_rows.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
