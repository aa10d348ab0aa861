"""What each drafter of an evaluation would need to reach a speedup on this machine (decode.cost_model).

    specdistill speedup-model REPORT.json [--goal 1.2 1.5] [--rows 1 2 3 4 6 8 12 16]
        [--verify-costs FILE.json] [--out DIR]

Measures the target's forward by row count on this machine (r rows after a 300-token context, the
counts interleaved rep by rep; or reads them back from a previous run's `--verify-costs`), then for
every speculative method in the report (`python -m decode.evaluate --out DIR` writes DIR/report.json):

- its measured speedup and tau, and the cost model's speedup at the measured acceptance and drafting
  cost, at the depth that pays most (the model's fit: it leaves out the adaptive depth's probing);
- the conditional acceptance per position it would need, at its drafting cost, for `--goal`;
- the same for a drafter that costs nothing (verification alone: no drafter can do better).

Chains only: a tree's extra rows are not modelled (Medusa and [LA] rows show as their chain), so for
tree drafters the modelled speedup is an upper bound. Feed it a `--fixed-depth` evaluation: with the
adaptive depth, deep positions are measured on confident steps only and an idle drafter's catch-up
counts as drafting cost (the script says so). Prints a table; writes DIR/speedup_model.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from specdistill.decode.cost_model import acceptance_needed, best_depth, interpolate, report_costs
from specdistill.decode.report import BASELINE
from specdistill.decode.runner import ModelRunner
from specdistill.models.target import load_target

MAX_DEPTH = 8  # the deepest chain considered when asking what acceptance a goal needs


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="an evaluation's report.json (python -m decode.evaluate --out DIR)")
    p.add_argument("--goal", type=float, nargs="+", default=[1.2, 1.5])
    p.add_argument("--target", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--verify-costs", default=None, help="a previous run's speedup_model.json: reuse its row costs")
    p.add_argument("--out", default="runs/speedup_model")
    return p.parse_args(argv)


def time_rows(runner: ModelRunner, context: list[int], rows: int, vocab: int) -> float:
    """Seconds of one forward of `rows` new tokens (logits for each, as verification needs) after `context`."""
    runner.start(len(context) + rows + 1)
    runner.forward(context, logits_rows=slice(len(context) - 1, len(context)))
    runner.cache.advance(len(context))
    start = time.perf_counter()
    runner.forward([(1000 + i) % vocab for i in range(rows)])
    return time.perf_counter() - start


@torch.inference_mode()
def measure_verify_costs(args) -> dict[int, float]:
    """{rows: median seconds over reps relative to one row}, the row counts interleaved rep by rep."""
    rows = sorted(set(args.rows) | {1})
    target = load_target(args.target)
    runner = ModelRunner(target.model)
    context = [(100 + i) % target.vocab_size for i in range(args.context)]
    times: dict[int, list[float]] = {r: [] for r in rows}
    for rep in range(args.reps + 1):  # the first rep warms up (kernels are built per shape)
        for r in rows:
            seconds = time_rows(runner, context, r, target.vocab_size)
            if rep:
                times[r].append(seconds)
    unit = statistics.median(times[1])
    return {r: statistics.median(t) / unit for r, t in times.items()}


ADAPTIVE_NOTE = ("note: this report used the adaptive depth. Its deep positions were measured only on steps\n"
                 "confident enough to draft there (P_k reads high), and a drafter left idle for a while catches\n"
                 "up on the skipped tokens when it drafts again (its cost per drafted token reads high).\n"
                 "For the model's inputs, evaluate with --fixed-depth.")


def load_report(path: str) -> tuple[dict, bool]:
    """(methods, whether the evaluation drafted the full depth at every step)."""
    report = json.loads(Path(path).read_text())
    methods = report.get("methods")
    if not isinstance(methods, dict) or BASELINE not in methods:
        raise SystemExit(f"{path}: not an evaluation report with a {BASELINE!r} method (decode.evaluate --out DIR)")
    return methods, bool((report.get("config") or {}).get("fixed_depth"))


def modellable(entry: dict) -> bool:
    """A speculative method the cost model can read: tau, drafting time and acceptance by position measured."""
    return entry.get("tau") is not None and entry.get("draft_time_s") is not None \
        and bool(entry.get("acceptance_per_position"))


def model_method(name: str, entry: dict, baseline: dict, verify: list[float], goals: list[float]) -> dict:
    costs = report_costs(entry, baseline)
    if not math.isfinite(costs["draft_cost"]):  # it never drafted: its cost per draft is unknown
        costs["draft_cost"] = 0.0
    cumulative = costs["cumulative"]
    depth, modelled = best_depth(cumulative, costs["draft_cost"], verify)  # depth 0 when it never drafted
    needed = {g: acceptance_needed(g, costs["draft_cost"], verify, MAX_DEPTH) for g in goals}
    free = {g: acceptance_needed(g, 0.0, verify, MAX_DEPTH) for g in goals}
    first = cumulative[0] if cumulative else 0.0
    return {"method": name, **costs, "best_depth": depth, "modelled_speedup": modelled,
            "first_position": first, "needed": needed, "needed_free_drafter": free}


def fmt(value: float | None) -> str:
    return "unreachable" if value is None else f"{value:.2f}"


def print_table(rows: list[dict], verify: dict[int, float], goals: list[float]) -> None:
    print("forward cost by rows (one row = 1): " + ", ".join(f"{r}: {v:.2f}" for r, v in sorted(verify.items())))
    heads = ["method", "measured", "tau", "P_1", "draft cost/token", "modelled (depth)"]
    heads += [f"a for {g}x" for g in goals] + [f"a for {g}x, free drafter" for g in goals]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for row in rows:
        cells = [row["method"], f"{row['speedup']:.2f}x", f"{row['tau']:.2f}", f"{row['first_position']:.3f}",
                 f"{row['draft_cost']:.3f}", f"{row['modelled_speedup']:.2f}x ({row['best_depth']})"]
        cells += [fmt(row["needed"][g]) for g in goals] + [fmt(row["needed_free_drafter"][g]) for g in goals]
        print("| " + " | ".join(cells) + " |")
    print("a: the conditional acceptance needed at every position (P_k = a^k), chains up to depth "
          f"{MAX_DEPTH}; P_1: the measured first-position acceptance")


def main(argv=None) -> dict:
    args = parse_args(argv)
    methods, fixed_depth = load_report(args.report)
    if args.verify_costs:
        measured = {int(r): v for r, v in json.loads(Path(args.verify_costs).read_text())["verify_cost"].items()}
    else:
        measured = measure_verify_costs(args)
    verify = interpolate(measured, MAX_DEPTH + 1)
    modelled = {name: entry for name, entry in methods.items() if name != BASELINE and modellable(entry)}
    rows = [model_method(name, entry, methods[BASELINE], verify, args.goal) for name, entry in modelled.items()]
    print_table(rows, measured, args.goal)
    left_out = [name for name in methods if name != BASELINE and name not in modelled]
    if left_out:  # peers (llama.cpp, vLLM) report tau but not where in a step their drafts were accepted
        print("not modelled (no acceptance by position or drafting time in the report): " + ", ".join(left_out))
    if not fixed_depth:
        print(ADAPTIVE_NOTE)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"report": args.report, "fixed_depth": fixed_depth, "verify_cost": measured, "methods": rows,
              "not_modelled": left_out}
    (out / "speedup_model.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out / 'speedup_model.json'}")
    return result


if __name__ == "__main__":
    main()
