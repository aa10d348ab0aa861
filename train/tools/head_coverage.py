"""What share of the target's answers a drafter's reduced head can draft at all, alone and with each request's prompt.

    specdistill head-coverage REPORT_DIR [REPORT_DIR ...] --drafter DIR

A reduced head (a draft vocabulary of the M tokens the teacher data uses most) never drafts another token, so a
draft stops wherever the target writes one: that share caps acceptance before any training. A draft model's
`prompt_vocab` (decode.proposers.draft_model) adds each request's prompt tokens to its head. Reads an evaluation's
turns (`decode.evaluate --out REPORT_DIR`: report.json, turns.jsonl), takes plain decoding's answers, rebuilds each
turn's prompt as the evaluation did (the user turns, the earlier answers, the target's chat template), and prints,
by category, the share of answer tokens in the head and in the head or the prompt. Writes
REPORT_DIR/head_coverage.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from specdistill.decode.evaluate import conversation_for_turn, decode_answer
from specdistill.decode.questions import load_questions
from specdistill.decode.report import BASELINE
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="evaluation output directories (report.json, turns.jsonl)")
    p.add_argument("--drafter", required=True, help="a drafter directory with a reduced head")
    return p.parse_args(argv)


def baseline_turns(report: Path) -> list[dict]:
    """Plain decoding's turns of one evaluation, in question and turn order."""
    turns = [json.loads(line) for line in (report / "turns.jsonl").read_text().splitlines() if line.strip()]
    turns = [t for t in turns if t["method"] == BASELINE]
    if not turns:
        raise SystemExit(f"{report / 'turns.jsonl'} has no {BASELINE!r} turns to measure")
    return sorted(turns, key=lambda t: (t["question_id"], t["turn"]))


def coverage(report: Path, target, head: set[int]) -> dict[str, dict[str, float]]:
    """{category: {"tokens", "head", "head_or_prompt"}} over plain decoding's answer tokens, plus "all"."""
    config = json.loads((report / "report.json").read_text())["config"]
    questions = {q.question_id: q for q in load_questions(config["questions"], limit=config.get("limit"),
                                                          per_category=config.get("per_category"))}
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    answers: dict[str, list[str]] = defaultdict(list)
    for turn in baseline_turns(report):
        question = questions[turn["question_id"]]
        prompt = set(target.encode_chat(conversation_for_turn(question.turns, answers[question.question_id],
                                                              turn["turn"])))
        answers[question.question_id].append(decode_answer(target.tokenizer, turn["tokens"]))
        turn_counts = (len(turn["tokens"]), sum(t in head for t in turn["tokens"]),
                       sum(t in head or t in prompt for t in turn["tokens"]))
        for key in (turn["category"], "all"):
            counts[key] = [a + b for a, b in zip(counts[key], turn_counts)]
    order = [key for key in counts if key != "all"] + ["all"]
    return {key: {"tokens": counts[key][0], "head": round(counts[key][1] / counts[key][0], 4),
                  "head_or_prompt": round(counts[key][2] / counts[key][0], 4)} for key in order}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    reports = [Path(r) for r in args.reports]
    names = {json.loads((r / "report.json").read_text())["config"]["target_name"] for r in reports}
    if len(names) != 1:
        raise SystemExit(f"the reports decode different targets ({', '.join(sorted(names))}); give one target's")
    target = load_target(names.pop())
    drafter = load_drafter(args.drafter, target)
    vocab_map = drafter.vocab_map if drafter.vocab_map is not None else getattr(drafter.model, "vocab_map", None)
    if vocab_map is None or vocab_map.numel() >= len(target.tokenizer):
        raise SystemExit(f"{args.drafter} drafts the full vocabulary: every token is in its head")
    head = set(vocab_map.tolist())
    results = {}
    for report in reports:
        results[str(report)] = coverage(report, target, head)
        (report / "head_coverage.json").write_text(json.dumps({"drafter": args.drafter, "head_tokens": len(head),
                                                               "coverage": results[str(report)]}, indent=1) + "\n")
        print(f"\n{report} ({len(head)} head tokens)\n\n| category | answer tokens | in the head | in the head "
              "or the prompt |\n|---|---:|---:|---:|")
        for key, row in results[str(report)].items():
            print(f"| {key} | {row['tokens']} | {row['head']:.3f} | {row['head_or_prompt']:.3f} |")
    return results


if __name__ == "__main__":
    main()
