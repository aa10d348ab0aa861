"""Teacher-forced accuracy of an EAGLE-3 drafter on the target's own greedy answers, per unrolled step.

    .venv/bin/python scripts/eagle3_teacher_forced.py DRAFTER --questions FILE [--limit 8] [--max-new-tokens 96]
        [--steps 4] [--out FILE.json]

For each prompt the target answers greedily (plain decoding); the drafter then reads the target's hidden states
along that answer and predicts, at unrolled step j, the token j + 2 ahead (step 0 is what decoding's first draft
position does). The share of response positions where its argmax is the target's token separates what the
drafter learned from what decoding makes of it: compare training prompts with held-out ones to see overfitting.
Questions: MT-bench-style ({"turns": [...]}, first turn) or {"prompt"} / {"question"} rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from decode.engine import SpeculativeEngine
from models.drafters import load_drafter
from models.target import load_target


def first_turn(row: dict) -> str:
    for key in ("turns", "prompt", "question", "instruction"):
        if key in row:
            return row[key][0] if key == "turns" else row[key]
    raise ValueError(f"a question row needs turns, prompt, question or instruction: {sorted(row)}")


@torch.inference_mode()
def step_accuracies(target, drafter, prompt_ids: list[int], answer: list[int], steps: int) -> list[float]:
    """Per unrolled step j, the share of answer positions whose token the drafter's step j predicts."""
    seq = prompt_ids + answer
    out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in drafter.target_layers], dim=-1)  # [1, T, 3D]
    embed = target.model.get_input_embeddings()
    embeds = [embed(torch.tensor([seq[1 + j:] + [0] * (1 + j)])) for j in range(steps)]  # step j reads token t+1+j
    accuracies = []
    for j, hidden in enumerate(drafter.unroll(embeds, features)):
        predicted = drafter.vocab_map[drafter.logits(hidden[0]).argmax(-1)]  # [T]: row t predicts seq[t + 2 + j]
        rows = range(max(len(prompt_ids) - 2 - j, 0), len(seq) - 2 - j)  # rows predicting an answer token
        hits = [int(predicted[t]) == seq[t + 2 + j] for t in rows]
        accuracies.append(sum(hits) / len(hits) if hits else float("nan"))
    return accuracies


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="an eagle3 drafter directory")
    p.add_argument("--questions", required=True)
    p.add_argument("--target", default=None, help="default: the embedded smollm2-135m")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    if drafter.kind != "eagle3":
        raise SystemExit(f"{args.drafter} is a {drafter.kind} drafter; this measures eagle3 drafters")
    net = drafter.model.float()
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


if __name__ == "__main__":
    main()
