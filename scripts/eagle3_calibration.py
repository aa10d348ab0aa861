"""How well an EAGLE-3 drafter's path probability predicts that the target accepts a node: the reliability table
behind the tree's probability floor (decode.proposers.eagle3, `min_prob`; BENCHMARKS.md "A probability floor for
EAGLE-3 trees").

    .venv/bin/python scripts/eagle3_calibration.py DRAFTER --questions FILE [--per-category 2] [--limit N]
        [--max-new-tokens 128] [--depth 8] [--out FILE.json]

Decodes the questions' first turns greedily at a forced depth with no floor, so that every node the tree's budget
keeps is verified, and records for each verified node its path probability under the drafter (the product of its
probabilities along the path) and whether the target accepted it. Prints per probability bin the nodes, their
mean path probability and the share accepted: where the two agree, a node's path probability is the tokens it
is expected to earn, and a floor at (a verified row's cost) x (tokens per second) keeps just the rows that pay.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from decode.engine import SpeculativeEngine
from decode.proposers import build_proposer
from decode.questions import load_questions
from decode.tree import TokenTree
from models.drafters import load_drafter
from models.target import load_target

Record = tuple[int, float, bool]  # (depth, path probability, accepted)


def root_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Each node's tokens from below the root down to it (the root's own: ())."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tree.tokens)):
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    return paths


def candidate_scores(candidates) -> dict[tuple[int, ...], float]:
    """The proposer's drafted candidates (decode.proposers.eagle3.Candidate) by token path -> log path probability."""
    paths: list[tuple[int, ...]] = []
    for c in candidates:
        paths.append((paths[c.parent] if c.parent >= 0 else ()) + (c.token,))
    return {path: c.score for path, c in zip(paths, candidates)}


def node_records(tree: TokenTree, scores: dict[tuple[int, ...], float], emitted: list[int]) -> list[Record]:
    """Every drafted node of a verified tree: its depth, path probability, and whether the target accepted it
    (`emitted`: the step's accepted drafts and then the bonus token)."""
    accepted = tuple(emitted[:-1])
    return [(len(path), math.exp(scores[path]), accepted[:len(path)] == path) for path in root_paths(tree)[1:]]


def reliability(records: list[Record], bins: int = 10) -> list[dict]:
    """Per probability bin [k / bins, (k + 1) / bins) that holds nodes: their count, mean path probability and the
    share the target accepted."""
    table = []
    for k in range(bins):
        inside = [(p, a) for _, p, a in records if min(int(p * bins), bins - 1) == k]
        if inside:
            table.append({"low": k / bins, "high": (k + 1) / bins, "nodes": len(inside),
                          "mean_probability": sum(p for p, _ in inside) / len(inside),
                          "accepted": sum(a for _, a in inside) / len(inside)})
    return table


def record_generation(engine: SpeculativeEngine, proposer, prompt: list[int], max_new_tokens: int):
    """Decode one prompt, recording every verified node. Returns (records, the engine's Generation)."""
    records, drafted = [], {}
    draft_tree, step = proposer.draft_tree, engine.step

    def drafting(root, out, depth):
        tree = draft_tree(root, out, depth)
        drafted["tree"], drafted["scores"] = tree, candidate_scores(proposer.candidates)
        return tree

    def stepping(seq, remaining, sampling, generator, stats):
        drafted.clear()
        emitted = step(seq, remaining, sampling, generator, stats)
        if drafted:
            records.extend(node_records(drafted["tree"], drafted["scores"], emitted))
        return emitted

    proposer.draft_tree, engine.step = drafting, stepping
    try:
        generation = engine.generate(prompt, max_new_tokens)
    finally:
        del proposer.draft_tree, engine.step  # back to the class's methods
    return records, generation


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="an eagle3 drafter directory")
    p.add_argument("--questions", required=True, help="MT-bench-style or {prompt} JSONL (decode.questions)")
    p.add_argument("--target", default=None, help="default: the embedded smollm2-135m")
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=8, help="the forced draft depth (the tree's shape otherwise "
                                                        "the drafter's)")
    p.add_argument("--out", default=None, help="write the table and the per-depth counts here (JSON)")
    args = p.parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    if drafter.kind != "eagle3":
        raise SystemExit(f"{args.drafter} is a {drafter.kind} drafter; this measures eagle3 drafters")
    proposer = build_proposer(drafter, target.model, eos_token_ids=target.eos_token_ids, eagle3_depth=args.depth,
                              eagle3_min_prob=0.0, eagle3_fixed_steps=False)  # the depth-by-depth path keeps candidates
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    records = []
    for question in load_questions(args.questions, limit=args.limit, per_category=args.per_category):
        prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
        records += record_generation(engine, proposer, prompt, args.max_new_tokens)[0]
    table = reliability(records)
    print("path probability   nodes   mean p   accepted")
    for row in table:
        print(f"[{row['low']:.1f}, {row['high']:.1f})      {row['nodes']:6d}   {row['mean_probability']:.3f}    "
              f"{row['accepted']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"drafter": args.drafter, "questions": args.questions,
                                              "depth": args.depth, "nodes": len(records), "table": table}, indent=2))
    return table


if __name__ == "__main__":
    main()
