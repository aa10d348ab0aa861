"""What a trained drafter gained over plain decoding and over the drafter it started from, from one
`decode.evaluate` report that ran both (`make demo` prints this after its evaluation).

    python scripts/training_gain.py runs/quickstart/eval/report.json \\
        --trained runs/quickstart/drafter --untrained runs/quickstart/untrained

--trained/--untrained take a method name from the report or a drafter spec given to `--drafter`
(`speculative[SPEC]`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode.report import training_gain  # noqa: E402


def method_of(name: str, methods: dict) -> str:
    return name if name in methods else f"speculative[{name}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="report.json written by decode.evaluate")
    parser.add_argument("--trained", required=True, help="the trained drafter's method or spec")
    parser.add_argument("--untrained", required=True, help="its starting point's method or spec")
    args = parser.parse_args(argv)
    methods = json.loads(args.report.read_text())["methods"]
    try:
        print(training_gain(methods, method_of(args.trained, methods), method_of(args.untrained, methods)))
    except (KeyError, ValueError) as err:
        parser.error(f"{args.report}: {err.args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
