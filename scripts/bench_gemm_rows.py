"""Benchmark: the target's forward over N new tokens with small fp32 GEMMs padded (B:T), against none.

    .venv/bin/python scripts/bench_gemm_rows.py [--pad B:T] [--rows 1 2 3 ... 16] [--reps 15] [--out DIR]

oneDNN's fp32 GEMM (the engine's packed linear layers, models.packed_linear) is slower for one or two rows
than for six on AVX-512 hosts, faster on AVX2 ones; `$SPECDISTILL_GEMM_PAD` ("B:T": a call of fewer than B
rows computes T; default 3:6 on AVX-512, else off) pads them. This measures a padding and none on this
machine, interleaved rep by rep, the order reversed every other rep, so the machine's noise and any
first-or-second bias hit both alike: the target's forward over N new tokens after a `--context`-token
prefix (the shape of a verification step; logits for every row), then plain greedy decoding of
`--decode-tokens` tokens after one MT-bench question (twice each way, the second counts), with a check that
both produce the same tokens. Prints a table; writes DIR/gemm_rows.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decode.engine import SpeculativeEngine  # noqa: E402  (ROOT on sys.path first)
from decode.questions import load_questions  # noqa: E402
from decode.runner import ModelRunner  # noqa: E402
from models.packed_linear import GEMM_PAD_ENV, gemm_padding  # noqa: E402
from models.target import load_target  # noqa: E402
from scripts.bench_packing import QUESTIONS, print_comparison, time_forward, write_report  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--pad", default=None, help="B:T to compare with none (default: this machine's)")
    p.add_argument("--rows", type=int, nargs="+", default=list(range(1, 9)) + [11, 16])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--out", default="runs/bench_gemm_rows")
    return p.parse_args(argv)


def built_with(pad: str, factory):
    """factory() with $SPECDISTILL_GEMM_PAD = pad while it packs its weights, the old value after."""
    old = os.environ.get(GEMM_PAD_ENV)
    os.environ[GEMM_PAD_ENV] = pad
    try:
        return factory()
    finally:
        os.environ.pop(GEMM_PAD_ENV)
        if old is not None:
            os.environ[GEMM_PAD_ENV] = old


@torch.inference_mode()
def bench_forwards(model, settings: list[str], args) -> list[dict]:
    runners = {k: built_with(k, lambda: ModelRunner(model)) for k in settings}
    context = list(range(100, 100 + args.context))
    table = []
    for rows in args.rows:
        times: dict[str, list[float]] = {k: [] for k in settings}
        for rep in range(args.reps + 1):  # the first rep warms up (oneDNN builds its kernel per shape)
            for k in settings if rep % 2 else settings[::-1]:
                times[k].append(time_forward(runners[k], context, rows))
        table.append({"rows": rows, **{k: 1000 * statistics.median(t[1:]) for k, t in times.items()}})
    return table


def bench_decoding(target, settings: list[str], args) -> dict:
    question = load_questions(QUESTIONS)[0]
    prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
    out = {}
    for k in settings + settings[::-1]:  # twice each, interleaved; the second of each counts
        engine = built_with(k, lambda: SpeculativeEngine(target.model, None, target.eos_token_ids))
        gen = engine.generate(prompt, args.decode_tokens)
        out[k] = (gen.tokens, gen.stats.new_tokens / gen.stats.total_time_s)
    first = settings[0]
    return {"tok_s": {k: tok_s for k, (_, tok_s) in out.items()},
            "same_tokens": all(tokens == out[first][0] for tokens, _ in out.values()), "tokens": len(out[first][0])}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.pad:
        try:
            built_with(args.pad, gemm_padding)  # a bad B:T fails here, before the target loads
        except ValueError as err:
            raise SystemExit(f"--pad: {err}") from err
    padded = args.pad or ":".join(map(str, gemm_padding()))
    if padded == "0:0":
        raise SystemExit("this machine pads no GEMM by default: pass --pad B:T to compare one with none")
    settings = ["off", padded]
    target = load_target(args.target)
    report = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "context": args.context, "pad": padded,
              "forwards": bench_forwards(target.model, settings, args),
              "decoding": bench_decoding(target, settings, args)}
    print(f"target forward over N new tokens after {args.context} cached, median of {args.reps} "
          f"(torch threads {report['threads']}, {report['cpu_capability']}):")
    print_comparison(report, padded, "off")
    write_report(report, Path(args.out) / "gemm_rows.json")
    return report


if __name__ == "__main__":
    main()
