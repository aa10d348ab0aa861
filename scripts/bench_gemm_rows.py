"""Benchmark: the target's forward over N new tokens with small fp32 GEMMs padded (B:T), against none.

    .venv/bin/python scripts/bench_gemm_rows.py [--pad B:T] [--rows 1 2 3 ... 16] [--reps 15] [--out DIR]

oneDNN's fp32 GEMM (the engine's packed linear layers, models.packed_linear) was slower for one or two rows
than for six on an AMD AVX-512 host, faster on an Intel AVX-512 one and on AVX2 ones; `$SPECDISTILL_GEMM_PAD`
("B:T": a call of fewer than B rows computes T; by default on AVX-512 what a short timing of packed GEMMs finds
faster, models.packed_linear.measured_gemm_padding, else off) pads them. This measures a padding and none on this
machine, interleaved rep by rep, the order reversed every other rep, so the machine's noise and any
first-or-second bias hit both alike: the target's forward over N new tokens after a `--context`-token
prefix (the shape of a verification step; logits for every row), then plain greedy decoding of
`--decode-tokens` tokens after one MT-bench question (twice each way, the second counts), with a check that
both produce the same tokens. Prints a table; writes DIR/gemm_rows.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decode.engine import SpeculativeEngine  # noqa: E402  (ROOT on sys.path first)
from decode.runner import ModelRunner  # noqa: E402
from models.packed_linear import GEMM_PAD_ENV, gemm_padding  # noqa: E402
from models.target import load_target  # noqa: E402
from scripts.bench_packing import (  # noqa: E402
    compare_decoding, compare_forwards, env_set, print_comparison, write_report)


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


def runners_and_engines(model, eos_token_ids, settings: list[str]):
    """Per setting of $SPECDISTILL_GEMM_PAD: a runner packed under it, and a function building a plain engine."""
    runners, engines = {}, {}
    for pad in settings:
        with env_set(GEMM_PAD_ENV, pad):
            runners[pad] = ModelRunner(model)

        def engine(pad=pad):
            with env_set(GEMM_PAD_ENV, pad):
                return SpeculativeEngine(model, None, eos_token_ids)
        engines[pad] = engine
    return runners, engines


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.pad:
        try:
            with env_set(GEMM_PAD_ENV, args.pad):
                gemm_padding()  # a bad B:T fails here, before the target loads
        except ValueError as err:
            raise SystemExit(f"--pad: {err}") from err
    padded = args.pad or ":".join(map(str, gemm_padding()))
    if padded == "0:0":
        raise SystemExit("this machine pads no GEMM by default: pass --pad B:T to compare one with none")
    settings = ["off", padded]
    target = load_target(args.target)
    runners, engines = runners_and_engines(target.model, target.eos_token_ids, settings)
    report = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "context": args.context, "pad": padded, "forwards": compare_forwards(runners, args),
              "decoding": compare_decoding(target, engines, args)}
    print(f"target forward over N new tokens after {args.context} cached, median of {args.reps} "
          f"(torch threads {report['threads']}, {report['cpu_capability']}):")
    print_comparison(report, padded, "off")
    write_report(report, Path(args.out) / "gemm_rows.json")
    return report


if __name__ == "__main__":
    main()
