"""Decoding benchmark: speculative decoding of the default target with the untrained `truncated:4`
drafter and with prompt lookup, against plain decoding and transformers' peers (generate, assisted
generation, prompt lookup), all in one process on the same MT-bench questions (Spec-Bench protocol).

    .venv/bin/python scripts/bench_decode.py [--limit 8] [--max-new-tokens 128] [--target T]

Writes report.json, report.md, turns.jsonl and plots under runs/bench_decode/<date-time>/ and prints
the tables. Minutes of CPU: run it when the machine is otherwise quiet.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode.evaluate import main as evaluate  # noqa: E402  (needs ROOT on sys.path when run by path)

DEFAULT_QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
DEFAULT_DRAFTERS = ("truncated:4", "prompt_lookup")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=None, help="target spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafters", nargs="+", default=list(DEFAULT_DRAFTERS), help="drafter specs, compared in one run")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="MT-bench / Spec-Bench question file")
    p.add_argument("--limit", default="8", help="the first N questions")
    p.add_argument("--max-new-tokens", default="128", help="per turn")
    p.add_argument("--warmup", default="2", help="untimed generations per method")
    p.add_argument("--threads", default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_decode" / datetime.now().strftime("%Y%m%d-%H%M%S")),
                   help="output directory")
    return p.parse_args(argv)


def evaluate_argv(args: argparse.Namespace) -> list[str]:
    """The decode.evaluate command line this benchmark amounts to."""
    argv = ["--questions", args.questions, "--limit", args.limit, "--max-new-tokens", args.max_new_tokens,
            "--warmup", args.warmup, "--peers", "hf", "--device", args.device, "--out", args.out]
    for spec in args.drafters:
        argv += ["--drafter", spec]
    if args.target:
        argv += ["--target", args.target]
    if args.threads:
        argv += ["--threads", args.threads]
    return argv


if __name__ == "__main__":
    sys.exit(evaluate(evaluate_argv(parse_args(None))))
