"""Benchmark: the adaptive depth with an idle draft model's catch-up split off (now) or charged to the
probe that resumes drafting (before), the two interleaved per turn in one process, beside plain decoding.

    .venv/bin/python scripts/bench_catch_up.py DRAFTER [DRAFTER ...] [--per-category 2] [--max-new-tokens 128]
        [--out DIR]

"before" sets decode.proposers.draft_model.CATCH_UP_SPLIT past any sequence length: the catch-up then
runs inside the first drafting forward and counts as drafting time, exactly as before the split. Greedy
MT-bench, turn 2 conditioned on each method's own turn-1 answer, every output checked against plain
decoding's. Prints a table; writes DIR/catch_up.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import decode.proposers.draft_model as draft_model  # noqa: E402  (its CATCH_UP_SPLIT is the one drafting reads)
from decode.engine import SpeculativeEngine  # noqa: E402
from decode.proposers import build_proposer  # noqa: E402
from decode.questions import load_questions  # noqa: E402
from models.drafters import load_drafter  # noqa: E402
from models.target import load_target  # noqa: E402

SPLIT = {"now": draft_model.CATCH_UP_SPLIT, "before": 10 ** 9}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+")
    p.add_argument("--questions", default=str(ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"))
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="runs/bench_catch_up")
    return p.parse_args(argv)


def build_methods(target, specs: list[str]) -> dict[str, tuple[SpeculativeEngine, int]]:
    """name -> (engine, CATCH_UP_SPLIT to draft with); plain decoding first."""
    methods = {"baseline": (SpeculativeEngine(target.model, None, target.eos_token_ids), SPLIT["now"])}
    for spec in specs:
        drafter = load_drafter(spec, target)
        for mode, split in SPLIT.items():
            proposer = build_proposer(drafter, target.model, 5, target.eos_token_ids)
            methods[f"{spec} ({mode})"] = (SpeculativeEngine(target.model, proposer, target.eos_token_ids), split)
    return methods


def generate(method: tuple[SpeculativeEngine, int], prompt: list[int], max_new_tokens: int):
    engine, split = method
    draft_model.CATCH_UP_SPLIT = split
    try:
        return engine.generate(prompt, max_new_tokens)
    finally:
        draft_model.CATCH_UP_SPLIT = SPLIT["now"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = load_target()
    questions = load_questions(args.questions, per_category=args.per_category)
    methods = build_methods(target, args.drafters)  # outside inference mode: weights are packed here
    with torch.inference_mode():
        totals = run(target, questions, methods, args.max_new_tokens)
    print_table(totals)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "catch_up.json").write_text(json.dumps(totals, indent=1))
    return totals


def run(target, questions, methods, max_new_tokens: int) -> dict:
    """Per method: new tokens, seconds, target forwards, turns whose output differs from plain decoding's."""
    totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "mismatches": 0} for name in methods}
    warmup = target.encode_chat([{"role": "user", "content": questions[0].turns[0]}])
    for method in methods.values():
        generate(method, warmup, max_new_tokens)
    for question in questions:
        conversations = {name: [] for name in methods}
        for turn in question.turns:
            reference = None
            for name, method in methods.items():
                conversations[name].append({"role": "user", "content": turn})
                out = generate(method, target.encode_chat(conversations[name]), max_new_tokens)
                total = totals[name]
                total["tokens"] += out.stats.new_tokens
                total["seconds"] += out.stats.total_time_s
                total["forwards"] += out.stats.target_forwards
                reference = out.tokens if reference is None else reference
                total["mismatches"] += int(out.tokens != reference)
                answer = target.tokenizer.decode(out.tokens, skip_special_tokens=True)
                conversations[name].append({"role": "assistant", "content": answer})
    return totals


def print_table(totals: dict) -> None:
    base = totals["baseline"]["tokens"] / totals["baseline"]["seconds"]
    print("| method | tokens/s | speedup | tau | mismatches |\n|---|---|---|---|---|")
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {t['tokens'] / t['forwards']:.2f} | {t['mismatches']} |")


if __name__ == "__main__":
    main()
