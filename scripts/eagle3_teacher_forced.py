"""Teacher-forced accuracy of an EAGLE-3 drafter on the target's own greedy answers, per unrolled step.

    .venv/bin/python scripts/eagle3_teacher_forced.py DRAFTER --questions FILE [--limit 8] [--max-new-tokens 96]
        [--steps 4] [--out FILE.json]

For each prompt the target answers greedily (plain decoding); the drafter then reads the target's hidden states
along that answer and predicts, at unrolled step j, the token j + 2 ahead (step 0 is what decoding's first draft
position does). The share of response positions where its argmax is the target's token separates what the
drafter learned from what decoding makes of it: compare training prompts with held-out ones to see overfitting.
Questions: MT-bench-style ({"turns": [...]}, first turn) or {"prompt"} / {"question"} rows.

    .venv/bin/python scripts/eagle3_teacher_forced.py DRAFTER --questions FILE --turns EVAL_DIR/turns.jsonl

reads every turn the evaluation's baseline wrote instead (a second turn's context holds the first answer, as
decode.evaluate builds it) and adds, per turn, how often a 2-gram prompt lookup in the context names the next
token and how often the drafter's first step does at those positions: whether the drafter copies from its
context (BENCHMARKS.md, "Second turns").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from decode.engine import SpeculativeEngine
from decode.evaluate import conversation_for_turn, decode_answer
from decode.proposers.prompt_lookup import lookup_match
from decode.questions import load_questions
from models.drafters import load_drafter
from models.target import load_target


def first_turn(row: dict) -> str:
    for key in ("turns", "prompt", "question", "instruction"):
        if key in row:
            return row[key][0] if key == "turns" else row[key]
    raise ValueError(f"a question row needs turns, prompt, question or instruction: {sorted(row)}")


def step_accuracies(target, drafter, prompt_ids: list[int], answer: list[int], steps: int) -> list[float]:
    """Per unrolled step j, the share of answer positions whose token the drafter's step j predicts."""
    return [share(hits) for hits in step_hits(target, drafter, prompt_ids, answer, steps)]


@torch.inference_mode()
def step_hits(target, drafter, prompt_ids: list[int], answer: list[int], steps: int) -> list[list[bool]]:
    """Per unrolled step j, per answer token from the (j + 2)-th of the sequence on, whether step j predicts it."""
    seq = prompt_ids + answer
    out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in drafter.target_layers], dim=-1)  # [1, T, 3D]
    embed = target.model.get_input_embeddings()
    embeds = [embed(torch.tensor([seq[1 + j:] + [0] * (1 + j)])) for j in range(steps)]  # step j reads token t+1+j
    hits = []
    for j, hidden in enumerate(drafter.unroll(embeds, features)):
        predicted = drafter.vocab_map[drafter.logits(hidden[0]).argmax(-1)]  # [T]: row t predicts seq[t + 2 + j]
        rows = range(max(len(prompt_ids) - 2 - j, 0), len(seq) - 2 - j)  # rows predicting an answer token
        hits.append([int(predicted[t]) == seq[t + 2 + j] for t in rows])
    return hits


def lookup_hits(prompt_ids: list[int], answer: list[int]) -> list[bool | None]:
    """Per answer token (as step 0's rows count them), whether a 2-gram prompt lookup in what precedes it names
    it (None: the 2-gram occurs nowhere earlier, the lookup drafts nothing)."""
    seq = prompt_ids + answer
    out = []
    for t in range(max(len(prompt_ids) - 2, 0), len(seq) - 2):
        n, follow = lookup_match(seq[:t + 2], 1, 2, 2)
        out.append(follow[0] == seq[t + 2] if n and follow else None)
    return out


def share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def copy_stats(drafter_hits: list[bool], lookup: list[bool | None]) -> dict:
    """How often the lookup is right, and the drafter's first step where it is and overall."""
    where = [d for d, l in zip(drafter_hits, lookup) if l]
    return {"positions": len(lookup), "lookup_right": share([bool(l) for l in lookup]),
            "drafter_right_where_lookup_right": share(where), "drafter_right": share(drafter_hits)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="an eagle3 drafter directory")
    p.add_argument("--questions", required=True)
    p.add_argument("--target", default=None, help="default: the embedded smollm2-135m")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--turns", default=None, help="an evaluation's turns.jsonl: measure its baseline's turns, "
                                                  "every turn, with prompt lookup's hits beside the drafter's")
    args = p.parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    if drafter.kind != "eagle3":
        raise SystemExit(f"{args.drafter} is a {drafter.kind} drafter; this measures eagle3 drafters")
    net = drafter.model.float()
    if args.turns:
        return by_turn(args, target, net)
    rows = [json.loads(x) for x in Path(args.questions).read_text().splitlines() if x.strip()][:args.limit]
    results = []
    for row in rows:
        prompt_ids = target.encode_chat([{"role": "user", "content": first_turn(row)}])
        answer = SpeculativeEngine(target.model, None, target.eos_token_ids).generate(prompt_ids,
                                                                                      args.max_new_tokens).tokens
        acc = step_accuracies(target, net, prompt_ids, answer, args.steps)
        results.append({"id": row.get("question_id", row.get("uid")), "category": row.get("category"),
                        "accuracy_per_step": acc})
        print(f"{str(row.get('category', '-')):14s} " + " ".join(f"{a:.3f}" for a in acc), flush=True)
    mean = [sum(r["accuracy_per_step"][j] for r in results) / len(results) for j in range(args.steps)]
    print("mean           " + " ".join(f"{a:.3f}" for a in mean))
    if args.out:
        Path(args.out).write_text(json.dumps({"drafter": args.drafter, "questions": args.questions,
                                              "mean_per_step": mean, "prompts": results}, indent=2))


def by_turn(args, target, net) -> None:
    """Every turn of the evaluation's baseline, rebuilt as decode.evaluate built it: per turn index, the
    mean step accuracies and the copy statistics over all its answer positions."""
    questions = {q.question_id: q for q in load_questions(args.questions)}
    written = {}
    for line in Path(args.turns).read_text().splitlines():
        row = json.loads(line)
        if row["method"] == "baseline" and str(row["question_id"]) in questions:
            written[(str(row["question_id"]), row["turn"])] = row["tokens"]
    per_turn: dict[int, dict] = {}
    for (qid, k), answer in sorted(written.items()):
        if any((qid, i) not in written for i in range(k)):
            continue
        answers = [decode_answer(target.tokenizer, written[(qid, i)]) for i in range(k)]
        prompt_ids = list(target.encode_chat(conversation_for_turn(questions[qid].turns, answers, k)))
        hits = step_hits(target, net, prompt_ids, list(answer), args.steps)
        into = per_turn.setdefault(k, {"steps": [[] for _ in hits], "lookup": []})
        for j, h in enumerate(hits):
            into["steps"][j] += h
        into["lookup"] += lookup_hits(prompt_ids, list(answer))
    summary = {}
    for k, into in sorted(per_turn.items()):
        summary[k] = {"accuracy_per_step": [share(h) for h in into["steps"]], **copy_stats(into["steps"][0], into["lookup"])}
        s = summary[k]
        print(f"turn {k + 1}: steps " + " ".join(f"{a:.3f}" for a in s["accuracy_per_step"])
              + f" | lookup right {s['lookup_right']:.3f}, drafter right there {s['drafter_right_where_lookup_right']:.3f}"
              + f" ({s['positions']} positions)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"drafter": args.drafter, "questions": args.questions, "turns": args.turns,
                                              "by_turn": summary}, indent=2))


if __name__ == "__main__":
    main()
