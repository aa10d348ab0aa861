"""Benchmark: a verification forward of the target with transformers' sdpa against decode.attention's
grouped-query attention (no K/V copies per group), with the tree mask tiled once per forward by the runner
(as decoding runs it) and tiled again in every layer (as before the runner passed `grouped_mask`).

    .venv/bin/python scripts/bench_attention.py [--rows 1 2 5 9 17] [--context 300 600] [--reps 40] [--out DIR]

For each context length and tree size N the target runs a forward over a branchy N-node tree after the
context, the three variants interleaved rep by rep on one runner (so the machine's noise
hits both alike), and the logits of both are compared. Prints a table; writes DIR/attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import decode.runner  # noqa: E402  (ROOT on sys.path first)
from decode.attention import GROUPED_SDPA  # noqa: E402
from decode.runner import ModelRunner  # noqa: E402
from decode.tree import TokenTree  # noqa: E402
from models.target import load_target  # noqa: E402

PER_LAYER = "grouped, tiled per layer"
IMPLEMENTATIONS = ("sdpa", PER_LAYER, GROUPED_SDPA)
TILE_ONCE = decode.runner.grouped_mask_argument


def select(model, impl: str) -> None:
    """Switch the attention; for PER_LAYER the runner hands no tiled mask, so each layer tiles its own."""
    model.config._attn_implementation = "sdpa" if impl == "sdpa" else GROUPED_SDPA
    decode.runner.grouped_mask_argument = (lambda m, mask: {}) if impl == PER_LAYER else TILE_ONCE


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    p.add_argument("--context", type=int, nargs="+", default=[300, 600])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out", default="runs/bench_attention")
    return p.parse_args(argv)


def branchy_tree(rows: int) -> TokenTree:
    """Node i > 0 hangs under node (i - 1) // 2: every level but the last full, siblings everywhere."""
    tree = TokenTree.root(5)
    for i in range(1, rows):
        tree.add(6 + i, (i - 1) // 2, dedupe=False)
    return tree


def measure(runner: ModelRunner, model, context: int, rows: int, reps: int) -> dict:
    runner.start(context + rows + 1)
    runner.forward(list(range(100, 100 + context)))
    runner.cache.advance(context)
    tree = branchy_tree(rows)
    times = {impl: [] for impl in IMPLEMENTATIONS}
    logits = {}
    for _ in range(reps):
        for impl in IMPLEMENTATIONS:
            select(model, impl)
            start = time.perf_counter()
            _, logits[impl] = runner.forward(tree.tokens, tree.depths, tree.ancestor_mask())
            times[impl].append(time.perf_counter() - start)
            runner.cache.truncate(context)
    ms = {impl: 1e3 * statistics.median(t) for impl, t in times.items()}
    diff = float((logits["sdpa"] - logits[GROUPED_SDPA]).abs().max())
    same_argmax = bool(torch.equal(logits["sdpa"].argmax(-1), logits[GROUPED_SDPA].argmax(-1)))
    return {"context": context, "rows": rows, "sdpa_ms": ms["sdpa"], "grouped_ms": ms[GROUPED_SDPA],
            "grouped_per_layer_ms": ms[PER_LAYER], "speedup": ms["sdpa"] / ms[GROUPED_SDPA],
            "tile_once_speedup": ms[PER_LAYER] / ms[GROUPED_SDPA], "max_abs_logit_diff": diff,
            "same_argmax": same_argmax}


def main(argv=None) -> None:
    args = parse_args(argv)
    target = load_target(args.target)
    model = target.model
    runner = ModelRunner(model)
    results = []
    with torch.inference_mode():
        for context in args.context:
            for rows in args.rows:
                results.append(measure(runner, model, context, rows, args.reps))
    select(model, GROUPED_SDPA)
    print(f"target forward over an N-node tree after C cached tokens, median of {args.reps} "
          f"(torch threads {torch.get_num_threads()}):")
    print("| C | N | sdpa ms | grouped, tiled per layer ms | grouped ms | sdpa / grouped | per layer / once | "
          "max logit diff | same argmax |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['context']} | {r['rows']} | {r['sdpa_ms']:.2f} | {r['grouped_per_layer_ms']:.2f} | "
              f"{r['grouped_ms']:.2f} | {r['speedup']:.3f}x | {r['tile_once_speedup']:.3f}x | "
              f"{r['max_abs_logit_diff']:.1e} | {r['same_argmax']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps({"threads": torch.get_num_threads(), "reps": args.reps,
                                                    "results": results}, indent=1))
    print(f"wrote {out / 'attention.json'}")


if __name__ == "__main__":
    main()
