"""Benchmark: the target's forward over N new tokens with oneDNN-packed weights against F.linear (MKL).

    .venv/bin/python scripts/bench_packing.py [--rows 1 2 4 8 16] [--reps 15] [--context 300] [--out DIR]

For each N the target runs a forward of N tokens after a `--context`-token prefix (the shape of a
verification step), packed and unpacked interleaved rep by rep, their order reversed every other rep, so
the machine's noise hits both alike. Then plain greedy decoding of `--decode-tokens` tokens after one
MT-bench question, both ways, and a check that both produce the same tokens. Prints a table; writes DIR/packing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decode.engine import SpeculativeEngine  # noqa: E402  (ROOT on sys.path first)
from decode.questions import load_questions  # noqa: E402
from decode.runner import ModelRunner, synchronized_clock  # noqa: E402
from models.packed_linear import DISABLE_ENV  # noqa: E402
from models.target import load_target  # noqa: E402

QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--out", default="runs/bench_packing")
    return p.parse_args(argv)


@contextmanager
def env_set(env: str, value: str | None):
    """`env` set to `value` (None: unset) while the block runs, restored after; the engine reads these settings
    when a runner or engine is built."""
    old = os.environ.pop(env, None)
    if value is not None:
        os.environ[env] = value
    try:
        yield
    finally:
        os.environ.pop(env, None)
        if old is not None:
            os.environ[env] = old


def switched_off(env: str, off: bool):
    """`env` set to "1" (a feature switched off) or unset while the block runs."""
    return env_set(env, "1" if off else None)


def time_forward(runner: ModelRunner, context: list[int], rows: int) -> float:
    runner.start(len(context) + rows + 1)
    runner.forward(context, logits_rows=slice(len(context) - 1, len(context)))
    runner.cache.advance(len(context))
    start = synchronized_clock(runner.device)
    runner.forward(list(range(1000, 1000 + rows)))  # logits for every row, as verification needs
    return synchronized_clock(runner.device) - start


@torch.inference_mode()
def compare_forwards(runners: dict[str, ModelRunner], args) -> list[dict]:
    """Per N in args.rows, each runner's forward over N new tokens after args.context cached: the median ms of
    args.reps, the runners interleaved rep by rep and their order reversed every other rep."""
    context = list(range(100, 100 + args.context))
    names = list(runners)
    table = []
    for rows in args.rows:
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.reps + 1):  # the first rep warms up (oneDNN builds its kernel per shape)
            for name in names if rep % 2 else names[::-1]:
                times[name].append(time_forward(runners[name], context, rows))
        table.append({"rows": rows, **{name: 1000 * statistics.median(t[1:]) for name, t in times.items()}})
    return table


def compare_decoding(target, build: dict, args) -> dict:
    """Plain greedy decoding of args.decode_tokens tokens after MT-bench's first question with each engine
    build[name]() makes: twice each, interleaved, the second of each counts; whether all gave the same tokens."""
    question = load_questions(QUESTIONS)[0]
    prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
    names = list(build)
    out = {}
    for name in names + names[::-1]:
        gen = build[name]().generate(prompt, args.decode_tokens)
        out[name] = (gen.tokens, gen.stats.new_tokens / gen.stats.total_time_s)
    first = out[names[0]][0]
    return {"tok_s": {name: tok_s for name, (_, tok_s) in out.items()},
            "same_tokens": all(tokens == first for tokens, _ in out.values()), "tokens": len(first)}


def packing(packed: bool):
    return switched_off(DISABLE_ENV, not packed)


def bench_forwards(model, args) -> list[dict]:
    runners = {}
    for name, packed in (("packed", True), ("unpacked", False)):
        with packing(packed):
            runners[name] = ModelRunner(model)
    return compare_forwards(runners, args)


def bench_decoding(target, args) -> dict:
    def build(packed: bool):
        def engine():
            with packing(packed):
                return SpeculativeEngine(target.model, None, target.eos_token_ids)
        return engine
    return compare_decoding(target, {"packed": build(True), "unpacked": build(False)}, args)


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = load_target(args.target)
    report = {"threads": torch.get_num_threads(), "context": args.context,
              "forwards": bench_forwards(target.model, args), "decoding": bench_decoding(target, args)}
    print(f"target forward over N new tokens after {args.context} cached, median of {args.reps} "
          f"(torch threads {report['threads']}):")
    print_comparison(report, "packed", "unpacked")
    write_report(report, Path(args.out) / "packing.json")
    return report


def print_comparison(report: dict, new: str, old: str) -> None:
    """The table and decoding line of a two-setting report: every report["forwards"] row holds the forward's ms
    under `new` and `old`; report["decoding"]["tok_s"] plain decoding's tokens a second under each."""
    print(f"| N | {new}, ms | {old}, ms | speedup | {new} cost / its 1-row cost |")
    print("|---|---|---|---|---|")
    one = report["forwards"][0][new]
    for row in report["forwards"]:
        print(f"| {row['rows']} | {row[new]:.1f} | {row[old]:.1f} | {row[old] / row[new]:.2f}x | "
              f"{row[new] / one:.2f} |")
    d = report["decoding"]
    print(f"plain greedy decoding, {d['tokens']} tokens: {new} {d['tok_s'][new]:.1f} tok/s, {old} "
          f"{d['tok_s'][old]:.1f} tok/s ({d['tok_s'][new] / d['tok_s'][old]:.2f}x); same tokens: {d['same_tokens']}")


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
