"""How much of the target's real output a reduced draft vocabulary can propose, at several sizes.

    python scripts/draft_vocab_coverage.py --teacher-data TEACHER_DIR --turns EVAL_DIR/turns.jsonl \
        [--sizes 4096 8192 16384] [--target-vocab 49152] [--eos 2] [--out FILE.json]

A drafter with a reduced head (`draft_vocab`: the teacher data's M most frequent response tokens, as
training chooses them, `distill.vocab.select_draft_vocab`) can never propose a token outside it, so the
share of the target's own tokens inside it caps every position's acceptance. The training responses
always fit (the vocabulary is cut from them); this measures the cap on held-out output: the baseline
turns of a `decode.evaluate` run (`turns.jsonl`, the target's greedy tokens). Printed per size: coverage
of the training responses, of the held-out tokens, and what BPE id order alone (ids 0..M-1, the
tokenizer's merge order) would cover, for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.teacher_data import load_teacher_data  # noqa: E402  (ROOT on sys.path first)
from distill.vocab import count_response_tokens, coverage, select_draft_vocab  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-data", required=True, help="a teacher-data directory (distill.teacher_data)")
    p.add_argument("--turns", required=True, help="a decode.evaluate turns.jsonl: its baseline turns are measured")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 12288, 16384])
    p.add_argument("--target-vocab", type=int, default=49152,
                   help="the target's vocabulary size (default: the default target's)")
    p.add_argument("--eos", type=int, nargs="*", default=[2],
                   help="ids always in the vocabulary, as training keeps them: the target's EOS (default: the default "
                        "target's)")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    return p.parse_args(argv)


def baseline_tokens(turns_file: str | Path) -> list[int]:
    """The target's greedy tokens: every baseline turn of a decode.evaluate run, concatenated."""
    tokens = []
    with open(turns_file) as f:
        for line in f:
            turn = json.loads(line)
            if turn["method"] == "baseline":
                tokens.extend(turn["tokens"])
    if not tokens:
        raise SystemExit(f"{turns_file}: no baseline turns (run decode.evaluate, which always decodes a baseline)")
    return tokens


def share_inside(tokens: list[int], vocab: set[int]) -> float:
    return sum(t in vocab for t in tokens) / len(tokens)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    counts = count_response_tokens(load_teacher_data(args.teacher_data))
    held_out = baseline_tokens(args.turns)
    rows = []
    for size in args.sizes:
        vocab_map = select_draft_vocab(counts, size, args.target_vocab, always=args.eos)
        rows.append({"size": size, "training": coverage(counts, vocab_map),
                     "held_out": share_inside(held_out, set(vocab_map.tolist())),
                     "id_order": share_inside(held_out, set(range(size)))})
    print(f"{len(counts)} distinct response tokens in the teacher data; {len(held_out)} held-out tokens")
    print("| draft_vocab | training responses | held-out | held-out, ids 0..M-1 |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['size']} | {row['training']:.3f} | {row['held_out']:.3f} | {row['id_order']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
