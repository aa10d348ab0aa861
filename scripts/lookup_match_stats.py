"""How much a prompt-lookup chain is worth, by the length of the n-gram it matched, on the target's own answers.

For every position of the baseline answers in an evaluation's turns.jsonl (first turns; the prompt rebuilt from
the question file with the target's chat template), the longest n-gram (n <= --max-ngram) ending the sequence
that occurred earlier, and how many of the up-to --tokens drafts that followed it equal the answer's next
tokens. Prints, per n, the share of positions, the first draft's acceptance and the mean accepted length: the
figures behind WithPromptLookup's lookup_first rule (BENCHMARKS.md, "Prompt lookup first").

    python scripts/lookup_match_stats.py ../shared/data/mt_bench/question.jsonl runs/eval_s31_mt/turns.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from decode.evaluate import conversation_for_turn
from decode.proposers.prompt_lookup import lookup_match
from decode.questions import load_questions
from models.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions")
    parser.add_argument("turns", help="an evaluation's turns.jsonl (its baseline method's first turns are read)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=10, help="drafts per lookup (the +prompt_lookup chain: 10)")
    parser.add_argument("--max-ngram", type=int, default=3)
    args = parser.parse_args()
    target = load_target(args.target)
    questions = {q.question_id: q for q in load_questions(args.questions)}
    stats = defaultdict(lambda: [0, 0, 0])  # n -> [positions, first draft accepted, drafts accepted]
    for line in open(args.turns):
        turn = json.loads(line)
        if turn["method"] != "baseline" or turn["turn"] != 0:
            continue
        question = questions[str(turn["question_id"])]
        prompt_ids = target.encode_chat(conversation_for_turn(question.turns, [], 0))  # as decode.evaluate does
        answer = turn["tokens"]
        for t in range(1, len(answer)):
            n, drafts = lookup_match(prompt_ids + answer[:t], args.tokens, args.max_ngram, 1)
            accepted = next((i for i, (d, a) in enumerate(zip(drafts, answer[t:])) if d != a),
                            min(len(drafts), len(answer) - t))
            row = stats[n]
            row[0] += 1
            row[1] += accepted > 0
            row[2] += accepted
    total = sum(row[0] for row in stats.values())
    print(f"{'match':>8} {'share':>6} {'first right':>11} {'mean accepted':>13}")
    for n in sorted(stats):
        positions, first, accepted = stats[n]
        print(f"{n:>6}-g {positions / total:6.1%} {first / positions:11.3f} {accepted / positions:13.2f}")


if __name__ == "__main__":
    main()
